"""One process against N: ``oodviz run CONFIG --nproc-per-node N`` on a CPU-bound extraction (issue 16).

resnet18 with random weights (a dry run: nothing downloaded) on 2,000 generated images (32 x 32 PNGs,
upscaled to 224 x 224 by the model's transform): a 2-class ID folder of 1,000 (fit) and 500 (test) images,
500 flat OOD images; detectors msp, energy, mahalanobis, knn. Each world size runs in a fresh runs root
(nothing reused), so the extraction of all 2,000 images is timed. Prints the wall time of the whole command,
the sum of its ``extract`` stages (rank 0's, from ``meta.json``), the speed-up over one process, and checks
that every world size gave the first one's scores (within 1e-5 relative).

    .venv/bin/python bench/distributed.py                                  # CPU: 1 vs 2 processes (gloo)
    .venv/bin/python bench/distributed.py --device cuda --nproc 1 2 4 8    # N GPUs (NCCL), one per process

With several processes on the CPU, torchrun gives each worker one thread (OMP_NUM_THREADS=1), while one
process uses every core: on a machine with as many cores as processes the gain is what sharding adds over
torch's own intra-op threads.
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

import numpy as np
import pandas as pd


def make_images(root: Path, seed: int = 0) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, per_class in (("fit", 500), ("test", 250)):
        for k, colour in enumerate(((200, 40, 40), (40, 40, 200))):
            folder = root / split / f"class-{k}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = np.clip(np.array(colour) + rng.normal(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    (root / "ood").mkdir()
    for i in range(500):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / "ood" / f"{i}.png")


def write_config(root: Path, device: str, batch_size: int) -> Path:
    from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig

    config = RunConfig(
        backbone="resnet18",
        weights="random",
        id_fit=DatasetChoice("folder", {"path": str(root / "fit")}),
        id_test=DatasetChoice("folder", {"path": str(root / "test")}),
        ood=[DatasetChoice("folder", {"path": str(root / "ood")}, group="far")],
        detectors=[DetectorChoice(name) for name in ("msp", "energy", "mahalanobis")]
        + [DetectorChoice("knn", {"k": 5})],
        batch_size=batch_size,
        device=device,
    )
    path = root / "config.json"
    config.save(path)
    return path


def timed_run(root: Path, config: Path, nproc: int) -> dict:
    out = root / f"runs-{nproc}" / "run"
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "oodviz.cli", "run", str(config), "--out", str(out), "--nproc-per-node", str(nproc)],
        capture_output=True,
        text=True,
        cwd=str(root),
    )
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{nproc} process(es) failed:\n{result.stderr[-3000:]}")
    meta = json.loads((out / "meta.json").read_text())
    extract_s = sum(s["wall_s"] for name, s in meta["stages"].items() if name.startswith("extract"))
    return {"nproc": nproc, "wall_s": wall, "extract_s": extract_s, "scores": pd.read_parquet(out / "scores.parquet")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="world sizes to compare (first = base)")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per process)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}, device {args.device}, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_images(root)
        config = write_config(root, args.device, args.batch_size)
        results = [timed_run(root, config, n) for n in args.nproc]
    base = results[0]
    print("| processes | wall s (command) | extract s (rank 0, 3 splits) | speed-up (extract) | scores as base |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        same = all(
            np.allclose(r["scores"][c], base["scores"][c], rtol=1e-5, atol=1e-7)
            for c in base["scores"].columns
            if base["scores"][c].dtype.kind == "f"
        )
        speedup = base["extract_s"] / r["extract_s"]
        print(f"| {r['nproc']} | {r['wall_s']:.1f} | {r['extract_s']:.1f} | {speedup:.2f}x | {same} |")


if __name__ == "__main__":
    main()
