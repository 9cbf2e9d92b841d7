"""Extraction throughput against the bare forward pass on the CPU (issue 13.7): how much the data path costs.

For each model, the same images go (a) through ``oodviz.engine.extract`` (data loading, transform, forward,
writing the feature store) and (b) through ``backbone.features_and_logits(x)`` alone, on tensors transformed
beforehand and held in memory (the limit). The ratio ``(b) / (a)`` is the share of the bare forward's speed the
extraction reaches. Two data paths are measured side by side, ``--repeats`` times taking turns (bare, before, after,
bare, ...), and each reported as the median of its repeats, in wall time and in CPU time (user + system of this
process and of its finished children, the DataLoader workers: ``resource.getrusage``). CPU time is far less
sensitive than wall time to other processes on a loaded machine; wall time is what a user waits for (with
DataLoader workers on other cores the CPU ratio is the lower of the two):

- "before": every item through PIL and the transform one at a time in this process (``num_workers=0``; the
  transform's ``batch`` method hidden), the path of every dataset before issue 13.7;
- "after": the path a run takes now: array-backed sets (digits, Fashion-MNIST-like arrays) transformed a batch
  at a time as tensors; the image folder (resnet18) read by ``num_workers="auto"`` DataLoader workers.

Data: digits-cnn on ``digits-train`` (1,081 8x8 images); fashion-cnn on 8,192 random 28x28 pixel arrays held
in an ``ArraySource``, the source type of the Fashion-MNIST sets (whose files are not on every machine); resnet18 (random weights) on a folder
of generated 64x64 PNGs, resized to 224 by its transform. Torch runs ``--threads`` intra-op threads (default 1,
as the issue measured)::

    python bench/throughput.py [--models digits-cnn,fashion-cnn,resnet18] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from oodviz.data import load_dataset
from oodviz.data.base import ImageDataset
from oodviz.data.bundled import ArraySource
from oodviz.engine import extract
from oodviz.models import load_backbone

#: model -> (batch size, items, items with --quick)
SIZES = {"digits-cnn": (256, None, 300), "fashion-cnn": (256, 8192, 1024), "resnet18": (32, 256, 32)}
TARGETS = {"digits-cnn": 0.70, "fashion-cnn": 0.90, "resnet18": 0.90}


class _OneByOne:
    """The backbone's transform without its ``batch`` method: every item through PIL, one at a time."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, image):
        return self.inner(image)


def _image_folder(root: Path, n: int) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    folder = root / "images" / "class-0"
    folder.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root / "images"


def _dataset(model: str, n: int | None, root: Path):
    if model == "digits-cnn":
        return load_dataset("digits-train", subsample=n)
    if model == "fashion-cnn":  # in-memory 28x28 pixels: the Fashion-MNIST sets' own source type
        pixels = np.random.default_rng(0).integers(0, 256, (n, 28, 28), dtype=np.uint8)
        return ImageDataset("fashion-like", ArraySource(pixels, np.zeros(n, np.int64), [str(c) for c in range(8)]))
    return load_dataset("folder", path=str(_image_folder(root, n)))


def _backbone(model: str):
    return load_backbone(model, weights="random") if model == "resnet18" else load_backbone(model)


def _cpu_seconds() -> float:
    """User + system seconds of this process and of its children that have ended (the DataLoader workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _timed(work) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of ``work()``."""
    wall, cpu = time.perf_counter(), _cpu_seconds()
    work()
    return time.perf_counter() - wall, _cpu_seconds() - cpu


def _time_extraction(backbone, dataset, root: Path, batch_size: int, num_workers) -> tuple[float, float]:
    store_root = Path(tempfile.mkdtemp(dir=root))
    return _timed(
        lambda: extract(backbone, dataset, store_root, batch_size=batch_size, num_workers=num_workers, sync=False)
    )


def _time_bare(backbone, batches: list[torch.Tensor]) -> tuple[float, float]:
    model = backbone.model
    if isinstance(model, torch.nn.Module):
        model.eval()

    def forward_all() -> None:
        with torch.inference_mode():
            for x in batches:
                backbone.features_and_logits(x)

    return _timed(forward_all)


def measure(model: str, repeats: int, quick: bool, root: Path) -> dict:
    batch_size, n, n_quick = SIZES[model]
    root.mkdir(parents=True)
    dataset = _dataset(model, n_quick if quick else n, root)
    after = _backbone(model)
    before = _backbone(model)
    before.transform = _OneByOne(after.transform)
    # the tensors the forward sees, transformed beforehand (not timed)
    items = [after.transform(dataset[i][0]) for i in range(len(dataset))]
    batches = [torch.stack(items[i : i + batch_size]) for i in range(0, len(items), batch_size)]
    _time_bare(after, batches[:1])  # warm-up
    times = {"bare": [], "before": [], "after": []}
    for _ in range(repeats):
        times["bare"].append(_time_bare(after, batches))
        times["before"].append(_time_extraction(before, dataset, root, batch_size, 0))
        times["after"].append(_time_extraction(after, dataset, root, batch_size, "auto"))
    median = {
        (key, clock): statistics.median(t[i] for t in values)
        for key, values in times.items()
        for i, clock in enumerate(("wall", "cpu"))
    }
    result = {"model": model, "items": len(dataset), "batch_size": batch_size}
    for clock in ("wall", "cpu"):
        for key in times:
            result[f"{key}_{clock}_s"] = median[key, clock]
        for key in ("before", "after"):
            result[f"{key}_{clock}_ratio"] = median["bare", clock] / median[key, clock]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    parser.add_argument("--quick", action="store_true", help="a few items per model: a smoke test, not figures")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"\n#### Extraction / bare forward, CPU, {args.threads} thread(s), median of {args.repeats}\n")
    print(
        "| model | items | batch | clock | bare forward s | extraction before s (ratio) | extraction now s (ratio) "
        "| target |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---|")
    missed = False
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            r = measure(model, args.repeats, args.quick, Path(tmp) / model)
            for clock in ("cpu", "wall"):
                met = r[f"after_{clock}_ratio"] >= TARGETS[model]
                missed |= not met
                print(
                    f"| {model} | {r['items']} | {r['batch_size']} | {clock} | {r[f'bare_{clock}_s']:.3f} | "
                    f"{r[f'before_{clock}_s']:.3f} ({r[f'before_{clock}_ratio']:.0%}) | "
                    f"{r[f'after_{clock}_s']:.3f} ({r[f'after_{clock}_ratio']:.0%}) | "
                    f">= {TARGETS[model]:.0%}: {'PASS' if met else 'FAIL'} |",
                    flush=True,
                )
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
