"""Test time per xdist worker and per test file, from the log of a suite run (bench/RESULTS.md, "Test time").

    .venv/bin/python -m pytest -n 2 --dist loadgroup -v --durations=0 > suite.log 2>&1
    .venv/bin/python bench/test_time.py suite.log

A worker's test time is the sum of pytest's setup, call and teardown durations of the tests it ran (``-v`` says
which worker ran which test): the busier worker's sum is the suite's critical path, the wall time less start-up.
"""

import argparse
import re
from collections import defaultdict
from pathlib import Path

RAN = re.compile(r"^\[(gw\d+)\] (?:\[\s*\d+%\] )?(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+)", re.M)
DURATION = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)", re.M)
SUMMARY = re.compile(r"^=+ (.* in [\d.]+s.*) =+$", re.M)


def test_times(log: str) -> tuple[dict[str, float], dict[str, str]]:
    """Seconds of setup + call + teardown by test node id, and the worker that ran each test."""
    seconds: dict[str, float] = defaultdict(float)
    for duration, test in DURATION.findall(log):
        seconds[test] += float(duration)
    return dict(seconds), {test: worker for worker, test in RAN.findall(log)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="the output of pytest -n N -v --durations=0")
    parser.add_argument("--files", type=int, default=15, help="how many of the slowest test files to list")
    args = parser.parse_args()
    log = args.log.read_text(errors="replace")
    seconds, worker = test_times(log)
    per_worker: dict[str, float] = defaultdict(float)
    per_file: dict[tuple[str, str], float] = defaultdict(float)
    for test, s in seconds.items():
        per_worker[worker.get(test, "?")] += s
        per_file[test.split("::")[0], worker.get(test, "?")] += s
    print(" · ".join(SUMMARY.findall(log)[-1:]) or "(no summary line)")
    print(f"test time, all workers: {sum(seconds.values()):.0f} s")
    for name, s in sorted(per_worker.items()):
        print(f"  {name}: {s:.0f} s")
    print(f"slowest files (seconds on each worker that ran some of their tests), first {args.files}:")
    files: dict[str, dict[str, float]] = defaultdict(dict)
    for (file, name), s in per_file.items():
        files[file][name] = s
    for file, by_worker in sorted(files.items(), key=lambda item: -sum(item[1].values()))[: args.files]:
        split = ", ".join(f"{name} {s:.0f}" for name, s in sorted(by_worker.items()))
        print(f"  {sum(by_worker.values()):7.0f} s  {file}  ({split})")


if __name__ == "__main__":
    main()
