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
rounding apart). This is an exact path, not shrinkage: the scores equal those of the ``D x D`` path.

:class:`FewRows` keeps copies of the first rows of a fit stream while there are at most ``D / 2`` of
them (``N x D`` in the features' dtype: at most a quarter of ``D^2`` float64 for float32 features) and
hands them to a :class:`~oodviz.detectors.stats.ClassMoments` as soon as the stream is longer, so a
long stream streams as before. No ``D x D`` matrix is formed on this path (mahalanobis and rmd keep no
``covariance_`` then): the fit holds the kept rows, one ``N x D`` float64 copy of them centred (rmd: a
second one for the call that whitens the total covariance), ``G`` and ``U`` ``[N, N]`` float64 and ``S``
(float32, made a block at a time), at most ``24 N D + 16 N^2`` bytes for float32 features (``1.5 x D^2 x 8``
at ``N = D / 2``), and far less for few rows: 96 rows of ``D = 151,296`` need 0.3 GiB where the
``D x D`` covariance alone is 171 GiB.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oodviz.detectors.stats import (
    ACCUMULATE,
    ClassMeans,
    ClassMoments,
    row_blocks,
    symmetric_eigh,
)


def gram_inverse_sqrt(centred: Tensor, n_samples: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """``S`` ``[D, k]`` (in ``dtype``) with ``S S^T = (centred^T centred / n_samples)^+``, from rows ``centred``
    ``[N, D]`` (float64) through their ``N x N`` Gram matrix (see the module docstring). Computed in float64
    a block of ``D`` at a time, so no float64 ``[D, k]`` exists next to the result."""
    dim = centred.shape[1]
    values, vectors = symmetric_eigh(centred @ centred.T, overwrite=True)  # ascending
    cutoff = values.amax().clamp(min=0) * dim * torch.finfo(values.dtype).eps
    first = int((values <= cutoff).sum())  # ascending: the dropped eigenpairs come first
    scaled = vectors[:, first:].to(centred.device).mul_(n_samples**0.5 / values[first:].to(centred.device))
    whitening = torch.empty(dim, scaled.shape[1], dtype=dtype, device=centred.device)
    for block in row_blocks(dim, len(scaled)):
        whitening[block] = centred[:, block].T @ scaled
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
        self._centred: Tensor | None = None
        self._means: ClassMeans | None = None

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
        """Compute the class means in float64 and keep the rows only centred on them (``x_i - mu_{y_i}``,
        ``[N, D]`` float64): the one copy of the data the Gram path holds; each kept batch is let go as soon
        as its rows are copied (the rows are never joined in their own dtype)."""
        self._y = torch.cat(self._labels)
        self._means = ClassMeans()
        for x, y in zip(self._features, self._labels, strict=True):
            self._means.update(x, y)
        means = self.means
        first = self._features[0]
        self._centred = torch.empty(self.rows, first.shape[1], dtype=ACCUMULATE, device=first.device)
        del first
        start = 0
        while self._features:
            x, y = self._features.pop(0), self._labels.pop(0)
            for block in row_blocks(len(x), x.shape[1]):
                rows = slice(start + block.start, start + block.stop)
                self._centred[rows] = x[block]
                self._centred[rows] -= means[y[block]]
            start += len(x)
            del x, y
        return self

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
        return gram_inverse_sqrt(self._centred, len(self._y), dtype)

    def inverse_sqrt_total(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``S`` ``[D, k]``, ``S S^T = Sigma_0^+`` for the covariance about the grand mean, from the rows
        centred on it, ``(x_i - mu_{y_i}) + (mu_{y_i} - mu)`` (a second ``N x D`` float64 copy, for the call)."""
        offsets = self.means - self.grand_mean  # [C, D]
        centred = torch.empty_like(self._centred)
        for block in row_blocks(len(centred), centred.shape[1]):
            torch.add(self._centred[block], offsets[self._y[block]], out=centred[block])
        return gram_inverse_sqrt(centred, len(self._y), dtype)


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
