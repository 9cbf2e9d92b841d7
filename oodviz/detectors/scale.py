"""SCALE: scale each sample's features by its activation-sum ratio, then the energy score.

Xu, Chen, Franchi & Yao, *Scaling for Training Time and Post-hoc Out-of-distribution Detection
Enhancement*, ICLR 2024, https://arxiv.org/abs/2310.00227

No statistics are fitted. Per sample, with features ``x`` ``[B, D]`` and ``p = percentile``:
``s1`` is the sum of all ``D`` activations and ``s2`` the sum of the ``k = D - round(D p / 100)``
largest (those that ASH would keep), and

    r(x) = s1 / s2
    score(x) = -logsumexp_k ( exp(r(x)) x W^T + b )_k

with the head ``(W [C, D], b [C])``: the energy of the logits of the *whole* feature vector
scaled by ``exp(r)``. Unlike ASH-S nothing is pruned: the paper argues that pruning is what
hurts, and keeps only ASH's scaling. The paper's confidence is the negative energy; the energy is the OOD score
(higher = more OOD). This is the paper's definition (applied after the final pooling, as
here), its code (``scale``) and pytorch-ood 0.4's ``scale`` function, whose percentile is a
fraction (default 0.65); oodviz's is in percent, 85 by default (OpenOOD v1.5's setting).

Deviations, both outside the method's assumption of non-negative (post-ReLU) features: where
``s2 <= 0`` the factor is set to 1 instead of ``exp(s1 / s2)`` (for non-negative features this
is an all-zero sample, on which the factor has no effect); and the scaled logits are formed in
float64 (``exp(r) (x W^T) + b``), a score beyond the float32 range raising a ValueError. For
``s2 > 0`` the factor is at most ``exp(D / k)`` (the top-k mean is at least the overall mean).
``fit(batches, head=...)`` only stores the head, reading the first in-distribution batch to
check its width and settle the device.

Its fit keeps the head only: nothing to split over ranks (every rank fits it on the whole store at no cost).

OpenOOD v1.5's ``scale`` postprocessor computes this score (negated) at ``percentile = 85``, oodviz's default:
``openood_params`` is empty. Its automatic search tries 65 to 95 in steps of 5 on the validation sets (the
value behind a figure depends on the benchmark).
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.ash import check_kept, log_scale, scaled_energy, store_head
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.react import check_percentile
from oodviz.detectors.teaching import Teaching


class SCALE(Detector):
    name = "scale"
    summary = "Energy of the features scaled by exp(sum of all / sum of the top activations) of each sample."
    paper = "https://arxiv.org/abs/2310.00227"
    default_grid = {"percentile": (65.0, 70.0, 75.0, 80.0, 85.0, 90.0, 95.0)}
    score_params = ("percentile",)
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_k e^{(e^{s_1/s_2} x W^\top + b)_k}",
        citation="Xu et al., *Scaling for Training Time and Post-hoc Out-of-distribution Detection Enhancement*, ICLR 2024",
        reads="the features and the head; nothing to fit",
        fails_when="Relies on the activation-sum ratio of non-negative features; signed or low-dimensional features break it.",
    )
    inputs = ("features",)
    needs_head = True

    def __init__(self, percentile: float = 85.0):
        self.percentile = check_percentile(self.name, percentile, upper_open=True)

    def _fit(self, data: FitData) -> None:
        store_head(self, data)

    def log_factor(self, features: Tensor) -> Tensor:
        """``r = s1 / s2`` ``[B]`` (float64), the log of each sample's scaling factor."""
        x = features.float()
        k = check_kept(self.name, x.shape[1], self.percentile)
        kept_sum = torch.topk(x, k, dim=1).values.sum(dim=1)  # ties do not change the sum
        return log_scale(x.sum(dim=1), kept_sum)

    def _score(self, batch: Batch) -> Tensor:
        x = batch.features.float()
        return scaled_energy(x, self.log_factor(x), self.head_weight_, self.head_bias_, self.name)
