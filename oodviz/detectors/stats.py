"""Streaming, mergeable sufficient statistics (float64), in the shape of torchmetrics' state.

Each accumulator is ``update``-d one batch at a time and can ``merge`` another accumulator that
saw a different shard of the data, giving the same result as one accumulator that saw both.
Memory is ``O(C * D + D^2)`` whatever the number of samples: float64 copies of a batch are made
a block of rows at a time (:func:`row_blocks`, at most ``BLOCK_BYTES`` each), so even the
temporaries do not grow with the batch size.

Precision: sums, means, the subtraction of shifts and means and the outer products of the
shifted rows are all float64. (Float32 products were tried: about 2x faster on the CPU, but
their rounding, ~1e-6 of the largest eigenvalue, swamped the small eigenvalues of an
ill-conditioned covariance, and the Mahalanobis distances then depended on how the data was
batched.) Speed comes from doing half the products instead: the scatter matrices are symmetric,
so the CPU path updates one triangle with BLAS ``syrk`` (:func:`add_gram`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import scipy.linalg
import scipy.linalg.blas
import scipy.linalg.lapack
import torch
from torch import Tensor

ACCUMULATE = torch.float64
BLOCK_BYTES = 4 * 2**20


def row_blocks(n_rows: int, n_cols: int, itemsize: int = 8) -> Iterator[slice]:
    """Slices of ``range(n_rows)`` whose ``rows x n_cols`` float64 copy stays within ``BLOCK_BYTES``."""
    step = max(1, BLOCK_BYTES // (itemsize * max(n_cols, 1)))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


def symmetric_eigh(
    matrix: Tensor, overwrite: bool = False, symmetric: bool = False, smallest: int | None = None
) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and eigenvectors of a symmetric float64 ``[D, D]`` matrix, of which
    only the lower triangle is read (so the one :func:`add_gram` leaves is enough).

    On the CPU through LAPACK's MRRR driver (``scipy.linalg.eigh(driver="evr")``), whose
    workspace is O(D) where torch's divide-and-conquer ``eigh`` needs ``2 D^2`` more floats
    (16 MiB at D = 1024). ``overwrite=True`` lets it destroy ``matrix`` instead of copying it.
    ``symmetric=True`` says both triangles hold the matrix: it is then decomposed in place even
    without ``overwrite`` and given back intact, since LAPACK overwrites only the lower triangle
    and the diagonal (restored from the strict upper triangle and a saved diagonal), which saves
    the ``D x D`` copy. ``smallest=m`` computes only the ``m`` smallest eigenpairs (vectors
    ``[D, m]``). Elsewhere ``torch.linalg.eigh``.
    """
    if matrix.device.type != "cpu":
        values, vectors = torch.linalg.eigh(matrix, UPLO="L")
        return (values, vectors) if smallest is None else (values[:smallest], vectors[:, :smallest])
    in_place = overwrite or symmetric
    diagonal = matrix.diagonal().clone() if in_place and not overwrite else None
    # The transpose of a C-ordered matrix is the same memory in Fortran order, which LAPACK can
    # work on in place; the lower triangle of the matrix is the upper one of its transpose.
    values, vectors = scipy.linalg.eigh(
        matrix.numpy().T,
        lower=False,
        driver="evr",
        overwrite_a=in_place,
        check_finite=False,
        subset_by_index=None if smallest is None else (0, smallest - 1),
    )
    if diagonal is not None:
        mirror_upper(matrix)
        matrix.diagonal().copy_(diagonal)
    return torch.from_numpy(values), torch.from_numpy(vectors)


