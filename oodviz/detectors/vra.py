"""VRA: variational rectified activations, two-sided and per unit, then the energy score.

Xu, Lian, Liu & Tao, *VRA: Variational Rectified Activation for Out-of-distribution Detection*,
NeurIPS 2023, https://arxiv.org/abs/2302.11716

Fit: for every feature unit ``d`` (column of the in-distribution features ``x`` ``[N, D]``) a lower
and an upper threshold, the ``lower_percentile``-th and ``upper_percentile``-th percentiles of that
unit's ``N`` activations (``np.quantile(x, q, axis=0)``, linear interpolation): ``lo`` and ``hi``,
both ``[D]``. Score, with features ``x`` ``[B, D]`` and the head ``(W [C, D], b [C])``:

    score(x) = -logsumexp_k ( clip(x, lo, hi) W^T + b )_k

the energy of the logits of the clipped features (higher = more OOD). The paper derives, by a
variational argument, that the best activation shaping suppresses abnormally low and abnormally high
activations and keeps the ones in between; this two-sided clip is the form pytorch-ood 0.4 implements
(``pytorch_ood.detector.VRA``): per-unit thresholds, values below ``lo`` raised to ``lo`` and above
``hi`` lowered to ``hi``. The paper's own piecewise function (``0`` below a global ``alpha``, ``x +
gamma`` between, ``beta`` above) is not this one; oodviz follows pytorch-ood, so the two agree.

The per-unit percentiles without holding the activations
-------------------------------------------------------
pytorch-ood keeps every training activation in RAM (``N x D`` floats). oodviz finds the same order
statistics exactly in four streaming passes with ``O(D)`` memory (:class:`ColumnQuantiles`): each
float32 activation is mapped to a 32-bit key that sorts like the value
(:func:`~oodviz.detectors.react.sortable_keys`), and pass ``p`` histograms the ``p``-th byte of the
keys (most significant first) of the values whose higher bytes match the prefix found so far, per
unit and per wanted rank: 256 bins x ``D`` units x (at most 4 ranks) counts. After four passes the
prefix is the whole key, the exact float32 order statistic. Percentiles are then interpolated as
numpy's ``linear`` method does, in float64, and kept as float32 (pytorch-ood interpolates in float32:
the thresholds agree to a float32 rounding).

``lower_percentile`` and ``upper_percentile`` are in percent, 0 to 100 (pytorch-ood's fractions times
100).

Not mergeable yet (the state protocol, :mod:`oodviz.detectors.protocol`): its per-unit radix histograms would
merge as counts, as react's do, but are not wired; in a run split over ranks every rank fits it on the whole
store (the same answer, without the speed-up).
"""

import math

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.react import check_percentile, energy, lerp, sortable_keys
from oodviz.detectors.stats import row_blocks
from oodviz.detectors.teaching import Teaching

_BYTE_BINS = 256
_PASSES = 4  # bytes of a float32 key
_SIGN = 1 << 31


def keys_to_floats(keys: Tensor) -> Tensor:
    """The float32 values whose :func:`~oodviz.detectors.react.sortable_keys` keys (int64 in ``[0, 2^32)``) these are."""
    bits = torch.where(keys >= _SIGN, keys - _SIGN, -1 - keys)  # the int32 bit pattern, as a signed number
    return bits.to(torch.int32).view(torch.float32)


