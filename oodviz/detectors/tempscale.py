"""Temperature scaling, then maximum softmax probability.

Guo et al., *On Calibration of Modern Neural Networks*, ICML 2017, https://arxiv.org/abs/1706.04599

Fit: the temperature ``T`` minimises the negative log-likelihood of the in-distribution labels,

    NLL(beta) = sum_i [ logsumexp(beta z_i) - beta z_{i, y_i} ],      beta = 1 / T,

which is convex in ``beta`` with ``NLL' = sum_i (E_p[z_i] - z_{i, y_i})`` and
``NLL'' = sum_i Var_p[z_i]`` (``p = softmax(beta z_i)``). oodviz runs a damped Newton
iteration on ``beta`` with one streaming pass over the logits per step (float64), so it reaches
the optimum exactly in a handful of passes without holding the logits in memory. pytorch-ood
runs 50 L-BFGS steps on all logits at once and stops near the optimum.

Why passes and not one pass into a summary: ``logsumexp(beta z_i)`` depends on every logit of
every row in a way no fixed-size statistic captures exactly (the linear term ``sum_i z_{i, y_i}``
is the only part that reduces), so an exact fit either keeps the ``N x C`` logits or reads them
again per step. oodviz reads them again; :class:`FitData` validates them (labels, finiteness) on
the first pass only, so a later pass costs the arithmetic alone.

Score:

    score(x) = -max_k softmax(z(x) / T)_k

on logits ``[B, C]``; higher = more OOD. Needs logits and labels to fit.
"""

import math
import warnings

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.stats import ACCUMULATE
from oodviz.detectors.teaching import Teaching

_BETA_MIN, _BETA_MAX = 1e-3, 1e3  # T in [1e-3, 1e3]


def _nll_derivatives(data: FitData, beta: float) -> tuple[float, float, float, int]:
    """NLL(beta) summed over the fit data, its first and second derivative, and the sample count.

    The three sums accumulate on the device in float64 (batch by batch, in order, as Python floats
    would) and are read once per pass: one host sync a pass, none a batch.
    """
    sums = None  # [NLL, NLL', NLL''] float64 on the data's device
    n = 0
    for batch in data:
        z = batch.logits.to(ACCUMULATE)
        y = batch.labels
        scaled = beta * z
        log_norm = torch.logsumexp(scaled, dim=1)
        p = torch.exp(scaled - log_norm[:, None])
        mean_z = (p * z).sum(dim=1)
        z_true = z.gather(1, y[:, None]).squeeze(1)
        batch_sums = torch.stack(
            [
                (log_norm - beta * z_true).sum(),
                (mean_z - z_true).sum(),
                ((p * z * z).sum(dim=1) - mean_z**2).clamp(min=0).sum(),
            ]
        )
        sums = batch_sums if sums is None else sums + batch_sums
        n += len(y)
    nll, grad, curv = sums.tolist()  # the pass's one host sync
    return nll, grad, curv, n


class TemperatureScaling(Detector):
    name = "tempscale"
    summary = "MSP after temperature scaling fitted by NLL on the in-distribution labels."
    paper = "https://arxiv.org/abs/1706.04599"
    teaching = Teaching(
        formula=r"s(x) = -\max_k \operatorname{softmax}(z(x)/T)_k,\quad T = \arg\min_T \mathrm{NLL}",
        citation="Guo et al., *On Calibration of Modern Neural Networks*, ICML 2017",
        reads="the logits and labels of the fit split (to fit T)",
        fails_when="Calibrates confidence on in-distribution data only; a monotone rescaling rarely changes the OOD ranking much.",
    )
    inputs = ("logits",)
    needs_labels = True
    fit_passes = 2  # several in fact: one per Newton step

    def __init__(self, max_steps: int = 50, tol: float = 1e-7):
        if int(max_steps) != max_steps or max_steps < 1:
            raise ValueError(f"tempscale: max_steps must be a positive integer, got {max_steps}")
        if not tol > 0:
            raise ValueError(f"tempscale: tol must be > 0, got {tol}")
        self.max_steps = int(max_steps)
        self.tol = float(tol)

    def _fit(self, data: FitData) -> None:
        beta = 1.0
        nll, grad, curv, n = _nll_derivatives(data, beta)
        for _ in range(self.max_steps):
            if curv <= 0:  # every softmax one-hot: the NLL is flat in beta
                break
            step = -grad / curv
            while True:
                candidate = min(max(beta + step, _BETA_MIN), _BETA_MAX)
                new = _nll_derivatives(data, candidate)
                if new[0] <= nll + 1e-12 * abs(nll) or abs(step) < self.tol * beta:
                    break
                step /= 2  # damped Newton: never accept a step that raises the NLL
            converged = abs(candidate - beta) <= self.tol * beta
            beta, (nll, grad, curv, n) = candidate, new
            if converged:
                break
        if beta in (_BETA_MIN, _BETA_MAX):
            warnings.warn(
                f"tempscale: the NLL-optimal temperature lies outside [{1 / _BETA_MAX:g}, {1 / _BETA_MIN:g}]; "
                f"using T={1 / beta:g}. The in-distribution data may be perfectly separated (or all wrong).",
                stacklevel=3,
            )
        self.temperature_ = 1.0 / beta
        self.nll_ = nll / n
        if not math.isfinite(self.nll_):
            raise ValueError("tempscale: the NLL is not finite; check the logits for extreme values.")

    def _score(self, batch: Batch) -> Tensor:
        return -(batch.logits.float() / self.temperature_).softmax(dim=1).amax(dim=1)
