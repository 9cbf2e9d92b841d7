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
the first pass only, so a later pass costs the arithmetic alone. Each pass's three sums merge across shards
by addition (the state protocol, :mod:`oodviz.detectors.protocol`): every shard then takes the same Newton
step from the merged sums, and the next pass evaluates the NLL there.

Score:

    score(x) = -max_k softmax(z(x) / T)_k

on logits ``[B, C]``; higher = more OOD. Needs logits and labels to fit.
"""

import math
import warnings

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.protocol import FitState, Sums
from oodviz.detectors.stats import ACCUMULATE
from oodviz.detectors.teaching import Teaching

_BETA_MIN, _BETA_MAX = 1e-3, 1e3  # T in [1e-3, 1e3]


def nll_sums(logits: Tensor, labels: Tensor, beta: float) -> Tensor:
    """``[NLL(beta), NLL'(beta), NLL''(beta)]`` summed over the rows of ``logits`` ``[B, C]``, float64 on their
    device (read once per pass: one host sync a pass, none a batch)."""
    z = logits.to(ACCUMULATE)
    scaled = beta * z
    log_norm = torch.logsumexp(scaled, dim=1)
    p = torch.exp(scaled - log_norm[:, None])
    mean_z = (p * z).sum(dim=1)
    z_true = z.gather(1, labels[:, None]).squeeze(1)
    return torch.stack(
        [
            (log_norm - beta * z_true).sum(),
            (mean_z - z_true).sum(),
            ((p * z * z).sum(dim=1) - mean_z**2).clamp(min=0).sum(),
        ]
    )


class TemperatureScaling(Detector):
    name = "tempscale"
    summary = "MSP after temperature scaling fitted by NLL on the in-distribution labels."
    paper = "https://arxiv.org/abs/1706.04599"
    teaching = Teaching(
        formula=r"s(x) = -\max_k p_k,\quad p = \operatorname{softmax}(z(x)/T),\quad T = \arg\min_T \mathrm{NLL}",
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

    mergeable = True

    def _new_parts(self, pass_index: int) -> dict:
        """One pass per NLL evaluation: the float64 sums ``[NLL, NLL', NLL'']`` at the pass's ``beta``."""
        if pass_index == 0:
            self._newton = None  # a new fit: pass 0 evaluates at beta = 1
        return {"nll_sums": Sums()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        beta = 1.0 if self._newton is None else self._newton["candidate"]
        state.parts["nll_sums"].add(nll_sums(batch.logits, batch.labels, beta))

    def _finish_pass(self, state: FitState) -> bool:
        """One step of the damped Newton iteration on the merged sums: True once it has converged (or run
        ``max_steps`` steps); otherwise the next pass evaluates the NLL at ``self._newton["candidate"]``."""
        nll, grad, curv = state.parts["nll_sums"].value.tolist()  # the pass's one host sync
        newton = self._newton
        if newton is None:  # pass 0, at beta = 1
            self._newton = newton = {"beta": 1.0, "nll": nll, "grad": grad, "curv": curv, "steps": 0, "n": state.rows}
            return self._propose(newton)
        beta, step = newton["beta"], newton["step"]
        if not (nll <= newton["nll"] + 1e-12 * abs(newton["nll"]) or abs(step) < self.tol * beta):
            newton["step"] = step / 2  # damped Newton: never accept a step that raises the NLL
            newton["candidate"] = min(max(beta + newton["step"], _BETA_MIN), _BETA_MAX)
            return False
        converged = abs(newton["candidate"] - beta) <= self.tol * beta
        newton.update(beta=newton["candidate"], nll=nll, grad=grad, curv=curv, steps=newton["steps"] + 1)
        if converged or newton["steps"] >= self.max_steps:
            return self._set_temperature(newton)
        return self._propose(newton)

    def _propose(self, newton: dict) -> bool:
        """The Newton step from ``beta``, or the end of the fit when the NLL is flat (every softmax one-hot)."""
        if newton["curv"] <= 0:
            return self._set_temperature(newton)
        newton["step"] = -newton["grad"] / newton["curv"]
        newton["candidate"] = min(max(newton["beta"] + newton["step"], _BETA_MIN), _BETA_MAX)
        return False

    def _set_temperature(self, newton: dict) -> bool:
        beta = newton["beta"]
        self._newton = None
        if beta in (_BETA_MIN, _BETA_MAX):
            warnings.warn(
                f"tempscale: the NLL-optimal temperature lies outside [{1 / _BETA_MAX:g}, {1 / _BETA_MIN:g}]; "
                f"using T={1 / beta:g}. The in-distribution data may be perfectly separated (or all wrong).",
                stacklevel=5,
            )
        self.temperature_ = 1.0 / beta
        self.nll_ = newton["nll"] / newton["n"]
        if not math.isfinite(self.nll_):
            raise ValueError("tempscale: the NLL is not finite; check the logits for extreme values.")
        return True

    def _score(self, batch: Batch) -> Tensor:
        return -(batch.logits.float() / self.temperature_).softmax(dim=1).amax(dim=1)
