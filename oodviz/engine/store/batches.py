"""Streaming a split as :class:`oodviz.Batch` chunks, from disk or from a copy held on a device.

:class:`StoreBatches` (``store.batches()``) reads row ranges with positioned reads in a background
thread, re-iterable for two-pass fits, optionally straight onto a GPU through pinned staging
buffers. :class:`DeviceSplit` (``store.to_device()``) holds a whole split on one device.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.engine.store.keys import StoreError
from oodviz.models.placement import parse_device

if TYPE_CHECKING:
    from oodviz.engine.store.reader import FeatureStore

#: Fields a :class:`~oodviz.Batch` carries, i.e. what ``batches(include=...)`` accepts.
BATCH_FIELDS = ("features", "logits", "labels")


def check_include(include: Sequence[str]) -> tuple[str, ...]:
    """``include`` (a field name or several) as a tuple of :data:`BATCH_FIELDS`, or a ValueError naming them."""
    if isinstance(include, str):
        include = (include,)
    include = tuple(include)
    unknown = [f for f in include if f not in BATCH_FIELDS]
    if unknown or not include:
        raise ValueError(
            f"include must name some of {BATCH_FIELDS} (what a Batch carries), got {include!r}; "
            "predictions and indices are read as store.predictions / store.indices"
        )
    return include


def check_batch_size(batch_size) -> int:
    """``batch_size`` as an int when it is a positive integer, else a ValueError."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


class StoreBatches:
    """A re-iterable stream of :class:`oodviz.Batch` over a :class:`FeatureStore` (see :meth:`FeatureStore.batches`).

    ``len()`` is the number of batches; ``n`` the number of rows.
    """

    def __init__(
        self, store: FeatureStore, batch_size=4096, device=None, include=BATCH_FIELDS, dtype=torch.float32, prefetch=2
    ):
        self.store = store
        self.batch_size = check_batch_size(batch_size)
        self.device = None if device is None else parse_device(device)
        self.include = check_include(include)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch dtype (features and logits), got {dtype}")
        self.dtype = dtype
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer (0 = no reader thread), got {prefetch!r}")
        self.prefetch = prefetch
        self.n = store.n

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    @property
    def features_on_disk(self) -> np.ndarray:
        """The ``[N, D]`` features these batches yield, in order, as the store's read-only memory map
        (what a detector that must keep every feature, knn, can use instead of a copy)."""
        return self.store.features

    def __iter__(self) -> Iterator[Batch]:
        ranges = [(s, min(s + self.batch_size, self.n)) for s in range(0, self.n, self.batch_size)]
        if self.device is not None and self.device.type == "cuda":
            return self._iter_cuda(ranges)
        return self._iter_host(ranges)

    def _open(self) -> dict[str, _RowFile]:
        files = {}
        try:
            for field in self.include:
                files[field] = _RowFile(self.store.path / f"{field}.npy", self.store.array(field))
        except BaseException:
            for f in files.values():
                f.close()
            raise
        return files

    # Host path: each chunk is read into a fresh array, converted to dtype on the way.
    def _iter_host(self, ranges) -> Iterator[Batch]:
        files = self._open()

        def read(r, _slot):
            start, stop = r
            return {field: f.read(start, stop) for field, f in files.items()}

        chunks = _prefetched(ranges, read, self.prefetch, slots=None)
        try:
            for chunk in chunks:
                tensors = {field: torch.from_numpy(array) for field, array in chunk.items()}
                for field in ("features", "logits"):
                    if field in tensors and tensors[field].dtype != self.dtype:
                        tensors[field] = tensors[field].to(self.dtype)
                if self.device is not None:
                    tensors = {f: t.to(self.device) for f, t in tensors.items()}
                yield Batch(**tensors)
        finally:
            chunks.close()  # stops and joins the reader thread before the files close
            for f in files.values():
                f.close()

    # CUDA path: pinned staging slots reused round-robin, each guarded by the event of its last copy. The copies
    # run on a stream of their own, so the next batch's copy overlaps the consumer's work on the last one.
    def _iter_cuda(self, ranges) -> Iterator[Batch]:
        device = self.device
        copy_stream = torch.cuda.Stream(device)
        n_slots = self.prefetch + 2
        rows = min(self.batch_size, self.n)
        files = self._open()
        staging = [
            {
                field: torch.empty((rows, *f.row_shape), dtype=_torch_dtype(f.dtype), pin_memory=True)
                for field, f in files.items()
            }
            for _ in range(n_slots)
        ]
        events: list[torch.cuda.Event | None] = [None] * n_slots

        def read(r, slot_index):
            event = events[slot_index]
            if event is not None:
                event.synchronize()  # the previous host-to-device copy out of this slot is done
            start, stop = r
            for field, f in files.items():
                f.read(start, stop, out=staging[slot_index][field].numpy())
            return slot_index, stop - start

        chunks = _prefetched(ranges, read, self.prefetch, slots=n_slots)
        try:
            for slot_index, m in chunks:
                slot = staging[slot_index]
                consumer = torch.cuda.current_stream(device)
                with torch.cuda.stream(copy_stream):
                    tensors = {f: slot[f][:m].to(device, non_blocking=True) for f in self.include}
                    event = torch.cuda.Event()
                    event.record(copy_stream)
                events[slot_index] = event  # the reader waits on it before refilling the slot
                consumer.wait_event(event)  # the consumer's work on the batch starts after its copy
                for tensor in tensors.values():
                    # made on the copy stream, used on the consumer's: its memory is not reused before that use ends
                    tensor.record_stream(consumer)
                for field in ("features", "logits"):
                    if field in tensors and tensors[field].dtype != self.dtype:
                        tensors[field] = tensors[field].to(self.dtype)
                yield Batch(**tensors)
        finally:
            chunks.close()
            for event in events:
                if event is not None:
                    event.synchronize()  # no copy may still read a staging buffer once it is freed
            for f in files.values():
                f.close()


