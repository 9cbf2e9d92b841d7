"""The floor under the app's click times: the same clicks on the smallest Streamlit page that draws what a tab does.

Issue 14 (point 5) asks for a tab switch and a slider step in at most 300 ms to settled pixels.
``bench/app_bench.py`` measures the app; this measures, on the same machine, with the same server flags, browser
and timing (:func:`app_bench.answered`), a page that computes almost nothing: two tabs (``st.tabs(on_change="rerun")``
in a fragment, as the app's results area), each a Plotly histogram (6 sets x 60 bars, the app's chart size: the
counts are cached, a rerun only builds the figure with the threshold line) and a 6-row table of the counts above
the threshold, and a slider above them that moves the line and the counts (a few ms of Python per rerun). What
this page takes is Streamlit's and Chromium's share of a click (the rerun's round trip, the figure's JSON, the
deltas, React, Plotly, the data grid's canvas), which no change in oodviz can remove.

Usage::

    .venv/bin/python bench/streamlit_floor.py [--repeats 5]

Prints one JSON object: the cold first load (a freshly launched browser, ``goto`` until the first tab is drawn and
the page idle, as ``app_bench``'s; the server's first run, which imports numpy, pandas and plotly, is made by
another browser before it, as the app's server imports its modules before "ready"), and the median seconds to the
last websocket frame and to settled pixels for a tab switch and a slider step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from app_bench import LAST_CHANGE, Wire, answered, settle, start_server

PAGE = """
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

EDGES = np.linspace(-4, 7, 61)

@st.cache_data
def data(shift):  # per set: its scores (sorted) and its histogram's heights (each set's area 1)
    rng = np.random.default_rng(0)
    sets = {f"set {i}": np.sort(rng.normal(i * 0.5 + shift, 1.0, 2000)) for i in range(6)}
    return {name: (values, np.histogram(values, EDGES)[0] / len(values)) for name, values in sets.items()}

@st.fragment
def area():
    threshold = st.slider("Threshold", -4.0, 7.0, 2.0, step=11 / 200, key="threshold")
    tabs = st.tabs(["First", "Second"], key="tab", on_change="rerun")
    for tab, shift in zip(tabs, (0.0, 0.25)):
        if not tab.open:
            continue
        with tab:
            sets = data(shift)
            fig = go.Figure()
            for name, (_, heights) in sets.items():
                fig.add_bar(x=(EDGES[:-1] + EDGES[1:]) / 2, y=heights, name=name)
            fig.update_layout(barmode="overlay", height=420)
            fig.add_vline(threshold)
            st.plotly_chart(fig, width="stretch")
            table = pd.DataFrame({
                "set": list(sets),
                "above": [len(v) - int(np.searchsorted(v, threshold)) for v, _ in sets.values()],
                "n": [len(v) for v, _ in sets.values()],
            })
            st.dataframe(table, hide_index=True, width="stretch")
            st.caption(f"Tab ready (scores shifted by {shift})")

area()
"""


def serve_page(script: Path) -> tuple[subprocess.Popen, str]:
    """``streamlit run SCRIPT`` with the app's server options, once it prints its URL."""
    server, url, _ = start_server(["-m", "streamlit", "run", str(script)], "URL:")
    return server, url


def measure(url: str, repeats: int) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = shutil.which("chromium") or "/usr/bin/chromium"
        warm = p.chromium.launch(executable_path=chromium)  # the server's first run imports its modules: not counted
        warm_page = warm.new_page()
        warm_page.goto(url)
        warm_page.get_by_text("Tab ready").first.wait_for(timeout=120_000)
        warm.close()
        browser = p.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": 1000, "height": 1400})
        page.add_init_script(LAST_CHANGE)
        wire = Wire(page)
        started = time.monotonic()
        page.goto(url)
        page.get_by_text("Tab ready").first.wait_for(timeout=120_000)
        settle(page)
        cold = time.monotonic() - started
        page.wait_for_timeout(1000)
        tabs, steps = [], []
        for _ in range(repeats):
            for name in ("Second", "First"):
                tabs.append(answered(page, wire, lambda name=name: page.get_by_role("tab", name=name).click()))
        slider = page.get_by_role("slider").first
        for _ in range(2 * repeats):
            slider.focus()
            steps.append(answered(page, wire, lambda: page.keyboard.press("ArrowRight")))
        browser.close()

    def median(pairs, i):
        return round(statistics.median(p[i] for p in pairs), 3)

    return {
        "cold_first_load_s": round(cold, 2),
        "tab_switch_last_frame_s": median(tabs, 0),
        "tab_switch_s": median(tabs, 1),
        "slider_step_last_frame_s": median(steps, 0),
        "slider_step_s": median(steps, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "floor_page.py"
        script.write_text(PAGE)
        server, url = serve_page(script)
        try:
            started = time.monotonic()
            out = measure(url, args.repeats)
            out["wall_s"] = round(time.monotonic() - started, 1)
        finally:
            server.terminate()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
