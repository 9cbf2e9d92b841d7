"""Weighted energy score (WeightedEBO), as pytorch-ood 0.4's ``WeightedEBO``.

Du, Wang, Cai & Li, *VOS: Learning What You Don't Know by Virtual Outlier Synthesis*, ICLR 2022,
https://arxiv.org/abs/2202.01197 (eq. 5: the uncertainty loss's weighted energy)

With the logits ``f`` ``[B, C]`` and class weights ``w`` ``[C]`` (negative ones clipped to 0):

    score(x) = -log sum_k max(w_k, 0) exp(f_k(x))                                          [B]

the free energy of the logits with each class's term weighted, high for OOD inputs. VOS learns ``w`` while training
the network (pytorch-ood's ``VOSRegLoss``: a ``Linear(C, 1)`` whose ``weight`` is passed here as ``weights``, a list
of ``C`` numbers); oodviz, post-hoc, only scores with it. ``weights=None`` weights every class 1, which is the
energy score (:mod:`oodviz.detectors.energy`). Needs no fit.

Differences from pytorch-ood 0.4, on purpose: it sums ``exp(f_k)`` directly, which overflows to infinity for logits
above ~88 (float32) and gives ``-inf`` for all; here ``-logsumexp_k (f_k + log max(w_k, 0))``, the same value without
overflow (a clipped class adds ``exp(-inf) = 0``). Weights that are all zero or negative are refused (every score
would be ``+inf``).
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.teaching import Teaching


class WeightedEBO(Detector):
    name = "weightedebo"
    summary = "Free energy of the logits with per-class weights learned by VOS (all 1: the energy score)."
    paper = "https://arxiv.org/abs/2202.01197"
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_k \max(w_k, 0)\, e^{f_k(x)}",
        citation="Du et al., *VOS: Learning What You Don't Know by Virtual Outlier Synthesis*, ICLR 2022",
        reads="the logits and the class weights learned with VOS training (a parameter); nothing to fit",
        fails_when="Only as good as its weights: without VOS-trained weights it is the energy score, overconfidence and all.",
    )
    inputs = ("logits",)
    needs_fit = False
    in_defaults = False  # issue 29: not in the default run

    def __init__(self, weights: list[float] | None = None):
        if weights is not None:
            values = torch.as_tensor(weights, dtype=torch.float64)
            if values.ndim == 2 and values.shape[0] == 1:  # Linear(C, 1).weight, [1, C]
                values = values[0]
            if values.ndim != 1 or not len(values) or not torch.isfinite(values).all():
                raise ValueError(
                    "weightedebo: weights must be C finite numbers, one per class (e.g. VOS's Linear(C, 1).weight), "
                    f"got shape {tuple(values.shape)}"
                )
            if not (values > 0).any():
                raise ValueError("weightedebo: at least one of the weights must be positive (all scores would be +inf)")
            weights = values.tolist()
        self.weights = weights

    def _score(self, batch: Batch) -> Tensor:
        logits = batch.logits.float()
        if self.weights is None:
            return torch.logsumexp(logits, dim=1).neg_()
        if len(self.weights) != logits.shape[1]:
            raise ValueError(
                f"weightedebo: {len(self.weights)} weights for logits of {logits.shape[1]} classes; "
                "pass one weight per class."
            )
        log_weights = torch.tensor(self.weights, dtype=torch.float32, device=logits.device).clamp_(min=0).log_()
        return torch.logsumexp(logits + log_weights, dim=1).neg_()
