"""Generalized entropy (GEN).

Liu, Lochman & Zach, *GEN: Pushing the Limits of Softmax-Based Out-of-Distribution Detection*,
CVPR 2023, https://openaccess.thecvf.com/content/CVPR2023/html/Liu_GEN_Pushing_the_Limits_of_Softmax-Based_Out-of-Distribution_Detection_CVPR_2023_paper.html

    score(x) = G_gamma(p) = sum_{j=1}^{M} p_(j)^gamma (1 - p_(j))^gamma

over the ``M = min(m, C)`` largest softmax probabilities ``p_(1) >= p_(2) >= ...`` of the logits
``[B, C]``. The paper's confidence is ``-G``; the generalized entropy itself is high for OOD
inputs, so it is the OOD score. Defaults are the paper's (``gamma = 0.1``, ``M = 100``).
pytorch-ood averages instead of summing over the ``M`` terms (same ranking); oodviz follows
the paper. Needs no fit.

oodviz computes each term in log space, ``p_(j)^gamma (1 - p_(j))^gamma = exp(gamma (log p_(j) + log(1 - p_(j))))``,
with ``log(1 - p_(1))`` of the top class taken as ``logsumexp`` of the other logits minus ``logsumexp`` of all: no
term is lost to rounding (``precision="exact"``, the default).

OpenOOD v1.5's ``gen`` postprocessor computes the softmax probabilities in float32 and the sum of
``p^gamma (1 - p)^gamma`` over the ``M`` largest of them on those probabilities (``torch.sort`` then the last
``M``). Where the top probability rounds to 1 in float32 (a margin of about 17 between the top logit and the
next ones, common for a confident network), ``1 - p`` is 0 and the top term, the largest of the sum for a
confident input, is lost; where it rounds close to 1, the term is that of the rounded ``1 - p``. ``precision="float32"``
computes that: the float32 softmax, ``(1 - p)`` in float32, the powers and the sum in float32:
``openood_params = {"precision": "float32"}`` (``protocol = "openood"``). Its defaults are oodviz's
(``gamma = 0.1``, ``M = 100``); its automatic search tries ``gamma`` in 0.01..10 and ``M`` in 10..1000 on the
validation sets (``gamma >= 1`` is outside the paper's range, which oodviz keeps: ``0 < gamma < 1``).
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.teaching import Teaching

#: ``GEN.precision``'s values: the terms in log space (exact) or on float32 probabilities (OpenOOD v1.5)
PRECISIONS = ("exact", "float32")
#: below this, a sum of ``exp(z_j - z_top)`` may have lost terms to float32's underflow: taken from the logits
TINY_SUM = 1e-30


class GEN(Detector):
    name = "gen"
    summary = "Generalized entropy of the top-M softmax probabilities."
    paper = "https://arxiv.org/abs/2303.04115"
    default_grid = {"gamma": (0.01, 0.05, 0.1, 0.5, 0.9)}
    teaching = Teaching(
        formula=r"s(x) = \sum_{j=1}^{M} p_{(j)}^{\gamma} (1 - p_{(j)})^{\gamma}",
        citation="Liu, Lochman & Zach, *GEN: Pushing the Limits of Softmax-Based Out-of-Distribution Detection*, CVPR 2023",
        reads="the logits; nothing to fit",
        fails_when="Still a function of the softmax alone: OOD inputs the network is confident about pass unnoticed.",
    )
    inputs = ("logits",)
    needs_fit = False
    param_choices = {"precision": PRECISIONS}
    openood_params = {"precision": "float32"}

    def __init__(self, gamma: float = 0.1, m: int = 100, precision: str = "exact"):
        if precision not in PRECISIONS:
            raise ValueError(
                f"gen: precision must be 'exact' (terms in log space) or 'float32' (OpenOOD v1.5's float32 "
                f"probabilities), got {precision!r}"
            )
        if not 0 < gamma < 1:
            raise ValueError(f"gen: gamma must be in (0, 1), got {gamma}")
        if int(m) != m or m < 1:
            raise ValueError(f"gen: m (number of top classes) must be a positive integer, got {m}")
        self.gamma = float(gamma)
        self.m = int(m)
        self.precision = precision

    def _score(self, batch: Batch) -> Tensor:
        z = batch.logits.float()
        if self.precision == "float32":  # OpenOOD v1.5: float32 probabilities, the M largest, 1 - p rounded
            top = torch.sort(torch.softmax(z, dim=1), dim=1).values[:, -self.m :]  # [B, M], ascending
            return (top.pow(self.gamma) * (1 - top).pow(self.gamma)).sum(dim=1)
        if self.m >= z.shape[1]:
            return self._all_classes(z)
        log_norm = torch.logsumexp(z, dim=1, keepdim=True)
        top_z, top_index = torch.topk(z, k=self.m, dim=1)
        log_p = top_z - log_norm  # [B, M], descending
        # Only the top class can have p > 1/2, where log1p(-p) loses precision.
        terms = torch.exp(self.gamma * (log_p + torch.log1p(-log_p.exp())))
        terms[:, :1] = self._top_term(z, top_index[:, :1], log_norm)
        return terms.sum(dim=1)

    def _all_classes(self, z: Tensor) -> Tensor:
        """The sum over every class (``M >= C``), which needs no order: no sort of each row (it took ~90% of the
        time), and one pass each for what the terms need. With ``e_j = exp(z_j - z_top)`` (the top's own 1 left
        out) and ``S = sum_j e_j``: ``p_top = 1 / (1 + S)``, ``1 - p_top = S / (1 + S)`` (``S`` summed without the
        top's 1: no cancellation), ``p_j^gamma`` from ``log p_j = z_j - z_top - log(1 + S)`` (no underflow below
        float32's range) and ``(1 - p_j)^gamma`` directly (exact where ``p_j <= 1/2``, every class but the top).
        Where ``S`` underflows (the top logit ~100 above all others) ``log S`` comes from the logits."""
        top_z, top_index = z.max(dim=1, keepdim=True)
        shifted = z - top_z  # [B, C], 0 at the top
        e = shifted.exp().scatter_(1, top_index, 0.0)
        others = e.sum(dim=1, keepdim=True)  # [B, 1]
        log_others = others.log()
        lost = (others < TINY_SUM).squeeze(1)
        if bool(lost.any()):
            rows = z[lost].scatter(1, top_index[lost], float("-inf"))
            log_others[lost] = torch.logsumexp(rows, dim=1, keepdim=True) - top_z[lost]
        log_total = torch.log1p(others)  # log(1 + S)
        one_minus_p = e.div_(others + 1).neg_().add_(1).pow_(self.gamma)  # (1 - p_j)^gamma
        terms = shifted.sub_(log_total).mul_(self.gamma).exp_().mul_(one_minus_p)
        top = torch.exp(self.gamma * (log_others - 2 * log_total))  # (p_top (1 - p_top))^gamma
        return terms.scatter_(1, top_index, top).sum(dim=1)

    def _top_term(self, z: Tensor, top_index: Tensor, log_norm: Tensor) -> Tensor:
        """``p^gamma (1 - p)^gamma`` ``[B, 1]`` of the top class, ``log(1 - p)`` as ``logsumexp`` of the other logits
        less ``logsumexp`` of all: exact where ``p`` rounds to 1."""
        log_p = z.gather(1, top_index) - log_norm
        log_1mp = torch.logsumexp(z.scatter(1, top_index, float("-inf")), dim=1, keepdim=True) - log_norm
        return torch.exp(self.gamma * (log_p + log_1mp))
