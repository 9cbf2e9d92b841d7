"""Batched extraction: run a backbone once over a dataset and write a :class:`FeatureStore`.

::

    store = extract_or_reuse(backbone, dataset, "features/", {"split": "val"}, device="cuda",
                             precision="bf16", progress=print)
    det = create("mahalanobis").fit(store.batches(device="cuda"))

What :func:`extract` guarantees:

- **Bounded memory.** Rows are written to the store as they come; host memory holds a few
  batches (the DataLoader's prefetch plus one batch in flight on the device) whatever ``N`` is.
- **No device side effects.** An ``nn.Module`` model is moved to the job device in eval mode for
  the extraction and put back afterwards, exactly as it was (device of every parameter and
  buffer, train/eval flag of every submodule, memory format), also when the extraction fails or
  is cancelled. A backbone whose model is a plain callable is used as is.
- **OOM back-off.** A CUDA out-of-memory error in a batch halves the batch size and retries the
  same samples, so the store is the same as without the error; the batch size in force is
  reported through ``progress`` and recorded in ``meta.json``. At batch size 1 it gives up with
  a message that says what to try.
- **All or nothing.** A failure, a kill or ``should_cancel()`` leaves no store a later run
  would trust (see :mod:`oodviz.engine.store`).

On CUDA the loop overlaps everything it can: DataLoader workers decode and transform ahead, the
collated batch is pinned and copied on a side stream, the forward of batch ``k`` runs while the
outputs of batch ``k - 1`` are copied back on another stream and written to disk.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, default_collate

import oodviz
from oodviz.engine.store import (
    FEATURE_DTYPES,
    FeatureStore,
    StoreWriter,
    clean_stale_tmp,
    find_store,
    key_spec,
    store_key,
)

logger = logging.getLogger("oodviz.engine")

#: ``precision`` -> autocast dtype (``None`` = no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

Progress = Callable[[int, int, dict], None]


class Cancelled(Exception):
    """The extraction stopped because ``should_cancel()`` returned True; nothing was stored."""


def is_out_of_memory(err: BaseException) -> bool:
    """True for ``torch.cuda.OutOfMemoryError`` and any RuntimeError saying "out of memory"."""
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower()
    )


# ---------------------------------------------------------------------------------- the model


class _ModelState:
    """Where every parameter and buffer of a module lives and which submodules are training."""

    def __init__(self, model: nn.Module, track_format: bool):
        self.model = model
        self.training = [(m, m.training) for m in model.modules()]
        self.tensors = []  # (module, kind, name, device, memory_format)
        for module in model.modules():
            for kind, items in (
                ("param", module.named_parameters(recurse=False)),
                ("buffer", module.named_buffers(recurse=False)),
            ):
                for name, tensor in items:
                    fmt = torch.preserve_format
                    if track_format and tensor.dim() == 4:
                        is_cl = tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous()
                        fmt = torch.channels_last if is_cl else torch.contiguous_format
                    self.tensors.append((module, kind, name, tensor.device, fmt))

    def restore(self) -> None:
        with torch.no_grad():
            for module, kind, name, device, fmt in self.tensors:
                current = dict(
                    module.named_parameters(recurse=False) if kind == "param" else module.named_buffers(recurse=False)
                )
                tensor = current.get(name)
                if tensor is None:
                    continue
                if tensor.device != device or fmt is not torch.preserve_format:
                    tensor.data = tensor.data.to(device=device, memory_format=fmt)
                if kind == "param" and tensor.grad is not None and tensor.grad.device != device:
                    tensor.grad = tensor.grad.to(device)
        for module, flag in self.training:
            module.training = flag


@contextlib.contextmanager
def model_on_device(model, device, channels_last: bool = False):
    """Run a block with ``model`` on ``device`` in eval mode, then put it back exactly as it was.

    A model that is not an ``nn.Module`` (a function, any callable) is left alone.
    ``channels_last=True`` also converts 4-D weights to channels-last for the block.
    """
    if not isinstance(model, nn.Module):
        yield model
        return
    state = _ModelState(model, track_format=channels_last)
    try:
        model.to(device)
        if channels_last:
            model.to(memory_format=torch.channels_last)
        model.eval()
        yield model
    finally:
        state.restore()


# ---------------------------------------------------------------------------------- data


class _Items(Dataset):
    """``dataset[i]`` -> ``(transform(image), label, source_index)``, or ``None`` for an unreadable item."""

    def __init__(self, dataset, transform):
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        item = self.dataset[i]
        if item is None:
            return None
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise ValueError(
                f"dataset item {i} must be (image, label, source_index) or None for an unreadable image, "
                f"got {type(item).__name__}" + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else "")
            )
        image, label, source_index = item
        x = image if self.transform is None else self.transform(image)
        if not isinstance(x, Tensor):
            raise ValueError(
                f"the backbone's transform must turn an image into a tensor [C, H, W]; item {i} gave a "
                f"{type(x).__name__} (end the transform with torchvision.transforms.ToTensor() or PILToTensor())"
            )
        return x, int(label), int(source_index)


def _collate(items):
    """Drop ``None`` items: ``(x [b, ...], labels [b], source_indices [b], n_dropped)``; x is None when b = 0."""
    kept = [item for item in items if item is not None]
    dropped = len(items) - len(kept)
    if not kept:
        return None, None, None, dropped
    x, labels, indices = default_collate(kept)
    return x, labels, indices, dropped


def _close_loader(iterator) -> None:
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def make_loader(dataset, transform, batch_size: int, num_workers: int, device: torch.device) -> DataLoader:
    """The dataset in order as ``(x [b, ...], labels [b], source_indices [b], n_dropped)`` batches.

    ``transform`` turns each image into a tensor; unreadable items (``None``) are dropped and
    counted, so every pass over the same dataset gives the same rows in the same order.
    """
    return DataLoader(
        _Items(dataset, transform),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_collate,
        pin_memory=device.type == "cuda",
        prefetch_factor=4 if num_workers > 0 else None,
    )


def progress_info(stage: str, done: int, started: float, backoff: Backoff, skipped: int, **extra) -> dict:
    """The ``info`` of a ``progress(done, total, info)`` call: stage, items/s since ``started``
    (a ``time.perf_counter()``), the batch size in force, the device, skipped items, OOM back-offs."""
    elapsed = time.perf_counter() - started
    return {
        "stage": stage,
        "items_per_s": done / elapsed if elapsed > 0 else 0.0,
        "batch_size": backoff.in_force,
        "device": str(backoff.device),
        "skipped": skipped,
        "elapsed_s": elapsed,
        "oom_backoffs": backoff.backoffs,
        **extra,
    }


class Backoff:
    """Runs ``n`` rows in chunks of at most ``in_force``; a CUDA out-of-memory error halves it.

    ``chunks(n, submit)`` calls ``submit(start, stop)`` for consecutive row ranges and yields
    ``(start, stop, result)``. When ``submit`` runs out of memory, the same rows are retried in
    two halves and the smaller size stays in force for later batches, so the results are those of
    a smaller batch size; at one row it gives up with a message that says what to try. Other
    errors are not retried.
    """

    def __init__(self, batch_size: int, device: torch.device, what: str):
        self.in_force = batch_size
        self.backoffs = 0
        self.device = device
        self.what = what

    def chunks(self, n: int, submit: Callable[[int, int], object]):
        pending = deque([(0, n)])
        while pending:
            start, stop = pending.popleft()
            if stop - start > self.in_force:
                pending.appendleft((start + self.in_force, stop))
                pending.appendleft((start, start + self.in_force))
                continue
            if stop == start:
                continue
            oom = None
            try:
                result = submit(start, stop)
            except Exception as err:
                if not is_out_of_memory(err):
                    raise
                oom = f"{type(err).__name__}: {err}"
            if oom is None:
                yield start, stop, result
                continue
            # Out of memory (the error and its frames are released by now): retry the same rows in halves.
            if stop - start == 1:
                raise torch.cuda.OutOfMemoryError(
                    f"out of memory on {self.device} even at batch size 1 while {self.what}; free memory on the device "
                    f"(other processes?), use precision='bf16', or a smaller input size. Original error: {oom}"
                )
            self.in_force = (stop - start) // 2
            self.backoffs += 1
            logger.warning(
                "out of memory on %s at batch size %d; retrying at %d", self.device, stop - start, self.in_force
            )
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            pending.appendleft((start + self.in_force, stop))
            pending.appendleft((start, start + self.in_force))


# ---------------------------------------------------------------------------------- the loop


@dataclass
class _Outputs:
    """One chunk's results, possibly still being copied off the device."""

    features: Tensor
    logits: Tensor
    predictions: Tensor
    nonfinite: Tensor
    labels: Tensor
    indices: Tensor
    ready: torch.cuda.Event | None = None
    keep: tuple = ()  # device tensors that must outlive the copies

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
        self.keep = ()


