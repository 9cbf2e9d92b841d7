"""Detector fit memory, fit time and scoring speed: oodviz against pytorch-ood 0.4 on the same features.

The entry point of the detector benchmark (``make bench``). What it measures, on CPU, each
figure in a fresh Python process (issue 2; issue 6 for the opt-in parts):

- ``fit`` (bench/fit_memory.py): fit memory growth and fit time of mahalanobis, rmd, vim, klm,
  she and knn side by side at N=50,000, D=1024, C=1000 (inputs already in RAM), the median of
  ``--repeats`` fresh processes (3 by default; the libraries take turns: fit times on a small
  shared CPU vary by 20-30% from run to run); and knn fitted from an oodviz feature store.
- ``score`` (bench/score_speed.py): Mahalanobis scoring throughput of both libraries, samples/s.
- ``flat`` (bench/flat_memory.py): oodviz's fit memory growth from generated batches at
  N=50,000 and N=1,000,000; it must not depend on N.
- ``fit6``, ``score6`` (opt-in, 10-15 minutes): the same fit measurement for react, ash, scale,
  dice, fdbd, nci and gradnorm, and oodviz's scoring rate for them on 20,000 samples.

bench/harness.py holds the synthetic data, the peak-RSS measurement and the fresh-process runner;
bench/report.py the tables, with PASS/FAIL against the issue's targets (figures in
bench/RESULTS.md).

Run (20-25 minutes on 2 CPU cores, half of it the N=1,000,000 fits)::

    make bench                                   # = .venv/bin/python bench/detectors.py
    .venv/bin/python bench/detectors.py --parts fit,score
    .venv/bin/python bench/detectors.py --parts flat --fixed-mmap-threshold     # diagnostic
    .venv/bin/python bench/detectors.py --parts fit6,score6
    .venv/bin/python bench/detectors.py --quick --detectors mahalanobis         # smoke test, < 1 minute

``--parts`` picks among fit, score and flat (the default) and the opt-in fit6 and score6;
``--detectors`` a subset of either list. ``--quick`` runs tiny sizes once per figure (a smoke
test of the script: 2-4 minutes for every detector, most of it starting Python processes).
``--fixed-mmap-threshold`` runs every measurement with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed,
so that freed large blocks go straight back to the OS: the peak then shows the live memory of the
fit rather than what the allocator keeps after freeing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time

from fit_memory import run_fit6, run_fits, run_store_fit
from flat_memory import run_flat_growth
from harness import FULL, QUICK, Sizes, write_dataset
from report import environment, print_report, sizes_line
from score_speed import run_score6, run_scoring

DETECTORS = ("mahalanobis", "rmd", "vim", "klm", "she", "knn")
FIT6_DETECTORS = ("react", "ash", "scale", "dice", "fdbd", "nci", "gradnorm")
LIBRARIES = ("oodviz", "pytorch-ood")
PARTS = ("fit", "score", "flat")  # the default run
ISSUE6_PARTS = ("fit6", "score6")  # opt-in: the issue-6 detectors
FIXED_MMAP_THRESHOLD = 128 * 1024  # glibc's initial value; setting it turns off its dynamic growth


def main(
    sizes: Sizes,
    detectors: tuple[str, ...],
    parts: set[str],
    detectors6: tuple[str, ...] = FIT6_DETECTORS,
    repeats: int = 1,
) -> None:
    have_pytorch_ood = importlib.util.find_spec("pytorch_ood") is not None
    libraries = LIBRARIES if have_pytorch_ood else ("oodviz",)
    print("\n".join(environment()))
    print(sizes_line(sizes, parts))
    if not have_pytorch_ood:
        print("- pytorch-ood is not installed: oodviz only (install the test extras for the comparison)")
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:.0f}s] {message}", flush=True)

    fits, scoring, flat, fits6, scoring6, store_knn = {}, None, {}, {}, {}, None
    if parts & {"fit", "score", "fit6", "score6"}:
        with tempfile.TemporaryDirectory(prefix="oodviz-bench-") as data_dir:
            write_dataset(data_dir, sizes)
            log(f"data written to {data_dir}")
            if "fit" in parts:
                fits = run_fits(data_dir, sizes, detectors, libraries, log, repeats)
                if "knn" in detectors:
                    store_knn = run_store_fit(data_dir, sizes, "knn", log, repeats)
            if "score" in parts:
                scoring = run_scoring(data_dir, sizes, libraries, log)
            if "fit6" in parts:
                fits6 = run_fit6(data_dir, sizes, detectors6, libraries, log)
            if "score6" in parts:
                scoring6 = run_score6(data_dir, sizes, detectors6, log)
    if "flat" in parts:
        flat = run_flat_growth(sizes, detectors, log)

    print(f"\nTotal {time.perf_counter() - started:.0f} s")
    print_report(sizes, fits, store_knn, scoring, flat, fits6, scoring6)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, one process per figure: a smoke test of the script"
    )
    parser.add_argument(
        "--detectors",
        default=None,
        help="comma-separated subset of "
        + ",".join(DETECTORS)
        + " (parts fit, score, flat) and of "
        + ",".join(FIT6_DETECTORS)
        + " (parts fit6, score6); default: all of each",
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS + ISSUE6_PARTS)
    )
    parser.add_argument(
        "--fixed-mmap-threshold",
        action="store_true",
        help=f"diagnostic: run the measurements with MALLOC_MMAP_THRESHOLD_={FIXED_MMAP_THRESHOLD} (glibc hands freed "
        "large blocks straight back to the OS, so the peak shows live memory, not what the allocator keeps)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="fresh processes per side-by-side fit measurement; the median is reported (default 3, 1 with --quick)",
    )
    args = parser.parse_args()
    given_detectors = None if args.detectors is None else tuple(d for d in args.detectors.split(",") if d)
    chosen = DETECTORS if given_detectors is None else tuple(d for d in given_detectors if d in DETECTORS)
    chosen6 = FIT6_DETECTORS if given_detectors is None else tuple(d for d in given_detectors if d in FIT6_DETECTORS)
    parts = {p for p in args.parts.split(",") if p}
    for label, given, valid in (
        ("detector", given_detectors or (), DETECTORS + FIT6_DETECTORS),
        ("part", parts, PARTS + ISSUE6_PARTS),
    ):
        if set(given) - set(valid):
            parser.error(
                f"unknown {label}(s) {', '.join(sorted(set(given) - set(valid)))}; choose from {', '.join(valid)}"
            )
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3
    if args.fixed_mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(FIXED_MMAP_THRESHOLD)  # inherited by every measurement
    main(QUICK if args.quick else FULL, chosen, parts, chosen6, repeats)