class _RowFile:
    """Rows ``[start, stop)`` of a ``.npy`` file by positioned reads (no memory map, no page faults)."""

    def __init__(self, path: Path, mapped: np.ndarray):
        self.dtype = mapped.dtype
        self.row_shape = tuple(mapped.shape[1:])
        self.offset = int(mapped.offset)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        self.file = open(path, "rb", buffering=0)

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        rows = stop - start
        if out is None:
            out = np.empty((rows, *self.row_shape), dtype=self.dtype)
        view = memoryview(out[:rows]).cast("B")
        want, got = rows * self.row_bytes, 0
        self.file.seek(self.offset + start * self.row_bytes)
        while got < want:
            n = self.file.readinto(view[got:])
            if not n:
                raise StoreError(
                    f"{self.file.name} ends early (row {start + got // self.row_bytes}); the store is damaged: extract again"
                )
            got += n
        return out[:rows]

    def close(self) -> None:
        self.file.close()


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype


def _prefetched(ranges, read, prefetch: int, slots: int | None):
    """Yield ``read(range, slot)`` for each range, ``prefetch`` ahead in a reader thread.

    ``slots``: with a number, ``read`` writes into slot ``i % slots``; at most ``prefetch`` read
    slots wait in the queue, plus the one being consumed, so with ``slots >= prefetch + 2`` a slot
    is never overwritten while its batch is in use (``read`` also waits on the slot's copy event).
    """
    if prefetch == 0:
        for i, r in enumerate(ranges):
            yield read(r, None if slots is None else i % slots)
        return
    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()
    done = object()

    def worker():
        try:
            for i, r in enumerate(ranges):
                if stop.is_set():
                    return
                item = read(r, None if slots is None else i % slots)
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            ready.put(done)
        except BaseException as err:  # handed to the consumer, raised there
            ready.put(err)

    thread = threading.Thread(target=worker, name="oodviz-store-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                ready.get(timeout=0.05)
            except queue.Empty:
                pass
        thread.join()


def available_bytes(free: int, reserved: int, allocated: int) -> int:
    """Bytes this process can still allocate on a GPU: the driver's ``free`` (``torch.cuda.mem_get_info``) plus
    what PyTorch's caching allocator holds but does not use (``reserved - allocated``, given back on demand)."""
    return free + max(0, reserved - allocated)


class DeviceSplit:
    """A whole split held on one device, with the same ``batches()`` as :class:`FeatureStore`.

    Made by :meth:`FeatureStore.to_device`. Batches are views of the device tensors (no copies):
    do not modify them in place.
    """

    def __init__(
        self, store: FeatureStore, device, include=BATCH_FIELDS, dtype=torch.float32, max_fraction: float = 0.5
    ):
        self.store = store
        self.device = parse_device(device)
        self.include = check_include(include)
        need = store.nbytes(self.include, dtype)
        if self.device.type == "cuda":
            free = available_bytes(
                torch.cuda.mem_get_info(self.device)[0],
                torch.cuda.memory_reserved(self.device),
                torch.cuda.memory_allocated(self.device),
            )
            if need > max_fraction * free:
                raise ValueError(
                    f"the split needs {need / 2**30:.2f} GiB on {self.device}, more than {max_fraction:.0%} of the "
                    f"{free / 2**30:.2f} GiB free; stream it with store.batches(device={str(self.device)!r}) instead "
                    "(same results, bounded memory) or raise max_fraction"
                )
        self.tensors: dict[str, Tensor] = {}
        for field in self.include:
            array = store.array(field)
            want = torch.int64 if field == "labels" else dtype
            self.tensors[field] = torch.empty((store.n, *array.shape[1:]), dtype=want, device=self.device)
        start = 0
        for batch in store.batches(batch_size=16384, device=self.device, include=self.include, dtype=dtype):
            for field in self.include:
                value = getattr(batch, field)
                self.tensors[field][start : start + len(value)] = value
            start += len(batch)
        self.n = store.n

    def batches(self, batch_size: int = 65536, include: Sequence[str] | None = None) -> _DeviceBatches:
        """Re-iterable :class:`oodviz.Batch` views of ``batch_size`` rows of the ``include`` fields."""
        include = self.include if include is None else check_include(include)
        missing = [f for f in include if f not in self.tensors]
        if missing:
            raise ValueError(f"{missing} were not copied to the device; call store.to_device(include=...) with them")
        return _DeviceBatches(self, check_batch_size(batch_size), include)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class _DeviceBatches:
    def __init__(self, split: DeviceSplit, batch_size: int, include: tuple[str, ...]):
        self.split, self.batch_size, self.include = split, batch_size, include

    def __len__(self) -> int:
        return math.ceil(self.split.n / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for start in range(0, self.split.n, self.batch_size):
            yield Batch(**{f: self.split.tensors[f][start : start + self.batch_size] for f in self.include})