class ColumnQuantiles:
    """Exact ``np.quantile(x, q, axis=0)`` (linear method) of a stream of ``[B, D]`` rows, in four passes.

    Usage, with the same rows in every pass (any batching and order)::

        cq = ColumnQuantiles([0.01, 0.99])
        for p in range(4):
            for x in stream: cq.update(x)
            cq.end_pass()
        cq.result()   # [2, D] float64

    State: one ``[D, 256]`` int64 histogram and a ``[D]`` prefix per distinct order statistic (at most
    two per quantile), whatever the number of rows.
    """

    def __init__(self, quantiles: list[float]):
        self.quantiles = [float(q) for q in quantiles]
        self.n = 0  # rows seen in the current pass
        self.passes_done = 0
        self._rows: int | None = None  # rows per pass, from the first
        self._ranks: list[int] = []  # distinct 0-based order statistics wanted
        self._prefix: Tensor | None = None  # [R, D] int64: key bytes found so far
        self._within: Tensor | None = None  # [R, D] int64: rank of the target among keys with that prefix
        self._counts: Tensor | None = None  # [R, D, 256] int64: this pass's byte histogram

    def update(self, x: Tensor) -> None:
        """Count the rows ``x`` ``[B, D]`` (float32 keys) in this pass's histograms."""
        if self.passes_done >= _PASSES:
            raise RuntimeError("ColumnQuantiles.update after the last pass: start a new ColumnQuantiles")
        width = x.shape[1]
        if self._counts is None:  # the first pass counts one histogram, the same for every rank
            self._counts = torch.zeros(1, width, _BYTE_BINS, dtype=torch.long, device=x.device)
        shift = 8 * (_PASSES - 1 - self.passes_done)
        offsets = torch.arange(width, device=x.device) * _BYTE_BINS
        for block in row_blocks(len(x), width):
            keys = sortable_keys(x[block]).view(-1, width).long() & 0xFFFFFFFF  # [b, D] uint32 values
            cell = offsets + ((keys >> shift) & 0xFF)  # unit * 256 + byte
            if self.passes_done == 0:  # every key matches the empty prefix
                counts = torch.bincount(cell.flatten(), minlength=width * _BYTE_BINS).view(width, _BYTE_BINS)
                self._counts[0] += counts
                continue
            upper = keys >> (shift + 8)
            for r in range(len(self._ranks)):
                match = upper == self._prefix[r]
                self._counts[r] += torch.bincount(cell[match], minlength=width * _BYTE_BINS).view(width, _BYTE_BINS)
        self.n += len(x)

    def end_pass(self) -> None:
        """Pick, per unit and rank, the byte bin holding the order statistic; refine within it next pass."""
        if self._rows is None:
            if not self.n:
                raise ValueError("ColumnQuantiles: no rows were counted")
            self._rows = self.n
            self._ranks = sorted({rank for q in self.quantiles for rank in self._virtual_index(q)[:2]})
            width = self._counts.shape[1]
            self._counts = self._counts[:1].expand(len(self._ranks), -1, -1).clone()
            self._prefix = torch.zeros(len(self._ranks), width, dtype=torch.long, device=self._counts.device)
            self._within = torch.tensor(self._ranks, device=self._counts.device)[:, None].expand(-1, width).clone()
        elif self.n != self._rows:
            raise ValueError(
                f"ColumnQuantiles: pass {self.passes_done + 1} saw {self.n} rows, the first saw {self._rows}; "
                "every pass must read the same rows"
            )
        cumulative = self._counts.cumsum(dim=2)  # [R, D, 256]
        byte = torch.searchsorted(cumulative, self._within[..., None], right=True).squeeze(2)  # [R, D]
        before = torch.where(byte > 0, cumulative.gather(2, (byte - 1).clamp(min=0)[..., None]).squeeze(2), 0)
        self._within -= before
        self._prefix = self._prefix * _BYTE_BINS + byte
        self._counts.zero_()
        self.passes_done += 1
        self.n = 0
        if self.passes_done == _PASSES:
            self._counts = None

    def _virtual_index(self, quantile: float) -> tuple[int, int, float]:
        h = (self._rows - 1) * quantile
        below = math.floor(h)
        return below, min(below + 1, self._rows - 1), h - below

    def result(self) -> Tensor:
        """``[len(quantiles), D]`` float64: the quantiles of every column, numpy's linear interpolation."""
        if self.passes_done != _PASSES:
            raise RuntimeError(f"ColumnQuantiles: {self.passes_done} of {_PASSES} passes done")
        values = keys_to_floats(self._prefix).double()  # [R, D]
        rows = []
        for q in self.quantiles:
            below, above, fraction = self._virtual_index(q)
            a, b = values[self._ranks.index(below)], values[self._ranks.index(above)]
            rows.append(lerp(a, b, fraction))  # elementwise on tensors, the branch on the scalar fraction
        return torch.stack(rows)


class VRA(Detector):
    name = "vra"
    summary = "Energy of the logits after clipping each feature unit between two percentiles of its training values."
    paper = "https://arxiv.org/abs/2302.11716"
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_k e^{(\operatorname{clip}(x, \ell, h) W^\top + b)_k},\quad \ell, h = \text{per-unit percentiles}",
        citation="Xu, Lian, Liu & Tao, *VRA: Variational Rectified Activation for Out-of-distribution Detection*, NeurIPS 2023",
        reads="the features of the fit split (a lower and an upper percentile per unit) and the head",
        fails_when="Helps only when OOD activations are abnormally low or high per unit; OOD inputs inside the ID ranges keep their energy.",
    )
    inputs = ("features",)
    needs_head = True
    fit_passes = _PASSES
    in_defaults = False  # the default list is issue 17's per-backbone choice

    def __init__(self, lower_percentile: float = 1.0, upper_percentile: float = 99.0):
        self.lower_percentile = check_percentile(self.name, lower_percentile, "lower_percentile")
        self.upper_percentile = check_percentile(self.name, upper_percentile, "upper_percentile")
        if self.lower_percentile > self.upper_percentile:
            raise ValueError(
                f"vra: lower_percentile={self.lower_percentile:g} exceeds upper_percentile={self.upper_percentile:g}; "
                "the lower clip must be at or below the upper one."
            )

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """``8 x (2 x 4 x 256 x D + C x D + C)``: up to four ranks' byte histograms per unit and their cumulative
        sums (int64), and the head."""
        return 8 * (2 * 4 * _BYTE_BINS * n_features + n_classes * n_features + n_classes)

    def _fit(self, data: FitData) -> None:
        quantiles = ColumnQuantiles([self.lower_percentile / 100, self.upper_percentile / 100])
        for _ in range(_PASSES):
            for batch in data:
                quantiles.update(batch.features)
            quantiles.end_pass()
        lower, upper = quantiles.result().float()
        self.lower_threshold_, self.upper_threshold_ = lower.to(data.device), upper.to(data.device)  # [D] each
        self.head_weight_, self.head_bias_ = data.head

    def _score(self, batch: Batch) -> Tensor:
        clipped = torch.clamp(batch.features.float(), min=self.lower_threshold_, max=self.upper_threshold_)
        return energy(clipped, self.head_weight_, self.head_bias_)