class _Extraction:
    def __init__(self, backbone, device: torch.device, precision: str, channels_last: bool, feature_dtype: str):
        self.backbone = backbone
        self.device = device
        self.cuda = device.type == "cuda"
        self.autocast_dtype = PRECISIONS[precision]
        self.channels_last = channels_last
        self.feature_dtype = {"float32": torch.float32, "float16": torch.float16}[feature_dtype]
        self.feature_dim: int | None = None
        self.num_classes: int | None = None
        if self.cuda:
            self.copy_in = torch.cuda.Stream(device)
            self.copy_out = torch.cuda.Stream(device)

    def _forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        out = self.backbone.features_and_logits(x)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(
                f"backbone.features_and_logits must return (features [B, D], logits [B, C]), got {type(out).__name__}"
            )
        features, logits = out
        n = len(x)
        for name, value, letter in (("features", features, "D"), ("logits", logits, "C")):
            if not isinstance(value, Tensor) or value.ndim != 2 or value.shape[0] != n:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                hint = (
                    " (pool feature maps [B, C, H, W] or tokens [B, T, D] to [B, D] first)"
                    if name == "features"
                    else ""
                )
                raise ValueError(
                    f"backbone.features_and_logits returned {name} {shape} for {n} inputs; expected [B, {letter}]{hint}"
                )
        if self.feature_dim is None:
            self.feature_dim, self.num_classes = int(features.shape[1]), int(logits.shape[1])
        elif (features.shape[1], logits.shape[1]) != (self.feature_dim, self.num_classes):
            raise ValueError(
                f"backbone.features_and_logits changed shape between batches: D={features.shape[1]}, C={logits.shape[1]} "
                f"after D={self.feature_dim}, C={self.num_classes}; every batch must come from the same layer"
            )
        features = features.detach().to(self.feature_dtype)
        logits = logits.detach().float()
        predictions = logits.argmax(dim=1)
        nonfinite = (~torch.isfinite(features).all(dim=1)).sum()
        return features, logits, predictions, nonfinite

    def submit(self, x: Tensor, labels: Tensor, indices: Tensor) -> _Outputs:
        """Start the forward of one chunk (``x`` on the CPU); results are collected with ``wait()``."""
        if not self.cuda:
            features, logits, predictions, nonfinite = self._forward(x.to(self.device))
            cpu = lambda t: t.to("cpu")  # noqa: E731
            return _Outputs(cpu(features), cpu(logits), cpu(predictions), cpu(nonfinite), labels, indices)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_in):
            x_device = x.to(self.device, non_blocking=True)
        loaded = torch.cuda.Event()
        loaded.record(self.copy_in)
        compute.wait_event(loaded)
        features, logits, predictions, nonfinite = self._forward(x_device)
        computed = torch.cuda.Event()
        computed.record(compute)
        with torch.cuda.stream(self.copy_out):
            self.copy_out.wait_event(computed)
            # non_blocking device-to-host copies land in pinned memory
            host = [t.to("cpu", non_blocking=True) for t in (features, logits, predictions, nonfinite)]
        copied = torch.cuda.Event()
        copied.record(self.copy_out)
        return _Outputs(
            *host, labels, indices, ready=copied, keep=(x, x_device, features, logits, predictions, nonfinite)
        )


