"""ReAct: rectified activations, then the energy score.

Sun, Guo & Li, *ReAct: Out-of-distribution Detection With Rectified Activations*, NeurIPS 2021,
https://arxiv.org/abs/2111.12797

Fit: the clipping threshold ``c``, the ``percentile``-th percentile of *all* ``N x D``
in-distribution penultimate activations (every entry of every feature vector ``x`` ``[N, D]``).
Score, with features ``x`` ``[B, D]`` and the head ``(W [C, D], b [C])``:

    score(x) = -logsumexp_k ( min(x, c) W^T + b )_k

the energy of the logits of the clipped features (the paper's confidence is the negative energy;
the energy itself is the OOD score: higher = more OOD). The paper applies ReAct to post-ReLU
(non-negative) penultimate features, where ``c`` is an upper clip; other features are clipped
from above just the same.

The percentile without holding the activations
----------------------------------------------
pytorch-ood 0.4 keeps every training activation in RAM and calls ``np.percentile`` (``N x D``
floats: 10 GB for ImageNet-1k with D = 2048). oodviz computes the same number **exactly** in
two streaming passes and ``O(1)`` memory (:class:`StreamingPercentile`), by a radix selection
on the float32 bit patterns:

1. each activation (as float32) is mapped to a 32-bit key that sorts like the value; pass 1
   counts the keys by their upper 16 bits (65,536 bins, whatever the value range);
2. the bins holding the two order statistics that ``np.percentile`` interpolates between are
   now known; pass 2 counts the lower 16 bits of the keys in those (at most two) bins, which
   pins each order statistic down to its exact float32 value.

The result is ``np.percentile``'s default ("linear") definition: with the ``n`` values sorted,
``h = (n - 1) p / 100``, ``c = v[floor h] + (h - floor h) (v[floor h + 1] - v[floor h])``, the
interpolation done in float64 as numpy does it. It equals ``np.percentile`` of the float32
activations taken as float64 (the tests check it bit for bit). The one difference from
pytorch-ood: it calls ``np.percentile`` on the float32 array, which interpolates in float32, so
its threshold can differ from oodviz's by a float32 rounding (relative 6e-8). Activations of
other dtypes are rounded to float32 first (float64 features lose digits beyond float32's).

``percentile`` is in percent, 0 to 100 (90 in the paper), not a fraction as in pytorch-ood.
"""

import math
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.teaching import Teaching

_HALF = 16  # bits per radix pass
_BINS = 1 << _HALF
_LOW_MASK = _BINS - 1
_SIGN = 1 << 31
_SIGN_INT32 = -(1 << 31)  # the sign bit as an int32 value
_KEY_BLOCK = 1 << 20


def check_percentile(detector: str, percentile, name: str = "percentile", upper_open: bool = False) -> float:
    """``percentile`` as a float in ``[0, 100]`` (or ``[0, 100)``), with a hint for a fraction."""
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not math.isfinite(percentile):
        raise ValueError(f"{detector}: {name} must be a number in percent (0 to 100), got {percentile!r}")
    percentile = float(percentile)
    if not 0.0 <= percentile <= 100.0 or (upper_open and percentile == 100.0):
        bound = "0 <= percentile < 100" if upper_open else "0 <= percentile <= 100"
        raise ValueError(f"{detector}: {name} is in percent and must satisfy {bound}, got {percentile:g}")
    if 0.0 < percentile < 1.0:
        warnings.warn(
            f"{detector}: {name}={percentile:g} is in percent (the {percentile:g}th percentile), not a fraction; "
            f"for the {100 * percentile:g}th percentile pass {name}={100 * percentile:g}.",
            UserWarning,
            stacklevel=3,
        )
    return percentile


def sortable_keys(values: Tensor) -> Tensor:
    """Keys ``[0, 2^32)`` of the float32 values, ordered like the values (``-0.0`` just below ``+0.0``),
    flattened; as int32 tensors holding the uint32 bit patterns (read them with :func:`key_halves`).

    Non-negative floats: the bit pattern grows with the value; setting the sign bit puts them above
    the negatives. Negative floats: the pattern grows with the magnitude; flipping every bit
    reverses that and clears the sign bit. One XOR with ``(bits >> 31) | sign`` does both.
    """
    bits = values.detach().to(torch.float32).contiguous().view(torch.int32).flatten()
    return bits ^ ((bits >> 31) | _SIGN_INT32)


def key_halves(keys: Tensor) -> tuple[Tensor, Tensor]:
    """The upper and lower 16 bits of :func:`sortable_keys` keys, each in ``[0, 65536)``."""
    return (keys >> _HALF) & _LOW_MASK, keys & _LOW_MASK


def _key_blocks(values: Tensor) -> Iterator[Tensor]:
    """:func:`sortable_keys` of ``values`` a million at a time (int32 temporaries of 4 MiB)."""
    flat = values.detach().reshape(-1)
    for start in range(0, flat.numel(), _KEY_BLOCK):
        yield sortable_keys(flat[start : start + _KEY_BLOCK])


def key_to_float(key: int) -> float:
    """The float32 value (as a Python float) whose :func:`sortable_keys` key is ``key``."""
    bits = key - _SIGN if key >= _SIGN else -1 - key
    return float(torch.tensor([bits], dtype=torch.int32).view(torch.float32)[0])


