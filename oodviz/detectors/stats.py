"""Streaming, mergeable sufficient statistics (float64), in the shape of torchmetrics' state.

Each accumulator is ``update``-d one batch at a time and can ``merge`` another accumulator that
saw a different shard of the data, giving the same result as one accumulator that saw both.
Memory is ``O(C * D + D^2)`` whatever the number of samples: float64 copies of a batch are made
a block of rows at a time (:func:`row_blocks`, at most ``BLOCK_BYTES`` each), so even the
temporaries do not grow with the batch size.

Precision: sums, means, the subtraction of means and the outer products of the centred rows are
all float64. (Float32 products of centred rows were tried: about 2x faster on the CPU, but their
rounding, ~1e-6 of the largest eigenvalue, swamped the small eigenvalues of an ill-conditioned
covariance, and the Mahalanobis distances then depended on how the data was batched.)
"""

from __future__ import annotations

from collections.abc import Iterator

import scipy.linalg
import torch
from torch import Tensor

ACCUMULATE = torch.float64
BLOCK_BYTES = 4 * 2**20


def row_blocks(n_rows: int, n_cols: int, itemsize: int = 8) -> Iterator[slice]:
    """Slices of ``range(n_rows)`` whose ``rows x n_cols`` float64 copy stays within ``BLOCK_BYTES``."""
    step = max(1, BLOCK_BYTES // (itemsize * max(n_cols, 1)))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


def symmetric_eigh(matrix: Tensor, overwrite: bool = False) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and eigenvectors of a symmetric float64 ``[D, D]`` matrix.

    On the CPU through LAPACK's MRRR driver (``scipy.linalg.eigh(driver="evr")``), whose
    workspace is O(D) where torch's divide-and-conquer ``eigh`` needs ``2 D^2`` more floats
    (16 MiB at D = 1024); ``overwrite=True`` lets it destroy ``matrix`` instead of copying it.
    Elsewhere ``torch.linalg.eigh``.
    """
    if matrix.device.type != "cpu":
        return torch.linalg.eigh(matrix)
    # The transpose of a symmetric C-ordered matrix is the same matrix in Fortran order, which
    # LAPACK can work on in place.
    values, vectors = scipy.linalg.eigh(matrix.numpy().T, driver="evr", overwrite_a=overwrite, check_finite=False)
    return torch.from_numpy(values), torch.from_numpy(vectors)


class Scratch:
    """Buffers reused from block to block and batch to batch.

    Temporaries of a few MiB allocated and freed per block make glibc's heap grow (freed chunks
    are kept, and fragmented); writing every block into the same memory keeps the footprint at
    one block's worth.
    """

    def __init__(self):
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        size = 1
        for n in shape:
            size *= n
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.device != device or buffer.numel() < size:
            buffer = self._buffers[name] = torch.empty(size, dtype=dtype, device=device)
        return buffer[:size].view(shape)

    def as_dtype(self, name: str, t: Tensor, dtype: torch.dtype) -> Tensor:
        """``t`` converted to ``dtype`` in a reused buffer (``t`` itself when it already is)."""
        if t.dtype == dtype:
            return t
        return self.get(name, tuple(t.shape), dtype, t.device).copy_(t)


def _grow_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] >= rows:
        return t
    extra = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, extra])


class ClassMeans:
    """Per-class counts ``n_c`` and sums ``sum_i x_i`` in float64.

    ``update(x [B, D], y [B], mask=None)`` with ``y`` in ``0..C-1``; rows where ``mask`` is False
    are left out. The number of classes grows with the largest label seen unless fixed by
    ``n_classes``.
    """

    def __init__(self, n_classes: int | None = None):
        self.n_classes = n_classes
        self.counts: Tensor | None = None  # [C] float64
        self.sums: Tensor | None = None  # [C, D] float64
        self._scratch = Scratch()

    def _ensure(self, x: Tensor, y: Tensor) -> None:
        rows = max(self.n_classes or 0, int(y.max()) + 1)
        if self.sums is None:
            self.counts = torch.zeros(rows, dtype=ACCUMULATE, device=x.device)
            self.sums = torch.zeros(rows, x.shape[1], dtype=ACCUMULATE, device=x.device)
        else:
            self.counts = _grow_rows(self.counts, rows)
            self.sums = _grow_rows(self.sums, rows)

    def update(self, x: Tensor, y: Tensor, mask: Tensor | None = None) -> None:
        if mask is not None and not bool(mask.any()):
            return
        if not len(y):
            return
        self._ensure(x, y if mask is None else y[mask])
        for block in row_blocks(len(y), x.shape[1]):
            xb, yb = x[block], y[block]
            if mask is not None:
                xb, yb = xb[mask[block]], yb[mask[block]]
            self.counts += torch.bincount(yb, minlength=len(self.counts))
            self.sums.index_add_(0, yb, self._scratch.as_dtype("rows", xb, ACCUMULATE))

    def merge(self, other: ClassMeans) -> ClassMeans:
        if other.sums is None:
            return self
        if self.sums is None:
            self.counts, self.sums = other.counts.clone(), other.sums.clone()
            return self
        rows = max(len(self.counts), len(other.counts))
        self.counts = _grow_rows(self.counts, rows)
        self.sums = _grow_rows(self.sums, rows)
        self.counts[: len(other.counts)] += other.counts.to(self.counts.device)
        self.sums[: len(other.sums)] += other.sums.to(self.sums.device)
        return self

    @property
    def means(self) -> Tensor:
        """``[C, D]`` float64; rows of empty classes are NaN (check ``empty_classes`` first)."""
        return self.sums / self.counts[:, None]

    def empty_classes(self, n_classes: int | None = None) -> list[int]:
        """Classes in ``0..max(C, n_classes)-1`` with no sample."""
        counts = _grow_rows(self.counts, n_classes or 0)
        return torch.nonzero(counts == 0).flatten().tolist()


class ClassMoments:
    """Per-class means and the pooled within-class scatter, by Chan et al.'s parallel update.

    Keeps ``n_c`` ``[C]``, class means ``mu_c`` ``[C, D]`` and the within-class scatter

        W = sum_c sum_{i: y_i = c} (x_i - mu_c)(x_i - mu_c)^T        [D, D]

    all in float64. Each batch is centred on its own per-class means before the outer product
    (so large feature offsets do not cancel catastrophically) and folded in with

        W += W_batch + sum_c n_a n_b / (n_a + n_b) * delta_c delta_c^T,   delta_c = mu_c,batch - mu_c

    (Chan, Golub & LeVeque, 1979). The total scatter about the grand mean follows exactly as
    ``W + sum_c n_c (mu_c - mu)(mu_c - mu)^T`` (``total_scatter``).
    """

    def __init__(self, n_classes: int | None = None):
        self.n_classes = n_classes
        self.counts: Tensor | None = None  # [C]
        self.means: Tensor | None = None  # [C, D]
        self.within: Tensor | None = None  # [D, D]
        self._scratch = Scratch()
        self._batch: ClassMeans | None = None  # reused: the per-class sums of the current batch

    def _ensure(self, x: Tensor, y: Tensor) -> None:
        rows = max(self.n_classes or 0, int(y.max()) + 1)
        if self.means is None:
            d = x.shape[1]
            self.counts = torch.zeros(rows, dtype=ACCUMULATE, device=x.device)
            self.means = torch.zeros(rows, d, dtype=ACCUMULATE, device=x.device)
            self.within = torch.zeros(d, d, dtype=ACCUMULATE, device=x.device)
        else:
            self.counts = _grow_rows(self.counts, rows)
            self.means = _grow_rows(self.means, rows)

    def update(self, x: Tensor, y: Tensor) -> None:
        if not len(y):
            return
        self._ensure(x, y)
        batch = self._batch
        if batch is None or batch.sums.shape != self.means.shape:
            batch = self._batch = ClassMeans(n_classes=len(self.counts))
        else:
            batch.counts.zero_()
            batch.sums.zero_()
        batch.update(x, y)
        batch_means = batch.sums.div_(batch.counts.clamp(min=1)[:, None])  # in place: [C, D]
        for block in row_blocks(len(y), x.shape[1]):  # W_batch, straight into W
            rows = y[block]
            centred = self._scratch.get("centred", (len(rows), x.shape[1]), ACCUMULATE, x.device).copy_(x[block])
            centred -= torch.index_select(batch_means, 0, rows, out=self._scratch.get("means", centred.shape, ACCUMULATE, x.device))
            self.within.addmm_(centred.T, centred)
        present = torch.nonzero(batch.counts > 0).flatten()
        self._fold(present, batch.counts[present], batch_means)

    def merge(self, other: ClassMoments) -> ClassMoments:
        if other.means is None:
            return self
        if self.means is None:
            self.counts, self.means, self.within = other.counts.clone(), other.means.clone(), other.within.clone()
            return self
        rows = max(len(self.counts), len(other.counts))
        self.counts = _grow_rows(self.counts, rows)
        self.means = _grow_rows(self.means, rows)
        counts = _grow_rows(other.counts.to(self.counts.device), rows)
        means = _grow_rows(other.means.to(self.means.device), rows)
        self.within += other.within.to(self.within.device)
        present = torch.nonzero(counts > 0).flatten()
        self._fold(present, counts[present], means)
        return self

    def _fold(self, present: Tensor, n_b: Tensor, means_b: Tensor) -> None:
        """Fold in the classes ``present`` [k] with ``n_b`` [k] samples and means ``means_b[present]``
        (their own scatter already added to ``within``), a block of classes at a time."""
        for block in row_blocks(len(present), self.means.shape[1]):
            classes, n_new = present[block], n_b[block]
            n_old = self.counts[classes]
            delta = means_b[classes] - self.means[classes]
            self.within.addmm_((delta * (n_old * n_new / (n_old + n_new))[:, None]).T, delta)
            self.means[classes] += delta * (n_new / (n_old + n_new))[:, None]
            self.counts[classes] = n_old + n_new

    def release(self) -> ClassMoments:
        """Drop the per-batch buffers once the stream is over (the statistics stay)."""
        self._scratch, self._batch = Scratch(), None
        return self

    @property
    def total(self) -> float:
        return float(self.counts.sum())

    @property
    def grand_mean(self) -> Tensor:
        """``mu = sum_c n_c mu_c / N``, ``[D]`` float64."""
        return self.counts @ self.means / self.counts.sum()

    def total_scatter(self) -> Tensor:
        """``sum_i (x_i - mu)(x_i - mu)^T`` over all samples, ``[D, D]`` float64 (a new tensor)."""
        total = self.within.clone()
        mu = self.grand_mean
        for block in row_blocks(len(self.counts), self.means.shape[1]):
            between = self.means[block] - mu
            total.addmm_((between * self.counts[block, None]).T, between)
        return total

    def empty_classes(self, n_classes: int | None = None) -> list[int]:
        """Classes in ``0..max(C, n_classes)-1`` with no sample."""
        counts = _grow_rows(self.counts, n_classes or 0)
        return torch.nonzero(counts == 0).flatten().tolist()
