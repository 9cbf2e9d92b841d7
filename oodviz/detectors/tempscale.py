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

OpenOOD v1.5's ``temp_scaling`` postprocessor fits ``T`` itself (not ``beta``) with one ``step`` of
``torch.optim.LBFGS([T], lr=0.01, max_iter=50)`` (torch's other defaults: no line search, history 100,
``tolerance_grad = 1e-7``, ``tolerance_change = 1e-9``) from ``T = 1.5``, on the mean cross-entropy of all the
logits at once, in float32. Without a line search every L-BFGS move is ``lr = 0.01`` times its step (for one
parameter: a secant step, ``-g s / y``): on an NLL quadratic in ``T`` each move after the first covers 1% of the
distance left, about 40% in all, so ``T`` stops short of the optimum unless it starts near it.
``optimizer="openood"`` takes those steps: each evaluation of the loss and its derivative
``dNLL/dT = -NLL'(beta) / T^2`` is one streaming pass (float64 sums, rounded to float32 as OpenOOD's float32 loss
and gradient are), the L-BFGS update between passes is torch's, in float32, and one more pass gives ``nll_`` at
the final ``T`` (which L-BFGS moves to without evaluating it): at most 51 passes; ``max_steps`` and ``tol`` are
then not used. ``optimizer="newton"`` (the default) is the exact optimum above.
``openood_params = {"optimizer": "openood"}`` (``protocol = "openood"``).

OpenOOD fits ``T`` on the ID validation split (``id_loader_dict['val']``); oodviz fits on the fit data it is
given (``id_fit`` in a run; ``oodviz bench openood-v1.5`` gives the ID training list), so the same figures need
OpenOOD's validation list as ``id_fit``.
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
#: ``TemperatureScaling.optimizer``'s values: the damped Newton iteration to the optimum, or OpenOOD v1.5's L-BFGS
OPTIMIZERS = ("newton", "openood")


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