def lerp(a: float, b: float, t: float) -> float:
    """``a + t (b - a)`` computed as numpy's ``_lerp`` does for ``method="linear"`` (monotone at both ends)."""
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


class StreamingPercentile:
    """The exact ``percentile``-th percentile of a stream of float32 values, in two passes.

    Usage, with every value seen in both passes (in any order and batching)::

        sp = StreamingPercentile(90.0)
        for x in stream: sp.count(x)        # pass 1
        for x in stream: sp.refine(x)       # pass 2
        sp.result()                         # == np.percentile(all values as float64, 90)

    State: three ``int64`` histograms of 65,536 bins, whatever the number of values.
    """

    def __init__(self, percentile: float):
        self.percentile = float(percentile)
        self.n = 0
        self._high: Tensor | None = None  # [65536] counts by upper 16 bits
        self._targets: list[tuple[int, int]] | None = None  # (high bin, rank within bin) of each order statistic
        self._low: dict[int, Tensor | None] = {}  # high bin -> [65536] counts by lower 16 bits
        self._refined = 0  # values seen by refine

    def count(self, values: Tensor) -> None:
        """Pass 1: add ``values`` (any shape) to the histogram of upper key bits."""
        if self._targets is not None:
            raise RuntimeError("StreamingPercentile.count after refine: start a new StreamingPercentile")
        for keys in _key_blocks(values):
            counts = torch.bincount(key_halves(keys)[0], minlength=_BINS)
            self._high = counts if self._high is None else self._high.add_(counts.to(self._high.device))
            self.n += keys.numel()

    def _virtual_index(self) -> tuple[int, int, float]:
        h = (self.n - 1) * (self.percentile / 100.0)  # numpy: (n - 1) * quantile, quantile = q / 100
        below = math.floor(h)
        above = min(below + 1, self.n - 1)
        return below, above, h - below

    def _locate(self) -> None:
        if not self.n:
            raise ValueError("StreamingPercentile: no values were counted")
        cumulative = self._high.cumsum(0).cpu()
        targets = []
        for rank in self._virtual_index()[:2]:
            high = int(torch.searchsorted(cumulative, torch.tensor(rank), right=True))
            before = int(cumulative[high - 1]) if high else 0
            targets.append((high, rank - before))
        self._targets = targets
        self._low = {high: None for high, _ in targets}

    def refine(self, values: Tensor) -> None:
        """Pass 2: count the lower key bits of the values in the bins holding the order statistics."""
        if self._targets is None:
            self._locate()
        for keys in _key_blocks(values):
            upper, lower = key_halves(keys)
            for high in self._low:
                counts = torch.bincount(lower[upper == high], minlength=_BINS)
                current = self._low[high]
                self._low[high] = counts if current is None else current.add_(counts.to(current.device))
            self._refined += keys.numel()

    def result(self) -> float:
        """The percentile, as a float64 Python float (``np.percentile``'s linear method)."""
        if self._targets is None or self._refined != self.n:
            raise RuntimeError(
                f"StreamingPercentile: pass 2 saw {self._refined} values, pass 1 saw {self.n}; "
                "both passes must read the same values"
            )
        order_statistics = []
        for high, within in self._targets:
            cumulative = self._low[high].cumsum(0).cpu()
            low = int(torch.searchsorted(cumulative, torch.tensor(within), right=True))
            order_statistics.append(key_to_float((high << _HALF) | low))
        _, _, fraction = self._virtual_index()
        return lerp(order_statistics[0], order_statistics[1], fraction)


def linear_quantile(values: Tensor, quantile: float) -> float:
    """``np.quantile(values, quantile)`` (linear method) of all entries of an in-memory tensor, by two selections."""
    flat = values.flatten()
    h = (flat.numel() - 1) * quantile
    below = math.floor(h)
    above = min(below + 1, flat.numel() - 1)
    a = float(torch.kthvalue(flat, below + 1).values)
    b = float(torch.kthvalue(flat, above + 1).values) if above != below else a
    return lerp(a, b, h - below)


def energy(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``-logsumexp(x W^T + b)`` ``[B]``: the energy of the head's logits."""
    return -torch.logsumexp(features @ weight.T + bias, dim=1)


class ReAct(Detector):
    name = "react"
    summary = "Energy of the logits after clipping the features at a percentile of the training activations."
    paper = "https://arxiv.org/abs/2111.12797"
    default_grid = {"percentile": (80.0, 85.0, 90.0, 95.0, 99.0)}
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_k e^{(\min(x, c) W^\top + b)_k}",
        citation="Sun, Guo & Li, *ReAct: Out-of-distribution Detection With Rectified Activations*, NeurIPS 2021",
        reads="the features of the fit split (the clipping percentile) and the head",
        fails_when="Helps only when OOD inputs have abnormally large activations; it can hurt models with bounded features.",
    )
    inputs = ("features",)
    needs_head = True
    fit_passes = 2

    def __init__(self, percentile: float = 90.0):
        self.percentile = check_percentile(self.name, percentile)

    def _fit(self, data: FitData) -> None:
        streaming = StreamingPercentile(self.percentile)
        for batch in data:
            streaming.count(batch.features)
        for batch in data:
            streaming.refine(batch.features)
        self.threshold_ = streaming.result()
        self.head_weight_, self.head_bias_ = data.head

    def _score(self, batch: Batch) -> Tensor:
        clipped = batch.features.float().clamp(max=self.threshold_)
        return energy(clipped, self.head_weight_, self.head_bias_)
