"""Predictive entropy.

Shannon entropy of the softmax, the uncertainty baseline used e.g. by Hendrycks & Gimpel
(ICLR 2017, https://arxiv.org/abs/1610.02136) and in pytorch-ood and OpenOOD:

    score(x) = H(p) = -sum_k p_k log p_k = logsumexp(z) - sum_k p_k z_k,   p = softmax(z)

``z`` are the logits ``[B, C]``; computed from the logits directly (no clipping of ``p``), so
it is exact for saturated softmaxes. Higher = more uncertain = more OOD. Needs no fit.
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector


class Entropy(Detector):
    name = "entropy"
    summary = "Entropy of the softmax: how spread out the prediction is."
    paper = "https://arxiv.org/abs/1610.02136"
    inputs = ("logits",)
    needs_fit = False

    def _score(self, batch: Batch) -> Tensor:
        z = batch.logits.float()
        p = z.softmax(dim=1)
        return (torch.logsumexp(z, dim=1) - (p * z).sum(dim=1)).clamp(min=0)
