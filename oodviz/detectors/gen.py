"""Generalized entropy (GEN).

Liu, Lochman & Zach, *GEN: Pushing the Limits of Softmax-Based Out-of-Distribution Detection*,
CVPR 2023, https://openaccess.thecvf.com/content/CVPR2023/html/Liu_GEN_Pushing_the_Limits_of_Softmax-Based_Out-of-Distribution_Detection_CVPR_2023_paper.html

    score(x) = G_gamma(p) = sum_{j=1}^{M} p_(j)^gamma (1 - p_(j))^gamma

over the ``M = min(m, C)`` largest softmax probabilities ``p_(1) >= p_(2) >= ...`` of the logits
``[B, C]``. The paper's confidence is ``-G``; the generalized entropy itself is high for OOD
inputs, so it is the OOD score. Defaults are the paper's (``gamma = 0.1``, ``M = 100``).
pytorch-ood averages instead of summing over the ``M`` terms (same ranking); oodviz follows
the paper. Needs no fit.
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.teaching import Teaching


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

    def __init__(self, gamma: float = 0.1, m: int = 100):
        if not 0 < gamma < 1:
            raise ValueError(f"gen: gamma must be in (0, 1), got {gamma}")
        if int(m) != m or m < 1:
            raise ValueError(f"gen: m (number of top classes) must be a positive integer, got {m}")
        self.gamma = float(gamma)
        self.m = int(m)

    def _score(self, batch: Batch) -> Tensor:
        z = batch.logits.float()
        log_norm = torch.logsumexp(z, dim=1, keepdim=True)
        top_z, top_index = torch.topk(z, k=min(self.m, z.shape[1]), dim=1)
        log_p = top_z - log_norm  # [B, M], descending
        # Only the top class can have p > 1/2, where log1p(-p) loses precision.
        log_1mp = torch.log1p(-log_p.exp())
        others = z.scatter(1, top_index[:, :1], float("-inf"))
        log_1mp[:, 0] = (torch.logsumexp(others, dim=1, keepdim=True) - log_norm).squeeze(1)
        return torch.exp(self.gamma * (log_p + log_1mp)).sum(dim=1)
