"""A bank of in-distribution rows on disk, searched in chunks: the machinery of the detectors that keep training rows.

:class:`FeatureBank` is the base of :class:`~oodviz.detectors.knn.KNN` (and ``nnguide``), ``relation``, ``cfood``,
``grood`` and ``combood``: methods whose score reads every training row (or a subsample, or a function of each),
so the fit keeps them, as a float32 ``[N, E]`` file, never in memory. Only knn and nnguide (the
:class:`~oodviz.detectors.knn.KNN` subclasses) shard their bank over the ranks of a run; the others fit on the
whole store on every rank.

- **Fit.** Batches from a feature store (``features_on_disk``) can be the bank themselves (knn: the store's file,
  L2-normalised as read). Otherwise :meth:`FeatureBank._write_bank` streams the rows
  :meth:`FeatureBank._bank_rows` makes of each block of fit features (knn: the normalised features; relation: the
  normalised features beside the softmax; cfood: a seeded subsample; grood: gradients of the correctly
  classified rows) into a file in ``bank_dir`` or a temporary
  directory removed with the detector, and keeps it as a read-only memory map (``bank_``, ``bank_path_``).
- **Score.** :meth:`FeatureBank._staged_queries` reads the query batches once, turns each row block into query rows
  (:meth:`FeatureBank._query_rows`) and stages them in a float32 file (beside a bank the detector wrote, else the
  system's temporary directory); :meth:`FeatureBank._sweep` then reads the bank **once** for all the queries: bank
  chunks of ``chunk_size`` rows are the outer loop and query blocks the inner one, each query block of
  ``max(1, SIMILARITY_BYTES // (4 x chunk rows))`` rows, so a ``[q, chunk]`` float32 block stays within
  ``SIMILARITY_BYTES`` (64 MiB). The detector folds each ``(query block, bank chunk)`` pair into a per-query state
  (knn and combood: a running top-k; relation: a running sum; cfood: running counts; grood: a running minimum).
- **CUDA.** The bank is held on the device when it fits in ``DEVICE_FRACTION`` of the free memory, else streamed in
  chunks through two pinned host buffers copied on a side stream (the copy of chunk ``j + 1`` overlaps the work on
  chunk ``j``); the staged queries are held on the device when they fit in half of that share.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.stats import row_blocks

#: bytes of one ``[query rows, bank chunk rows]`` float32 block
SIMILARITY_BYTES = 64 * 2**20
#: share of the free CUDA memory the bank may take to be held on the device whole
DEVICE_FRACTION = 0.5


def _normalise(x: Tensor) -> Tensor:
    return x.float() / x.float().norm(dim=1, keepdim=True).clamp(min=1e-12)


def check_chunk_size(name: str, chunk_size) -> int:
    if int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be a positive integer, got {chunk_size}")
    return int(chunk_size)


class FeatureBank(Detector):
    """Base of the detectors that keep a bank of fit rows on disk (module docstring). Subclasses set ``chunk_size``
    and ``bank_dir`` in ``__init__`` and say what a bank row (:meth:`_bank_rows`) and a query row
    (:meth:`_query_rows`) are; by default both are the L2-normalised features."""

    inputs = ("features",)
    chunk_size: int
    bank_dir: str | None

    # -- fit ---------------------------------------------------------------------------------
    def _new_bank_directory(self) -> str:
        """Where a fit writes its files: ``bank_dir``, or a new temporary directory removed with the detector."""
        if self.bank_dir is not None:
            os.makedirs(self.bank_dir, exist_ok=True)
            return self.bank_dir
        directory = tempfile.mkdtemp(prefix=f"oodviz-{self.name}-")
        weakref.finalize(self, shutil.rmtree, directory, True)  # the bank lives as long as this detector
        return directory

    def _write_bank(self, data: FitData) -> None:
        """Stream the bank rows of every fit block into a float32 file and keep it as a memory map."""
        path = os.path.join(self._new_bank_directory(), f"{self.name}-bank-{id(self):x}.f32")
        rows, width = 0, None
        with open(path, "wb") as file:
            for batch in data:
                for block in row_blocks(len(batch.features), batch.features.shape[1], itemsize=4):
                    written = self._bank_rows(batch.features[block], data, batch, block).float()
                    width = written.shape[1]
                    written.cpu().numpy().tofile(file)
                    rows += len(written)
        self._check_bank(rows)  # before mapping: a file of no rows (a subsample that kept none) cannot be mapped
        self._keep_bank(np.memmap(path, dtype=np.float32, mode="r", shape=(rows, width)), normalised=True)

    def _bank_rows(self, features: Tensor, data: FitData, batch, rows: slice) -> Tensor:
        """The bank rows written for the fit features ``[b, D]`` (rows ``rows`` of ``batch``): float32, L2-normalised."""
        return _normalise(features)

    def _keep_bank(self, bank: np.ndarray, normalised: bool) -> None:
        self._check_bank(len(bank))
        self.bank_ = bank  # [N, E] memory map
        self.bank_path_ = str(bank.filename)
        self.bank_normalised_ = normalised  # False: the feature store's raw features, normalised as read

    def _check_bank(self, rows: int) -> None:
        """ValueError when a bank of ``rows`` rows cannot serve the detector's parameters."""

    # -- score -------------------------------------------------------------------------------
    def _query_rows(self, batch, rows: slice) -> Tensor:
        """The staged query rows of rows ``rows`` of a validated scoring batch: float32, width that of the bank."""
        return _normalise(batch.features[rows])

    def _query_extra(self, batch) -> Tensor | None:
        """Per-query numbers the final score needs besides the bank pass (``[B]``, kept on the CPU), or None."""
        return None

    @contextlib.contextmanager
    def _staged_queries(self, batches, device):
        """The validated query batches, turned into query rows in row blocks in a float32 file: yields its memory
        map ``[N_q, E]``, the scoring device and the queries' :meth:`_query_extra` ``[N_q]`` (or None); the file is
        removed afterwards."""
        # Beside a bank this detector wrote, never inside a feature store (then the system's temporary directory).
        own = getattr(self, "bank_normalised_", False)
        directory = os.path.dirname(self.bank_path_) if own else None
        file = tempfile.NamedTemporaryFile(prefix=f"{self.name}-queries-", suffix=".f32", dir=directory, delete=False)
        try:
            rows, extras = 0, []
            with file:
                for batch in self.validated_batches(batches, device):
                    device = batch.device
                    for block in row_blocks(len(batch.features), self.bank_.shape[1], itemsize=4):
                        self._query_rows(batch, block).float().cpu().numpy().tofile(file)
                    rows += len(batch.features)
                    extras.append(self._query_extra(batch))
            if not rows:
                raise ValueError(f"{self.name}.score got no samples: the batches were empty.")
            extra = None if extras[0] is None else torch.cat(extras)
            yield np.memmap(file.name, dtype=np.float32, mode="r", shape=(rows, self.bank_.shape[1])), device, extra
        finally:
            os.unlink(file.name)

    def _sweep(self, queries: np.ndarray, device: torch.device) -> Iterator[tuple[slice, Tensor, Tensor, int, Tensor]]:
        """One pass over the bank for all the staged ``queries``: ``(rows, z, chunk, start, buffer)`` for every bank
        chunk (outer loop, in bank order) and query block (inner loop): the query rows ``rows`` as ``z``
        ``[q, E]`` and the bank rows ``start : start + len(chunk)`` as ``chunk`` ``[c, E]``, both float32 on
        ``device``, with ``buffer``, a flat float32 tensor of at least ``q x c`` elements the caller may use for
        one ``[q, c]`` product (the same memory for every pair)."""
        held = self._queries_on(device, queries)
        buffer = torch.empty(max(SIMILARITY_BYTES // 4, self.chunk_size), device=device)
        start = 0
        for chunk in self._bank_chunks(device):
            step = max(1, SIMILARITY_BYTES // (4 * len(chunk)))
            for first in range(0, len(queries), step):
                rows = slice(first, first + step)
                z = held[rows] if held is not None else torch.from_numpy(np.array(queries[rows])).to(device)
                yield rows, z, chunk, start, buffer
            start += len(chunk)

    @staticmethod
    def _queries_on(device: torch.device, queries: np.ndarray) -> Tensor | None:
        """All staged queries on a CUDA device when they fit in half the bank's share of its free memory, else None
        (they are then read block by block from the staging file)."""
        if device.type != "cuda" or queries.nbytes > DEVICE_FRACTION * torch.cuda.mem_get_info(device)[0] / 2:
            return None
        return torch.from_numpy(np.array(queries)).to(device)

    def _bank_chunks(self, device: torch.device):
        """The bank as float32 chunks ``[<= chunk_size, E]`` on ``device``, in bank order (normalised as read when the
        bank is a feature store's raw features)."""
        if device.type == "cuda":
            if self.bank_.nbytes <= DEVICE_FRACTION * torch.cuda.mem_get_info(device)[0]:
                # Views of chunk_size rows: a [q, N] block would leave q tiny and read the bank N_q / q times.
                yield from self._bank_on_device(device).split(self.chunk_size)
            else:
                yield from self._streamed_chunks(device)
            return
        for start in range(0, len(self.bank_), self.chunk_size):
            chunk = torch.from_numpy(np.array(self.bank_[start : start + self.chunk_size]))
            yield chunk if self.bank_normalised_ else _normalise(chunk)

    def _bank_on_device(self, device: torch.device) -> Tensor:
        """The whole bank ``[N, E]`` on ``device``, copied in chunks (no full host copy)."""
        bank = torch.empty(self.bank_.shape, dtype=torch.float32, device=device)
        for start in range(0, len(bank), self.chunk_size):
            chunk = torch.from_numpy(np.array(self.bank_[start : start + self.chunk_size])).to(device)
            bank[start : start + len(chunk)] = chunk if self.bank_normalised_ else _normalise(chunk)
        return bank

    def _streamed_chunks(self, device: torch.device):
        """Bank chunks through two pinned host buffers: the host fills one while the other's copy (on a side
        stream) or the work on the chunk it carried runs; events order the copy before the work and the
        refill of a buffer after its previous copy."""
        compute, copy = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        dim = self.bank_.shape[1]
        buffers = [torch.empty((self.chunk_size, dim), dtype=torch.float32, pin_memory=True) for _ in range(2)]
        copied: list[torch.cuda.Event | None] = [None, None]
        for index, start in enumerate(range(0, len(self.bank_), self.chunk_size)):
            slot = index % 2
            if copied[slot] is not None:
                copied[slot].synchronize()  # the buffer's previous copy has left it
            rows = min(self.chunk_size, len(self.bank_) - start)
            host = buffers[slot][:rows]
            host.numpy()[:] = self.bank_[start : start + rows]
            with torch.cuda.stream(copy):
                chunk = host.to(device, non_blocking=True)
                copied[slot] = torch.cuda.Event()
                copied[slot].record(copy)
            compute.wait_event(copied[slot])
            chunk.record_stream(compute)  # allocated on the copy stream, used on the compute stream
            yield chunk if self.bank_normalised_ else _normalise(chunk)
