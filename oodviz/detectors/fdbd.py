"""fDBD: feature distance to the decision boundaries, relative to the distance to the mean.

Liu & Qin, *Fast Decision Boundary based Out-of-Distribution Detector*, ICML 2024,
https://arxiv.org/abs/2312.11536

Fit, one streaming pass (a float64 sum that merges across shards,
:class:`~oodviz.detectors.dice.FeatureMeanFit`): the mean in-distribution feature ``mu`` ``[D]`` (float64). With the
head ``(W [C, D], b [C])``, logits ``z = x W^T + b`` and the predicted class
``c = argmax_k z_k``, the distance of features ``x`` to the decision boundary between ``c``
and class ``j`` is ``|z_c - z_j| / ||w_c - w_j||``, and

    fDBD(x) = 1/(C - 1) sum_{j != c} |z_c - z_j| / ||w_c - w_j||  /  ||x - mu||

the average boundary distance, regularised by the distance to the mean. In-distribution
inputs lie far from the boundaries, so the score is the negation (higher = more OOD):

    score(x) = -fDBD(x)

Shapes: ``x`` ``[B, D]``, ``z`` ``[B, C]``. The pairwise norms come from the Gram matrix,
``||w_c - w_j||^2 = ||w_c||^2 + ||w_j||^2 - 2 w_c . w_j``, computed in float64 block by block at
fit time and stored as their inverses ``[C, C]`` (float32, zero diagonal); no ``C x C x D`` tensor
is formed, in fit or score. Scoring gathers the predicted class's row, ``[B, C]``.

The paper averages over the ``C - 1`` other classes; the authors' code sums (a constant factor
``C - 1``, the same ranking); pytorch-ood 0.4 averages, as oodviz does. Two classes with the
same weight vector have no boundary: fit raises a ValueError rather than dividing by zero. As
in pytorch-ood, ``||x - mu||`` is floored at 1e-8 (a sample exactly at the mean would otherwise
score ``-inf``). Logits are computed from the features through the head, not read from the
batch.

OpenOOD v1.5's ``fdbd`` postprocessor (the authors' code: the sum over classes, not the mean, the same ranking)
defaults to ``distance_as_normalizer: True``, the ``||x - mu||`` above, so ``openood_params`` is empty; its
automatic search also tries the feature norm ``||x||`` as the normaliser, which oodviz does not offer, so a figure
tuned to that normaliser is not reproduced here.
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.dice import FeatureMeanFit
from oodviz.detectors.stats import ACCUMULATE
from oodviz.detectors.teaching import Teaching

MIN_DISTANCE = 1e-8
_BLOCK = 1024  # rows of the C x C matrix computed at once


def inverse_difference_norms(weight: Tensor, detector: str = "fdbd") -> Tensor:
    """``1 / ||w_c - w_j||`` ``[C, C]`` (float32, zero diagonal) from the Gram matrix of ``weight`` ``[C, D]``."""
    w = weight.to(ACCUMULATE)
    squared_norms = (w * w).sum(dim=1)
    n_classes = len(w)
    inverse = torch.empty(n_classes, n_classes, dtype=torch.float32, device=w.device)
    for start in range(0, n_classes, _BLOCK):
        rows = slice(start, min(start + _BLOCK, n_classes))
        pair_sum = squared_norms[rows, None] + squared_norms[None, :]
        squared = (pair_sum - 2 * w[rows] @ w.T).clamp(min=0)  # [block, C]
        diagonal = torch.arange(rows.start, rows.stop, device=w.device)
        local = diagonal - start
        # Equal rows leave only float64 rounding of the expanded form.
        same = squared <= 64 * torch.finfo(ACCUMULATE).eps * pair_sum
        same[local, diagonal] = False
        if bool(same.any()):
            c, j = (int(i) for i in torch.nonzero(same)[0])
            raise ValueError(
                f"{detector}: classes {start + c} and {j} have the same head weight vector, so there is no decision "
                "boundary between them; merge the classes or pass the trained head."
            )
        block = squared.sqrt().reciprocal()
        block[local, diagonal] = 0.0
        inverse[rows] = block.float()
    return inverse


class FDBD(FeatureMeanFit):
    name = "fdbd"
    fitted_shapes = {**FeatureMeanFit.fitted_shapes, "inverse_boundary_norms_": "CC"}
    summary = "Mean distance to the decision boundaries over the distance to the mean feature (negated)."
    paper = "https://arxiv.org/abs/2312.11536"
    teaching = Teaching(
        formula=r"s(x) = -\frac{\bar d(x)}{\|x - \mu\|},\quad \bar d(x) = \frac{1}{C-1}\sum_{j \ne c} \frac{|z_c - z_j|}{\|w_c - w_j\|}",
        citation="Liu & Qin, *Fast Decision Boundary based Out-of-Distribution Detector*, ICML 2024",
        reads="the features of the fit split (their mean) and the head",
        fails_when="Assumes ID features lie far from the decision boundaries; poorly separated classes make ID look OOD.",
    )
    inputs = ("features",)
    needs_head = True

    def _fit_mean(self, mean: Tensor, head: tuple[Tensor, Tensor]) -> None:
        weight, bias = head
        if len(weight) < 2:
            raise ValueError(f"fdbd needs a head with at least 2 classes (decision boundaries), got C={len(weight)}")
        self.inverse_boundary_norms_ = inverse_difference_norms(weight, self.name)  # [C, C]
        self.feature_mean_ = mean.float()
        self.head_weight_, self.head_bias_ = weight, bias

    def boundary_distance(self, features: Tensor) -> Tensor:
        """Mean distance to the ``C - 1`` decision boundaries of the predicted class, ``[B]``."""
        logits = features @ self.head_weight_.T + self.head_bias_
        top, predicted = logits.max(dim=1)
        gaps = top[:, None] - logits  # |z_c - z_j| >= 0, zero at j = c
        return (gaps * self.inverse_boundary_norms_[predicted]).sum(dim=1) / (logits.shape[1] - 1)

    def _score(self, batch: Batch) -> Tensor:
        x = batch.features.float()
        to_mean = (x - self.feature_mean_).norm(dim=1).clamp(min=MIN_DISTANCE)
        return -self.boundary_distance(x) / to_mean
