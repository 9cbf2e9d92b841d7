"""PNG/SVG export with kaleido in the system's Chromium (issue 15.6): what a first export, each further figure
and a report with every figure as files cost, on a finished run.

    python bench/export.py RUN_DIR      # e.g. the default run: oodviz run --out runs/default

Prints a markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from oodviz.figures.export import browser_path, export_problem, figure_images
from oodviz.figures.plots import histogram_figure
from oodviz.figures.report import write_report
from oodviz.results.analysis import score_histogram
from oodviz.results.tables import detectors_of, load_results


def main(run_dir: str) -> None:
    start = time.perf_counter()
    problem = export_problem()
    first = time.perf_counter() - start
    if problem:
        sys.exit(f"export does not work here: {problem}")
    results = load_results(run_dir)
    figures = [
        histogram_figure(score_histogram(results.scores, d), threshold=0.0) for d in detectors_of(results.scores)
    ]
    start = time.perf_counter()
    images = figure_images(figures)
    many = time.perf_counter() - start
    png = sum(len(i["png"]) for i in images) / len(images)
    svg = sum(len(i["svg"]) for i in images) / len(images)
    with tempfile.TemporaryDirectory() as folder:
        timings = {}
        for files in (False, True):
            start = time.perf_counter()
            out = write_report(run_dir, Path(folder) / f"r{files}.html", figure_files=files)
            timings[files] = (time.perf_counter() - start, out.stat().st_size)
    print(f"browser: {browser_path()}\n")
    print("| what | seconds | size |\n| --- | ---: | ---: |")
    print(f"| first export in a process (browser start + a 64 px figure) | {first:.1f} | |")
    print(
        f"| {len(figures)} histograms as PNG and SVG, one browser session | {many:.1f} "
        f"({many / len(figures):.2f} per figure) | PNG {png / 1024:.0f} KiB, SVG {svg / 1024:.0f} KiB each |"
    )
    for files, label in ((False, "report"), (True, "report --figure-files")):
        seconds, size = timings[files]
        print(f"| `oodviz {label}` (every detector) | {seconds:.1f} | {size / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main(sys.argv[1])
