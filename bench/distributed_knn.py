"""knn with its bank split over N processes (issue 16: fit_bank_across_ranks / search_across_ranks) against one.

A synthetic float32 bank ``[N, D]`` (a few hundred Gaussian clusters, as ID features are) and ``Q`` queries
(half near the clusters, half spread). Each world size starts fresh processes (gloo on the CPU, NCCL with
``--device cuda``: one GPU per rank, :func:`distributed_fit.run_world`); rank ``r`` keeps its contiguous rows of the
bank as its shard (:func:`oodviz.pipeline.distributed.fit_bank_across_ranks`: the normalised rows written to a file, as a run
does for a bank that is not a store), then every rank searches every query against its shard and rank 0 merges the
top-``k`` lists (:func:`oodviz.pipeline.distributed.search_across_ranks`). Prints rank 0's wall time of the fit and of the
search (each after a barrier), the speed-up over the first world size, and whether the scores equal its scores
within 1e-5 relative. One process is an ordinary ``fit`` and ``score``. One thread per process
(``OMP_NUM_THREADS=1``, as torchrun sets it for several workers), so the figures compare processes, not threads.

    .venv/bin/python bench/distributed_knn.py                                 # CPU: 1 vs 2 processes
    .venv/bin/python bench/distributed_knn.py --device cuda --nproc 1 2 4 8   # N GPUs
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from distributed_fit import run_world

RANK_SCRIPT = """
import sys, time
import numpy as np
import torch
from oodviz import Batch
from oodviz.detectors import create
from oodviz.pipeline.distributed import World, barrier, fit_bank_across_ranks, join_world, leave_world, search_across_ranks
from oodviz.pipeline.distributed import shard_bounds

world = World.from_env()
data_dir, out_path, device, k = sys.argv[1:5]
device = torch.device(device if device == "cpu" else f"cuda:{world.local_rank}")
bank = np.load(f"{data_dir}/bank.npy", mmap_mode="r")
queries = np.load(f"{data_dir}/queries.npy", mmap_mode="r")
start, stop = shard_bounds(len(bank), world.rank, world.size)
rows = [Batch(features=torch.from_numpy(np.array(bank[i : min(i + 8192, stop)]))) for i in range(start, stop, 8192)]
asked = [Batch(features=torch.from_numpy(np.array(queries[i : i + 4096]))) for i in range(0, len(queries), 4096)]
join_world(world, device)
barrier(world)
started = time.perf_counter()
knn = fit_bank_across_ranks(create("knn", k=int(k)), rows, world, device=device)
fit_s = time.perf_counter() - started
barrier(world)
started = time.perf_counter()
scores = search_across_ranks(knn, asked, world, device=device)
search_s = time.perf_counter() - started
leave_world()
if world.rank == 0:
    np.savez(out_path, scores=scores.numpy(), fit_s=fit_s, search_s=search_s)
"""


def make_data(directory: Path, n: int, d: int, q: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(256, d)).astype(np.float32)
    bank = centres[rng.integers(0, 256, n)] + 0.5 * rng.normal(size=(n, d)).astype(np.float32)
    near = centres[rng.integers(0, 256, q // 2)] + 0.5 * rng.normal(size=(q // 2, d)).astype(np.float32)
    spread = 2 * rng.normal(size=(q - q // 2, d)).astype(np.float32)
    np.save(directory / "bank.npy", bank)
    np.save(directory / "queries.npy", np.concatenate([near, spread]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="bank rows")
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--q", type=int, default=10_000, help="queries")
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_data(tmp, args.n, args.d, args.q)
        (tmp / "rank.py").write_text(RANK_SCRIPT)
        results = {
            size: run_world(size, tmp, tmp / f"out{size}.npz", args.device, [str(args.k)], tmp / "rank.py")
            for size in args.nproc
        }
    first = results[args.nproc[0]]
    print(f"N={args.n} D={args.d} Q={args.q} k={args.k} device={args.device}")
    print("| processes | fit s (rank 0) | search s (rank 0) | speed-up (search) | scores as 1 process (1e-5 rel.) |")
    print("| --- | --- | --- | --- | --- |")
    for size, result in results.items():
        same = np.allclose(result["scores"], first["scores"], rtol=1e-5, atol=0)
        speed_up = float(first["search_s"]) / float(result["search_s"])
        print(f"| {size} | {float(result['fit_s']):.2f} | {float(result['search_s']):.2f} | {speed_up:.2f}x | {same} |")


if __name__ == "__main__":
    main()
