"""Detector fit memory and time: oodviz against pytorch-ood 0.4 on the same features (issue 2).

What it measures, on CPU, for mahalanobis, rmd, vim, klm, she and knn:

1. **Fit memory growth and fit time, side by side.** One set of seeded, class-structured
   synthetic features (N=50,000, D=1024, C=1000: class means + noise, post-ReLU, a linear head
   ``W [C, D], b [C]``, ``logits = features @ W.T + b``, every class present) is generated once
   into a temporary directory as ``.npy``. Each measurement runs in a fresh subprocess that loads
   the arrays into RAM, warms torch up on tiny tensors, then records the peak RSS *growth* during
   construct + fit (peak RSS during the fit minus RSS just before it) and the fit's wall time.
   oodviz gets the in-RAM tensors as a list of ``Batch`` views (slices, no copies) of 4096 rows;
   pytorch-ood gets the whole tensors (``fit_features`` / ``fit_logits``). Each measurement is
   repeated (``--repeats``, 3 by default; the libraries take turns) and the median reported with
   the range: fit times on a small shared CPU vary by 20-30% from run to run.
2. **Mahalanobis scoring throughput**: oodviz ``det.score(batches)`` against pytorch-ood
   ``Mahalanobis.predict_features(z)`` (a loop over the C classes), in samples/s. pytorch-ood
   scores fewer samples (it is slow); a rate does not depend on the count.
3. **Flat growth in N** (oodviz only): the same detectors fitted from a re-iterable object that
   generates seeded batches on the fly (N x D is never materialised), at N=50,000 and
   N=1,000,000; the fit memory growth must not depend on N.

Peak RSS: writing "5" to ``/proc/self/clear_refs`` resets the kernel's high-water mark (VmHWM)
to the current RSS; VmHWM is read from ``/proc/self/status`` after the fit. Where that is not
possible, a thread samples the RSS with psutil every millisecond. Torch threads are left at their
default (one per core).

Run (20-25 minutes on 2 CPU cores, half of it the N=1,000,000 fits; ``--quick`` is a smoke
test of 3-5 minutes, most of it starting Python processes):

    make bench                                   # = .venv/bin/python bench/detector_fit.py
    .venv/bin/python bench/detector_fit.py --quick
    .venv/bin/python bench/detector_fit.py --parts fit,flat --fixed-mmap-threshold   # diagnostic

It prints markdown tables with PASS/FAIL against the issue's targets (recorded in
bench/RESULTS.md). ``--parts`` picks among fit, score and flat (the default) and the opt-in
fit6 and score6; ``--detectors`` a subset.

**Issue 6 detectors** (``--parts fit6,score6``; 10-15 minutes at the full sizes): the same fit
measurement for react (percentile 90), ash (variant "s", percentile 90), scale (percentile 85),
dice (sparsity 0.9), fdbd, nci and gradnorm, all fitted with ``head=(W, b)`` on the same batch
views, against pytorch-ood 0.4 on the whole tensors: ``ReAct.fit_feature_maps`` on the features
as ``N x D x 1 x 1`` maps (views, no copy), ``DICE.fit_features``, ``fDBD.fit_features`` and
``NCI.fit_features`` (both with the head as an ``nn.Linear``). pytorch-ood's ASH, SCALE and
GradNorm fit nothing (no ``fit_features``; ``GradNorm.fit`` returns self): "no fit", oodviz
only. score6 is oodviz's scoring throughput for the same detectors on 20,000 samples.

    .venv/bin/python bench/detector_fit.py --parts fit6,score6
``--fixed-mmap-threshold`` runs every measurement with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed,
so that freed large blocks go straight back to the OS: the peak then shows the live memory of
the fit rather than what the allocator keeps after freeing. ``--one MEASUREMENT JSON`` runs a
single measurement in this process and prints its result as one ``RESULT {...}`` line; the main
run calls itself that way.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import date

import numpy as np
import torch

MiB = 2**20
SEED = 0
BATCH_SIZE = 4096
KNN_K = 50
FEATURE_NOISE = 1.5  # std of the noise around each class mean, before the ReLU
HEAD_NOISE = 2.0  # random part of the head; the rest points at the class means (about 80% accuracy)

DETECTORS = ("mahalanobis", "rmd", "vim", "klm", "she", "knn")
LIBRARIES = ("oodviz", "pytorch-ood")
PARTS = ("fit", "score", "flat")  # the default run
ISSUE6_PARTS = ("fit6", "score6")  # opt-in: the issue-6 detectors
FIT6_DETECTORS = ("react", "ash", "scale", "dice", "fdbd", "nci", "gradnorm")
NO_FIT_IN_PYTORCH_OOD = ("ash", "scale", "gradnorm")  # pytorch-ood 0.4 has nothing to fit for these
FIXED_MMAP_THRESHOLD = 128 * 1024  # glibc's initial value; setting it turns off its dynamic growth

# Targets from the issue.
MAX_GROWTH_MIB = 64  # oodviz fit memory growth for the statistics-based detectors
MIN_MEMORY_RATIO = 10  # pytorch-ood growth / oodviz growth
MIN_SCORING_SPEEDUP = 10  # oodviz / pytorch-ood Mahalanobis samples/s
FLAT_TOLERANCE_MIB = 5  # growth at the large N may exceed the growth at the small N by this much


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
QUICK = Sizes(10_000, 50_000, 512, 100, 4_000, 400, 300)


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
    from oodviz.engine.store import StoreWriter

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


def _can_reset_peak() -> bool:
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
        self.method = "VmHWM" if _can_reset_peak() else "psutil sampling"
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


# -- one measurement per function (each runs in its own subprocess) ----------------------------


def vim_dim(dim: int) -> int:
    """ViM's principal-subspace dimension: D / 2 (512 at D=1024, as the ViM paper uses for 768 <= D < 2048)."""
    return dim // 2


