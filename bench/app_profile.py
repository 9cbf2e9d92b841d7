"""What the results page costs the server, per script run, with Streamlit's AppTest (issue 14, point 5).

The script thread's CPU time (``time.thread_time``: other processes' load inflates it far less than wall time)
and wall time of each script run of the page on one finished run: the cold first run (imports, first read of
the run, the Metrics tab), each tab's first and second visit, and threshold-slider steps on the histogram and
failure cases tabs. AppTest reruns the whole script at every step; the results fragment's own time is reported
beside it (``fragment_cpu_s``): in the browser a click in the results area reruns only that fragment.

Usage::

    .venv/bin/python bench/app_profile.py --run DIR      # DIR: a finished run, e.g. a full Fashion-MNIST one

Prints one JSON object (seconds); ``heavy_imported_by_cold_run`` lists torch / torchvision / scikit-learn /
scipy if the cold run imported them (run it in a fresh process: it is the first load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

#: The entry script AppTest runs: the app's ``main()`` timed, and the results fragment timed inside it.
ENTRY = """
import json, os, time

import oodviz.ui.results as results

t0, w0 = time.thread_time(), time.perf_counter()
fragment = results.__dict__.setdefault("profiled_fragment", {})
fragment.clear()
if not hasattr(results.results_area, "profiled"):
    drawn = results.results_area

    def timed(page):
        a, b = time.thread_time(), time.perf_counter()
        try:
            drawn(page)
        finally:
            fragment.update(cpu=time.thread_time() - a, wall=time.perf_counter() - b)

    timed.profiled = True
    results.results_area = timed
try:
    from oodviz.ui.main import main

    main()
finally:
    with open(os.environ["OODVIZ_PROFILE_LOG"], "a") as log:
        row = {"cpu_s": time.thread_time() - t0, "wall_s": time.perf_counter() - w0}
        row.update({f"fragment_{k}_s": v for k, v in results.profiled_fragment.items()})
        log.write(json.dumps(row) + "\\n")
"""
HEAVY = ("torch", "torchvision", "sklearn", "scipy")
TABS = ("Score histograms", "ROC / PR", "Failure cases", "Metrics")


def rounded(row: dict) -> dict:
    return {key: round(value, 3) for key, value in row.items()}


def profile(run: Path, steps: int) -> dict:
    from streamlit.testing.v1 import AppTest

    with tempfile.TemporaryDirectory(prefix="oodviz-app-profile-") as tmp:
        root, log, entry = Path(tmp) / "runs", Path(tmp) / "log.jsonl", Path(tmp) / "entry.py"
        shutil.copytree(run, root / "bench")
        entry.write_text(ENTRY)
        os.environ.update(OODVIZ_RUNS_ROOT=str(root), OODVIZ_PROFILE_LOG=str(log))

        def last() -> dict:
            return rounded(json.loads(log.read_text().splitlines()[-1]))

        app = AppTest.from_file(str(entry), default_timeout=600)
        app.query_params["run"] = "bench"
        app.run()
        if app.exception:
            raise RuntimeError(f"the page failed: {app.exception}")
        out = {"cold": last(), "heavy_imported_by_cold_run": sorted(set(HEAVY) & set(sys.modules))}
        out["tabs"] = {tab: [] for tab in TABS}
        for _ in range(2):  # first visit, then again
            for tab in TABS:
                app.session_state["results-tab"] = tab
                app.run()
                out["tabs"][tab].append(last())
        for tab in ("Score histograms", "Failure cases"):
            app.session_state["results-tab"] = tab
            app.run()
            rows = []
            for _ in range(steps):
                slider = app.slider[0]
                slider.set_value(min(slider.max, slider.value + (slider.max - slider.min) / 200)).run()
                rows.append(last())
            out[f"slider ({tab}), median of {steps}"] = {
                key: round(statistics.median(r[key] for r in rows), 3) for key in rows[0]
            }
        out["load_average"] = [round(x, 1) for x in os.getloadavg()]
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished run directory")
    parser.add_argument("--steps", type=int, default=5, help="slider steps per tab")
    args = parser.parse_args()
    print(json.dumps(profile(args.run, args.steps), indent=2))


if __name__ == "__main__":
    main()
