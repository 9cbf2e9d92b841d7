"""Maximum logit.

Hendrycks et al., *Scaling Out-of-Distribution Detection for Real-World Settings*, ICML 2022,
https://arxiv.org/abs/1911.11132

    score(x) = -max_k z_k(x)

``z`` are the logits ``[B, C]``; higher = more OOD. Needs no fit.

OpenOOD v1.5's ``mls`` postprocessor computes this score (negated), with no parameter: ``openood_params`` is
empty.
"""

from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.teaching import Teaching


class MaxLogit(Detector):
    name = "maxlogit"
    summary = "Negative maximum logit: like MSP without the softmax's saturation."
    paper = "https://arxiv.org/abs/1911.11132"
    teaching = Teaching(
        formula=r"s(x) = -\max_k z_k(x)",
        citation="Hendrycks et al., *Scaling Out-of-Distribution Detection for Real-World Settings*, ICML 2022",
        reads="the logits; nothing to fit",
        fails_when="Logit scale varies per class and per input norm, so it is weak when OOD inputs have large activations.",
    )
    inputs = ("logits",)
    needs_fit = False

    def _score(self, batch: Batch) -> Tensor:
        return -batch.logits.float().amax(dim=1)