def _check_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available here; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_options(batch_size, num_workers, precision, feature_dtype) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be a non-negative integer (0 = load in this process), got {num_workers!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    if feature_dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature_dtype must be one of {FEATURE_DTYPES}, got {feature_dtype!r}")


def _read_head(backbone):
    try:
        head = getattr(backbone, "head", None)
    except Exception as err:  # the head is optional in the store: say why it is missing, go on
        logger.warning("backbone %s: could not read its head (%s); the store will have none", backbone.name, err)
        return None
    if head is None:
        return None
    if isinstance(head, nn.Linear):
        head = (head.weight, head.bias if head.bias is not None else torch.zeros(head.out_features))
    weight, bias = head
    return weight.detach().float().cpu(), bias.detach().float().cpu()


def extract(
    backbone,
    dataset,
    store_root,
    key_params: dict | None = None,
    *,
    device="cpu",
    batch_size: int = 256,
    num_workers: int = 0,
    precision: str = "fp32",
    channels_last: bool = False,
    feature_dtype: str = "float32",
    progress: Progress | None = None,
    should_cancel: Callable[[], bool] | None = None,
    sync: bool = True,
) -> FeatureStore:
    """Run ``backbone`` over ``dataset`` and write the split to ``<store_root>/<key>/``; returns it opened.

    :param backbone: has ``name``, ``model`` (``nn.Module`` or any callable), ``transform(image) ->
        Tensor [C, H, W]``, ``features_and_logits(x [B, ...]) -> (features [B, D], logits [B, C])``,
        ``head`` (``(W [C, D], b [C])`` or ``None``) and ``weights_id``
    :param dataset: ``len(dataset)``, ``dataset[i] -> (image, label, source_index)`` or ``None`` for an
        unreadable image (skipped and counted), ``name``, ``classes``
    :param store_root: directory holding the stores (created if missing)
    :param key_params: everything else that determines the content (layer, pooling, dataset
        parameters, subsample, seed, transform description, ...), JSON-able; see :func:`key_spec`
    :param device: where the model runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``)
    :param batch_size: samples per forward pass; halved automatically on CUDA out-of-memory
    :param num_workers: DataLoader worker processes that read and transform images (0 = this process)
    :param precision: ``"fp32"``, or ``"bf16"`` / ``"fp16"`` autocast (part of the key)
    :param channels_last: run 4-D inputs and weights in channels-last memory format (faster convnets on CUDA)
    :param feature_dtype: ``"float32"`` or ``"float16"`` for ``features.npy`` (logits stay float32)
    :param progress: ``progress(done, total, info)`` after every batch; ``info`` has ``stage``,
        ``items_per_s``, ``batch_size`` (in force), ``device``, ``skipped``, ``written``, ``elapsed_s``
    :param should_cancel: checked before every batch; when it returns True, :class:`Cancelled` is
        raised and nothing is stored
    :param sync: fsync the files before the final rename (crash-safe; turn off for throwaway stores)
    :raises Cancelled: when ``should_cancel()`` said so
    :raises torch.cuda.OutOfMemoryError: when even one sample does not fit on the device
    """
    device = _check_device(device)
    _check_options(batch_size, num_workers, precision, feature_dtype)
    total = len(dataset)
    if total == 0:
        raise ValueError(f"dataset {dataset.name!r} is empty; nothing to extract (check its path and subsample)")
    spec = key_spec(backbone, dataset, key_params, feature_dtype=feature_dtype, precision=precision)
    key = store_key(backbone, dataset, key_params, feature_dtype=feature_dtype, precision=precision)
    clean_stale_tmp(store_root, key=key)

    started = time.perf_counter()
    first_batch_s = None
    done = skipped = nonfinite = 0
    backoff = Backoff(batch_size, device, f"extracting {backbone.name} features")
    writer: StoreWriter | None = None
    head = None
    loader_iter = None

    def report(stage: str) -> None:
        if progress is not None:
            written = 0 if writer is None else writer.rows
            progress(done, total, progress_info(stage, done, started, backoff, skipped, written=written, key=key))

    try:
        with model_on_device(getattr(backbone, "model", None), device, channels_last):
            with torch.no_grad():
                head = _read_head(backbone)
            loader = make_loader(dataset, getattr(backbone, "transform", None), batch_size, num_workers, device)
            run = _Extraction(backbone, device, precision, channels_last, feature_dtype)
            pending: deque[_Outputs] = deque()
            depth = 1 if run.cuda else 0  # chunks left in flight while the next one starts

            def finish(outputs: _Outputs) -> None:
                nonlocal writer, nonfinite
                outputs.wait()
                if writer is None:
                    writer = StoreWriter(store_root, key, total, run.feature_dim, run.num_classes, feature_dtype)
                writer.append(outputs.features, outputs.logits, outputs.labels, outputs.indices, outputs.predictions)
                nonfinite += int(outputs.nonfinite)

            autocast = (
                torch.autocast(device_type=device.type, dtype=run.autocast_dtype)
                if run.autocast_dtype is not None
                else contextlib.nullcontext()
            )
            with torch.inference_mode(), autocast, torch.cuda.device(device) if run.cuda else contextlib.nullcontext():
                loader_iter = iter(loader)
                for x, labels, indices, dropped in loader_iter:
                    if should_cancel is not None and should_cancel():
                        raise Cancelled(f"extraction cancelled after {done} of {total} items; nothing was stored")
                    skipped += dropped
                    done += dropped
                    submit = lambda a, b: run.submit(x[a:b], labels[a:b], indices[a:b])  # noqa: B023, E731
                    for start, stop, outputs in backoff.chunks(0 if x is None else len(x), submit):
                        pending.append(outputs)
                        done += stop - start
                        while len(pending) > depth:
                            finish(pending.popleft())
                    if first_batch_s is None:
                        first_batch_s = time.perf_counter() - started
                    report("extract")
                while pending:
                    finish(pending.popleft())
                _close_loader(loader_iter)
                loader_iter = None

        if writer is None:
            raise ValueError(
                f"no readable items in dataset {dataset.name!r}: all {total} were unreadable (None); check the files"
            )
        elapsed = time.perf_counter() - started
        if nonfinite:
            logger.warning("%d of %d rows have NaN or infinite features (%s)", nonfinite, writer.rows, backbone.name)
        meta = {
            "key_spec": spec,
            "backbone": {
                "name": str(backbone.name),
                "weights_id": str(getattr(backbone, "weights_id", None)),
                "layer": getattr(backbone, "layer", None),
                "pooling": getattr(backbone, "pooling", None),
                "model_type": type(getattr(backbone, "model", None)).__name__,
            },
            "dataset": {"name": str(dataset.name), "len": total, "classes": spec["dataset"]["classes"]},
            "params": spec["params"],
            "counts": {"requested": total, "written": writer.rows, "skipped": skipped, "nonfinite_rows": nonfinite},
            "skipped": skipped,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "precision": precision,
            "channels_last": channels_last,
            "num_workers": num_workers,
            "batch_size_requested": batch_size,
            "batch_size_in_force": backoff.in_force,
            "oom_backoffs": backoff.backoffs,
            "timings": {
                "extract_s": elapsed,
                "first_batch_s": first_batch_s,
                "items_per_s": total / elapsed if elapsed > 0 else None,
            },
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "oodviz_version": oodviz.__version__,
            "torch_version": torch.__version__,
            "numpy_version": np.__version__,
        }
        store = writer.commit(meta, head=head, sync=sync)
        logger.info("extracted %s: %d rows in %.1f s -> %s", backbone.name, store.n, elapsed, store.path)
        report("done")
        return store
    finally:
        if loader_iter is not None:
            _close_loader(loader_iter)
        if writer is not None:
            writer.abort()  # no-op after a commit


def extract_or_reuse(
    backbone,
    dataset,
    store_root,
    key_params: dict | None = None,
    *,
    device="cpu",
    batch_size: int = 256,
    num_workers: int = 0,
    precision: str = "fp32",
    channels_last: bool = False,
    feature_dtype: str = "float32",
    progress: Progress | None = None,
    should_cancel: Callable[[], bool] | None = None,
    sync: bool = True,
) -> FeatureStore:
    """The store of this (backbone, dataset, key_params, precision, feature_dtype) if one exists, else :func:`extract` it.

    Reuse runs no forward pass; it is reported as ``progress(n, n, {"stage": "reused", ...})`` and
    logged, and the returned store has ``reused = True``. Arguments as for :func:`extract`.
    """
    _check_options(batch_size, num_workers, precision, feature_dtype)
    key = store_key(backbone, dataset, key_params, feature_dtype=feature_dtype, precision=precision)
    store = find_store(store_root, key)
    if store is None:
        return extract(
            backbone,
            dataset,
            store_root,
            key_params,
            device=device,
            batch_size=batch_size,
            num_workers=num_workers,
            precision=precision,
            channels_last=channels_last,
            feature_dtype=feature_dtype,
            progress=progress,
            should_cancel=should_cancel,
            sync=sync,
        )
    store.reused = True
    logger.info("reusing feature store %s (%s on %s, %d rows)", store.path, backbone.name, dataset.name, store.n)
    if progress is not None:
        total = int(store.meta.get("counts", {}).get("requested", store.n))
        progress(
            total,
            total,
            {
                "stage": "reused",
                "items_per_s": 0.0,
                "batch_size": store.meta.get("batch_size_in_force"),
                "device": store.meta.get("device"),
                "skipped": store.meta.get("skipped", 0),
                "written": store.n,
                "elapsed_s": 0.0,
                "oom_backoffs": 0,
                "key": key,
                "path": str(store.path),
            },
        )
    return store
