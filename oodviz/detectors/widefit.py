"""Gaussian fits of wide features from few samples: the Gram-matrix path (``N <= D / 2``).

With ``N`` samples of ``D`` features the scatter ``X_c^T X_c`` ``[D, D]`` has rank at most ``N``;
when ``N < D`` it is singular, the Cholesky factorisation fails and the pseudo-inverse needs an
eigendecomposition of the ``D x D`` matrix, ``O(D^3)`` (22 s at D = 2048 on 2 cores). The same
non-zero eigenpairs come from the ``N x N`` Gram matrix ``G = X_c X_c^T`` in ``O(N^2 D + N^3)``:

    G = U diag(lambda) U^T   =>   X_c^T X_c = V diag(lambda) V^T,   V = X_c^T U diag(lambda)^(-1/2)

and for ``Sigma = X_c^T X_c / N`` (eigenvalues ``lambda / N``) the whitening ``S S^T = Sigma^+`` is

    S = V diag(lambda / N)^(-1/2) = X_c^T U diag(sqrt(N) / lambda)        [D, k]

keeping the eigenpairs above the cutoff ``D * eps(float64) * lambda_max`` of
:func:`oodviz.detectors.mahalanobis.inverse_sqrt`, so both paths give the same ``Sigma^+`` (float64
rounding apart). This is an exact path, not shrinkage: the scores equal those of the ``D x D`` path. On an
oversubscribed CPU the eigendecomposition runs on one BLAS thread (:func:`eigensolver_threads`): there, two
threads made the N < D fits 2-4x slower than pytorch-ood 0.4's, one makes them as fast (``bench/RESULTS.md``).

:class:`FewRows` keeps copies of the first rows of a fit stream while there are at most ``D / 2`` of
them (``N x D`` in the features' dtype: at most a quarter of ``D^2`` float64 for float32 features) and
hands them to a :class:`~oodviz.detectors.stats.ClassMoments` as soon as the stream is longer, so a
long stream streams as before. No ``D x D`` matrix is formed on this path (mahalanobis and rmd keep no
``covariance_`` then), and no float64 copy of the rows either: the centred rows ``X_c`` are made from the
kept rows a block of columns at a time (``[N, <= 4 MiB / (8 N)]`` float64, one reused buffer), each block
adding to ``G`` and later to ``S``. Besides the kept rows (``4 N D`` bytes for float32 features) and two
4 MiB blocks, the fit holds ``G`` and ``U`` ``[N, N]`` float64 during the eigendecomposition, then ``U`` and
``S`` (float32): at most ``4 N D + max(16 N^2, 8 N^2 + 4 N D)`` bytes, ``0.75 x D^2 x 8`` at ``N = D / 2``
(rmd holds its first ``S`` during the second: ``1 x D^2 x 8``; ``bench/wide_fit.py`` measures 1.34 with
BLAS/LAPACK workspaces and the heap's slack), and far less for few rows: 96 rows of ``D = 151,296`` need
0.2 GiB where the ``D x D`` covariance alone is 171 GiB.

rmd's background Gaussian needs the rows centred on the grand mean, ``t_i = c_i + o_{y_i}`` with the
within-class rows ``c_i = x_i - mu_{y_i}`` and the class offsets ``o_k = mu_k - mu`` ``[C, D]``. With
``P = X_c O^T`` ``[N, C]`` (accumulated with ``G``) and ``Q = O O^T`` ``[C, C]``,

    G_t[i, j] = <t_i, t_j> = G[i, j] + P[i, y_j] + P[j, y_i] + Q[y_i, y_j]
    S_t       = T^T U' = X_c^T U' + O^T (E^T U'),   (E^T U')[k] = sum_{i: y_i = k} U'[i]    [C, k]

(``U'`` the scaled kept eigenvectors of ``G_t``, ``E`` the ``N x C`` one-hot labels): the same blocks of
``X_c`` serve both Gaussians, for ``O(N^2 + N C D)`` more work.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from oodviz.detectors.stats import (
    ACCUMULATE,
    BLOCK_BYTES,
    ClassMeans,
    ClassMoments,
    Scratch,
    row_blocks,
    symmetric_eigh,
)

#: ``() -> iterator of (columns, X_c[:, columns])``: the centred rows a block of columns at a time, float64
ColumnBlocks = Callable[[], Iterator[tuple[slice, Tensor]]]
#: the scratch buffer of the block temporaries, shared by the column blocks' centring and the Gram path
TEMPORARY = "temporary"


def block_buffer(scratch: Scratch, name: str, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """A float64 ``shape`` view of ``scratch``'s buffer ``name`` of ``BLOCK_BYTES`` (more only for a block wider than
    that): every block buffer of the Gram path has that one size, so glibc reuses the memory one leaves for the next
    (blocks of varying sizes fragment its heap, which then grows by a block per allocation)."""
    size = math.prod(shape)
    return scratch.get(name, (max(size, BLOCK_BYTES // 8),), ACCUMULATE, device)[:size].view(shape)


def eigensolver_threads(device: torch.device):
    """The BLAS threads of the Gram matrix's eigendecomposition: one while the CPU is oversubscribed (its 1-minute
    load average above its core count), else the library's own (a null context; also off the CPU).

    LAPACK's symmetric eigensolvers reduce the matrix to tridiagonal form with level-2 BLAS, which synchronises
    its threads at every column; when the cores are shared with other busy processes a descheduled thread stalls
    the others: the 1000 x 1000 Gram matrix took 5.7-17.6 s on two threads and 0.95-1.8 s on one (scipy's MRRR and
    divide-and-conquer drivers and torch's, same process, load average 13 on 2 cores; ``bench/RESULTS.md``)."""
    if device.type != "cpu" or os.getloadavg()[0] <= (os.cpu_count() or 1):
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def gram_inverse_sqrt(
    column_blocks: ColumnBlocks,
    n_samples: int,
    dtype: torch.dtype = torch.float32,
    offsets: Tensor | None = None,
    labels: Tensor | None = None,
    scratch: Scratch | None = None,
) -> Tensor:
    """``S`` ``[D, k]`` (in ``dtype``) with ``S S^T = (T^T T / n_samples)^+`` for rows ``T`` ``[N, D]`` through
    their ``N x N`` Gram matrix (see the module docstring): ``T = X_c``, given by ``column_blocks`` (read twice),
    or, with ``offsets`` ``[C, D]`` and ``labels`` ``[N]``, ``T = X_c + offsets[labels]`` without forming it.
    Float64 throughout; ``S`` is written a block of ``D`` at a time, so no float64 ``[D, k]`` exists. ``scratch``
    holds the block temporaries (:func:`block_buffer`), across calls when given."""
    scratch = Scratch() if scratch is None else scratch
    gram = cross = None
    dim = 0
    for columns, block in column_blocks():
        if gram is None:
            gram = torch.zeros(len(block), len(block), dtype=block.dtype, device=block.device)
            if offsets is not None:
                cross = torch.zeros(len(block), len(offsets), dtype=block.dtype, device=block.device)
        gram.addmm_(block, block.T)
        if offsets is not None:
            cross.addmm_(block, offsets[:, columns].T)  # P [N, C]: <c_i, o_k>
        dim = columns.stop
    del block
    device = gram.device
    if offsets is not None:
        # G_t = G + R E^T + E R^T with R = P + E Q / 2 [N, C] (Q symmetric), a block of rows at a time
        cross += (offsets @ offsets.T)[labels].mul_(0.5)
        for rows in row_blocks(len(gram), len(gram)):
            part = block_buffer(scratch, TEMPORARY, (rows.stop - rows.start, len(gram)), device)
            gram[rows] += torch.index_select(cross[rows], 1, labels, out=part)  # R[i, y_j]
            gram[rows] += torch.index_select(cross.T, 0, labels[rows], out=part)  # R[j, y_i]
        del cross
    with eigensolver_threads(device):
        values, vectors = symmetric_eigh(gram, overwrite=True)  # ascending
    del gram
    cutoff = values.amax().clamp(min=0) * dim * torch.finfo(values.dtype).eps
    first = int((values <= cutoff).sum())  # ascending: the dropped eigenpairs come first
    scaled = vectors[:, first:].to(device).mul_(n_samples**0.5 / values[first:].to(device))  # U' [N, k]
    if offsets is not None:
        class_sums = torch.zeros(len(offsets), scaled.shape[1], dtype=scaled.dtype, device=device)
        class_sums.index_add_(0, labels, scaled)  # E^T U' [C, k]
    whitening = torch.empty(dim, scaled.shape[1], dtype=dtype, device=device)
    for columns, block in column_blocks():
        part = torch.mm(
            block.T, scaled, out=block_buffer(scratch, TEMPORARY, (block.shape[1], scaled.shape[1]), device)
        )
        if offsets is not None:
            part.addmm_(offsets[:, columns].T, class_sums)
        whitening[columns] = part
    return whitening


class FewRows:
    """The rows of a fit stream while there are at most ``D / 2``, with the statistics of
    :class:`~oodviz.detectors.stats.ClassMoments` (``counts``, ``means``, ``total``, ``grand_mean``,
    ``within``, ``empty_classes``) and the Gram-path whitenings :meth:`inverse_sqrt_within` and
    :meth:`inverse_sqrt_total`.

    ``add(x [B, D], y [B])`` returns False, keeping nothing, when the rows would pass ``D / 2``;
    the caller then streams :meth:`kept` and every later batch into a ``ClassMoments``.
    """

    def __init__(self):
        self._features: list[Tensor] = []
        self._labels: list[Tensor] = []
        self.rows = 0
        self._y: Tensor | None = None
        self._means: ClassMeans | None = None
        self._scratch = Scratch()

    def add(self, x: Tensor, y: Tensor) -> bool:
        if self.rows + len(y) > x.shape[1] // 2:
            return False
        self._features.append(x.clone())  # the batch's memory may be reused by its producer
        self._labels.append(y.clone())
        self.rows += len(y)
        return True

    def kept(self) -> list[tuple[Tensor, Tensor]]:
        """The kept rows, batch by batch (and forgotten here)."""
        kept = list(zip(self._features, self._labels, strict=True))
        self._features, self._labels, self.rows = [], [], 0
        return kept

    def release(self) -> FewRows:
        """Compute the class counts and means in float64, the sums a block of columns at a time (the kept rows
        stay as they are: :meth:`centred_columns` centres them a block of columns at a time)."""
        self._y = torch.cat(self._labels)
        device = self._features[0].device
        sums = torch.zeros(int(self._y.max()) + 1, self._features[0].shape[1], dtype=ACCUMULATE, device=device)
        for columns, block in self._columns():
            sums[:, columns].index_add_(0, self._y, block)
        counts = torch.bincount(self._y, minlength=len(sums)).to(ACCUMULATE)
        self._means = ClassMeans().load_state_dict({"counts": counts, "sums": sums})
        return self

    def _columns(self) -> Iterator[tuple[slice, Tensor]]:
        """``(columns, x [N, columns])`` float64, the kept rows a block of columns of at most ``BLOCK_BYTES`` at a
        time, in one reused buffer (each block valid until the next is asked for)."""
        dim = self._features[0].shape[1]
        step = max(1, BLOCK_BYTES // (8 * self.rows))
        for start in range(0, dim, step):
            columns = slice(start, min(start + step, dim))
            block = block_buffer(self._scratch, "columns", (self.rows, columns.stop - start), self._features[0].device)
            first = 0
            for x in self._features:
                block[first : first + len(x)] = x[:, columns]
                first += len(x)
            yield columns, block

    def centred_columns(self) -> Iterator[tuple[slice, Tensor]]:
        """``(columns, x_i - mu_{y_i} [N, columns])`` float64, as :meth:`_columns`."""
        means = self.means
        for columns, block in self._columns():
            # TEMPORARY is free here: gram_inverse_sqrt uses it only between two blocks
            class_means = block_buffer(self._scratch, TEMPORARY, block.shape, block.device)
            block -= torch.index_select(means[:, columns], 0, self._y, out=class_means)
            yield columns, block

    @property
    def counts(self) -> Tensor:
        return self._means.counts

    @property
    def means(self) -> Tensor:
        return self._means.means

    @property
    def total(self) -> float:
        return float(len(self._y))

    @property
    def grand_mean(self) -> Tensor:
        return self.counts @ self.means / self.counts.sum()

    def empty_classes(self, n_classes: int | None = None) -> list[int]:
        return self._means.empty_classes(n_classes)

    def inverse_sqrt_within(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``S`` ``[D, k]``, ``S S^T = Sigma^+`` for the tied class covariance ``Sigma = W / N``."""
        return gram_inverse_sqrt(self.centred_columns, len(self._y), dtype, scratch=self._scratch)

    def inverse_sqrt_total(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``S`` ``[D, k]``, ``S S^T = Sigma_0^+`` for the covariance about the grand mean, of the rows centred on
        it, ``(x_i - mu_{y_i}) + (mu_{y_i} - mu)``, which are never formed (the module docstring's ``G_t``, ``S_t``)."""
        offsets = self.means - self.grand_mean  # [C, D]
        return gram_inverse_sqrt(
            self.centred_columns, len(self._y), dtype, offsets=offsets, labels=self._y, scratch=self._scratch
        )


class ClassGaussianStream:
    """Class means and the within-class scatter of a stream, mergeable: the rows themselves while there are at
    most ``D / 2`` (:class:`FewRows`, the Gram path), a :class:`~oodviz.detectors.stats.ClassMoments` beyond.

    ``update(x [B, D], y [B])``; ``merge(other)`` adds ``other``'s rows (kept ones re-added here, in order, so
    the path taken is that of one stream of both: the Gram path only when both together have at most ``D / 2``
    rows); :meth:`release` gives the ``FewRows`` or the ``ClassMoments`` to read the statistics from.
    """

    def __init__(self):
        self.few: FewRows | None = FewRows()
        self.moments = ClassMoments()

    def update(self, x: Tensor, y: Tensor) -> None:
        if self.few is not None and self.few.add(x, y):
            return
        self._spill()
        self.moments.update(x, y)

    def _spill(self) -> None:
        if self.few is not None:  # more than D / 2 rows: stream the kept ones, then everything
            for x, y in self.few.kept():
                self.moments.update(x, y)
            self.few = None

    def merge(self, other: ClassGaussianStream) -> ClassGaussianStream:
        if other.few is not None:
            for x, y in zip(other.few._features, other.few._labels, strict=True):
                self.update(x, y)
        else:
            self._spill()
            self.moments.merge(other.moments)
        return self

    def release(self) -> FewRows | ClassMoments:
        return self.moments.release() if self.few is None else self.few.release()

    def state_dict(self) -> dict:
        """``rows`` ``[N, D]`` and ``labels`` ``[N]`` while on the Gram path (else None), and ``moments``."""
        kept = self.few is not None and self.few.rows > 0
        return {
            "rows": torch.cat(self.few._features) if kept else None,
            "labels": torch.cat(self.few._labels) if kept else None,
            "gram_path": self.few is not None,
            "moments": self.moments.state_dict(),
        }

    def load_state_dict(self, state: dict) -> ClassGaussianStream:
        self.few = FewRows() if state["gram_path"] else None
        if state["rows"] is not None:
            self.few._features, self.few._labels = [state["rows"]], [state["labels"]]
            self.few.rows = len(state["labels"])
        self.moments.load_state_dict(state["moments"])
        return self
