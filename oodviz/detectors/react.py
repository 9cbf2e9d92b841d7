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
two streaming passes (more only for streams of billions of values that crowd one bin) and bounded
memory, by the radix selection of :class:`~oodviz.detectors.quantiles.ColumnQuantiles` over one column,
all the activations: pass 1 counts the upper 16 bits of float32 keys that sort like the values, pass 2
collects the keys in the (at most two) bins holding the order statistics that ``np.percentile``
interpolates between.

The result is ``np.percentile``'s default ("linear") definition: with the ``n`` values sorted,
``h = (n - 1) p / 100``, ``c = v[floor h] + (h - floor h) (v[floor h + 1] - v[floor h])``, the
interpolation done in float64 as numpy does it. It equals ``np.percentile`` of the float32
activations taken as float64 (the tests check it bit for bit). The one difference from
pytorch-ood: it calls ``np.percentile`` on the float32 array, which interpolates in float32, so
its threshold can differ from oodviz's by a float32 rounding (relative 6e-8). Activations of
other dtypes are rounded to float32 first (float64 features lose digits beyond float32's).

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`), each pass's state merges exactly
(counts add, collected keys concatenate) and the next pass is planned from the merged state, so the threshold
is the same exact percentile of all the shards' activations.

``percentile`` is in percent, 0 to 100 (90 in the paper), not a fraction as in pytorch-ood.

OpenOOD v1.5's ``react`` postprocessor computes this score (negated) at ``percentile = 90``, oodviz's default,
with ``np.percentile`` of all the activations flattened: ``openood_params`` is empty. Its automatic search tries
85, 90, 95 and 99 on the validation sets (the value behind a figure depends on the benchmark), and it takes the
threshold from the ID validation split (``id_loader_dict['val']``) where oodviz takes it from the fit data it is
given (``id_fit``).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.protocol import FitState
from oodviz.detectors.quantiles import ColumnQuantiles, lerp
from oodviz.detectors.teaching import Teaching


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
    fit_passes = 2  # more only for a stream that crowds one bin (oodviz.detectors.quantiles)

    def __init__(self, percentile: float = 90.0):
        self.percentile = check_percentile(self.name, percentile)

    mergeable = True

    def _new_parts(self, pass_index: int) -> dict:
        """The radix selection's pass: the first counts upper key bits, the next follows the merged plan."""
        return {"percentile": ColumnQuantiles([self.percentile / 100], self._plan if pass_index else None)}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        state.parts["percentile"].update(batch.features.reshape(-1, 1))

    def _finish_pass(self, state: FitState) -> bool:
        following = state.parts["percentile"].next_pass()
        self._plan = following.plan
        if not following.complete:
            return False
        self.threshold_ = float(following.result()[0, 0])
        self.head_weight_, self.head_bias_ = state.head
        self._plan = None
        return True

    def _score(self, batch: Batch) -> Tensor:
        clipped = batch.features.float().clamp(max=self.threshold_)
        return energy(clipped, self.head_weight_, self.head_bias_)
