"""Streaming, mergeable sufficient statistics (float64), in the shape of torchmetrics' state.

Each accumulator is ``update``-d one batch at a time and can ``merge`` another accumulator that
saw a different shard of the data, giving the same result as one accumulator that saw both.
Memory is ``O(C * D + D^2)`` whatever the number of samples.
"""

from __future__ import annotations

import torch
from torch import Tensor

ACCUMULATE = torch.float64


def _grow_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] >= rows:
        return t
    extra = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, extra])


class ClassMeans:
    """Per-class counts ``n_c`` and sums ``sum_i x_i`` in float64.

    ``update(x [B, D], y [B])`` with ``y`` in ``0..C-1``. The number of classes grows with the
    largest label seen unless fixed by ``n_classes``.
    """

    def __init__(self, n_classes: int | None = None):
        self.n_classes = n_classes
        self.counts: Tensor | None = None  # [C] float64
        self.sums: Tensor | None = None  # [C, D] float64

    def _ensure(self, x: Tensor, y: Tensor) -> None:
        rows = max(self.n_classes or 0, int(y.max()) + 1)
        if self.sums is None:
            self.counts = torch.zeros(rows, dtype=ACCUMULATE, device=x.device)
            self.sums = torch.zeros(rows, x.shape[1], dtype=ACCUMULATE, device=x.device)
        else:
            self.counts = _grow_rows(self.counts, rows)
            self.sums = _grow_rows(self.sums, rows)

    def update(self, x: Tensor, y: Tensor) -> None:
        if not len(y):
            return
        self._ensure(x, y)
        self.counts.index_add_(0, y, torch.ones(len(y), dtype=ACCUMULATE, device=x.device))
        self.sums.index_add_(0, y, x.to(ACCUMULATE))

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
        batch = ClassMeans(n_classes=len(self.counts))
        batch.update(x, y)
        present = batch.counts > 0
        n_b = batch.counts[present]
        mu_b = batch.sums[present] / n_b[:, None]
        centred = x.to(ACCUMULATE) - (batch.sums / batch.counts.clamp(min=1)[:, None])[y]
        self._fold(present, n_b, mu_b, centred.T @ centred)

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
        present = counts > 0
        self._fold(present, counts[present], means[present], other.within.to(self.within.device))
        return self

    def _fold(self, present: Tensor, n_b: Tensor, mu_b: Tensor, within_b: Tensor) -> None:
        n_a = self.counts[present]
        delta = mu_b - self.means[present]
        weight = n_a * n_b / (n_a + n_b)
        self.within += within_b + (delta * weight[:, None]).T @ delta
        self.means[present] += delta * (n_b / (n_a + n_b))[:, None]
        self.counts[present] = n_a + n_b

    @property
    def total(self) -> float:
        return float(self.counts.sum())

    @property
    def grand_mean(self) -> Tensor:
        """``mu = sum_c n_c mu_c / N``, ``[D]`` float64."""
        return (self.counts[:, None] * self.means).sum(0) / self.counts.sum()

    def total_scatter(self) -> Tensor:
        """``sum_i (x_i - mu)(x_i - mu)^T`` over all samples, ``[D, D]`` float64."""
        between = self.means - self.grand_mean
        return self.within + (between * self.counts[:, None]).T @ between

    def empty_classes(self, n_classes: int | None = None) -> list[int]:
        """Classes in ``0..max(C, n_classes)-1`` with no sample."""
        counts = _grow_rows(self.counts, n_classes or 0)
        return torch.nonzero(counts == 0).flatten().tolist()