def inverse_cholesky_factor(matrix: Tensor) -> Tensor | None:
    """``L^{-1}`` ``[D, D]`` (lower triangular) for the Cholesky factor ``matrix = L L^T`` of a
    symmetric float64 matrix, or None when it is not numerically positive definite.

    ``D^3 / 3`` operations each, an order of magnitude fewer than an eigendecomposition. On the
    CPU through LAPACK (``potrf``, then ``trtri`` in place: one ``[D, D]`` buffer); elsewhere torch.
    """
    if matrix.device.type != "cpu":
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info):
            return None
        identity = torch.eye(len(matrix), dtype=matrix.dtype, device=matrix.device)
        return torch.linalg.solve_triangular(factor, identity, upper=False)
    factor, info = scipy.linalg.lapack.dpotrf(matrix.numpy().T, lower=1, clean=1)
    if info:
        return None
    inverse, info = scipy.linalg.lapack.dtrtri(factor, lower=1, overwrite_c=1)
    return None if info else torch.from_numpy(inverse)


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

    def state_dict(self) -> dict:
        """``counts`` ``[C]`` and ``sums`` ``[C, D]`` (float64, None before any row)."""
        return {"counts": self.counts, "sums": self.sums}

    def load_state_dict(self, state: dict) -> ClassMeans:
        self.counts, self.sums = state["counts"], state["sums"]
        return self

    @property
    def means(self) -> Tensor:
        """``[C, D]`` float64; rows of empty classes are NaN (check ``empty_classes`` first)."""
        return self.sums / self.counts[:, None]

    def empty_classes(self, n_classes: int | None = None) -> list[int]:
        """Classes in ``0..max(C, n_classes)-1`` with no sample."""
        counts = _grow_rows(self.counts, n_classes or 0)
        return torch.nonzero(counts == 0).flatten().tolist()


def add_gram(accumulator: Tensor, rows: Tensor, alpha: float = 1.0) -> bool:
    """``accumulator += alpha * rows^T rows`` for float64 ``rows [K, D]`` into ``[D, D]`` float64.

    On the CPU through BLAS ``dsyrk``, which computes one triangle only (half the work of a matrix
    product): the result is valid in the *lower* triangle, and the function returns True so the
    caller knows to mirror it (:func:`mirror_lower`) before reading the upper one. Elsewhere a full
    ``addmm_`` (returns False).
    """
    if accumulator.device.type != "cpu" or not (accumulator.is_contiguous() and rows.is_contiguous()):
        accumulator.addmm_(rows.T, rows, alpha=alpha)
        return False
    # A C-ordered matrix is its transpose in Fortran order: BLAS's upper triangle of
    # ``accumulator.T`` is the lower triangle of ``accumulator``, updated in place.
    scipy.linalg.blas.dsyrk(alpha, rows.numpy().T, beta=1.0, c=accumulator.numpy().T, overwrite_c=1, lower=0)
    return True


