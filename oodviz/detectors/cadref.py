"""CADRef: class-aware decoupled relative feature error, weighted by a logit score.

Ling et al., *CADRef: Robust Out-of-Distribution Detection via Class-Aware Decoupled Relative Feature Leveraging*,
CVPR 2025, https://arxiv.org/abs/2503.00325 (code: https://github.com/LingAndZero/CADRef)

CARef's relative error (:mod:`oodviz.detectors.caref`: class means ``mu_c`` ``[C, D]`` of the fit rows grouped by
the predicted class ``c = argmax_k z_k(x)``) split by the sign of the predicted class's head weights
``s = sign(w_c)`` ``[B, D]``: the part of ``x - mu_c`` that raises the predicted logit and the part that lowers it,

    E+(x) = |max((x - mu_c) * s, 0)|_1 / |x|_1        E-(x) = |max(-(x - mu_c) * s, 0)|_1 / |x|_1      [B]

and the score (higher = more OOD; the paper's confidence is its negative)

    score(x) = E+(x) / S(x) + E-(x) / mean_i S(x_i)                                       [B]

where ``S`` ``[B]`` is a logit-based confidence of the input (``logit_score``: ``"energy"``, ``logsumexp_k z_k``,
the paper's default; ``"maxlogit"``, ``max_k z_k``; ``"msp"``, ``max_k softmax(z)_k``) and ``mean_i S(x_i)`` its
mean over the fit rows. Fit, one streaming pass: CARef's per-class sums and the sum of ``S`` over the rows.
The logits are the batch's own when it carries them, else ``x W^T + b`` from the head. A weight of exactly 0 puts its
feature in neither part, as in the authors' code.

Differences from the authors' code, on purpose: a class that no fit row is predicted as is refused at fit (see
caref); ``|x|_1`` is floored at 1e-8; their GEN option (``1 / G`` over the top ``max(10, C // 10)``
probabilities) is not offered. Like theirs, the score assumes ``S > 0``: fit refuses a mean ``S`` that is not
positive (energy or max logit of a head whose logits are mostly negative; ``"msp"`` is always positive), while a
single input with ``S(x) <= 0`` gets its ``E+`` term negated or infinite, as in the paper's formula.

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`): the per-class counts and sums and the sum
of ``S`` merge by addition.
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.caref import CARef
from oodviz.detectors.protocol import FitState, Sums
from oodviz.detectors.stats import ACCUMULATE, ClassMeans
from oodviz.detectors.teaching import Teaching
from oodviz.detectors.vim import batch_logits

LOGIT_SCORES = ("energy", "maxlogit", "msp")


def logit_confidence(logits: Tensor, kind: str) -> Tensor:
    """``S(z)`` ``[B]`` (float64) of logits ``z`` ``[B, C]``: ``logsumexp`` (energy), the maximum logit, or the
    maximum softmax probability (msp)."""
    z = logits.to(ACCUMULATE)
    if kind == "energy":
        return torch.logsumexp(z, dim=1)
    if kind == "maxlogit":
        return z.amax(dim=1)
    return (z.amax(dim=1) - torch.logsumexp(z, dim=1)).exp_()


class CADRef(CARef):
    name = "cadref"
    summary = "CARef's error split by the sign of the predicted class's weights, each part over a logit score."
    teaching = Teaching(
        formula=(
            r"s(x) = \frac{E^{+}(x)}{S(x)} + \frac{E^{-}(x)}{\bar S},"
            r"\quad E^{\pm}(x) = \frac{\| \max(\pm (x - \mu_c) \odot \mathrm{sign}(w_c), 0) \|_1}{\| x \|_1},"
            r"\quad S(x) = \log \sum_k e^{z_k(x)}"
        ),
        citation=CARef.teaching.citation,
        reads="the features of the fit split (mean feature per predicted class, mean logit score) and the head",
        fails_when="Needs a positive logit score: with energy or max logit on mostly negative logits it breaks down.",
    )
    param_choices = {"logit_score": LOGIT_SCORES}

    def __init__(self, logit_score: str = "energy"):
        if logit_score not in LOGIT_SCORES:
            raise ValueError(f"cadref: logit_score must be one of {', '.join(LOGIT_SCORES)}, got {logit_score!r}")
        self.logit_score = logit_score

    def _new_parts(self, pass_index: int) -> dict:
        return {"class_sums": ClassMeans(), "logit_score_sum": Sums()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        super()._update_state(state, batch)
        confidence = logit_confidence(batch_logits(batch, *state.head), self.logit_score)
        state.parts["logit_score_sum"].add(confidence.sum())

    def _finish_pass(self, state: FitState) -> bool:
        mean_confidence = float(state.parts["logit_score_sum"].value) / state.rows
        if not mean_confidence > 0:
            raise ValueError(
                f"cadref: the mean {self.logit_score} logit score of the fit data is {mean_confidence:.4g}, not "
                "positive, so it cannot weight the errors; use logit_score='msp' (always positive)."
            )
        self.mean_logit_score_ = mean_confidence
        return super()._finish_pass(state)

    def _score(self, batch: Batch) -> Tensor:
        offsets, predicted, logits = self.relative_offsets(batch)
        signed = offsets.mul_(self.head_weight_[predicted].sign())  # (x - mu_c) * sign(w_c) / |x|_1
        raising = signed.clamp(min=0).sum(dim=1)  # E+
        lowering = signed.clamp_(max=0).sum(dim=1).neg_()  # E-
        return raising / logit_confidence(logits, self.logit_score) + lowering / self.mean_logit_score_
