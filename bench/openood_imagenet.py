"""OpenOOD v1.5's ImageNet-1k protocol on one machine: what the pre-flight projects, and a reduced run measured.

Two parts, both on synthetic data roots in OpenOOD's exact layout (``benchmark_imglist/imagenet/*.txt``, images
under ``images_largescale/`` and ``images_classic/``), with torchvision's ResNet-50 at random weights (the
leaderboard's network; weights change no byte count):

1. **Projection.** List files with the protocol's sizes (``SIZES``: ImageNet-1k's 1,281,167 training images, and
   the test and OOD list sizes as commonly reported for OpenOOD v1.5; pass ``--data-root`` of a real OpenOOD data
   root to read the real counts from its lists) whose lines all name the same few real images: the run's
   pre-flight (:func:`oodviz.pipeline.preflight.preflight`, what ``oodviz bench`` runs before any work) gives
   the disk of every feature store, the RAM of every detector's fit and of one batch, on this machine.
2. **A reduced run measured.** The same protocol on real (random-pixel) images at two sizes, the second with twice
   the images of every set: ``oodviz bench openood-v1.5 imagenet --weights random`` in a fresh process each, its
   peak resident memory (``VmHWM`` of the run's process, from its own telemetry: each stage's ``peak_cpu_rss``)
   and wall time. Bounded memory means the peak does not grow with the images.

Run (about 10 minutes on 2 CPU cores)::

    .venv/bin/python bench/openood_imagenet.py [--scale 300] [--device cpu] [--detectors msp,energy,mahalanobis,vim,knn]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from report import environment

from oodviz.config.splits import load_split
from oodviz.data.openood import benchmark_splits
from oodviz.models.memory import format_bytes
from oodviz.pipeline.batchprobe import batch_peaks
from oodviz.pipeline.openood import benchmark_config
from oodviz.pipeline.preflight import preflight

#: Images per set of the ImageNet-1k protocol (without tuning: no validation lists). id_train: ImageNet-1k's training
#: set. The others as commonly cited for OpenOOD v1.5, not read from its lists (``--data-root`` reads them).
SIZES = {
    "id_train": 1_281_167,
    "id_test": 45_000,
    "near/ssb_hard": 49_000,
    "near/ninco": 5_879,
    "far/inaturalist": 10_000,
    "far/textures": 5_160,
    "far/openimage_o": 15_869,
}
DETECTORS = "msp,energy,mahalanobis,vim,knn"


def write_root(root: Path, sizes: dict[str, int], distinct: int | None = None, seed: int = 0) -> None:
    """Every set the protocol reads under ``root``: ``sizes[split]`` list lines, naming ``distinct`` real images
    in turn (None: one real image per line), each a random 64 x 48 JPEG."""
    rng = np.random.default_rng(seed)
    for s in benchmark_splits("imagenet"):
        if s.split not in sizes:
            continue
        n = sizes[s.split]
        files = n if distinct is None else min(n, distinct)
        paths = [f"{s.archive}/{s.split.replace('/', '_')}/{i}.JPEG" for i in range(files)]
        for path in paths:
            target = root / s.image_dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(target, quality=90)
        list_file = root / s.list_file
        list_file.parent.mkdir(parents=True, exist_ok=True)
        with open(list_file, "w") as out:
            out.writelines(f"{paths[i % files]} {i % 1000 if s.labelled else 0}\n" for i in range(n))


def list_sizes(data_root: Path) -> dict[str, int]:
    """The lines of each list the protocol reads, from a real OpenOOD data root."""
    return {
        s.split: sum(1 for line in open(s.list_path(str(data_root))) if line.strip())
        for s in benchmark_splits("imagenet")
        if s.split in SIZES
    }


def projection(root: Path, detectors: list[str], device: str) -> None:
    config = benchmark_config("imagenet", root, None, weights="random", detectors=detectors, device=device)
    config.validate()
    started = time.perf_counter()
    report = preflight(config, root / "runs")
    seconds = time.perf_counter() - started
    print(f"pre-flight of the full protocol ({seconds:.0f} s, of which listing 1.28 M lines):")
    print(report.table())
    # the extraction's batch (the pre-flight measures it only for runs with model-based detectors)
    backbone = config.load_backbone()
    dataset = load_split(config, config.id_fit, False, backbone.classes)
    (extraction,), _ = batch_peaks(config, backbone, dataset, names=[])
    print(f"one extraction batch, measured: {extraction.describe()}")
    fits = sum(need.needed for need in report.needs if need.resource == "ram")
    print(
        f"host RAM beyond the model: one batch {format_bytes(extraction.bytes_at(extraction.rows))} + every fit's state "
        f"{format_bytes(fits)} (the fits run one after another: at most the largest at once)"
    )


def measured_run(root: Path, detectors: str, device: str) -> dict:
    runs = root / "runs"
    argv = [sys.executable, "-m", "oodviz.cli", "bench", "openood-v1.5", "imagenet", "--data-root", str(root)]
    argv += ["--weights", "random", "--detectors", detectors, "--device", device, "--batch-size", "64"]
    argv += ["--runs-root", str(runs), "--force"]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    (run,) = [path for path in runs.iterdir() if (path / "meta.json").is_file()]
    meta = json.loads((run / "meta.json").read_text())
    stages = meta["stages"]
    peak = max(stage.get("peak_cpu_rss", 0) for stage in stages.values())
    gpu = {
        key: max(stage.get(key, 0) for stage in stages.values())
        for key in {key for stage in stages.values() for key in stage if key.startswith("peak_gpu")}
    }
    images = sum(split["n"] for split in meta["splits"].values())
    return {"images": images, "wall_s": wall, "peak_rss": peak, "peak_gpu": gpu, "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=300, help="ID training images of the smaller measured run")
    parser.add_argument("--detectors", default=DETECTORS)
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    parser.add_argument("--data-root", help="a real OpenOOD data root: take the projection's sizes from its lists")
    args = parser.parse_args()
    print("\n".join(environment()))
    detectors = [name.strip() for name in args.detectors.split(",")]
    sizes = list_sizes(Path(args.data_root)) if args.data_root else SIZES
    print("set sizes:", ", ".join(f"{split} {n:,}" for split, n in sizes.items()))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "full"
        write_root(root, sizes, distinct=8)
        projection(root, detectors, args.device)
    results = []
    for factor in (1, 2):
        reduced = {
            "id_train": factor * args.scale,
            "id_test": factor * args.scale // 3,
            **{split: factor * args.scale // 10 for split in SIZES if split.startswith(("near/", "far/"))},
        }
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "reduced"
            write_root(root, reduced)
            result = measured_run(root, args.detectors, args.device)
        results.append(result)
        print(
            f"measured run x{factor}: {result['images']:,} images, {result['wall_s']:.0f} s wall, "
            f"peak RSS {format_bytes(result['peak_rss'])}"
            + "".join(f", {key} {format_bytes(value)}" for key, value in sorted(result["peak_gpu"].items()))
        )
    first, second = results
    print(
        f"twice the images: peak RSS x{second['peak_rss'] / first['peak_rss']:.2f}, "
        f"wall x{second['wall_s'] / first['wall_s']:.2f}"
    )


if __name__ == "__main__":
    main()