def _oodviz_params(detector: str, dim: int) -> dict:
    return {
        "vim": {"dim": vim_dim(dim)},
        "knn": {"k": KNN_K},
        "react": {"percentile": 90.0},
        "ash": {"variant": "s", "percentile": 90.0},
        "scale": {"percentile": 85.0},
        "dice": {"sparsity": 0.9},
    }.get(detector, {})


def _pytorch_ood_fit(detector: str, data: dict[str, torch.Tensor]):
    """Construct and fit the pytorch-ood 0.4 counterpart of ``detector`` on whole tensors."""
    from pytorch_ood.detector import DICE, KNN, NCI, RMD, SHE, KLMatching, Mahalanobis, ReAct, ViM, fDBD

    z, y, weight, bias = data["features"], data["labels"], data["weight"], data["bias"]
    if detector == "mahalanobis":
        return Mahalanobis(None).fit_features(z, y)
    if detector == "rmd":
        return RMD(None).fit_features(z, y)
    if detector == "vim":
        return ViM(None, d=vim_dim(z.shape[1]), w=weight, b=bias).fit_features(z, y)
    if detector == "klm":
        return KLMatching(None).fit_logits(data["logits"], y)
    if detector == "she":
        return SHE(None, head=data["head_layer"]).fit_features(z, y)
    if detector == "knn":
        return KNN(None, k=KNN_K).fit_features(z, y)
    # issue 6: pytorch-ood's percentiles/sparsities are fractions, oodviz's percentiles are percent
    if detector == "react":  # takes feature maps B x D x H x W; pooled features as D x 1 x 1 maps (a view)
        return ReAct(None, data["head_layer"], percentile=0.9).fit_feature_maps(z[:, :, None, None], y)
    if detector == "dice":
        return DICE(None, w=weight, b=bias, p=0.9).fit_features(z, y)
    if detector == "fdbd":
        return fDBD(None, data["head_layer"]).fit_features(z, y)
    if detector == "nci":
        return NCI(None, data["head_layer"]).fit_features(z, y)
    raise ValueError(detector)


