"""Maximum logit.

Hendrycks et al., *Scaling Out-of-Distribution Detection for Real-World Settings*, ICML 2022,
https://arxiv.org/abs/1911.11132

    score(x) = -max_k z_k(x)

``z`` are the logits ``[B, C]``; higher = more OOD. Needs no fit.
"""

from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector


class MaxLogit(Detector):
    name = "maxlogit"
    summary = "Negative maximum logit: like MSP without the softmax's saturation."
    paper = "https://arxiv.org/abs/1911.11132"
    inputs = ("logits",)
    needs_fit = False

    def _score(self, batch: Batch) -> Tensor:
        return -batch.logits.float().amax(dim=1)
