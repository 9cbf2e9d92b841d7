"""Single-layer predictive normalized maximum likelihood (pNML) regret.

Bibas, Feder & Hassner, *Single Layer Predictive Normalized Maximum Likelihood for Out-of-Distribution Detection*,
NeurIPS 2021, https://arxiv.org/abs/2110.09246 (code: https://github.com/kobybibas/pnml_ood_detection)

The pNML learner of the last layer pays a regret for a test point that the training features do not span. With
the L2-normalised features ``x`` ``[B, D]`` (``x / |x|``), the Gram matrix of the normalised in-distribution
features ``G = X^T X = sum_i x_i x_i^T`` ``[D, D]`` (float64; ``G^+ = X^+ X^+^T``), the probabilities of
the head on the normalised features ``p = softmax(x W^T + b)`` ``[B, C]`` and

    kappa(x) = x^T G^+ x / (1 + x^T G^+ x)                                               [B], in [0, 1)

the score (higher = more OOD) is the paper's normalised regret (eq. 20 divided by ``log C``):

    score(x) = 1/log C * log sum_k p_k / (p_k + (1 - p_k) p_k^kappa(x))                  [B], in [0, 1]

Each term is computed as ``sigmoid(-(log(1 - p_k) + (kappa - 1) log p_k))`` in float64, the same value without
``0 / 0`` when ``p_k`` underflows (the authors' code and pytorch-ood 0.4 divide directly; pytorch-ood clamps ``p``
to ``[1e-12, 1 - 1e-12]`` for that). ``x^T G^+ x`` is ``|x S|^2`` with ``S S^T = G^+`` (a Cholesky factor, or the
pseudo-inverse's eigenpairs when ``G`` is singular, e.g. dead ReLU units or ``N < D``:
:func:`~oodviz.detectors.mahalanobis.inverse_sqrt`), as the authors invert ``G`` unless it is singular. Labels and
the batch's logits are not read (the head sees the normalised feature, as in the paper's code).

``G`` is streamed as the mean ``mu`` and the scatter about it of the normalised features (shifted sums,
:class:`~oodviz.detectors.stats.Moments`) and formed once as ``scatter + N mu mu^T``: features far from the origin
normalise to nearly one direction, ``G`` is then very ill-conditioned, and plain sums of ``x x^T`` rounded
differently in another row order or over shards moved ``G^+`` by ~1e-7; the scatter does not. ``S`` is kept in
float32 (as mahalanobis's whitening), ``|x S|^2`` and the regret computed from it in float64.

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`): the moments merge exactly (Chan's
shifted sums).
"""

import math

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.mahalanobis import inverse_sqrt, l2_normalised
from oodviz.detectors.protocol import FitState
from oodviz.detectors.stats import Moments
from oodviz.detectors.teaching import Teaching


class PNML(Detector):
    name = "pnml"
    fitted_shapes = {**Detector.fitted_shapes, "gram_inverse_sqrt_": "DK"}
    summary = "pNML regret of the last layer: how much the unseen direction of the normalised feature could change p."
    paper = "https://arxiv.org/abs/2110.09246"
    teaching = Teaching(
        formula=(
            r"s(x) = \frac{1}{\log C} \log \sum_k \frac{p_k}{p_k + (1 - p_k)\, p_k^{\kappa(x)}},"
            r"\quad \kappa(x) = \frac{x^\top G^{+} x}{1 + x^\top G^{+} x},\quad G = \sum_i x_i x_i^\top"
        ),
        citation=(
            "Bibas, Feder & Hassner, *Single Layer Predictive Normalized Maximum Likelihood for "
            "Out-of-Distribution Detection*, NeurIPS 2021"
        ),
        reads="the L2-normalised features of the fit split (their Gram matrix) and the classifier's head",
        fails_when="With many ID samples G^+ is small and kappa near 0 for every input: the regret then says little.",
    )
    inputs = ("features",)
    needs_head = True
    mergeable = True
    in_defaults = False  # issue 29: not in the default run

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """``8 x 2.5 x D^2``: the Gram matrix and its inverse square root (float64), the float32 copy of that."""
        return int(8 * 2.5 * n_features**2)

    def _new_parts(self, pass_index: int) -> dict:
        return {"moments": Moments()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        if state.n_classes < 2:
            raise ValueError(
                f"pnml: the regret is normalised by log C and needs a head of C >= 2 classes, got C = {state.n_classes}"
            )
        state.parts["moments"].update(l2_normalised(batch.features))

    def _finish_pass(self, state: FitState) -> bool:
        moments = state.parts["moments"].release()
        mean = moments.mean
        gram = moments.scatter.addr_(mean, mean, alpha=moments.total)  # in place: X^T X = scatter + N mu mu^T
        self.gram_inverse_sqrt_ = inverse_sqrt(gram, overwrite=True).float()  # [D, k], S S^T = G^+
        self.head_weight_, self.head_bias_ = state.head
        state.parts.clear()
        return True

    def _score(self, batch: Batch) -> Tensor:
        x = l2_normalised(batch.features)
        projected = torch.linalg.vector_norm((x @ self.gram_inverse_sqrt_).double(), dim=1).square()  # x^T G^+ x
        kappa = (projected / (1 + projected))[:, None]
        log_p = torch.addmm(self.head_bias_, x, self.head_weight_.T).double().log_softmax(dim=1)
        log_1mp = torch.log1p(-log_p.exp())
        terms = torch.sigmoid(-(log_1mp + (kappa - 1) * log_p))  # p / (p + (1 - p) p^kappa)
        return terms.sum(dim=1).log_() / math.log(log_p.shape[1])
