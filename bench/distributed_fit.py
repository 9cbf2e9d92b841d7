"""A detector fit split over N processes (the state protocol, issue 16.3) against one process.

Synthetic float32 features ``[N, D]`` with ``C`` classes (a large common offset), logits from a random head.
Each world size starts ``N`` processes (gloo on the CPU, NCCL with ``--device cuda``: one GPU per rank) that
load the data, take their contiguous rows and fit each detector with
:func:`oodviz.pipeline.distributed.fit_across_ranks`; the fit time is rank 0's wall time of that call (update on its
rows, gather and merge of the states, finalize, per pass). One process is an ordinary ``fit``. Prints the
seconds per detector and world size, the speed-up, and whether the fitted float64 statistics equal one
process's within 1e-9 relative. Every process runs one thread (``OMP_NUM_THREADS=1``, as torchrun sets it for
several workers), so the figures compare processes, not threads; each detector is fitted once on one batch
first (lazy initialisations), untimed.

    .venv/bin/python bench/distributed_fit.py                                 # CPU: 1 vs 2 processes
    .venv/bin/python bench/distributed_fit.py --device cuda --nproc 1 2 4 8   # N GPUs
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

RANK_SCRIPT = """
import sys, time
import numpy as np
import torch
from oodviz import Batch
from oodviz.detectors import create
from oodviz.pipeline.distributed import World, fit_across_ranks, join_world, leave_world, shard_bounds

world = World.from_env()
data_path, out_path, device, *names = sys.argv[1:]
device = torch.device(device if device == "cpu" else f"cuda:{world.local_rank}")
data = np.load(data_path)
x, logits, y = (torch.from_numpy(data[k]) for k in ("x", "logits", "y"))
head = (torch.from_numpy(data["weight"]).to(device), torch.from_numpy(data["bias"]).to(device))
start, stop = shard_bounds(len(y), world.rank, world.size)
rows = [slice(i, min(i + 4096, stop)) for i in range(start, stop, 4096)]
batches = [Batch(features=x[r], logits=logits[r], labels=y[r]).to(device) for r in rows]
join_world(world, device)
result = {}
for name in names:
    create(name).fit(batches[:1], head=head, device=device)  # warm-up: lazy initialisations, not timed
    torch.distributed.barrier() if world.distributed else None
    started = time.perf_counter()
    detector = fit_across_ranks(create(name), batches, world, head=head, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result[f"{name}.seconds"] = np.asarray(time.perf_counter() - started)
    for key, value in vars(detector).items():
        if key.endswith("_") and isinstance(value, torch.Tensor) and value.dtype == torch.float64:
            result[f"{name}.{key}"] = value.cpu().numpy()
leave_world()
if world.rank == 0:
    np.savez(out_path, **result)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(path: Path, n: int, d: int, c: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, c, n)
    weight, bias = rng.normal(size=(c, d)).astype(np.float32), rng.normal(size=c).astype(np.float32)
    x = (100 + rng.normal(size=(n, d)) * np.linspace(0.1, 2, d) + 0.5 * weight[y]).astype(np.float32)
    logits = (x - 100) @ weight.T + bias
    np.savez(path, x=x, y=y, logits=logits, weight=weight, bias=bias)


def run_world(size: int, data: Path, out: Path, device: str, names: list[str], script: Path) -> dict:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(size)}
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"  # one thread a process, whatever the world size
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(data), str(out), device, *names],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(size)
    ]
    if any(p.wait() for p in ranks):
        raise RuntimeError(f"a rank of the world of {size} failed")
    return dict(np.load(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--c", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--detectors", nargs="+", default=["mahalanobis", "gmm", "vim", "react"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_data(tmp / "data.npz", args.n, args.d, args.c)
        (tmp / "rank.py").write_text(RANK_SCRIPT)
        results = {
            size: run_world(
                size, tmp / "data.npz", tmp / f"out{size}.npz", args.device, args.detectors, tmp / "rank.py"
            )
            for size in args.nproc
        }
    first = results[args.nproc[0]]
    print(f"N={args.n} D={args.d} C={args.c} device={args.device}")
    print("| detector | processes | fit s (rank 0) | speed-up | float64 state as 1 process (1e-9 rel.) |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.detectors:
        for size, result in results.items():
            seconds = float(result[f"{name}.seconds"])
            same = all(
                np.allclose(result[key], first[key], rtol=0, atol=1e-9 * np.abs(first[key]).max())
                for key in first
                if key.startswith(f"{name}.") and not key.endswith(".seconds")
            )
            speed_up = float(first[f"{name}.seconds"]) / seconds
            print(f"| {name} | {size} | {seconds:.2f} | {speed_up:.2f}x | {same} |")


if __name__ == "__main__":
    main()
