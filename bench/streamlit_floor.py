"""The floor under the app's click times: the same clicks on the smallest Streamlit page that draws what a tab does.

Issue 14 (point 5) asks for a tab switch and a slider step in at most 300 ms to settled pixels.
``bench/app_bench.py`` measures the app; this measures, on the same machine, with the same server flags, browser
and timing (:func:`app_bench.answered`), a page that does no work of its own: two tabs
(``st.tabs(on_change="rerun")`` in a fragment, as the app's results area), each one precomputed Plotly histogram
(6 sets x 60 bars, the app's chart size) and a 10-row table, and a slider above them that moves the chart's
threshold line and the table's counts. Whatever this page takes is Streamlit's and Chromium's share of a click
(the rerun's round trip, the deltas, React, Plotly, the data grid's canvas), which no change in oodviz can
remove.

Usage::

    .venv/bin/python bench/streamlit_floor.py [--repeats 5]

Prints one JSON object: the cold first load (a fresh browser context on a server whose first run has imported
its modules, ``goto`` until the first tab is drawn and the page idle, as ``app_bench``'s), and the median seconds to the last websocket frame and to settled pixels for a tab
switch and a slider step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from app_bench import LAST_CHANGE, Wire, answered, free_port, settle

from oodviz.ui import SERVER_FLAGS

PAGE = """
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

@st.cache_data
def data():
    rng = np.random.default_rng(0)
    return {f"set {i}": rng.normal(i * 0.5, 1.0, 2000) for i in range(6)}

@st.fragment
def area():
    sets = data()
    edges = np.linspace(-4, 7, 61)
    threshold = st.slider("Threshold", -4.0, 7.0, 2.0, step=11 / 200, key="threshold")
    tabs = st.tabs(["First", "Second"], key="tab", on_change="rerun")
    for tab, shift in zip(tabs, (0.0, 0.25)):
        if not tab.open:
            continue
        with tab:
            fig = go.Figure()
            for name, values in sets.items():
                counts, _ = np.histogram(values + shift, edges)
                fig.add_bar(x=(edges[:-1] + edges[1:]) / 2, y=counts / counts.sum(), name=name)
            fig.update_layout(barmode="overlay", height=420)
            fig.add_vline(threshold)
            st.plotly_chart(fig, width="stretch")
            table = pd.DataFrame({
                "set": list(sets), "above": [int((v + shift >= threshold).sum()) for v in sets.values()],
                "n": [len(v) for v in sets.values()],
            })
            st.dataframe(table, hide_index=True, width="stretch")
            st.caption(f"Tab ready (scores shifted by {shift})")

area()
"""


def serve_page(script: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(script), *SERVER_FLAGS, "--server.headless", "true"]
        + ["--server.port", str(port), "--server.address", "127.0.0.1", "--server.fileWatcherType", "none"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in server.stdout:
        if "Local URL" in line or "URL:" in line:
            break
    threading.Thread(target=server.stdout.read, daemon=True).start()
    return server, f"http://127.0.0.1:{port}"


def measure(url: str, repeats: int) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium")
        warm = browser.new_context()  # the server's first run imports numpy, pandas and plotly: not counted
        warm.new_page().goto(url)
        warm.pages[0].get_by_text("Tab ready").first.wait_for(timeout=120_000)
        warm.close()
        page = browser.new_page(viewport={"width": 1000, "height": 1400})  # a fresh context: nothing cached
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
