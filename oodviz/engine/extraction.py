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

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

import oodviz
from oodviz.engine.batched import PRECISIONS, BatchedPass, Progress, check_pass_options
from oodviz.engine.store import (
    VERIFY_LEVELS,
    FeatureStore,
    StoreError,
    StoreWriter,
    check_feature_dtype,
    clean_stale_tmp,
    key_spec,
    remove_store,
    store_key,
)
from oodviz.engine.store.integrity import verify_store
from oodviz.models.placement import parse_device

logger = logging.getLogger("oodviz.engine")


# ---------------------------------------------------------------------------------- the loop


@dataclass
class _Outputs:
    """One chunk's results, possibly still being copied off the device."""

    features: Tensor
    logits: Tensor
    predictions: Tensor
    nonfinite: Tensor  # [3] rows with NaN/inf features or logits, features, logits (_Extraction._forward)
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
        bad_features, bad_logits = ~torch.isfinite(features).all(dim=1), ~torch.isfinite(logits).all(dim=1)
        # rows with NaN/inf features or logits, with features, with logits: [3], read when the chunk is written
        nonfinite = torch.stack([(bad_features | bad_logits).sum(), bad_features.sum(), bad_logits.sum()])
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
    num_workers: int | str = 0,
    precision: str = "fp32",
    channels_last: bool = False,
    feature_dtype: str = "float32",
    progress: Progress | None = None,
    should_cancel: Callable[[], bool] | None = None,
    sync: bool = True,
    make_writer: Callable = StoreWriter,
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
    :param num_workers: DataLoader worker processes that read and transform images (0 = this process;
        ``"auto"``: :func:`oodviz.engine.batched.auto_workers`); array-backed datasets whose transform has a
        ``batch`` method are transformed a batch at a time in this process instead (the number in force is
        recorded in ``meta.json``)
    :param precision: ``"fp32"``, or ``"bf16"`` / ``"fp16"`` autocast (part of the key)
    :param channels_last: run 4-D inputs and weights in channels-last memory format (faster convnets on CUDA)
    :param feature_dtype: ``"float32"`` or ``"float16"`` for ``features.npy`` (logits stay float32)
    :param progress: ``progress(done, total, info)`` after every batch; ``info`` has ``stage``,
        ``items_per_s``, ``batch_size`` (in force), ``device``, ``skipped``, ``written``, ``elapsed_s``
    :param should_cancel: checked before every batch; when it returns True, :class:`Cancelled` is
        raised and nothing is stored
    :param sync: fsync the files before the final rename (crash-safe; turn off for throwaway stores)
    :param make_writer: ``make_writer(store_root, key, capacity, D, C, feature_dtype)``, a :class:`StoreWriter`
        or an object with its ``rows`` / ``append`` / ``commit`` / ``abort`` (one store per layer:
        :mod:`oodviz.engine.layers`)
    :raises Cancelled: when ``should_cancel()`` said so
    :raises torch.cuda.OutOfMemoryError: when even one sample does not fit on the device
    """
    device = parse_device(device)
    check_feature_dtype(feature_dtype)
    writer: StoreWriter | None = None
    nonfinite = torch.zeros(3, dtype=torch.long)  # rows with NaN/inf features or logits, features, logits

    def written() -> dict:
        return {"written": 0 if writer is None else writer.rows, "key": key}

    batched = BatchedPass(
        backbone,
        dataset,
        device=device,
        batch_size=batch_size,
        num_workers=num_workers,
        precision=precision,
        channels_last=channels_last,
        activity=f"extracting {backbone.name} features",
        stage="extract",
        progress=progress,
        should_cancel=should_cancel,
        info=written,
    )
    total = batched.total
    spec = key_spec(backbone, dataset, key_params, feature_dtype=feature_dtype, precision=precision)
    key = store_key(backbone, dataset, key_params, feature_dtype=feature_dtype, precision=precision)
    clean_stale_tmp(store_root)

    try:
        with batched:
            with torch.no_grad():
                head = _read_head(backbone)
            run = _Extraction(backbone, device, precision, channels_last, feature_dtype)
            pending: deque[_Outputs] = deque()
            depth = 1 if run.cuda else 0  # chunks left in flight while the next one starts

            def finish(outputs: _Outputs) -> None:
                nonlocal writer, nonfinite
                outputs.wait()
                if writer is None:
                    writer = make_writer(store_root, key, total, run.feature_dim, run.num_classes, feature_dtype)
                writer.append(outputs.features, outputs.logits, outputs.labels, outputs.indices, outputs.predictions)
                nonfinite += outputs.nonfinite

            def collect(outputs: _Outputs) -> None:
                pending.append(outputs)
                while len(pending) > depth:
                    finish(pending.popleft())

            with torch.inference_mode():
                batched.run(run.submit, collect)
                while pending:
                    finish(pending.popleft())

        elapsed = time.perf_counter() - batched.started
        nonfinite_rows, nonfinite_features, nonfinite_logits = nonfinite.tolist()
        if nonfinite_rows:
            logger.warning(
                "%d of %d rows have NaN or infinite values (%d in features, %d in logits; %s)",
                nonfinite_rows,
                writer.rows,
                nonfinite_features,
                nonfinite_logits,
                backbone.name,
            )
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
            "counts": {
                "requested": total,
                "written": writer.rows,
                "skipped": batched.skipped,
                "nonfinite_rows": nonfinite_rows,
                "nonfinite_feature_rows": nonfinite_features,
                "nonfinite_logit_rows": nonfinite_logits,
            },
            "skipped": batched.skipped,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "precision": precision,
            "channels_last": channels_last,
            "num_workers": batched.num_workers,
            "batch_size_requested": batch_size,
            "batch_size_in_force": batched.backoff.in_force,
            "oom_backoffs": batched.backoff.backoffs,
            "timings": {
                "extract_s": elapsed,
                "first_batch_s": batched.first_batch_s,
                "items_per_s": total / elapsed if elapsed > 0 else None,
            },
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "oodviz_version": oodviz.__version__,
            "torch_version": torch.__version__,
            "numpy_version": np.__version__,
        }
        store = writer.commit(meta, head=head, sync=sync)
        logger.info("extracted %s: %d rows in %.1f s -> %s", backbone.name, store.n, elapsed, store.path)
        batched.report("done")
        return store
    finally:
        if writer is not None:
            writer.abort()  # no-op after a commit


def check_verify(verify: str) -> str:
    """``verify`` when it is one of :data:`VERIFY_LEVELS`, else a ValueError naming them."""
    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {VERIFY_LEVELS}, got {verify!r}")
    return verify


def trusted_store(store_root, key: str, verify: str) -> tuple[FeatureStore | None, str | None]:
    """The store ``<store_root>/<key>`` if it passes verification, else ``(None, why it was removed)``."""
    path = Path(store_root) / key
    if not path.is_dir():
        return None, None
    # Checksums first: a damaged file is named as such, before memory-mapping it can fail.
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = None
    problems = verify_store(path, meta, full=verify == "full") if isinstance(meta, dict) else []
    if not problems:
        try:
            return FeatureStore(path), None
        except StoreError as err:
            problems = [str(err)]
    try:
        remove_store(store_root, key)
    except FileNotFoundError:  # a concurrent run removed or replaced it first
        pass
    return None, f"feature store {key} was damaged and has been extracted again ({'; '.join(problems)})"


def extract_or_reuse(
    backbone,
    dataset,
    store_root,
    key_params: dict | None = None,
    *,
    device="cpu",
    batch_size: int = 256,
    num_workers: int | str = 0,
    precision: str = "fp32",
    channels_last: bool = False,
    feature_dtype: str = "float32",
    progress: Progress | None = None,
    should_cancel: Callable[[], bool] | None = None,
    sync: bool = True,
    verify: str = "cheap",
) -> FeatureStore:
    """The store of this (backbone, dataset, key_params, precision, feature_dtype) if one exists, else :func:`extract` it.

    Reuse runs no forward pass; it is reported as ``progress(n, n, {"stage": "reused", ...})`` and
    logged, and the returned store has ``reused = True``. Before reuse the store's files are checked
    against the checksums taken when they were written: ``verify="cheap"`` trusts a file whose size
    and mtime match its record and rehashes the others, ``"full"`` rehashes every file. A store
    that fails (or cannot be opened) is removed and the split extracted again; the new store's
    ``reuse_warning`` then says what was wrong (logged too). Other arguments as for :func:`extract`.
    """
    check_pass_options(batch_size, num_workers, precision)
    check_feature_dtype(feature_dtype)
    check_verify(verify)
    key = store_key(backbone, dataset, key_params, feature_dtype=feature_dtype, precision=precision)
    store, warning = trusted_store(store_root, key, verify)
    if store is None:
        if warning:
            logger.warning(warning)
        store = extract(
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
        store.reuse_warning = warning
        return store
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
