"""Tuning cost: a grid over a parameter the fit does not use, rescored on one fit against refitted per point.

knn's ``k`` grid (:data:`KNN_GRID`, the detector's default grid) on seeded synthetic features: N fit rows, D
features, and a validation set of ``n_val`` ID and ``n_val`` OOD rows. "rescore" is what a tuning run does for
knn (one fit writes the bank, ``set_params(k=...)`` then scores the validation rows per point); "refit" fits
again for every point. Both give the same AUROC per point (checked here). Wall-clock seconds, median of
``--repeats``.

    python bench/tuning.py [--n 20000] [--dim 512] [--n-val 5000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch

from oodviz import Batch
from oodviz.detectors import create, detector_class
from oodviz.results.metrics import ood_metrics

KNN_GRID = detector_class("knn").default_grid["k"]


def batches(x: torch.Tensor, size: int = 4096) -> list[Batch]:
    return [Batch(features=x[i : i + size]) for i in range(0, len(x), size)]


def data(n: int, dim: int, n_val: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(10, dim, generator=g)
    fit = centres[torch.arange(n) % 10] + torch.randn(n, dim, generator=g)
    val_id = centres[torch.arange(n_val) % 10] + torch.randn(n_val, dim, generator=g)
    between = 0.5 * (centres[torch.arange(n_val) % 10] + centres[(torch.arange(n_val) + 1) % 10])
    val_ood = between + torch.randn(n_val, dim, generator=g)  # between two classes: near OOD, AUROC below 1
    return batches(torch.relu(fit)), batches(torch.relu(val_id)), batches(torch.relu(val_ood))


def auroc(detector, val_id, val_ood) -> float:
    return ood_metrics(detector.score(val_id).numpy(), detector.score(val_ood).numpy())["auroc"]


def rescore(fit, val_id, val_ood, bank: str) -> list[float]:
    detector = create("knn", k=KNN_GRID[0], bank_dir=bank).fit(fit)
    return [auroc(detector.set_params(k=k), val_id, val_ood) for k in KNN_GRID]


def refit(fit, val_id, val_ood, bank: str) -> list[float]:
    return [auroc(create("knn", k=k, bank_dir=bank).fit(fit), val_id, val_ood) for k in KNN_GRID]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--n-val", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    fit, val_id, val_ood = data(args.n, args.dim, args.n_val)
    times = {"rescore": [], "refit": []}
    results = {}
    for _ in range(args.repeats):
        for name, method in (("rescore", rescore), ("refit", refit)):
            with tempfile.TemporaryDirectory() as bank:
                started = time.perf_counter()
                results[name] = method(fit, val_id, val_ood, bank)
                times[name].append(time.perf_counter() - started)
    np.testing.assert_allclose(results["rescore"], results["refit"], atol=1e-12)
    print(f"knn k grid {KNN_GRID}, N={args.n}, D={args.dim}, validation {args.n_val} + {args.n_val} rows")
    for name, measured in times.items():
        print(f"{name}: {statistics.median(measured):.2f} s (range {min(measured):.2f}-{max(measured):.2f})")
    print("AUROC per k:", ", ".join(f"{k}: {a:.4f}" for k, a in zip(KNN_GRID, results["rescore"])))


if __name__ == "__main__":
    main()