def _linear_layer(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer.requires_grad_(False)


def measure_oodviz_fit(data_dir: str, detector: str) -> dict:
    """oodviz ``create(detector).fit(batch views, head=(W, b))`` on the in-RAM dataset."""
    from oodviz.detectors import create

    data = load_dataset(data_dir)
    batches = batch_views(data)
    head = (data["weight"], data["bias"])
    warm_up_torch()
    with PeakGrowth() as peak:
        fitted = create(detector, **_oodviz_params(detector, data["features"].shape[1])).fit(batches, head=head)
    del fitted
    return peak.result()


def measure_oodviz_store_fit(data_dir: str, detector: str) -> dict:
    """oodviz ``create(detector).fit(store.batches(4096))`` on the dataset's feature store (the app's path)."""
    from oodviz.detectors import create
    from oodviz.engine.store import FeatureStore

    store = FeatureStore(os.path.join(data_dir, STORE_KEY))
    data = {name: torch.from_numpy(np.load(os.path.join(data_dir, f"{name}.npy"))) for name in ("weight", "bias")}
    head = (data["weight"], data["bias"])
    warm_up_torch()
    with PeakGrowth() as peak:
        batches = store.batches(BATCH_SIZE, include=("features", "labels"))  # what knn reads; prefetching 2 chunks
        fitted = create(detector, **_oodviz_params(detector, store.feature_dim)).fit(batches, head=head)
    del fitted
    return peak.result()


def measure_pytorch_ood_fit(data_dir: str, detector: str) -> dict:
    """pytorch-ood 0.4 construct + ``fit_features`` (``fit_logits`` for klm) on the in-RAM dataset."""
    import pytorch_ood.detector  # noqa: F401
    import sklearn.neighbors  # noqa: F401  (KNN imports it in its constructor)

    data = load_dataset(data_dir)
    data["head_layer"] = _linear_layer(data["weight"], data["bias"])  # SHE's head: the model's layer
    warm_up_torch()
    with PeakGrowth() as peak:
        fitted = _pytorch_ood_fit(detector, data)
    del fitted
    return peak.result()


def measure_oodviz_scoring(data_dir: str, n: int, n_saved: int) -> dict:
    """Samples/s of oodviz Mahalanobis ``score`` on the first ``n`` rows (batch views)."""
    from oodviz.detectors import create

    data = load_dataset(data_dir)
    detector = create("mahalanobis").fit(batch_views(data))
    detector.score(batch_views(data, 64))  # warm-up
    batches = batch_views(data, n)
    start = time.perf_counter()
    scores = detector.score(batches)
    seconds = time.perf_counter() - start
    np.save(os.path.join(data_dir, "scores-oodviz.npy"), scores[:n_saved].numpy())
    return {"samples": n, "seconds": seconds, "samples_per_s": n / seconds}


def measure_pytorch_ood_scoring(data_dir: str, n: int) -> dict:
    """Samples/s of pytorch-ood Mahalanobis ``predict_features`` on the first ``n`` rows."""
    from pytorch_ood.detector import Mahalanobis

    data = load_dataset(data_dir)
    detector = Mahalanobis(None).fit_features(data["features"], data["labels"])
    detector.predict_features(data["features"][:8])  # warm-up
    z = data["features"][:n]
    start = time.perf_counter()
    scores = detector.predict_features(z)
    seconds = time.perf_counter() - start
    np.save(os.path.join(data_dir, "scores-pytorch-ood.npy"), scores.numpy())
    return {"samples": n, "seconds": seconds, "samples_per_s": n / seconds}


def measure_oodviz_streamed_fit(detector: str, n: int, dim: int, classes: int) -> dict:
    """oodviz fit from a ``SyntheticStream`` of ``n`` samples generated on the fly.

    The batches carry logits only for the detectors that read them (klm, she); generating a
    batch is part of the fit's memory and time here, the same at every N.
    """
    from oodviz.detectors import create

    stream = SyntheticStream(n, dim, classes, with_logits=detector in ("klm", "she"))
    head = (stream.weight, stream.bias)
    warm_up_torch()
    with PeakGrowth() as peak:
        fitted = create(detector, **_oodviz_params(detector, dim)).fit(stream, head=head)
    del fitted
    return peak.result()


def measure_oodviz_detector_scoring(data_dir: str, detector: str, n: int) -> dict:
    """Samples/s of oodviz ``score`` for ``detector`` (fitted on the whole set) on the first ``n`` rows."""
    from oodviz.detectors import create

    data = load_dataset(data_dir)
    head = (data["weight"], data["bias"])
    fitted = create(detector, **_oodviz_params(detector, data["features"].shape[1])).fit(batch_views(data), head=head)
    fitted.score(batch_views(data, 64))  # warm-up
    batches = batch_views(data, n)
    start = time.perf_counter()
    fitted.score(batches)
    seconds = time.perf_counter() - start
    return {"samples": n, "seconds": seconds, "samples_per_s": n / seconds}


MEASUREMENTS = {
    "oodviz_detector_scoring": measure_oodviz_detector_scoring,
    "oodviz_fit": measure_oodviz_fit,
    "oodviz_store_fit": measure_oodviz_store_fit,
    "pytorch_ood_fit": measure_pytorch_ood_fit,
    "oodviz_scoring": measure_oodviz_scoring,
    "pytorch_ood_scoring": measure_pytorch_ood_scoring,
    "oodviz_streamed_fit": measure_oodviz_streamed_fit,
}


def run_one(measurement: str, timeout_s: int, **kwargs) -> dict:
    """Run ``measurement(**kwargs)`` in a fresh Python process; its result, or ``{"error": ...}``."""
    command = [sys.executable, os.path.abspath(__file__), "--one", measurement, json.dumps(kwargs)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {done.returncode}: " + " | ".join(tail)}


# -- the report ----------------------------------------------------------------------------------


def _mib(result: dict) -> str:
    return f"{result['growth_mib']:.1f}" if "growth_mib" in result else "error"


def _secs(result: dict) -> str:
    return f"{result['seconds']:.2f}" if "seconds" in result else "error"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _with_range(result: dict, key: str, digits: int) -> str:
    if key not in result:
        return "error"
    text = f"{result[key]:.{digits}f}"
    low, high = result.get(key + "_range", (result[key], result[key]))
    return text if high - low < 10**-digits else f"{text} ({low:.{digits}f}-{high:.{digits}f})"


def fit_table(results: dict[str, dict[str, dict]]) -> list[str]:
    rows = [
        f"| detector | oodviz growth (MiB) | pytorch-ood growth (MiB) | ratio | < {MAX_GROWTH_MIB} MiB | "
        f">= {MIN_MEMORY_RATIO}x below | oodviz fit (s) | pytorch-ood fit (s) | time target |",
        "|---|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for detector, by_library in results.items():
        ours, theirs = by_library["oodviz"], by_library.get("pytorch-ood", {"error": "not run"})
        ratio, small, below, timing = "-", "error", "error", "error"
        if "growth_mib" in ours:
            small = _verdict(ours["growth_mib"] < MAX_GROWTH_MIB)
        if "growth_mib" in ours and "growth_mib" in theirs:
            ratio_value = theirs["growth_mib"] / max(ours["growth_mib"], 0.1)
            ratio = f"{ratio_value:.0f}x" if ratio_value >= 10 else f"{ratio_value:.1f}x"
            below = _verdict(ratio_value >= MIN_MEMORY_RATIO)
            timing = _verdict(ours["seconds"] <= theirs["seconds"])
        rows.append(
            f"| {detector} | {_with_range(ours, 'growth_mib', 1)} | {_with_range(theirs, 'growth_mib', 1)} | {ratio} | "
            f"{small} | {below} | {_with_range(ours, 'seconds', 2)} | {_with_range(theirs, 'seconds', 2)} | {timing} |"
        )
    return rows


def scoring_table(ours: dict, theirs: dict, correlation: float | None) -> list[str]:
    rows = [
        "| library | samples | seconds | samples/s |",
        "|---|---:|---:|---:|",
    ]
    for name, result in (("oodviz `score`", ours), ("pytorch-ood `predict_features`", theirs)):
        if "error" in result:
            rows.append(f"| {name} | - | - | {result['error']} |")
        else:
            rows.append(f"| {name} | {result['samples']} | {result['seconds']:.2f} | {result['samples_per_s']:,.0f} |")
    if "samples_per_s" in ours and "samples_per_s" in theirs:
        speedup = ours["samples_per_s"] / theirs["samples_per_s"]
        rows.append("")
        rows.append(
            f"Speed-up {speedup:,.0f}x (target >= {MIN_SCORING_SPEEDUP}x): {_verdict(speedup >= MIN_SCORING_SPEEDUP)}"
        )
    if correlation is not None:
        rows.append(f"Pearson correlation of the two libraries' scores on the same samples: {correlation:.6f}")
    return rows


def flat_table(results: dict[str, dict[int, dict]], n_small: int, n_large: int) -> list[str]:
    rows = [
        f"| detector | growth at N={n_small:,} (MiB) | growth at N={n_large:,} (MiB) | difference | "
        f"fit at N={n_small:,} (s) | fit at N={n_large:,} (s) | no growth (<= +{FLAT_TOLERANCE_MIB} MiB) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for detector, by_n in results.items():
        small, large = by_n[n_small], by_n[n_large]
        difference, verdict = "-", "error"
        if "growth_mib" in small and "growth_mib" in large:
            delta = large["growth_mib"] - small["growth_mib"]
            difference, verdict = f"{delta:+.1f}", _verdict(delta <= FLAT_TOLERANCE_MIB)
        if "error" in large:
            verdict = f"error: {large['error']}"
        rows.append(
            f"| {detector} | {_mib(small)} | {_mib(large)} | {difference} | {_secs(small)} | {_secs(large)} | {verdict} |"
        )
    return rows


def fit6_table(results: dict[str, dict[str, dict]], scoring: dict[str, dict]) -> list[str]:
    """Issue-6 fits side by side (no targets: report only), with oodviz's scoring rate if measured."""
    rows = [
        "| detector | oodviz growth (MiB) | pytorch-ood growth (MiB) | ratio | oodviz fit (s) | pytorch-ood fit (s) | "
        "oodviz score (samples/s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for detector, by_library in results.items():
        ours = by_library["oodviz"]
        theirs = by_library.get("pytorch-ood", {"error": "not run"})
        ratio = "-"
        if "growth_mib" in ours and "growth_mib" in theirs:
            ratio_value = theirs["growth_mib"] / max(ours["growth_mib"], 0.1)
            ratio = f"{ratio_value:,.0f}x" if ratio_value >= 10 else f"{ratio_value:.1f}x"
        if theirs.get("no_fit"):
            their_mib = their_secs = "no fit"
        elif "error" in theirs:
            their_mib, their_secs = f"error: {theirs['error']}", "error"
        else:
            their_mib, their_secs = _mib(theirs), _secs(theirs)
        rate = scoring.get(detector, {})
        rate = f"{rate['samples_per_s']:,.0f}" if "samples_per_s" in rate else rate.get("error", "-")
        our_mib = _mib(ours) if "error" not in ours else f"error: {ours['error']}"
        rows.append(f"| {detector} | {our_mib} | {their_mib} | {ratio} | {_secs(ours)} | {their_secs} | {rate} |")
    return rows


def run_fit6(data_dir: str, sizes: Sizes, detectors, libraries, log) -> dict[str, dict[str, dict]]:
    """Issue-6 fit memory growth and time; pytorch-ood only where it has something to fit."""
    fits: dict[str, dict[str, dict]] = {}
    for detector in detectors:
        fits[detector] = {}
        for library in libraries:
            if library == "pytorch-ood" and detector in NO_FIT_IN_PYTORCH_OOD:
                fits[detector][library] = {"no_fit": True}
                continue
            measurement = "oodviz_fit" if library == "oodviz" else "pytorch_ood_fit"
            fits[detector][library] = result = run_one(
                measurement, sizes.subprocess_timeout_s, data_dir=data_dir, detector=detector
            )
            log(f"fit6 {detector:<9} {library:<11} {result}")
    return fits


def run_score6(data_dir: str, sizes: Sizes, detectors, log) -> dict[str, dict]:
    scoring = {}
    for detector in detectors:
        scoring[detector] = result = run_one(
            "oodviz_detector_scoring",
            sizes.subprocess_timeout_s,
            data_dir=data_dir,
            detector=detector,
            n=sizes.n_score_oodviz,
        )
        log(f"score6 {detector:<9} {result}")
    return scoring


def environment() -> list[str]:
    versions = [f"torch {torch.__version__}", f"numpy {np.__version__}"]
    if importlib.util.find_spec("pytorch_ood"):
        import pytorch_ood

        versions.append(f"pytorch-ood {pytorch_ood.__version__}")
    return [
        f"- date: {date.today().isoformat()}",
        f"- machine: {platform.machine()} CPU, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
        f"Python {platform.python_version()}, {platform.system()}",
        f"- versions: {', '.join(versions)}",
        f"- peak memory: {'VmHWM after /proc/self/clear_refs' if _can_reset_peak() else 'psutil sampling thread'}",
        f"- glibc malloc: {'MALLOC_MMAP_THRESHOLD_=' + threshold if (threshold := os.environ.get('MALLOC_MMAP_THRESHOLD_')) else 'default (dynamic mmap threshold)'}",
    ]


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


def run_fits(data_dir: str, sizes: Sizes, detectors, libraries, log, repeats: int = 1) -> dict[str, dict[str, dict]]:
    """Fit memory growth and time of every detector, each library, on the in-RAM dataset: the median
    of ``repeats`` fresh processes, the libraries taking turns so that both see the same machine."""
    runs: dict[str, dict[str, list]] = {d: {library: [] for library in libraries} for d in detectors}
    for _ in range(repeats):
        for detector in detectors:
            for library in libraries:
                measurement = "oodviz_fit" if library == "oodviz" else "pytorch_ood_fit"
                result = run_one(measurement, sizes.subprocess_timeout_s, data_dir=data_dir, detector=detector)
                runs[detector][library].append(result)
                log(f"fit {detector:<11} {library:<11} {result}")
    return {d: {library: median_of_runs(r) for library, r in by_library.items()} for d, by_library in runs.items()}


def run_scoring(data_dir: str, sizes: Sizes, libraries, log) -> tuple[dict, dict, float | None]:
    """Mahalanobis scoring throughput of both libraries, and how well their scores agree."""
    timeout = sizes.subprocess_timeout_s
    ours = run_one(
        "oodviz_scoring", timeout, data_dir=data_dir, n=sizes.n_score_oodviz, n_saved=sizes.n_score_pytorch_ood
    )
    log(f"scoring oodviz {ours}")
    if "pytorch-ood" not in libraries:
        return ours, {"error": "pytorch-ood not installed"}, None
    theirs = run_one("pytorch_ood_scoring", timeout, data_dir=data_dir, n=sizes.n_score_pytorch_ood)
    log(f"scoring pytorch-ood {theirs}")
    correlation = None
    with contextlib.suppress(OSError):
        a = np.load(os.path.join(data_dir, "scores-oodviz.npy"))
        b = np.load(os.path.join(data_dir, "scores-pytorch-ood.npy"))
        correlation = float(np.corrcoef(a, b)[0, 1])
    return ours, theirs, correlation


def run_flat_growth(sizes: Sizes, detectors, log) -> dict[str, dict[int, dict]]:
    """oodviz fit memory growth from streamed batches at the small and the large N."""
    flat: dict[str, dict[int, dict]] = {}
    for detector in detectors:
        flat[detector] = {}
        for n in (sizes.n_fit, sizes.n_flat):
            flat[detector][n] = result = run_one(
                "oodviz_streamed_fit",
                sizes.subprocess_timeout_s,
                detector=detector,
                n=n,
                dim=sizes.dim,
                classes=sizes.classes,
            )
            log(f"streamed {detector:<11} N={n:<9} {result}")
    return flat


def main(
    sizes: Sizes,
    detectors: tuple[str, ...],
    parts: set[str],
    detectors6: tuple[str, ...] = FIT6_DETECTORS,
    repeats: int = 1,
) -> None:
    have_pytorch_ood = importlib.util.find_spec("pytorch_ood") is not None
    libraries = LIBRARIES if have_pytorch_ood else ("oodviz",)
    print("\n".join(environment()))
    print(
        f"- sizes: N={sizes.n_fit:,} D={sizes.dim} C={sizes.classes}, batch {BATCH_SIZE}, "
        f"vim dim {vim_dim(sizes.dim)}, knn k {KNN_K}; parts: {', '.join(sorted(parts))}"
    )
    if not have_pytorch_ood:
        print("- pytorch-ood is not installed: oodviz only (install the test extras for the comparison)")
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:.0f}s] {message}", flush=True)

    fits, scoring, flat, fits6, scoring6, store_knn = {}, None, {}, {}, {}, None
    if parts & {"fit", "score", "fit6", "score6"}:
        with tempfile.TemporaryDirectory(prefix="oodviz-bench-") as data_dir:
            write_dataset(data_dir, sizes)
            log(f"data written to {data_dir}")
            if "fit" in parts:
                fits = run_fits(data_dir, sizes, detectors, libraries, log, repeats)
                if "knn" in detectors:
                    runs = [
                        run_one("oodviz_store_fit", sizes.subprocess_timeout_s, data_dir=data_dir, detector="knn")
                        for _ in range(repeats)
                    ]
                    store_knn = median_of_runs(runs)
                    log(f"fit knn from the feature store {store_knn}")
            if "score" in parts:
                scoring = run_scoring(data_dir, sizes, libraries, log)
            if "fit6" in parts:
                fits6 = run_fit6(data_dir, sizes, detectors6, libraries, log)
            if "score6" in parts:
                scoring6 = run_score6(data_dir, sizes, detectors6, log)
    if "flat" in parts:
        flat = run_flat_growth(sizes, detectors, log)

    print(f"\nTotal {time.perf_counter() - started:.0f} s")
    if fits:
        print(f"\n### Fit: memory growth and time, N={sizes.n_fit:,}, D={sizes.dim}, C={sizes.classes}\n")
        print("\n".join(fit_table(fits)))
    if store_knn:
        print(
            f"\nknn fitted from a feature store (`store.batches(4096, include=('features', 'labels'))`, as runs fit; "
            f"the store's file is the bank, nothing is written): growth {_with_range(store_knn, 'growth_mib', 1)} MiB, fit {_with_range(store_knn, 'seconds', 2)} s"
        )
    if scoring:
        print(f"\n### Mahalanobis scoring throughput, D={sizes.dim}, C={sizes.classes}\n")
        print("\n".join(scoring_table(*scoring)))
    if flat:
        print("\n### oodviz fit memory growth from streamed batches, by N\n")
        print("\n".join(flat_table(flat, sizes.n_fit, sizes.n_flat)))
    if fits6 or scoring6:
        if not fits6:
            fits6 = {d: {"oodviz": {"error": "not run"}} for d in scoring6}
        print(
            f"\n### Issue 6 detectors: fit memory growth and time, N={sizes.n_fit:,}, D={sizes.dim}, C={sizes.classes}"
            f" (scoring: {sizes.n_score_oodviz:,} samples)\n"
        )
        print("\n".join(fit6_table(fits6, scoring6)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the script")
    parser.add_argument(
        "--detectors",
        default=None,
        help="comma-separated subset of "
        + ",".join(DETECTORS)
        + " (parts fit, score, flat) and of "
        + ",".join(FIT6_DETECTORS)
        + " (parts fit6, score6); default: all of each",
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS + ISSUE6_PARTS)
    )
    parser.add_argument(
        "--fixed-mmap-threshold",
        action="store_true",
        help=f"diagnostic: run the measurements with MALLOC_MMAP_THRESHOLD_={FIXED_MMAP_THRESHOLD} (glibc hands freed "
        "large blocks straight back to the OS, so the peak shows live memory, not what the allocator keeps)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="fresh processes per side-by-side fit measurement; the median is reported",
    )
    parser.add_argument("--one", nargs=2, metavar=("MEASUREMENT", "JSON"), help="internal: run one measurement here")
    args = parser.parse_args()
    if args.one:
        name, kwargs = args.one
        print("RESULT " + json.dumps(MEASUREMENTS[name](**json.loads(kwargs))), flush=True)
    else:
        given_detectors = None if args.detectors is None else tuple(d for d in args.detectors.split(",") if d)
        chosen = DETECTORS if given_detectors is None else tuple(d for d in given_detectors if d in DETECTORS)
        chosen6 = (
            FIT6_DETECTORS if given_detectors is None else tuple(d for d in given_detectors if d in FIT6_DETECTORS)
        )
        parts = {p for p in args.parts.split(",") if p}
        for label, given, valid in (
            ("detector", given_detectors or (), DETECTORS + FIT6_DETECTORS),
            ("part", parts, PARTS + ISSUE6_PARTS),
        ):
            if set(given) - set(valid):
                parser.error(
                    f"unknown {label}(s) {', '.join(sorted(set(given) - set(valid)))}; choose from {', '.join(valid)}"
                )
        if args.fixed_mmap_threshold:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(FIXED_MMAP_THRESHOLD)  # inherited by every measurement
        main(QUICK if args.quick else FULL, chosen, parts, chosen6, args.repeats)