@contextlib.contextmanager
def torch_on_one_thread(device: torch.device) -> Iterator[None]:
    """Run torch's CPU ops on the calling thread only, inside the block (threads restored after).

    For loops that alternate torch's elementwise ops with :func:`add_gram`'s BLAS call on the CPU:
    BLAS's worker threads keep spinning for a while after each call, and torch's parallel ops in
    between then fight them for the cores (about 3x slower on 2 cores). The elementwise work is
    memory-bound, so one thread loses little.
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def mirror_lower(matrix: Tensor) -> None:
    """Copy the lower triangle of a square ``matrix`` onto its upper one, in place, a block at a time."""
    for block in row_blocks(len(matrix), len(matrix)):
        diagonal = matrix[block, block]
        diagonal.copy_(diagonal.tril() + diagonal.tril(-1).T)
        matrix[block, block.stop :] = matrix[block.stop :, block].T


def mirror_upper(matrix: Tensor) -> None:
    """Copy the strict upper triangle of a square ``matrix`` onto its lower one, in place (the diagonal is kept)."""
    mirror_lower(matrix.T)


class ClassMoments:
    """Per-class means and the pooled within-class scatter, streamed with per-class shifts.

    The statistics are

        mu_c = 1/n_c sum_{i: y_i = c} x_i                                      [C, D]
        W    = sum_c sum_{i: y_i = c} (x_i - mu_c)(x_i - mu_c)^T               [D, D]

    all in float64. Streaming keeps, for a shift ``k_c`` per class (the first sample seen of the
    class), the shifted sums and the shifted scatter

        t_c = sum_{i: y_i = c} (x_i - k_c),    S = sum_i (x_i - k_{y_i})(x_i - k_{y_i})^T

    from which ``mu_c = k_c + t_c / n_c`` and ``W = S - sum_c t_c t_c^T / n_c`` (the "shifted data"
    algorithm; Chan, Golub & LeVeque, *Algorithms for computing the sample variance*, 1983). A
    shift inside the class keeps ``S`` of the order of ``W``, so the subtraction does not cancel the
    way ``sum x x^T - n mu mu^T`` would under a large feature offset. Each batch costs one
    symmetric product of its shifted rows (:func:`add_gram`) and no per-batch ``[C, D]`` state;
    :meth:`settle` re-centres on the means once, when ``means`` or ``within`` is read. Shards
    merge exactly (:meth:`merge`). The total scatter about the grand mean follows as
    ``W + sum_c n_c (mu_c - mu)(mu_c - mu)^T`` (:meth:`total_scatter`).
    """

    def __init__(self, n_classes: int | None = None):
        self.n_classes = n_classes
        self.counts: Tensor | None = None  # [C] float64
        self._shifts: Tensor | None = None  # [C, D]: k_c, the class means once settled
        self._sums: Tensor | None = None  # [C, D]: t_c; None when settled (all zero)
        self._scatter: Tensor | None = None  # [D, D]: S, W once settled
        self._lower_only = False  # only the lower triangle of _scatter is up to date
        self._scratch = Scratch()

    def _ensure(self, x: Tensor, y: Tensor) -> None:
        rows = max(self.n_classes or 0, int(y.max()) + 1)
        if self.counts is None:
            self.counts = torch.zeros(rows, dtype=ACCUMULATE, device=x.device)
            self._shifts = torch.zeros(rows, x.shape[1], dtype=ACCUMULATE, device=x.device)
            self._scatter = torch.zeros(x.shape[1], x.shape[1], dtype=ACCUMULATE, device=x.device)
        self.counts = _grow_rows(self.counts, rows)
        self._shifts = _grow_rows(self._shifts, rows)
        self._sums = torch.zeros_like(self._shifts) if self._sums is None else _grow_rows(self._sums, rows)

    def update(self, x: Tensor, y: Tensor) -> None:
        if not len(y):
            return
        self._ensure(x, y)
        unseen = self.counts[y] == 0
        if bool(unseen.any()):  # a class's first sample becomes its shift
            rows = torch.nonzero(unseen).flatten()
            first = torch.full_like(self.counts, len(y), dtype=torch.long)
            first.scatter_reduce_(0, y[rows], rows, reduce="amin")
            first = first[first < len(y)]
            self._shifts[y[first]] = x[first].to(ACCUMULATE)
        self.counts += torch.bincount(y, minlength=len(self.counts))
        with torch_on_one_thread(x.device):
            for block in row_blocks(len(y), x.shape[1]):
                labels = y[block]
                shifted = self._scratch.get("rows", (len(labels), x.shape[1]), ACCUMULATE, x.device).copy_(x[block])
                shifted -= torch.index_select(
                    self._shifts, 0, labels, out=self._scratch.get("shifts", shifted.shape, ACCUMULATE, x.device)
                )
                self._sums.index_add_(0, labels, shifted)
                self._lower_only |= add_gram(self._scatter, shifted)

    def settle(self) -> ClassMoments:
        """Re-centre on the class means: ``k_c <- mu_c``, ``S <- W``, ``t_c <- 0`` (and free ``t``)."""
        if self._sums is not None:
            for block in row_blocks(len(self.counts), self._shifts.shape[1]):
                n = self.counts[block, None]
                offset = self._sums[block].div_(n.clamp(min=1))  # mu_c - k_c, in place
                weighted = torch.mul(
                    offset, n.sqrt(), out=self._scratch.get("rows", offset.shape, ACCUMULATE, offset.device)
                )
                self._lower_only |= add_gram(self._scatter, weighted, alpha=-1.0)  # S - sum_c n_c d_c d_c^T
                self._shifts[block] += offset
            self._sums = None
        if self._lower_only:
            mirror_lower(self._scatter)
            self._lower_only = False
        return self

    def merge(self, other: ClassMoments) -> ClassMoments:
        """Add the statistics of a shard ``other`` saw (``other`` is settled on the way)."""
        if other.counts is None:
            return self
        other.settle()
        if self.counts is None:
            self.counts, self._shifts, self._scatter = (
                other.counts.clone(),
                other._shifts.clone(),
                other._scatter.clone(),
            )
            return self
        device = self.counts.device
        counts, means = other.counts.to(device), other._shifts.to(device)
        self._ensure(means, torch.tensor([len(counts) - 1], device=device))
        # Other's samples about our shift k: sum (x - k) = n_b delta and
        # sum (x - k)(x - k)^T = W_b + n_b delta delta^T, with delta = mu_b - k per class.
        new = (self.counts[: len(counts)] == 0) & (counts > 0)
        self._shifts[: len(counts)][new] = means[new]
        self._scatter += other._scatter.to(device)
        for block in row_blocks(len(counts), means.shape[1]):
            n = counts[block, None]
            delta = means[block] - self._shifts[block]
            self._sums[block] += delta * n
            self._lower_only |= add_gram(self._scatter, delta.mul_(n.sqrt()))
        self.counts[: len(counts)] += counts
        return self

    def state_dict(self) -> dict:
        """Settled: ``counts`` ``[C]``, the class ``means`` ``[C, D]`` and the within-class scatter ``within``
        ``[D, D]`` (float64, both triangles; None before any row)."""
        if self.counts is None:
            return {"counts": None, "means": None, "within": None}
        self.settle()
        return {"counts": self.counts, "means": self._shifts, "within": self._scatter}

    def load_state_dict(self, state: dict) -> ClassMoments:
        self.counts, self._shifts, self._scatter = state["counts"], state["means"], state["within"]
        self._sums, self._lower_only = None, False
        return self

    def release(self) -> ClassMoments:
        """Settle, and drop the per-block buffers once the stream is over (the statistics stay)."""
        self._scratch = Scratch()
        return self.settle()

    @property
    def means(self) -> Tensor:
        """``mu_c`` ``[C, D]`` float64; rows of empty classes are meaningless (check ``empty_classes``)."""
        return self.settle()._shifts

    @property
    def within(self) -> Tensor:
        """The within-class scatter ``W`` ``[D, D]`` float64 (the stored tensor: dividing it in place is fine
        once the stream is over)."""
        return self.settle()._scatter

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
        lower_only = False
        for block in row_blocks(len(self.counts), self.means.shape[1]):
            between = (self.means[block] - mu).mul_(self.counts[block, None].sqrt())
            lower_only |= add_gram(total, between)
        if lower_only:
            mirror_lower(total)
        return total

    def empty_classes(self, n_classes: int | None = None) -> list[int]:
        """Classes in ``0..max(C, n_classes)-1`` with no sample."""
        counts = _grow_rows(self.counts, n_classes or 0)
        return torch.nonzero(counts == 0).flatten().tolist()


class Moments(ClassMoments):
    """The mean ``mu`` ``[D]`` and the scatter about it ``sum_i (x_i - mu)(x_i - mu)^T`` ``[D, D]`` of all rows (float64),
    streamed and merged as :class:`ClassMoments` of a single class: ``update(x [B, D])``; ``mean``, ``scatter``."""

    def __init__(self):
        super().__init__(n_classes=1)

    def update(self, x: Tensor) -> None:
        super().update(x, torch.zeros(len(x), dtype=torch.long, device=x.device))

    @property
    def mean(self) -> Tensor:
        return self.means[0]

    @property
    def scatter(self) -> Tensor:
        """The stored tensor, as :attr:`ClassMoments.within`."""
        return self.within
