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
statistics exactly in two streaming passes (more only when very many values crowd the bins holding them)
and bounded memory, the radix selection react's percentile uses
(:class:`~oodviz.detectors.quantiles.ColumnQuantiles`, one column per unit): pass 1 counts the upper ``b``
bits of float32 keys that sort like the values per unit (``D x 2^b`` counts, about a million), pass 2
collects the keys in the bins holding each wanted order statistic and selects them. Percentiles are then
interpolated as numpy's ``linear`` method does, in float64, and kept as float32 (pytorch-ood interpolates in
float32: the thresholds agree to a float32 rounding).

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`), each pass's counts add and its
collected keys concatenate, and the next pass is planned from the merged state: the thresholds are the exact
percentiles of all the shards' rows, as react's.

``lower_percentile`` and ``upper_percentile`` are in percent, 0 to 100 (pytorch-ood's fractions times
100).

OpenOOD v1.5's ``vra`` postprocessor clips the same way (``feature.clip(min=lo, max=hi)``, then the energy) but
with two **global** thresholds, ``np.percentile`` of all ``N x D`` activations flattened (as react's
threshold), at ``percentile_low = 10`` and ``percentile_high = 90``: every unit is clipped to the same range.
``thresholds="global"`` computes them (the radix selection over one column, all the activations, as react's;
the thresholds are kept as ``[D]`` vectors of one value); ``thresholds="per_unit"`` (the default) is the per-unit
form above. ``openood_params = {"thresholds": "global", "lower_percentile": 10.0, "upper_percentile": 90.0}``
(``protocol = "openood"``). OpenOOD's automatic search tries ``percentile_high`` in 85, 90, 95, 99 and
``percentile_low`` in 1, 5, 10, 15 on the validation sets, and it fits on the ID validation split
(``id_loader_dict['val']``) where oodviz fits on the fit data it is given (``id_fit``).
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.protocol import FitState
from oodviz.detectors.quantiles import COLLECT_LIMIT, FIRST_COUNTS, ColumnQuantiles
from oodviz.detectors.react import check_percentile, energy
from oodviz.detectors.teaching import Teaching

#: ``VRA.thresholds``'s values: a lower and upper percentile per unit, or one pair over all activations (OpenOOD v1.5)
THRESHOLDS = ("per_unit", "global")


class VRA(Detector):
    name = "vra"
    fitted_shapes = {**Detector.fitted_shapes, "lower_threshold_": "D", "upper_threshold_": "D"}
    summary = "Energy of the logits after clipping each feature unit between two percentiles of its training values."
    paper = "https://arxiv.org/abs/2302.11716"
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_k e^{(\bar x W^\top + b)_k},\quad \bar x = \operatorname{clip}(x, \ell, h),\quad \ell, h = \text{per-unit percentiles}",
        citation="Xu, Lian, Liu & Tao, *VRA: Variational Rectified Activation for Out-of-distribution Detection*, NeurIPS 2023",
        reads="the features of the fit split (a lower and an upper percentile per unit) and the head",
        fails_when="Helps only when OOD activations are abnormally low or high per unit; OOD inputs inside the ID ranges keep their energy.",
    )
    inputs = ("features",)
    needs_head = True
    fit_passes = 2  # more only when many values crowd a bin (oodviz.detectors.quantiles)
    mergeable = True
    in_defaults = False  # the default list is issue 17's per-backbone choice
    param_choices = {"thresholds": THRESHOLDS}
    openood_params = {"thresholds": "global", "lower_percentile": 10.0, "upper_percentile": 90.0}

    def __init__(self, lower_percentile: float = 1.0, upper_percentile: float = 99.0, thresholds: str = "per_unit"):
        if thresholds not in THRESHOLDS:
            raise ValueError(
                f"vra: thresholds must be 'per_unit' (percentiles of each unit) or 'global' (of all activations, "
                f"OpenOOD v1.5's), got {thresholds!r}"
            )
        self.thresholds = thresholds
        self.lower_percentile = check_percentile(self.name, lower_percentile, "lower_percentile")
        self.upper_percentile = check_percentile(self.name, upper_percentile, "upper_percentile")
        if self.lower_percentile > self.upper_percentile:
            raise ValueError(
                f"vra: lower_percentile={self.lower_percentile:g} exceeds upper_percentile={self.upper_percentile:g}; "
                "the lower clip must be at or below the upper one."
            )

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """``8 x (4 x max(2^20, 1024 D) + 2 x 2^22 + C x D + C)``: a pass's counts, smallest and largest keys per bin
        and cumulative counts (int64; about a million bins in the first pass, ``4 x D x 256`` in a refining one),
        the keys the collecting pass keeps and sorts, and the head."""
        bins = max(FIRST_COUNTS, 1024 * n_features)
        return 8 * (4 * bins + 2 * COLLECT_LIMIT + n_classes * n_features + n_classes)

    def _new_parts(self, pass_index: int) -> dict:
        """The radix selection's pass: the first counts upper key bits per unit, the next follows the merged plan."""
        quantiles = [self.lower_percentile / 100, self.upper_percentile / 100]
        return {"thresholds": ColumnQuantiles(quantiles, self._plan if pass_index else None)}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        features = batch.features
        state.parts["thresholds"].update(features.reshape(-1, 1) if self.thresholds == "global" else features)

    def _finish_pass(self, state: FitState) -> bool:
        following = state.parts["thresholds"].next_pass()
        self._plan = following.plan
        if not following.complete:
            return False
        lower, upper = following.result().float()  # [D] each, or [1] for global thresholds
        if self.thresholds == "global":
            lower, upper = (t.expand(state.n_features).contiguous() for t in (lower, upper))
        self.lower_threshold_, self.upper_threshold_ = lower.to(state.device), upper.to(state.device)  # [D] each
        self.head_weight_, self.head_bias_ = state.head
        self._plan = None
        return True

    def _score(self, batch: Batch) -> Tensor:
        clipped = torch.clamp(batch.features.float(), min=self.lower_threshold_, max=self.upper_threshold_)
        return energy(clipped, self.head_weight_, self.head_bias_)
