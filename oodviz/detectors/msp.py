"""Maximum softmax probability (MSP).

Hendrycks & Gimpel, *A Baseline for Detecting Misclassified and Out-of-Distribution Examples
in Neural Networks*, ICLR 2017, https://arxiv.org/abs/1610.02136

    score(x) = -max_k softmax(z(x))_k

``z`` are the logits ``[B, C]``; the paper's confidence is negated so that higher = more OOD.
Scores lie in ``[-1, -1/C]``. Needs no fit.

OpenOOD v1.5's ``msp`` postprocessor (its ``BasePostprocessor``) computes this score (negated), with no
parameter: ``openood_params`` is empty.
"""

from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.teaching import Teaching


class MaxSoftmax(Detector):
    name = "msp"
    summary = "Negative maximum softmax probability: the classic baseline."
    paper = "https://arxiv.org/abs/1610.02136"
    teaching = Teaching(
        formula=r"s(x) = -\max_k \operatorname{softmax}(z(x))_k",
        citation="Hendrycks & Gimpel, *A Baseline for Detecting Misclassified and Out-of-Distribution Examples in Neural Networks*, ICLR 2017",
        reads="the logits; nothing to fit",
        fails_when="Overconfident networks give OOD inputs high softmax confidence, so far-OOD images can look certain.",
    )
    inputs = ("logits",)
    needs_fit = False

    def _score(self, batch: Batch) -> Tensor:
        return -batch.logits.float().softmax(dim=1).amax(dim=1)
