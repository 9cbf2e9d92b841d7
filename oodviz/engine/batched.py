"""One batched pass of a dataset through a model on a device: what extraction and model-based scoring share.

::

    with BatchedPass(backbone, dataset, device=device, batch_size=256, num_workers=2, precision="bf16",
                     activity="extracting resnet18 features", stage="extract", progress=print) as batched:
        batched.run(submit, collect)     # submit(x, labels, indices) -> result; collect(result)

:class:`BatchedPass` owns, for every caller:

- **The data.** A DataLoader reads the dataset in order through ``backbone.transform``; unreadable
  items (``None``) are dropped and counted, so every pass over a dataset gives the same rows in the
  same order (:func:`make_loader`). Array-backed datasets (bundled digits, Fashion-MNIST, generated
  noise) whose transform has a ``batch`` method are transformed a whole batch at a time as tensors, in
  this process; the others are read by ``num_workers`` persistent worker processes (``"auto"``:
  :func:`auto_workers`), shut down when the pass ends, also after an error or a cancel.
- **The model.** ``backbone.model`` is on the device in eval mode for the whole ``with`` block and
  put back exactly as it was afterwards (:func:`oodviz.models.placement.model_on_device`);
  autocast follows ``precision`` (:data:`PRECISIONS`) around ``submit``.
- **Out-of-memory back-off.** A CUDA out-of-memory error in ``submit`` halves the batch and retries
  the same rows; the smaller size stays in force (:class:`Backoff`), so the results are those of
  that batch size from the start. cuBLAS/cuDNN allocation failures count as out of memory; a
  sticky CUDA error (illegal address, device-side assert) is never retried (:func:`cuda_error_kind`).
- **Cancel and progress.** ``should_cancel()`` is asked before every batch (True raises
  :class:`Cancelled`); ``progress(done, total, info)`` is called after every batch
  (:func:`progress_info`).

Gradient mode is the caller's: extraction runs ``run`` under ``torch.inference_mode()``; ODIN
differentiates with respect to its inputs, so scoring does not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, default_collate

from oodviz.engine.loading import AUTO_WORKERS, ArrayBatches, auto_workers, batch_transform
from oodviz.models.memory import format_bytes
from oodviz.models.placement import model_on_device

logger = logging.getLogger("oodviz.engine")

#: ``precision`` -> autocast dtype (``None`` = no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

#: ``progress(done, total, info)``
Progress = Callable[[int, int, dict], None]
Result = TypeVar("Result")


class Cancelled(Exception):
    """The work stopped because ``should_cancel()`` returned True; nothing was stored."""


#: lower-case fragments of the messages of allocation failures: the caching allocator's ("CUDA out of memory.
#: Tried to allocate ..."), the runtime's ("CUDA error: out of memory") and the libraries' own, which reach
#: Python as RuntimeErrors ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
#: "cuDNN error: CUDNN_STATUS_ALLOC_FAILED", cuSOLVER's and cuFFT's likewise), and the host's: torch's CPU allocator
#: ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ... bytes"), retried smaller just the same
OUT_OF_MEMORY_MARKERS = (
    "out of memory",
    "can't allocate memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cusolver_status_alloc_failed",
    "cufft_alloc_failed",
)

#: lower-case fragments of the CUDA errors that leave the process's CUDA context unusable ("sticky": every later
#: CUDA call fails with the same error), e.g. "CUDA error: an illegal memory access was encountered"
STICKY_CUDA_MARKERS = (
    "illegal memory access",
    "device-side assert triggered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
    "invalid program counter",
    "hardware stack error",
    "the launch timed out and was terminated",
    "uncorrectable ecc error",
)


class CudaContextLost(RuntimeError):
    """A sticky CUDA error: the device cannot be used again by this process; the run must restart."""


def cuda_error_kind(err: BaseException) -> str:
    """``"sticky"`` (:data:`STICKY_CUDA_MARKERS`, never retried), ``"out_of_memory"``
    (``torch.cuda.OutOfMemoryError`` or a RuntimeError with one of :data:`OUT_OF_MEMORY_MARKERS`:
    retried smaller) or ``"other"``. Sticky wins: an error that mentions both is not retried."""
    if isinstance(err, CudaContextLost):
        return "sticky"
    message = str(err).lower() if isinstance(err, RuntimeError) else ""
    if any(marker in message for marker in STICKY_CUDA_MARKERS):
        return "sticky"
    if isinstance(err, torch.cuda.OutOfMemoryError) or any(marker in message for marker in OUT_OF_MEMORY_MARKERS):
        return "out_of_memory"
    return "other"


def is_out_of_memory(err: BaseException) -> bool:
    """True for an allocation failure that a smaller batch may avoid (:func:`cuda_error_kind`)."""
    return cuda_error_kind(err) == "out_of_memory"


def context_lost(err: BaseException, device: torch.device, what: str) -> CudaContextLost:
    """The error to raise, from ``err``, after a sticky CUDA error while ``what``."""
    return CudaContextLost(
        f"a CUDA error left the CUDA context on {device} unusable while {what}: every later CUDA call in this "
        f"process fails, so it is not retried. Restart the run (a new process); if it happens again, run with "
        f"CUDA_LAUNCH_BLOCKING=1 to find the kernel. Original error: {type(err).__name__}: {err}"
    )


def autocast_for(precision: str, device: torch.device):
    """The autocast context of ``precision`` (:data:`PRECISIONS`) on ``device``'s type; a null context for fp32."""
    dtype = PRECISIONS[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def check_pass_options(batch_size, num_workers, precision) -> None:
    """A ValueError naming the fix when ``batch_size``, ``num_workers`` or ``precision`` is not usable."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if num_workers != AUTO_WORKERS and (
        isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
    ):
        raise ValueError(
            f"num_workers must be a non-negative integer (0 = load in this process) or {AUTO_WORKERS!r}, "
            f"got {num_workers!r}"
        )
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")


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


#: where DataLoader workers put the batches they hand over (Linux shared memory; Docker gives 64 MB by default)
SHARED_MEMORY = "/dev/shm"
#: batches read ahead per worker when shared memory allows; fraction of the free shared memory they may fill
PREFETCH, SHARED_MEMORY_SHARE = 4, 0.5


def prefetch_factor(batch_bytes: int, num_workers: int, free_bytes: int | None) -> tuple[int, str | None]:
    """``(batches read ahead per worker, note or None)`` so that the batches in flight fit in shared memory.

    ``num_workers x factor`` batches of ``batch_bytes`` wait in shared memory at once; the factor is
    :data:`PREFETCH`, lowered (to at least 1) so that they fill at most :data:`SHARED_MEMORY_SHARE` of
    ``free_bytes`` (None = unknown: no limit). The note says when the factor was lowered or when even one
    batch per worker does not fit (the workers would crash with "Bus error").
    """
    if free_bytes is None or batch_bytes <= 0:
        return PREFETCH, None
    fits = int(SHARED_MEMORY_SHARE * free_bytes) // (num_workers * batch_bytes)
    factor = max(1, min(PREFETCH, fits))
    if factor == PREFETCH:
        return factor, None
    need = f"{num_workers} workers x {format_bytes(batch_bytes)} per batch"
    if fits < 1:
        return factor, (
            f"shared memory ({SHARED_MEMORY}) has {format_bytes(free_bytes)} free, too little for {need}: the data "
            "loader may crash with 'Bus error'. Use fewer workers or a smaller batch, or give the container more "
            "shared memory (docker run --shm-size=2g)."
        )
    return factor, (
        f"shared memory ({SHARED_MEMORY}) has {format_bytes(free_bytes)} free: reading {factor} batch(es) ahead per "
        f"worker instead of {PREFETCH} ({need}); give the container more shared memory (docker run --shm-size=2g)."
    )


def free_shared_memory() -> int | None:
    """Free bytes in :data:`SHARED_MEMORY`, or None where there is no such file system (not Linux)."""
    try:
        stats = os.statvfs(SHARED_MEMORY)
    except (OSError, AttributeError):
        return None
    return stats.f_bavail * stats.f_frsize


def _batch_bytes(items: Dataset, batch_size: int) -> int:
    """Bytes of one batch of ``items``, from the first readable of its first few items (0 when none is)."""
    for i in range(min(len(items), 8)):
        item = items[i]
        if item is not None:
            return item[0].numel() * item[0].element_size() * batch_size
    return 0


def make_loader(
    dataset, transform, batch_size: int, num_workers: int, device: torch.device
) -> tuple[DataLoader, str | None]:
    """``(loader, note)``: the dataset in order as ``(x [b, ...], labels [b], source_indices [b], n_dropped)``
    batches, and a note when shared memory is short (:func:`prefetch_factor`, also logged as a warning).

    ``transform`` turns each image into a tensor; unreadable items (``None``) are dropped and
    counted, so every pass over the same dataset gives the same rows in the same order. An array-backed
    dataset with a batch transform (:func:`batch_transform`) is read and transformed a batch at a time in
    this process, whatever ``num_workers`` says. On CUDA the batches come in pinned memory (asynchronous
    copies to the device). Worker processes are persistent and read ahead as many batches as fit in the
    free shared memory (one item is read here to size a batch).
    """
    pin = device.type == "cuda"
    batch = batch_transform(dataset, transform)
    if batch is not None:
        return DataLoader(ArrayBatches(dataset, batch, batch_size), batch_size=None, pin_memory=pin), None
    items = _Items(dataset, transform)
    factor, note = None, None
    if num_workers > 0:
        factor, note = prefetch_factor(_batch_bytes(items, batch_size), num_workers, free_shared_memory())
        if note is not None:
            logger.warning("%s", note)
    loader = DataLoader(
        items,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_collate,
        pin_memory=pin,
        prefetch_factor=factor,
        persistent_workers=num_workers > 0,
    )
    return loader, note


def _shut_down(iterator) -> None:
    """Stop a DataLoader iterator's worker processes now (not when it is garbage-collected)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


# ---------------------------------------------------------------------------------- back-off and progress


class Backoff:
    """Runs ``n`` rows in chunks of at most ``in_force``; an out-of-memory error (CUDA's or the host's) halves it.

    ``chunks(n, submit)`` calls ``submit(start, stop)`` for consecutive row ranges and yields
    ``(start, stop, result)``. When ``submit`` runs out of memory, the same rows are retried in
    two halves and the smaller size stays in force for later batches, so the results are those of
    a smaller batch size; at one row it gives up with a message that says what to try. A sticky
    CUDA error (:func:`cuda_error_kind`) raises :class:`CudaContextLost` at once; other errors are
    not retried.
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
                kind = cuda_error_kind(err)
                if kind == "sticky" and not isinstance(err, CudaContextLost):
                    raise context_lost(err, self.device, self.what) from err
                if kind != "out_of_memory":
                    raise
                oom = f"{type(err).__name__}: {err}"
            if oom is None:
                yield start, stop, result
                continue
            # Out of memory (the error and its frames are released by now): retry the same rows in halves.
            if stop - start == 1:
                message = (
                    f"out of memory on {self.device} even at batch size 1 while {self.what}; free memory on the device "
                    f"(other processes?), use precision='bf16', or a smaller input size. Original error: {oom}"
                )
                host = "can't allocate memory" in oom.lower()  # the CPU allocator's, not the device's
                raise MemoryError(message) if host else torch.cuda.OutOfMemoryError(message)
            self.in_force = (stop - start) // 2
            self.backoffs += 1
            logger.warning(
                "out of memory on %s at batch size %d; retrying at %d", self.device, stop - start, self.in_force
            )
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            pending.appendleft((start + self.in_force, stop))
            pending.appendleft((start, start + self.in_force))


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


# ---------------------------------------------------------------------------------- the pass


class BatchedPass:
    """One pass of ``dataset`` through ``backbone.transform`` and a model step on ``device`` (see the module doc).

    :param backbone: has ``model`` (an ``nn.Module`` is moved to ``device`` for the ``with`` block;
        any other callable is used as is) and ``transform`` (image -> tensor ``[C, H, W]``)
    :param dataset: ``len(dataset)``, ``dataset[i] -> (image, label, source_index)`` or ``None`` for
        an unreadable image, ``name``
    :param device: a checked ``torch.device`` (:func:`oodviz.models.placement.parse_device`)
    :param batch_size: rows per batch, halved on out-of-memory
    :param num_workers: DataLoader workers, or ``"auto"`` (:func:`auto_workers`); the number in force is
        ``self.num_workers``
    :param precision: a key of :data:`PRECISIONS`; :param channels_last: 4-D weights channels-last for the block
    :param activity: what the pass does, e.g. ``"extracting resnet18 features"`` (in messages)
    :param stage: the ``stage`` of the progress reported after every batch
    :param info: extra fields for every progress report (called at report time)

    Counters, readable at any time: ``total``, ``done`` (items read, unreadable ones included),
    ``skipped`` (unreadable), ``first_batch_s``, ``backoff`` (batch size in force, back-offs), ``started``,
    ``note`` (the data loader's when shared memory is short; also in every progress ``info``).
    """

    def __init__(
        self,
        backbone,
        dataset,
        *,
        device: torch.device,
        batch_size: int,
        num_workers: int,
        precision: str,
        activity: str,
        stage: str,
        channels_last: bool = False,
        progress: Progress | None = None,
        should_cancel: Callable[[], bool] | None = None,
        info: Callable[[], dict] | None = None,
    ):
        check_pass_options(batch_size, num_workers, precision)
        self.total = len(dataset)
        if self.total == 0:
            raise ValueError(
                f"dataset {dataset.name!r} is empty, nothing to do ({activity}); check its path and subsample"
            )
        self.backbone, self.dataset, self.device = backbone, dataset, device
        if num_workers == AUTO_WORKERS:
            num_workers = auto_workers(dataset, getattr(backbone, "transform", None), device)
        self.batch_size, self.num_workers, self.precision = batch_size, num_workers, precision
        self.channels_last, self.activity, self.stage = channels_last, activity, stage
        self.progress, self.should_cancel, self.info = progress, should_cancel, info
        self.backoff = Backoff(batch_size, device, activity)
        self.started = time.perf_counter()
        self.first_batch_s: float | None = None
        self.done = self.skipped = 0
        self.note: str | None = None  # the data loader's, when shared memory is short (:func:`make_loader`)
        self._held = contextlib.ExitStack()

    def __enter__(self) -> BatchedPass:
        with contextlib.ExitStack() as held:
            held.enter_context(model_on_device(getattr(self.backbone, "model", None), self.device, self.channels_last))
            if self.device.type == "cuda":
                held.enter_context(torch.cuda.device(self.device))
            self._held = held.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._held.close()

    def report(self, stage: str) -> None:
        """``progress(done, total, info)`` now, with ``stage`` and the extra ``info``."""
        if self.progress is not None:
            extra = self.info() if self.info is not None else {}
            if self.note is not None:
                extra = {"note": self.note, **extra}
            self.progress(
                self.done,
                self.total,
                progress_info(stage, self.done, self.started, self.backoff, self.skipped, **extra),
            )

    def run(self, submit: Callable[[Tensor, Tensor, Tensor], Result], collect: Callable[[Result], None]) -> None:
        """``collect(submit(x, labels, indices))`` for every chunk of readable rows, in dataset order.

        ``x`` ``[b, ...]``, ``labels`` ``[b]`` and source ``indices`` ``[b]`` are CPU tensors (pinned on
        CUDA); ``b`` is at most the batch size in force. ``submit`` runs under autocast; when it runs
        out of memory, the same rows are submitted again in halves (so ``submit`` must not have
        side effects that a retry would repeat: ``collect`` keeps the results).

        :raises Cancelled: when ``should_cancel()`` returns True (asked before every batch)
        :raises ValueError: when no item of the dataset was readable
        :raises torch.cuda.OutOfMemoryError: when even one row does not fit on the device
        :raises CudaContextLost: after a sticky CUDA error (in ``submit`` or ``collect``): the run must restart
        """
        autocast = autocast_for(self.precision, self.device)
        transform = getattr(self.backbone, "transform", None)
        loader, self.note = make_loader(self.dataset, transform, self.batch_size, self.num_workers, self.device)
        iterator = iter(loader)
        try:
            with autocast:
                for x, labels, indices, dropped in iterator:
                    if self.should_cancel is not None and self.should_cancel():
                        raise Cancelled(
                            f"cancelled after {self.done} of {self.total} items while {self.activity}; "
                            "nothing was stored"
                        )
                    self.skipped += dropped
                    self.done += dropped
                    chunk = lambda a, b: submit(x[a:b], labels[a:b], indices[a:b])  # noqa: B023, E731
                    for start, stop, result in self.backoff.chunks(0 if x is None else len(x), chunk):
                        collect(result)
                        self.done += stop - start
                    if self.first_batch_s is None:
                        self.first_batch_s = time.perf_counter() - self.started
                    self.report(self.stage)
        except RuntimeError as err:  # a sticky error often surfaces at a later sync, outside submit (in collect)
            if cuda_error_kind(err) == "sticky" and not isinstance(err, CudaContextLost):
                raise context_lost(err, self.device, self.activity) from err
            raise
        finally:
            _shut_down(iterator)
        if self.done == self.skipped:
            raise ValueError(
                f"no readable items in dataset {self.dataset.name!r}: all {self.total} were unreadable (None); "
                "check the files"
            )
