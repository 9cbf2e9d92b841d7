"""On-demand hover thumbnails of the feature map (issue 15.4): bytes per answer and the time from hover to image.

Starts the app (``app_bench.serve``: ``python -m oodviz.ui.serve``) on a finished run, opens its Feature space
tab in Debian's Chromium (Playwright) and hovers, one after the other, the ``--points`` most isolated drawn points that are not in the
hover sprite (so the mouse hovers that point and no other). For each it records the time from the mouse reaching
the point to the panel's image being decoded (the panel waits ``DWELL_MS`` before it asks), the bytes that came
over the websocket meanwhile (the answer's fragment: the component's new data, with up to ``ANSWER_TILES``
thumbnails), and whether the thumbnail was already in the page (sent with an earlier answer as a neighbour).
Also, in this process, :func:`oodviz.figures.projection_map.thumbnail_answer`'s time and JSON size for batches of
``ANSWER_TILES`` drawn rows with the datasets already open. Usage::

    .venv/bin/python bench/hover_answers.py RUN_DIR [--points 20]

RUN_DIR's PCA map is computed first when missing (``oodviz project``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
from app_bench import Wire, serve  # the app served as the other browser benchmark serves it

from oodviz.figures.projection_map import ANSWER_TILES, KEYS, drawn_rows, thumbnail_answer, thumbnails_path

CHROMIUM = "/usr/bin/chromium"
SHOWN = (
    "row => { const p = document.querySelector('.oodviz-hover-thumbnail'), i = p && p.querySelector('img');"
    " return p && p.dataset.row === String(row) && p.dataset.source !== '' && i.complete && i.naturalWidth > 0; }"
)
PAGE_XY = (
    "(gd, p) => { const L = gd._fullLayout, r = gd.getBoundingClientRect();"
    " return [r.left + L._size.l + L.xaxis.l2p(p[0]), r.top + L._size.t + L.yaxis.l2p(p[1])]; }"
)


def answers_in_process(run: Path, frame: pd.DataFrame, batches: int = 20) -> dict:
    """:func:`thumbnail_answer` for ``batches`` batches of drawn rows, datasets already open: seconds and bytes."""
    config = json.loads((run / "config.json").read_text())
    drawn = frame.iloc[drawn_rows(len(frame))].reset_index(drop=True)[KEYS]
    thumbnail_answer(config, drawn, {"rows": [0]})  # opens the datasets (the app prefetches them)
    rows = np.random.default_rng(0).permutation(len(drawn))[: batches * ANSWER_TILES].reshape(batches, -1)
    seconds, sizes = [], []
    for batch in rows:
        started = time.perf_counter()
        answer = thumbnail_answer(config, drawn, {"rows": [int(r) for r in batch]})
        seconds.append(time.perf_counter() - started)
        sizes.append(len(json.dumps(answer)))
    return {
        "rows_per_answer": ANSWER_TILES,
        "median_ms": round(1000 * statistics.median(seconds), 1),
        "max_ms": round(1000 * max(seconds), 1),
        "median_json_bytes": int(statistics.median(sizes)),
        "max_json_bytes": max(sizes),
    }


def hovers(run: Path, frame: pd.DataFrame, points: int) -> list[dict]:
    from playwright.sync_api import sync_playwright

    keys = pd.read_parquet(thumbnails_path(run, "pca", ".parquet"))
    in_sprite = frame.assign(row=np.arange(len(frame))).merge(keys).row.to_numpy()
    server, url, _ = serve(run.parent)
    results = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            wire = Wire(page)
            page.goto(f"{url}/?run={run.name}")
            page.get_by_role("tab", name="Feature space").click(timeout=120_000)
            chart = page.locator(".js-plotly-plot").filter(has_text="PCA of the features")
            chart.wait_for(timeout=120_000)
            page.wait_for_timeout(2000)  # the panel attaches to the chart (it looks every 500 ms)
            chart.scroll_into_view_if_needed()
            area = chart.locator(".nsewdrag").first.bounding_box()
            (x0, x1), (y0, y1) = chart.evaluate("gd => [gd._fullLayout.xaxis.range, gd._fullLayout.yaxis.range]")
            unit = np.c_[(frame.x - x0) / (x1 - x0) * area["width"], (frame.y - y0) / (y1 - y0) * area["height"]]
            outside = np.setdiff1d(np.arange(len(frame)), in_sprite)
            gaps = np.array([np.sort(np.hypot(*(unit - unit[r]).T))[1] for r in outside])
            for row in outside[np.argsort(-gaps)][:points]:
                x, y = chart.evaluate(PAGE_XY, [float(frame.x.iloc[row]), float(frame.y.iloc[row])])
                page.mouse.move(x - 3, y - 3)
                before = time.monotonic()
                started = time.perf_counter()
                page.mouse.move(x, y, steps=3)
                try:
                    page.wait_for_function(SHOWN, arg=int(row), timeout=30_000, polling="raf")
                except Exception:  # hovered a neighbour instead, or no answer in 30 s
                    results.append({"row": int(row), "shown": False})
                    continue
                seconds = time.perf_counter() - started
                came = wire.since(before)
                results.append({"row": int(row), "shown": True, "ms": round(1000 * seconds), "ws_bytes": came})
                page.mouse.move(area["x"] + 2, area["y"] + area["height"] + 60)
                page.wait_for_timeout(300)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--points", type=int, default=20)
    args = parser.parse_args()
    run = args.run.resolve()
    if not thumbnails_path(run, "pca", ".parquet").exists():
        from oodviz.figures.projection import project_run

        project_run(run, "pca")
    frame = pd.read_parquet(run / "projection-pca.parquet")
    out = {"run": run.name, "points": len(frame), "cpus": os.cpu_count(), "load": os.getloadavg()}
    out["in_process"] = answers_in_process(run, frame)
    done = hovers(run, frame, args.points)
    fetched = [h for h in done if h["shown"] and h["ws_bytes"] > 0]
    cached = [h for h in done if h["shown"] and h["ws_bytes"] == 0]
    out["browser"] = {
        "hovered": len(done),
        "not_shown": sum(not h["shown"] for h in done),
        "fetched": len(fetched),
        "fetched_ms_median": statistics.median(h["ms"] for h in fetched) if fetched else None,
        "fetched_ms_max": max((h["ms"] for h in fetched), default=None),
        "fetched_ws_bytes_median": statistics.median(h["ws_bytes"] for h in fetched) if fetched else None,
        "fetched_ws_bytes_max": max((h["ws_bytes"] for h in fetched), default=None),
        "already_in_page": len(cached),
        "already_in_page_ms_median": statistics.median(h["ms"] for h in cached) if cached else None,
    }
    out["hovers"] = done
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
