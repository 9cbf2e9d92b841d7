"""NCI: the neural-collapse inspired detector (proximity to the class weight vector, plus the feature norm).

Liu & Qin, *Detecting Out-of-Distribution Through the Lens of Neural Collapse*, CVPR 2025,
https://arxiv.org/abs/2311.01479 (code: https://github.com/litianliu/NCI-OOD, in OpenOOD v1.5)

Fit, one streaming pass (a float64 sum that merges across shards,
:class:`~oodviz.detectors.dice.FeatureMeanFit`): the global mean in-distribution feature ``mu_G`` ``[D]`` (float64).
With the head ``(W [C, D], b [C])`` and the predicted class ``c = argmax_k (x W^T + b)_k``:

    pScore(x) = (x - mu_G) . w_c / ||x - mu_G||        proximity of the centred feature to w_c
    NCI(x)    = pScore(x) + alpha ||x||_1              plus the L1 norm, which filters OOD near the origin

Under neural collapse, centred in-distribution features align with their class's weight vector
and lie far from the origin, so NCI is high for in-distribution inputs and the score is the
negation (higher = more OOD):

    score(x) = -pScore(x) - alpha ||x||_1

Shapes: ``x`` ``[B, D]``; ``w_c`` is gathered per sample, ``[B, D]``. The formula is that of the
authors' code (OpenOOD's NCI postprocessor) and pytorch-ood 0.4: ``||w_c||`` is not divided
out of the proximity. ``alpha >= 0`` is tuned on held-out ID and OOD data in the paper;
the default ``1e-4`` is the authors' OpenOOD default (pytorch-ood's default is 0, the pure
proximity). As for fDBD, ``||x - mu_G||`` is floored at 1e-8 so a sample exactly at the mean
does not divide by zero (pytorch-ood returns NaN there).

OpenOOD v1.5's ``nci`` postprocessor computes this score (negated) at ``alpha = 1e-4``, oodviz's default:
``openood_params`` is empty. Its automatic search tries ``alpha`` in 1e-4, 1e-3, 0.01, 0.1 on the validation
sets (the value behind a figure depends on the benchmark).
"""

import math

from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.dice import FeatureMeanFit
from oodviz.detectors.fdbd import MIN_DISTANCE
from oodviz.detectors.teaching import Teaching


class NCI(FeatureMeanFit):
    name = "nci"
    summary = "Alignment of the centred features with the predicted class's weights, plus alpha * L1 norm (negated)."
    paper = "https://arxiv.org/abs/2311.01479"
    default_grid = {"alpha": (0.0001, 0.001, 0.01, 0.1)}
    score_params = ("alpha",)
    teaching = Teaching(
        formula=r"s(x) = -\Big(\frac{(x - \mu_G) \cdot w_c}{\|x - \mu_G\|} + \alpha \|x\|_1\Big)",
        citation="Liu & Qin, *Detecting Out-of-Distribution Through the Lens of Neural Collapse*, CVPR 2025",
        reads="the features of the fit split (their mean) and the head",
        fails_when="Relies on neural collapse; a model trained briefly or with few epochs has not collapsed and the score weakens.",
    )
    inputs = ("features",)
    needs_head = True

    def __init__(self, alpha: float = 1e-4):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"nci: alpha (weight of the feature L1 norm) must be a finite number >= 0, got {alpha!r}")
        self.alpha = float(alpha)

    def _fit_mean(self, mean: Tensor, head: tuple[Tensor, Tensor]) -> None:
        self.feature_mean_ = mean.float()
        self.head_weight_, self.head_bias_ = head

    def proximity(self, features: Tensor) -> Tensor:
        """``pScore`` ``[B]``: ``(x - mu_G) . w_c / ||x - mu_G||`` for the predicted class ``c``."""
        x = features.float()
        predicted = (x @ self.head_weight_.T + self.head_bias_).argmax(dim=1)
        centred = x - self.feature_mean_
        return (centred * self.head_weight_[predicted]).sum(dim=1) / centred.norm(dim=1).clamp(min=MIN_DISTANCE)

    def _score(self, batch: Batch) -> Tensor:
        x = batch.features.float()
        score = -self.proximity(x)
        if self.alpha:
            score = score - self.alpha * x.abs().sum(dim=1)
        return score
