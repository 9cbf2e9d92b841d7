"""knn scoring at scale (issue 13.4): the per-batch search before issue 13 against the one-pass search.

Before: every query batch (4096 rows) walked the whole bank, re-reading and (for a feature store's raw
features) re-normalising every chunk, so a score call read the bank ``ceil(N_q / 4096)`` times. Now:
one pass over the bank per ``score`` call, bank chunks outer, query blocks inner, running top-k.

The bank is a raw float32 file declared as ``features_on_disk`` (as a feature store's batches do), so
both searches read and normalise it chunk by chunk. Each method runs in a fresh process; the figures are
wall time of ``score`` and peak RSS growth during it (VmHWM after ``/proc/self/clear_refs`` minus the RSS
before), and the bank bytes read. The extrapolation to the ImageNet job (1.28M x 2048 bank, 50k queries)
scales the measured time by ``N x N_q x D`` (the similarity products dominate) and counts the bank passes.
With faiss-cpu installed the FAISS backends (flat, IVF) run too. The data are clustered (100 clusters in the
bank); half the queries come from those clusters (ID), half from 10 others (OOD), and the AUROC of each
search is reported (IVF is to be within 1e-3 of the exact one).

    python bench/knn_scale.py [--bank 100000 --queries 10000 --dim 512 --k 50]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

QUERY_BATCH = 4096  # the run's scoring batch size, that of the per-batch search's figures in issue 13
METHODS = ("per-batch", "one-pass") + (("faiss-flat", "faiss-ivf") if importlib.util.find_spec("faiss") else ())
IMAGENET = {"bank": 1_281_167, "queries": 50_000, "dim": 2048}


class StoreFeatures:
    """Batches of a raw float32 features file that declare it as ``features_on_disk`` (as a feature store)."""

    def __init__(self, path: str, rows: int, dim: int):
        self.features_on_disk = np.memmap(path, dtype=np.float32, mode="r", shape=(rows, dim))

    def __iter__(self):
        from oodviz import Batch

        for start in range(0, len(self.features_on_disk), QUERY_BATCH):
            yield Batch(torch.from_numpy(np.array(self.features_on_disk[start : start + QUERY_BATCH])))


def per_batch_search(detector, batches) -> torch.Tensor:
    """The search before issue 13, for comparison: each batch walks the whole bank."""
    scores = []
    for batch in batches:
        z = batch.features / batch.features.norm(dim=1, keepdim=True).clamp(min=1e-12)
        best = torch.full((len(z), 0), -2.0)
        for start in range(0, len(detector.bank_), detector.chunk_size):
            chunk = torch.from_numpy(np.array(detector.bank_[start : start + detector.chunk_size]))
            chunk = chunk / chunk.norm(dim=1, keepdim=True).clamp(min=1e-12)
            candidates = torch.cat([best, z @ chunk.T], dim=1)
            best = torch.topk(candidates, k=min(detector.k, candidates.shape[1]), dim=1).values
        scores.append((2 - 2 * best[:, -1]).clamp(min=0).sqrt())
    return torch.cat(scores)


def status(key: str) -> int:
    with open("/proc/self/status") as file:
        return int(next(line for line in file if line.startswith(key)).split()[1]) * 1024


def measure(method: str, directory: str, sizes: dict) -> dict:
    """One method in this (fresh) process: seconds, peak RSS growth and scores of ``score``."""
    from oodviz import Batch
    from oodviz.detectors import create

    backend = method if method.startswith("faiss") else "exact"
    detector = create("knn", k=sizes["k"], backend=backend).fit(
        StoreFeatures(os.path.join(directory, "bank.f32"), sizes["bank"], sizes["dim"])
    )
    queries = torch.from_numpy(np.fromfile(os.path.join(directory, "queries.f32"), dtype=np.float32))
    queries = queries.reshape(sizes["queries"], sizes["dim"])
    batches = [Batch(queries[s : s + QUERY_BATCH]) for s in range(0, len(queries), QUERY_BATCH)]
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # reset VmHWM
    before = status("VmRSS:")
    start = time.perf_counter()
    scores = per_batch_search(detector, batches) if method == "per-batch" else detector.score(batches)
    seconds = time.perf_counter() - start
    np.save(os.path.join(directory, f"scores-{method}.npy"), scores.numpy())
    passes = math.ceil(sizes["queries"] / QUERY_BATCH) if method == "per-batch" else 1  # FAISS: one, to build
    return {"seconds": seconds, "peak_growth": status("VmHWM:") - before, "bank_passes": passes}


def write_data(directory: str, sizes: dict) -> None:
    """A raw clustered bank (row norms 0.5..3), ID queries from its clusters, OOD ones from others; in blocks."""
    rng = np.random.default_rng(0)
    centres = 0.5 * rng.standard_normal((110, sizes["dim"]), dtype=np.float32)

    def around(first: int, last: int, rows: int) -> np.ndarray:
        noise = rng.standard_normal((rows, sizes["dim"]), dtype=np.float32)
        return (centres[rng.integers(first, last, rows)] + noise) * rng.uniform(0.5, 3, (rows, 1)).astype(np.float32)

    with open(os.path.join(directory, "bank.f32"), "wb") as file:
        for start in range(0, sizes["bank"], 65536):
            around(0, 100, min(65536, sizes["bank"] - start)).tofile(file)
    half = sizes["queries"] // 2
    queries = np.concatenate([around(0, 100, half), around(100, 110, sizes["queries"] - half)])
    queries.tofile(os.path.join(directory, "queries.f32"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bank", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = {"bank": args.bank, "queries": args.queries, "dim": args.dim, "k": args.k}
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], sizes)))
        return
    with tempfile.TemporaryDirectory(prefix="oodviz-knn-bench-") as directory:
        write_data(directory, sizes)
        command = [sys.executable, __file__] + [f"--{key}={value}" for key, value in sizes.items()]
        results = {
            method: json.loads(
                subprocess.run(
                    command + ["--child", method, directory], check=True, capture_output=True, text=True
                ).stdout
            )
            for method in METHODS
        }
        scores = {method: np.load(os.path.join(directory, f"scores-{method}.npy")) for method in results}
    is_ood = np.arange(args.queries) >= args.queries // 2
    scale = IMAGENET["bank"] * IMAGENET["queries"] * IMAGENET["dim"] / (args.bank * args.queries * args.dim)
    bank_gib = args.bank * args.dim * 4 / 2**30
    imagenet_gib = IMAGENET["bank"] * IMAGENET["dim"] * 4 / 2**30
    print(
        f"bank {args.bank} x {args.dim} ({bank_gib:.2f} GiB), {args.queries} queries, k={args.k}, "
        f"torch threads {torch.get_num_threads()}; "
        f"max |one-pass - per-batch| {np.abs(scores['one-pass'] - scores['per-batch']).max():.2e}"
    )
    print(
        "| search | score s | peak RSS growth MiB | bank passes (GiB read) | AUROC | ImageNet: bank passes (GiB read), CPU h |"
    )
    print("|---|---|---|---|---|---|")
    for method, r in results.items():
        passes = math.ceil(IMAGENET["queries"] / QUERY_BATCH) if method == "per-batch" else 1
        print(
            f"| {method} | {r['seconds']:.1f} | {r['peak_growth'] / 2**20:.0f} | {r['bank_passes']} "
            f"({r['bank_passes'] * bank_gib:.1f}) | {roc_auc_score(is_ood, scores[method]):.5f} | {passes} ({passes * imagenet_gib:.0f}), "
            f"{r['seconds'] * scale / 3600:.1f} |"
        )


if __name__ == "__main__":
    main()