class OpenOODLBFGS:
    """One ``step`` of ``torch.optim.LBFGS([T], lr=0.01, max_iter=50)`` (no line search; torch's defaults otherwise)
    from ``T = 1.5``, OpenOOD v1.5's fit of the temperature, with the closure's evaluations taken one at a time:
    :meth:`evaluated` receives the loss and its derivative at :attr:`x` and says whether the step is over; when not,
    the next evaluation is at the new :attr:`x`. The update is torch's ``LBFGS.step`` for one float32 parameter,
    operation for operation, so the same losses and gradients give the same ``T`` bit for bit."""

    LR, MAX_ITER, START = 0.01, 50, 1.5  # torch's max_eval (62) is not reached without a line search: 50 at most
    TOLERANCE_GRAD, TOLERANCE_CHANGE = 1e-7, 1e-9

    def __init__(self):
        self.x = torch.full((1,), self.START, dtype=torch.float32)  # T
        self.iterations = 0
        self.dirs: list[Tensor] = []
        self.stps: list[Tensor] = []
        self.ro: list[Tensor] = []
        self.h_diag = 1
        self.d = self.t = self.grad = self.prev_grad = None
        self.loss = self.prev_loss = None
        self.final = False  # the step is over; the pass under way evaluates the NLL at the final T

    def evaluated(self, loss: float, grad: float) -> bool:
        """The closure's float32 ``loss`` and ``dloss/dT`` at :attr:`x`; True when the step is over (``x`` is then
        the fitted ``T``), False when the loss is wanted at the new :attr:`x`."""
        flat_grad = torch.tensor([grad], dtype=torch.float32)
        loss = float(torch.tensor(loss, dtype=torch.float32))
        optimal = bool(flat_grad.abs().max() <= self.TOLERANCE_GRAD)
        if self.iterations == 0:  # the first evaluation, before the loop
            if optimal:
                return True
        elif (  # the checks after an evaluation inside the loop, in torch's order
            optimal
            or bool(self.d.mul(self.t).abs().max() <= self.TOLERANCE_CHANGE)
            or abs(loss - self.prev_loss) < self.TOLERANCE_CHANGE
        ):
            return True
        self.loss, self.grad = loss, flat_grad
        return self._iterate()

    def _iterate(self) -> bool:
        """One pass of torch's loop up to the next closure call: the direction, the move; True when it ends."""
        self.iterations += 1
        flat_grad = self.grad
        if self.iterations == 1:
            d = flat_grad.neg()
        else:
            y = flat_grad.sub(self.prev_grad)
            s = self.d.mul(self.t)
            ys = y.dot(s)
            if ys > 1e-10:  # torch's history of 100 pairs never fills in 50 iterations
                self.dirs.append(y)
                self.stps.append(s)
                self.ro.append(1.0 / ys)
                self.h_diag = ys / y.dot(y)
            al = [None] * len(self.dirs)
            q = flat_grad.neg()
            for i in range(len(self.dirs) - 1, -1, -1):
                al[i] = self.stps[i].dot(q) * self.ro[i]
                q.add_(self.dirs[i], alpha=-al[i])
            d = r = torch.mul(q, self.h_diag)
            for i in range(len(self.dirs)):
                be_i = self.dirs[i].dot(r) * self.ro[i]
                r.add_(self.stps[i], alpha=al[i] - be_i)
        self.prev_grad = flat_grad.clone()
        self.prev_loss = self.loss
        self.t = min(1.0, 1.0 / flat_grad.abs().sum()) * self.LR if self.iterations == 1 else self.LR
        self.d = d
        if flat_grad.dot(d) > -self.TOLERANCE_CHANGE:  # not a descent direction: the step ends here
            return True
        self.x.add_(d, alpha=self.t)
        return self.iterations == self.MAX_ITER  # the last move is not evaluated


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
    fit_passes = 2  # several in fact: one per Newton step (one per L-BFGS evaluation)
    param_choices = {"optimizer": OPTIMIZERS}
    openood_params = {"optimizer": "openood"}

    def __init__(self, max_steps: int = 50, tol: float = 1e-7, optimizer: str = "newton"):
        if optimizer not in OPTIMIZERS:
            raise ValueError(
                f"tempscale: optimizer must be 'newton' (the NLL optimum) or 'openood' (OpenOOD v1.5's L-BFGS), "
                f"got {optimizer!r}"
            )
        if int(max_steps) != max_steps or max_steps < 1:
            raise ValueError(f"tempscale: max_steps must be a positive integer, got {max_steps}")
        if not tol > 0:
            raise ValueError(f"tempscale: tol must be > 0, got {tol}")
        self.max_steps = int(max_steps)
        self.tol = float(tol)
        self.optimizer = optimizer

    mergeable = True

    def _new_parts(self, pass_index: int) -> dict:
        """One pass per NLL evaluation: the float64 sums ``[NLL, NLL', NLL'']`` at the pass's ``beta``."""
        if pass_index == 0:
            self._newton = None  # a new fit: pass 0 evaluates at beta = 1 (OpenOOD's L-BFGS: at T = 1.5)
            self._lbfgs = OpenOODLBFGS() if self.optimizer == "openood" else None
        return {"nll_sums": Sums()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        if self._lbfgs is not None:
            beta = 1.0 / float(self._lbfgs.x)
        else:
            beta = 1.0 if self._newton is None else self._newton["candidate"]
        state.parts["nll_sums"].add(nll_sums(batch.logits, batch.labels, beta))

    def _finish_pass(self, state: FitState) -> bool:
        if self._lbfgs is not None:
            return self._lbfgs_pass(state)
        return self._newton_pass(state)

    def _lbfgs_pass(self, state: FitState) -> bool:
        """One evaluation of OpenOOD's L-BFGS on the merged sums (the mean NLL and ``dNLL/dT`` at its ``T``): True
        once the step is over and the NLL at the final ``T`` is known."""
        nll, grad, _ = state.parts["nll_sums"].value.tolist()  # the pass's one host sync
        lbfgs, temperature = self._lbfgs, float(self._lbfgs.x)
        mean_nll = nll / state.rows
        if lbfgs.final or lbfgs.evaluated(mean_nll, -grad / state.rows / temperature**2):
            if float(lbfgs.x) != temperature:  # the last move was not evaluated: one more pass, at the final T
                lbfgs.final = True
                return self._check_lbfgs_temperature(float(lbfgs.x))
            self._lbfgs = None
            self.temperature_ = temperature
            self.nll_ = mean_nll
            if not math.isfinite(self.nll_):
                raise ValueError("tempscale: the NLL is not finite; check the logits for extreme values.")
            return True
        return self._check_lbfgs_temperature(float(lbfgs.x))

    def _check_lbfgs_temperature(self, temperature: float) -> bool:
        """False (another pass), or a ValueError when OpenOOD's L-BFGS left ``T`` outside ``(0, inf)``."""
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(
                f"tempscale: OpenOOD's L-BFGS (optimizer='openood') moved the temperature to T={temperature:g}; "
                "use optimizer='newton', which stays at the NLL optimum."
            )
        return False

    def _newton_pass(self, state: FitState) -> bool:
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
