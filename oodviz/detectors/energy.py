"""Energy score.

Liu et al., *Energy-based Out-of-distribution Detection*, NeurIPS 2020,
https://arxiv.org/abs/2010.03759

    score(x) = E(x; T) = -T * log sum_k exp(z_k(x) / T)

``z`` are the logits ``[B, C]``, ``T > 0`` the temperature (1 in the paper). The free energy is
high for OOD inputs, so it is the OOD score as is. Needs no fit.

OpenOOD v1.5's ``ebo`` postprocessor computes ``T logsumexp(z / T)`` (the negated score) at ``temperature = 1``
(its automatic search tries only 1), oodviz's default: ``openood_params`` is empty.
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.teaching import Teaching


class Energy(Detector):
    name = "energy"
    summary = "Free energy of the logits, -T logsumexp(z/T): a smoother maximum logit."
    paper = "https://arxiv.org/abs/2010.03759"
    default_grid = {"temperature": (0.5, 1.0, 2.0, 5.0, 10.0)}
    teaching = Teaching(
        formula=r"s(x) = -T \log \sum_k e^{z_k(x)/T}",
        citation="Liu et al., *Energy-based Out-of-distribution Detection*, NeurIPS 2020",
        reads="the logits; nothing to fit",
        fails_when="Dominated by the largest logit, so it inherits MSP's overconfidence on OOD inputs with large activations.",
    )
    inputs = ("logits",)
    needs_fit = False

    def __init__(self, temperature: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"energy: temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def _score(self, batch: Batch) -> Tensor:
        t = self.temperature
        logits = batch.logits.float()
        if t == 1.0:  # the paper's setting: no [B, C] copy for the division
            return torch.logsumexp(logits, dim=1).neg_()
        return -t * torch.logsumexp(logits / t, dim=1)
