"""The harness of the detector benchmark (``bench/detectors.py``): synthetic data, peak memory,
and one measurement per fresh Python process.

**The data.** One set of seeded, class-structured synthetic features (class means + noise,
post-ReLU, a linear head ``W [C, D], b [C]``, ``logits = features @ W.T + b``, every class
present) made by :class:`SyntheticStream`, either on the fly (nothing materialised: the
flat-memory check) or written once into a temporary directory as ``.npy`` and as an oodviz
feature store (:func:`write_dataset`), which each measurement loads fully into RAM.

**Peak memory.** :class:`PeakGrowth` records the peak RSS *growth* of the code inside it (peak
RSS minus RSS on entry) and its wall time. Writing "5" to ``/proc/self/clear_refs`` resets the
kernel's high-water mark (VmHWM) to the current RSS; VmHWM is read from ``/proc/self/status``
afterwards. Where that is not possible, a thread samples the RSS with psutil every millisecond.
:func:`warm_up_torch` runs each kind of kernel once first, so that lazy initialisation is
counted for neither library. Torch threads are left at their default (one per core).

**Fresh processes.** :func:`run_one` runs a measurement function (``measure_*`` in the
measurement modules) in a new Python process, which prints its result as one ``RESULT {...}``
line; :func:`median_of_runs` folds repeats. To run one measurement by hand (a diagnostic)::

    .venv/bin/python bench/harness.py fit_memory.measure_oodviz_fit '{"data_dir": "DIR", "detector": "knn"}'
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

MiB = 2**20
SEED = 0
BATCH_SIZE = 4096
KNN_K = 50
FEATURE_NOISE = 1.5  # std of the noise around each class mean, before the ReLU
HEAD_NOISE = 2.0  # random part of the head; the rest points at the class means (about 80% accuracy)


@dataclass(frozen=True)
class Sizes:
    n_fit: int  # samples in the side-by-side fits
    n_flat: int  # the large N of the flat-growth check
    dim: int  # D
    classes: int  # C
    n_score_oodviz: int
    n_score_pytorch_ood: int
    subprocess_timeout_s: int


FULL = Sizes(50_000, 1_000_000, 1024, 1000, 20_000, 500, 1200)
QUICK = Sizes(5_000, 20_000, 128, 20, 2_000, 200, 300)  # a smoke test of the script, not figures


# -- the data ------------------------------------------------------------------------------------


class SyntheticStream:
    """``n`` seeded, class-structured samples as a re-iterable of ``oodviz.Batch``, made on the fly.

    Features are ``relu(mu_y + FEATURE_NOISE * eps)`` with random non-negative class means
    ``mu [C, D]``; labels cycle through ``0..C-1`` (shuffled within a batch), so every class
    occurs once ``n >= C``. The head ``W = unit(mu_k - mean mu) + HEAD_NOISE * eps / sqrt(D)``
    classifies about 80% correctly at D=1024, C=1000. Batch ``i`` comes from its own generator, so every pass
    yields the same data and only one batch exists at a time: each batch is written into the same
    buffers (a consumer must be done with a batch before it asks for the next, as a fit is), so the
    stream's own memory is constant and allocates nothing per batch that the allocator could keep.
    """

    def __init__(self, n: int, dim: int, classes: int, with_logits: bool = True, batch_size: int = BATCH_SIZE):
        self.n, self.dim, self.classes = n, dim, classes
        self.with_logits, self.batch_size = with_logits, batch_size
        generator = torch.Generator().manual_seed(SEED)
        self.class_means = torch.randn(classes, dim, generator=generator).relu_()
        centred = self.class_means - self.class_means.mean(dim=0)
        noise = torch.randn(classes, dim, generator=generator) / dim**0.5
        self.weight = centred / centred.norm(dim=1, keepdim=True) + HEAD_NOISE * noise
        self.bias = 0.1 * torch.randn(classes, generator=generator)
        self._features = torch.empty(batch_size, dim)
        self._offsets = torch.empty(batch_size, dim)
        self._logits = torch.empty(batch_size, classes) if with_logits else None

    def __iter__(self):
        for index, start in enumerate(range(0, self.n, self.batch_size)):
            yield self.batch(index, start, min(start + self.batch_size, self.n))

    def batch(self, index: int, start: int, stop: int):
        from oodviz import Batch

        generator = torch.Generator().manual_seed(SEED + 1 + index)
        n = stop - start
        labels = (torch.arange(start, stop) % self.classes)[torch.randperm(n, generator=generator)]
        features = torch.randn(n, self.dim, generator=generator, out=self._features[:n]).mul_(FEATURE_NOISE)
        features.add_(torch.index_select(self.class_means, 0, labels, out=self._offsets[:n])).relu_()
        logits = None
        if self.with_logits:
            logits = torch.addmm(self.bias, features, self.weight.T, out=self._logits[:n])
        return Batch(features, logits, labels)


STORE_KEY = "store"  # the same data as an oodviz feature store, under <data dir>/store


def write_dataset(directory: str, sizes: Sizes) -> None:
    """Materialise ``SyntheticStream(sizes.n_fit)`` as features/logits/labels/weight/bias ``.npy``,
    and as an oodviz feature store (what the app's runs fit from)."""
    from oodviz.engine import StoreWriter

    stream = SyntheticStream(sizes.n_fit, sizes.dim, sizes.classes)
    writer = StoreWriter(directory, STORE_KEY, capacity=sizes.n_fit, feature_dim=sizes.dim, num_classes=sizes.classes)
    files = {
        "features": ((sizes.n_fit, sizes.dim), np.float32),
        "logits": ((sizes.n_fit, sizes.classes), np.float32),
        "labels": ((sizes.n_fit,), np.int64),
    }
    arrays = {
        name: np.lib.format.open_memmap(os.path.join(directory, f"{name}.npy"), mode="w+", dtype=dtype, shape=shape)
        for name, (shape, dtype) in files.items()
    }
    start = 0
    for batch in stream:
        stop = start + len(batch)
        arrays["features"][start:stop] = batch.features.numpy()
        arrays["logits"][start:stop] = batch.logits.numpy()
        arrays["labels"][start:stop] = batch.labels.numpy()
        writer.append(batch.features, batch.logits, batch.labels, torch.arange(start, stop))
        start = stop
    for array in arrays.values():
        array.flush()
    writer.commit({"dataset": {"name": "synthetic"}})
    np.save(os.path.join(directory, "weight.npy"), stream.weight.numpy())
    np.save(os.path.join(directory, "bias.npy"), stream.bias.numpy())


def load_dataset(directory: str) -> dict[str, torch.Tensor]:
    """Every array read fully into RAM (not memory-mapped), as CPU tensors."""
    names = ("features", "logits", "labels", "weight", "bias")
    return {name: torch.from_numpy(np.load(os.path.join(directory, f"{name}.npy"))) for name in names}


def batch_views(data: dict[str, torch.Tensor], n: int | None = None) -> list:
    """The first ``n`` rows as a list of ``Batch`` views of ``BATCH_SIZE`` rows (slices, no copies)."""
    from oodviz import Batch

    n = len(data["labels"]) if n is None else n
    return [
        Batch(
            data["features"][i : i + BATCH_SIZE], data["logits"][i : i + BATCH_SIZE], data["labels"][i : i + BATCH_SIZE]
        )
        for i in range(0, n, BATCH_SIZE)
    ]


# -- memory and time ------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        _status_kib("VmHWM")
        return True
    except (OSError, KeyError):
        return False


class PeakGrowth:
    """Context manager: peak RSS growth (MiB) and wall time (s) of the code inside it.

    ``growth_mib`` = peak RSS inside the block minus the RSS on entry. The peak is the kernel's
    VmHWM after resetting it through ``/proc/self/clear_refs``, or else the maximum of a psutil
    sampling thread.
    """

    def __enter__(self):
        gc.collect()
        self.method = "VmHWM" if can_reset_peak() else "psutil sampling"
        if self.method == "VmHWM":
            self._before = _status_kib("VmRSS") * 1024
        else:
            import psutil

            self._process = psutil.Process()
            self._before = self._peak = self._process.memory_info().rss
            self._stop = threading.Event()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        self._start = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._start
        if self.method == "VmHWM":
            peak = _status_kib("VmHWM") * 1024
        else:
            self._stop.set()
            self._sampler.join()
            peak = max(self._peak, self._process.memory_info().rss)
        self.rss_before_mib = self._before / MiB
        self.growth_mib = (peak - self._before) / MiB
        return False

    def result(self) -> dict:
        return {
            "growth_mib": self.growth_mib,
            "seconds": self.seconds,
            "rss_before_mib": self.rss_before_mib,
            "peak_method": self.method,
        }


def warm_up_torch() -> None:
    """Run each kind of kernel the fits use once, so that lazy initialisation (the intra-op
    thread pool with its stacks and malloc arenas, ~30 MiB; BLAS/LAPACK) is not counted as fit
    memory. Same for both libraries. The first op is large enough (1M elements) to start the
    thread pool; the rest are tiny."""
    big = torch.randn(1024, 1024)
    torch.isfinite(big).all()
    (big.double() * 2).sum()
    del big
    for dtype in (torch.float32, torch.float64):
        a = torch.randn(64, 32, dtype=dtype)
        s = a.T @ a + torch.eye(32, dtype=dtype)
        torch.linalg.eigh(s)
        torch.linalg.inv(s)
        torch.linalg.pinv(a)
        torch.zeros(8, 32, dtype=dtype).index_add_(0, torch.arange(64) % 8, a)
        a.softmax(dim=1).logsumexp(dim=1)
        a.norm(dim=1).topk(4)
    gc.collect()


# -- the detectors' parameters (the same in every measurement) ----------------------------------


def vim_dim(dim: int) -> int:
    """ViM's principal-subspace dimension: D / 2 (512 at D=1024, as the ViM paper uses for 768 <= D < 2048)."""
    return dim // 2


def oodviz_params(detector: str, dim: int) -> dict:
    """The parameters oodviz's ``create(detector, ...)`` gets here (percentiles in percent)."""
    return {
        "vim": {"dim": vim_dim(dim)},
        "knn": {"k": KNN_K},
        "react": {"percentile": 90.0},
        "ash": {"variant": "s", "percentile": 90.0},
        "scale": {"percentile": 85.0},
        "dice": {"sparsity": 0.9},
    }.get(detector, {})


# -- one measurement per process ------------------------------------------------------------------


def run_one(measure, timeout_s: int, **kwargs) -> dict:
    """Run ``measure(**kwargs)`` (a function of a bench module) in a fresh Python process; its result,
    or ``{"error": ...}``."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        f"{measure.__module__}.{measure.__name__}",
        json.dumps(kwargs),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {done.returncode}: " + " | ".join(tail)}


def median_of_runs(runs: list[dict]) -> dict:
    """One result from repeated runs: the median growth and time, with their ranges; an error if any run failed."""
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    result = dict(runs[0])
    for key in ("growth_mib", "seconds"):
        values = sorted(r[key] for r in runs)
        result[key] = values[len(values) // 2]
        result[key + "_range"] = (values[0], values[-1])
    result["runs"] = len(runs)
    return result


if __name__ == "__main__":
    # python bench/harness.py MODULE.FUNCTION JSON: one measurement in this process (what run_one starts).
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} MODULE.FUNCTION JSON_KWARGS  (e.g. flat_memory.measure_oodviz_streamed_fit)")
    module_name, _, function_name = sys.argv[1].rpartition(".")
    measure = getattr(importlib.import_module(module_name), function_name)
    print("RESULT " + json.dumps(measure(**json.loads(sys.argv[2]))), flush=True)
