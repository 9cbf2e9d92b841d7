"""Wall time of the bundled offline default run from a cold start (issue 4's target: < 60 s on 2 cores).

Cold = a fresh Python process and an empty runs root (so no stored features to reuse): exactly
what `oodviz run` costs a new user. Also runs it a second time in the same root (features reused)
and prints each run's slowest stages from its meta.json.

    .venv/bin/python bench/default_run.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed_run(root: Path, name: str) -> tuple[float, dict]:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "oodviz.cli", "run", "--out", str(root / name)], check=True, capture_output=True
    )
    wall = time.perf_counter() - started
    return wall, json.loads((root / name / "meta.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}, python {sys.version.split()[0]}")
    print("| run | wall s (cold) | wall s (features reused) | slowest stages (cold) |")
    print("| --- | --- | --- | --- |")
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            cold, meta = timed_run(root, "cold")
            warm, _ = timed_run(root, "warm")
            slowest = sorted(meta["stages"].items(), key=lambda kv: -kv[1]["wall_s"])[:3]
            stages = ", ".join(f"{name} {s['wall_s']:.1f}" for name, s in slowest)
            print(f"| {i + 1} | {cold:.1f} | {warm:.1f} | {stages} |")


if __name__ == "__main__":
    main()
