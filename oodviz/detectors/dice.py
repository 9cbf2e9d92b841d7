"""DICE: directed sparsification of the last layer, then the energy score.

Sun & Li, *DICE: Leveraging Sparsification for Out-of-Distribution Detection*, ECCV 2022,
https://arxiv.org/abs/2111.09805

Fit, one streaming pass (a float64 sum that merges across shards,
:class:`~oodviz.detectors.dice.FeatureMeanFit`): the mean in-distribution feature ``m = 1/N sum_i x_i`` ``[D]``
(float64). With the head ``(W [C, D], b [C])``, the contribution of each weight is

    V = m ⊙ W,   V_kd = m_d W_kd                                   [C, D]

and DICE keeps the weights whose contribution is strictly above the ``100 * sparsity``-th
percentile ``t`` of all ``C * D`` entries of ``V`` (``np.percentile``'s linear definition, as
the paper's code does), zeroing the others: ``W' = W ⊙ [V > t]``, about ``(1 - sparsity) C D``
weights. Score, with features ``x`` ``[B, D]``:

    score(x) = -logsumexp_k ( x W'^T + b )_k

the energy of the sparsified logits (the paper's confidence is the negative energy; higher =
more OOD). The paper's code and pytorch-ood 0.4 form ``x[:, None, :] * W'`` (``B x C x D``) and
sum it; oodviz uses the matrix product, which is the same number without the ``B x C x D``
tensor. ``V`` and ``t`` are computed in float64 (pytorch-ood: float32 and ``torch.quantile``),
so an entry within a float32 rounding of ``t`` may fall on the other side of it.

``sparsity`` is a fraction in ``[0, 1)``; the default 0.9 is OpenOOD v1.5's ``p = 90``. DICE
assumes non-negative (post-ReLU) features, as the paper's networks produce.

OpenOOD v1.5's ``dice`` postprocessor computes this score (negated) at ``p = 90``, oodviz's default, with the
mean feature of the training split and no automatic search: ``openood_params`` is empty.
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.protocol import FitState, Sums
from oodviz.detectors.react import energy, linear_quantile
from oodviz.detectors.stats import ACCUMULATE, Scratch, row_blocks
from oodviz.detectors.teaching import Teaching


class FeatureMeanFit(Detector):
    """Base of the detectors whose fit is the mean in-distribution feature ``[D]`` (float64) and the head (dice,
    fdbd, nci): one streaming pass of a float64 feature sum, which merges across shards by addition (the state
    protocol, :mod:`oodviz.detectors.protocol`). Subclasses implement :meth:`_fit_mean`."""

    mergeable = True

    def _new_parts(self, pass_index: int) -> dict:
        return {"feature_sum": Sums()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        if getattr(self, "_scratch", None) is None:
            self._scratch = Scratch()
        x = batch.features
        for block in row_blocks(len(x), x.shape[1]):  # float64 copies a block of rows at a time
            state.parts["feature_sum"].add(self._scratch.as_dtype("rows", x[block], ACCUMULATE).sum(dim=0))

    def _finish_pass(self, state: FitState) -> bool:
        self._scratch = None
        self._fit_mean(state.parts["feature_sum"].value / state.rows, state.head)
        return True

    def _fit_mean(self, mean: Tensor, head: tuple[Tensor, Tensor]) -> None:
        """Set the fitted state from the mean feature ``[D]`` (float64) and the head on the fit device."""
        raise NotImplementedError


class DICE(FeatureMeanFit):
    name = "dice"
    fitted_shapes = {**FeatureMeanFit.fitted_shapes, "masked_weight_": "CD"}
    summary = "Energy of the logits after zeroing the head weights with the smallest mean contribution."
    paper = "https://arxiv.org/abs/2111.09805"
    default_grid = {"sparsity": (0.5, 0.7, 0.9)}
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_k e^{(x (W \odot M)^\top + b)_k},\quad M = [\bar x \odot W > t]",
        citation="Sun & Li, *DICE: Leveraging Sparsification for Out-of-Distribution Detection*, ECCV 2022",
        reads="the features of the fit split (mean contribution per weight) and the head",
        fails_when="Zeroing weights costs in-distribution accuracy signal when the head is already sparse or small.",
    )
    inputs = ("features",)
    needs_head = True

    def __init__(self, sparsity: float = 0.9):
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
            hint = (
                f"; use {sparsity / 100:g} for {sparsity:g}%"
                if isinstance(sparsity, (int, float)) and not isinstance(sparsity, bool) and 1.0 <= sparsity < 100.0
                else ""
            )
            raise ValueError(
                f"dice: sparsity is the fraction of head weights to drop and must satisfy 0 <= sparsity < 1, "
                f"got {sparsity!r}{hint}"
            )
        self.sparsity = float(sparsity)

    def _fit_mean(self, mean: Tensor, head: tuple[Tensor, Tensor]) -> None:
        weight, bias = head
        contribution = mean[None, :] * weight.to(ACCUMULATE)  # [C, D] float64
        threshold = linear_quantile(contribution, self.sparsity)
        keep = contribution > threshold
        if not bool(keep.any()):
            raise ValueError(
                f"dice: sparsity={self.sparsity:g} keeps no weight: no contribution m_d W_kd lies above its "
                f"{100 * self.sparsity:g}th percentile ({threshold:g}); lower sparsity, or check that the features "
                "are not all zero."
            )
        self.feature_mean_ = mean
        self.threshold_ = threshold
        self.masked_weight_ = torch.where(keep, weight, torch.zeros((), dtype=weight.dtype, device=weight.device))
        self.head_bias_ = bias

    def _score(self, batch: Batch) -> Tensor:
        return energy(batch.features.float(), self.masked_weight_, self.head_bias_)
