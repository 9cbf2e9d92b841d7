"""Predictive entropy.

Shannon entropy of the softmax, the uncertainty baseline used e.g. by Hendrycks & Gimpel
(ICLR 2017, https://arxiv.org/abs/1610.02136) and in pytorch-ood and OpenOOD:

    score(x) = H(p) = -sum_k p_k log p_k,   p = softmax(z)

``z`` are the logits ``[B, C]``; ``log p`` comes from ``log_softmax`` (no clipping of ``p`` as in
pytorch-ood), so tiny entropies of confident predictions stay distinct instead of rounding to 0. Higher = more uncertain = more OOD. Needs no fit.
"""

from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.teaching import Teaching


class Entropy(Detector):
    name = "entropy"
    summary = "Entropy of the softmax: how spread out the prediction is."
    paper = "https://arxiv.org/abs/1610.02136"
    teaching = Teaching(
        formula=r"s(x) = -\sum_k p_k \log p_k,\quad p = \operatorname{softmax}(z(x))",
        citation="Hendrycks & Gimpel, *A Baseline for Detecting Misclassified and Out-of-Distribution Examples in Neural Networks*, ICLR 2017",
        reads="the logits; nothing to fit",
        fails_when="Confuses ambiguous in-distribution images (between two classes) with OOD ones.",
    )
    inputs = ("logits",)
    needs_fit = False

    def _score(self, batch: Batch) -> Tensor:
        log_p = batch.logits.float().log_softmax(dim=1)
        return -(log_p.exp() * log_p).sum(dim=1)
