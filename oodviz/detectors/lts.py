"""LTS: logit scaling by each sample's activation-sum ratio, then the energy score.

Djurisic et al., *Logit Scaling for Out-of-Distribution Detection*, arXiv 2409.01175 (Machine Vision and
Applications 2025), https://arxiv.org/abs/2409.01175 (code: https://github.com/andrijazz/lts)

No statistics and no training data. Per sample, with features ``x`` ``[B, D]``, their ReLU ``a = max(x, 0)`` and
``p = percentile``: ``s1 = sum_d a_d`` is the sum of all activations and ``s2`` the sum of the
``k = D - round(D p / 100)`` largest, and

    S(x) = (s1 / s2)^2                                                                      [B]
    score(x) = -logsumexp_k ( S(x) (x W^T + b)_k )                                          [B]

with the head ``(W [C, D], b [C])``: the energy of the logits scaled by ``S``, high for OOD inputs. Unlike SCALE
(:mod:`oodviz.detectors.scale`) the logits, not the features, are scaled, and by the squared ratio. The
percentile is in percent like SCALE's and ASH's: 95 (the paper's and pytorch-ood's ``p = 0.05``, the fraction of
activations kept, is ``1 - percentile / 100``).

As the authors' code and pytorch-ood 0.4's ``LTS``: the ReLU is applied for ``S`` only (the paper does not
mention it; it matters only for features that can be negative), the head reads ``x`` itself. Deviation, on
purpose: a sample whose kept activations sum to 0 (every activation 0; ``0 / 0`` there) gets ``S = 1``.
``fit(batches, head=...)`` only stores the head, reading the first in-distribution batch to check its width.

Its fit keeps the head only: nothing to split over ranks (every rank fits it on the whole store at no cost).
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.ash import check_kept, store_head
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.react import check_percentile
from oodviz.detectors.teaching import Teaching


class LTS(Detector):
    name = "lts"
    summary = "Energy of the logits scaled by the squared ratio of all to the top activations of each sample."
    paper = "https://arxiv.org/abs/2409.01175"
    default_grid = {"percentile": (65.0, 70.0, 75.0, 80.0, 85.0, 90.0, 95.0)}
    score_params = ("percentile",)
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_k e^{(s_1/s_2)^2 (x W^\top + b)_k},\quad s_1 = \sum_d a_d,\quad a = \max(x, 0)",
        citation="Djurisic et al., *Logit Scaling for Out-of-Distribution Detection*, Machine Vision and Applications 2025",
        reads="the features and the head; no training data",
        fails_when="The activation-sum ratio says little for features that are not post-ReLU or for low-dimensional features.",
    )
    inputs = ("features",)
    needs_head = True
    in_defaults = False  # issue 29: not in the default run

    def __init__(self, percentile: float = 95.0):
        self.percentile = check_percentile(self.name, percentile, upper_open=True)

    def _fit(self, data: FitData) -> None:
        store_head(self, data)

    def scale_factor(self, features: Tensor) -> Tensor:
        """``S = (s1 / s2)^2`` ``[B]`` (float32) of features ``[B, D]``; 1 where no activation is positive."""
        activations = features.float().relu()
        k = check_kept(self.name, activations.shape[1], self.percentile)
        kept_sum = torch.topk(activations, k, dim=1).values.sum(dim=1)  # ties do not change the sum
        ratio = activations.sum(dim=1) / torch.where(kept_sum > 0, kept_sum, 1.0)
        return torch.where(kept_sum > 0, ratio, 1.0).square()

    def _score(self, batch: Batch) -> Tensor:
        x = batch.features.float()
        logits = torch.addmm(self.head_bias_, x, self.head_weight_.T)
        return torch.logsumexp(logits * self.scale_factor(x)[:, None], dim=1).neg_()
