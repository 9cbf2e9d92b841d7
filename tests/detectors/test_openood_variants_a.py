"""OpenOOD v1.5's variants and defaults (``openood_params``, ``protocol = "openood"``) of gen, tempscale, vra, vim,
residual and gmm, and the defaults of the other detectors OpenOOD has: each variant against a reference written here
from OpenOOD's postprocessor (not imported), the paper mode unchanged, the parameters saved and loaded."""

import copy

import numpy as np
import pytest
import torch
from detector_checks import fitted_scores
from helpers import Problem, cuda
from scipy.special import log_softmax, logsumexp, softmax

from oodviz import Batch
from oodviz.config.run import DetectorChoice, RunConfig
from oodviz.detectors import create, detector_class, load
from oodviz.detectors.protocol import load_merged
from oodviz.detectors.tempscale import OpenOODLBFGS

pytestmark = pytest.mark.kernels  # OpenOOD's float32 L-BFGS against oodviz's steps; saved detectors to the bit

#: each detector's OpenOOD v1.5 parameters, as its postprocessor and ``configs/postprocessors/<name>.yml`` have them
OPENOOD = {
    "gen": {"precision": "float32"},
    "tempscale": {"optimizer": "openood"},
    "vra": {"thresholds": "global", "lower_percentile": 10.0, "upper_percentile": 90.0},
    "vim": {"dim": 256},
    "residual": {"dim": 512},
    "ash": {"variant": "b"},
    # the same as oodviz's defaults (or benchmark-dependent: tuned), or no OpenOOD postprocessor of the method
    **{
        name: {}
        for name in (
            "gmm", "msp", "maxlogit", "energy", "weightedebo", "entropy", "klm", "mahalanobis", "rmd", "neco", "pnml",
            "she", "caref", "cadref", "knn", "react", "scale", "lts", "dice", "fdbd", "nci",
        )
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OPENOOD))
def test_the_openood_protocol_gives_each_detector_openoods_parameters(name):
    cls = detector_class(name)
    assert cls.openood_params == OPENOOD[name]
    config = RunConfig(protocol="openood", detectors=[DetectorChoice(name)])
    assert config.detectors[0].params == cls.openood_params
    made = create(name, **config.detectors[0].params)
    assert {k: made.get_params()[k] for k in OPENOOD[name]} == OPENOOD[name]
    assert RunConfig(detectors=[DetectorChoice(name)]).detectors[0].params == {}  # paper mode: oodviz's defaults


# ---- gen ------------------------------------------------------------------------------------------------------


def _gen_logits(seed=0, n=400, c=10):
    """Logits with rows of every kind: confident (a margin of 25 or more: the top softmax probability is 1 in
    float32), soft (a margin of 5 or less) and random."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, c, generator=g) * 2
    top = torch.randint(0, c, (n,), generator=g)
    z[: n // 3, :] = torch.randn(n // 3, c, generator=g)
    z[torch.arange(n // 3), top[: n // 3]] += 25 + 10 * torch.rand(n // 3, generator=g)  # confident rows
    return z


def _gen_openood(z, gamma, m):
    """OpenOOD's ``generalized_entropy``: softmax probabilities in float32 (here the float64 softmax correctly rounded
    to float32), sorted, the ``M`` largest, ``sum p^gamma (1 - p)^gamma`` with ``1 - p`` of the float32 ``p``."""
    p32 = softmax(z.double().numpy(), axis=1).astype(np.float32)
    top = np.sort(p32, axis=1)[:, -m:]
    one_minus = (np.float32(1) - top).astype(np.float64)  # exact for p >= 1/2 (Sterbenz), what float32 gives
    return (top.astype(np.float64) ** gamma * one_minus**gamma).sum(axis=1)


def _gen_exact(z, gamma, m):
    """The paper's sum in float64, with ``1 - p`` of each probability as the sum of the others (no rounding to 1)."""
    z = z.double().numpy()
    p = softmax(z, axis=1)
    order = np.argsort(-p, axis=1)[:, :m]
    total = 0.0
    for j in range(order.shape[1]):
        rows = np.arange(len(z))
        pj = p[rows, order[:, j]]
        others = z.copy()
        others[rows, order[:, j]] = -np.inf
        rest = np.exp(logsumexp(others, axis=1) - logsumexp(z, axis=1))
        total = total + pj**gamma * rest**gamma
    return total


@pytest.mark.parametrize(("gamma", "m"), [(0.1, 100), (0.1, 4), (0.5, 1), (0.01, 10)])
def test_gen_float32_is_openoods_sum_on_float32_probabilities(gamma, m):
    z = _gen_logits()
    ours = create("gen", gamma=gamma, m=m, precision="float32").score([Batch(logits=z)]).double().numpy()
    expected = _gen_openood(z, gamma, m)
    np.testing.assert_allclose(ours, expected, rtol=2e-5, atol=1e-7)
    exact = create("gen", gamma=gamma, m=m).score([Batch(logits=z)]).double().numpy()
    np.testing.assert_allclose(exact, _gen_exact(z, gamma, m), rtol=1e-4)  # the paper mode, as before
    confident = slice(0, len(z) // 3)
    # OpenOOD loses the top term of the confident rows, the largest of their sum: much smaller scores there
    top_term = _gen_exact(z, gamma, 1)[confident]
    np.testing.assert_allclose(exact[confident] - ours[confident], top_term, rtol=1e-3)
    assert (top_term * min(m, z.shape[1]) * (1 + 1e-5) >= exact[confident]).all()  # the largest term of the sum
    soft = slice(len(z) // 3, None)  # elsewhere the two agree to float32 rounding
    np.testing.assert_allclose(ours[soft], exact[soft], rtol=1e-3)


def test_gen_precision_is_checked_and_the_default_is_exact():
    assert create("gen").precision == "exact"
    with pytest.raises(ValueError, match="precision must be 'exact' .* or 'float32'"):
        create("gen", precision="float16")


# ---- tempscale -------------------------------------------------------------------------------------------------


def _openood_temperature(logits, labels):
    """OpenOOD's ``TemperatureScalingPostprocessor.setup``: ``T = 1.5``, ``LBFGS([T], lr=0.01, max_iter=50)``, one
    ``step`` on ``CrossEntropyLoss()(logits / T, labels)`` over all the logits, in float32."""
    temperature = torch.nn.Parameter(torch.ones(1) * 1.5)
    optimizer = torch.optim.LBFGS([temperature], lr=0.01, max_iter=50)
    criterion = torch.nn.CrossEntropyLoss()

    def closure():
        optimizer.zero_grad()
        loss = criterion(logits.float() / temperature, labels)
        loss.backward()
        return loss

    optimizer.step(closure)
    return float(temperature.detach())


def _nll(logits, labels, temperature):
    z = logits.double().numpy() / temperature
    return -log_softmax(z, axis=1)[np.arange(len(labels)), labels.numpy()].mean()


def _logit_problems():
    """(logits, labels) pairs: the problem fixture's head is not needed; logits of every scale, labels mostly the
    argmax (an over- or under-confident classifier)."""
    problems = []
    for seed, scale in ((0, 1.0), (1, 4.0), (2, 12.0)):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(700, 9, generator=g) * scale
        labels = torch.where(
            torch.rand(700, generator=g) < 0.75, logits.argmax(dim=1), torch.randint(0, 9, (700,), generator=g)
        )
        problems.append((logits, labels))
    return problems


def _logit_batches(logits, labels, size=64):
    return [Batch(logits=logits[i : i + size], labels=labels[i : i + size]) for i in range(0, len(logits), size)]


@pytest.mark.parametrize("case", range(3))
def test_tempscale_openood_takes_openoods_lbfgs_steps(case):
    logits, labels = _logit_problems()[case]
    det = create("tempscale", optimizer="openood").fit(_logit_batches(logits, labels))
    expected = _openood_temperature(logits, labels)
    assert det.temperature_ == pytest.approx(expected, rel=5e-5)  # float32 losses summed in another order
    assert det.nll_ == pytest.approx(_nll(logits, labels, det.temperature_), rel=1e-9)  # the NLL at the final T
    scores = det.score(_logit_batches(logits, labels)).double().numpy()
    np.testing.assert_allclose(scores, -softmax(logits.double().numpy() / expected, axis=1).max(1), rtol=1e-4)
    # the paper mode is unchanged: the NLL optimum, which OpenOOD's steps stop short of
    exact = create("tempscale").fit(_logit_batches(logits, labels))
    assert exact.get_params() == create("tempscale", optimizer="newton").get_params()
    assert abs(exact.temperature_ - det.temperature_) > 0.2
    assert _nll(logits, labels, exact.temperature_) < _nll(logits, labels, det.temperature_) - 1e-3


def _torch_lbfgs(loss_and_grad):
    """``torch.optim.LBFGS([T], lr=0.01, max_iter=50)`` from 1.5 on a closure giving ``(loss, dloss/dT)`` at ``T``;
    the temperatures it evaluated and its final one."""
    temperature = torch.nn.Parameter(torch.ones(1) * 1.5)
    optimizer = torch.optim.LBFGS([temperature], lr=0.01, max_iter=50)
    seen = []

    def closure():
        seen.append(float(temperature.detach()))
        loss, grad = loss_and_grad(float(temperature.detach()))
        temperature.grad = torch.tensor([grad], dtype=torch.float32)
        return torch.tensor(loss, dtype=torch.float32)

    optimizer.step(closure)
    return seen, float(temperature.detach())


CLOSURES = {
    "quadratic": lambda t: (0.3 * (t - 0.4) ** 2, 0.6 * (t - 0.4)),
    "at the optimum": lambda t: ((t - 1.5) ** 2, 2 * (t - 1.5)),  # a zero gradient: no move
    "flat": lambda t: (1e-6 * (t - 3.0) ** 2, 2e-6 * (t - 3.0)),  # tiny moves: the loss stops changing
    "concave": lambda t: (-((t - 1.0) ** 2), -2 * (t - 1.0)),  # y s < 0: the history is never updated
    "shallow": lambda t: (1e-3 * (t - 6.5) ** 2, 2e-3 * (t - 6.5)),  # 0 < y s <= 1e-10: nor here
    "offset": lambda t: (1e3 + 5e-3 * (t - 0.5) ** 2, 1e-2 * (t - 0.5)),  # the change is below float32's resolution
    "steep": lambda t: (50.0 * (t - 1.49) ** 4, 200.0 * (t - 1.49) ** 3),
}


def _cross_entropy():
    """The mean NLL of one of the logit problems at ``T`` and its derivative, float64 (torch autograd)."""
    logits, labels = _logit_problems()[1]

    def loss_and_grad(t):
        temperature = torch.tensor(t, dtype=torch.float64, requires_grad=True)
        loss = torch.nn.functional.cross_entropy(logits.double() / temperature, labels)
        loss.backward()
        return float(loss.detach()), float(temperature.grad)

    return loss_and_grad


def _gradient_below_tolerance():
    """Gradients (one per call, whatever ``T``) that stay near 1, so that the secant steps grow huge, then fall to
    ``tolerance_grad = 1e-7``: torch stops there, where the next direction would still be a descent direction."""
    below_one = float(np.nextafter(np.float32(1), np.float32(0)))
    grads = iter([1.0, below_one, float(np.nextafter(np.float32(below_one), np.float32(0))), 1.0000001e-7, 1e-7])
    losses = iter(np.arange(1.0, 0.0, -1e-3))
    return lambda t: (float(next(losses)), next(grads, 1e-7))


def _moves_below_tolerance():
    """Gradients (one per call) of alternating sign and growing a million-fold: each secant step is a thousandth of
    the last, until a move ``|d t|`` is below ``tolerance_change = 1e-9`` while the loss still changes."""
    grads = iter([1.0, -1e3, 1e9, -1e15, 1e21, -1e27, 1e33])
    losses = iter(np.arange(1.0, 0.0, -1e-3))
    return lambda t: (float(next(losses)), next(grads))


SEQUENCES = {
    "cross-entropy": _cross_entropy,
    "gradient below tolerance": _gradient_below_tolerance,
    "moves below tolerance": _moves_below_tolerance,
}


def _closure(name):
    return SEQUENCES[name]() if name in SEQUENCES else CLOSURES[name]


@pytest.mark.parametrize("name", [*SEQUENCES, *CLOSURES])
def test_the_lbfgs_steps_are_torchs_bit_for_bit(name):
    """oodviz's L-BFGS, one evaluation at a time, against torch's own on the same closure values: the same
    temperatures evaluated, the same final one, whichever of torch's stopping rules ends the step."""
    seen, final = _torch_lbfgs(_closure(name))
    loss_and_grad, lbfgs, mine = _closure(name), OpenOODLBFGS(), []
    while True:
        mine.append(float(lbfgs.x))
        if lbfgs.evaluated(*loss_and_grad(float(lbfgs.x))):
            break
    assert mine == seen and float(lbfgs.x) == final
    if name == "at the optimum":
        assert final == 1.5 and len(seen) == 1
    if name in ("flat", "steep", "offset", "gradient below tolerance", "moves below tolerance"):
        assert len(seen) < 50  # a stopping rule other than max_iter


def test_tempscale_openood_shards_merged_give_the_fit_on_the_whole():
    logits, labels = _logit_problems()[2]
    batches = _logit_batches(logits, labels)
    whole = create("tempscale", optimizer="openood").fit(batches)
    shards = [batches[:4], batches[4:]]
    detectors = [create("tempscale", optimizer="openood") for _ in shards]
    while detectors[0].fit_in_progress or not hasattr(detectors[0], "temperature_"):
        states = [d.update(shard).state_dict() for d, shard in zip(detectors, shards, strict=True)]
        for detector in detectors:
            load_merged(detector, copy.deepcopy(states)).finalize()
    for detector in detectors:
        assert detector.temperature_ == pytest.approx(whole.temperature_, rel=1e-6)


@cuda
@pytest.mark.parametrize("name", ["tempscale", "vra"])
def test_the_openood_variants_fit_on_a_gpu_as_on_the_cpu(problem, name):
    on_cpu = create(name, **OPENOOD[name]).fit(problem.fit_batches(), head=problem.head)
    on_gpu = create(name, **OPENOOD[name]).fit(
        [b.to("cuda") for b in problem.fit_batches()], head=tuple(t.cuda() for t in problem.head)
    )
    query = problem.batches(problem.eval_x)
    expected = on_cpu.score(query).numpy()
    np.testing.assert_allclose(on_gpu.score(query).numpy(), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_tempscale_optimizer_is_checked():
    with pytest.raises(ValueError, match="optimizer must be 'newton' .* or 'openood'"):
        create("tempscale", optimizer="lbfgs")


# ---- vra -------------------------------------------------------------------------------------------------------


def _relu(problem: Problem) -> Problem:
    f = lambda x: x.clamp(min=0)  # noqa: E731
    return Problem(f(problem.fit_x), problem.fit_y, f(problem.test_x), f(problem.ood_x), problem.weight, problem.bias)


@pytest.mark.parametrize(("percentiles", "kind"), [((10, 90), "raw"), ((10, 90), "relu"), ((1, 99), "raw")])
def test_vra_global_clips_at_two_percentiles_of_all_activations(problem, percentiles, kind):
    p = _relu(problem) if kind == "relu" else problem
    lower, upper = percentiles
    det, ours = fitted_scores(p, "vra", lower_percentile=lower, upper_percentile=upper, thresholds="global")
    fx, ex = p.fit_x.double().numpy(), p.eval_x.double().numpy()
    # OpenOOD: np.percentile(activation_log.flatten(), percentile_low / percentile_high); the same clip for every unit
    lo, hi = np.percentile(fx.flatten(), lower), np.percentile(fx.flatten(), upper)
    width = fx.shape[1]
    np.testing.assert_array_equal(det.lower_threshold_.numpy(), np.full(width, lo, dtype=np.float32))
    np.testing.assert_array_equal(det.upper_threshold_.numpy(), np.full(width, hi, dtype=np.float32))
    w, b = p.weight.double().numpy(), p.bias.double().numpy()
    expected = -logsumexp(np.clip(ex, lo, hi) @ w.T + b, axis=1)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    # the paper mode (per unit) is unchanged, and another score
    per_unit, paper = fitted_scores(p, "vra", lower_percentile=lower, upper_percentile=upper)
    lo_u, hi_u = np.quantile(fx, lower / 100, axis=0), np.quantile(fx, upper / 100, axis=0)
    np.testing.assert_array_equal(per_unit.lower_threshold_.numpy(), lo_u.astype(np.float32))
    paper_expected = -logsumexp(np.clip(ex, lo_u, hi_u) @ w.T + b, axis=1)
    np.testing.assert_allclose(paper, paper_expected, rtol=1e-4, atol=1e-5 * np.abs(paper_expected).max())
    assert np.abs(paper - ours).max() > 1e-2


def test_vra_global_merges_across_shards(problem):
    batches = problem.fit_batches(100)
    whole = create("vra", thresholds="global").fit(batches, head=problem.head)
    shards = [batches[:3], batches[3:]]
    detectors = [create("vra", thresholds="global") for _ in shards]
    while not hasattr(detectors[0], "lower_threshold_"):
        states = [d.update(s, head=problem.head).state_dict() for d, s in zip(detectors, shards, strict=True)]
        for detector in detectors:
            load_merged(detector, copy.deepcopy(states)).finalize()
    for detector in detectors:
        assert torch.equal(detector.lower_threshold_, whole.lower_threshold_)
        assert torch.equal(detector.upper_threshold_, whole.upper_threshold_)


def test_vra_thresholds_is_checked():
    with pytest.raises(ValueError, match="thresholds must be 'per_unit' .* or 'global'"):
        create("vra", thresholds="per-unit")


# ---- vim and residual at OpenOOD's dim ---------------------------------------------------------------------------


def _wide(width, n=1500, classes=12, seed=0):
    """Features of ``width`` units with a spread of variances, a head, ID and OOD query rows."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.05, 2.0, width)
    fit_x = torch.randn(n, width, generator=g) * scales + 0.5
    query = torch.cat([torch.randn(200, width, generator=g) * scales + 0.5, torch.randn(200, width, generator=g)])
    weight, bias = 0.1 * torch.randn(classes, width, generator=g), torch.randn(classes, generator=g)
    return fit_x, query, weight, bias


def _openood_residual(fit_x, query, weight, bias, dim):
    """OpenOOD's vim/residual setup: ``u = -pinv(w) b``, ``EmpiricalCovariance(assume_centered=True)`` of ``x - u``,
    ``NS`` the eigenvectors outside the ``dim`` largest; the residual norms of the queries and of the fit rows."""
    fx, q = fit_x.double().numpy(), query.double().numpy()
    w, b = weight.double().numpy(), bias.double().numpy()
    u = -np.linalg.pinv(w) @ b
    covariance = (fx - u).T @ (fx - u) / len(fx)
    eigenvalues, eigenvectors = np.linalg.eigh(covariance)
    ns = eigenvectors[:, np.argsort(-eigenvalues)[dim:]]
    return np.linalg.norm((q - u) @ ns, axis=1), np.linalg.norm((fx - u) @ ns, axis=1)


def test_vim_at_openoods_dim(problem):
    fit_x, query, weight, bias = _wide(300)
    dim = OPENOOD["vim"]["dim"]
    det = create("vim", dim=dim).fit([Batch(features=fit_x)], head=(weight, bias))
    ours = det.score([Batch(features=query)]).double().numpy()
    residual, fit_residual = _openood_residual(fit_x, query, weight, bias, dim)
    w, b = weight.double().numpy(), bias.double().numpy()
    alpha = (fit_x.double().numpy() @ w.T + b).max(axis=1).mean() / fit_residual.mean()
    expected = alpha * residual - logsumexp(query.double().numpy() @ w.T + b, axis=1)  # OpenOOD's, negated
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    assert det.residual_space_.shape == (300, 300 - 256)
    paper = create("vim").fit([Batch(features=fit_x)], head=(weight, bias))  # the paper's rule: D // 2 here
    assert paper.residual_space_.shape == (300, 150)
    with pytest.raises(ValueError, match="dim=256 must be between 1 and D-1"):
        create("vim", dim=dim).fit(problem.fit_batches(), head=problem.head)  # D = 12: no residual space


def test_residual_at_openoods_dim():
    fit_x, query, weight, bias = _wide(520, n=900, seed=1)
    dim = OPENOOD["residual"]["dim"]
    det = create("residual", dim=dim).fit([Batch(features=fit_x)], head=(weight, bias))
    ours = det.score([Batch(features=query)]).double().numpy()
    expected, _ = _openood_residual(fit_x, query, weight, bias, dim)
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max())
    assert det.residual_space_.shape == (520, 520 - 512)
    assert create("residual").fit([Batch(features=fit_x)], head=(weight, bias)).residual_space_.shape == (520, 260)


# ---- saved and loaded ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gen", "tempscale", "vra"])
def test_the_openood_parameters_are_saved_and_loaded(problem, name, tmp_path):
    detector = create(name, **OPENOOD[name]).fit(problem.fit_batches(), head=problem.head)
    query = problem.batches(problem.eval_x)
    before = detector.score(query)
    detector.save(tmp_path / name)
    loaded = load(tmp_path / name)
    assert loaded.get_params() == detector.get_params()
    assert {k: loaded.get_params()[k] for k in OPENOOD[name]} == OPENOOD[name]
    assert torch.equal(loaded.score(query), before)
    assert not torch.equal(create(name).fit(problem.fit_batches(), head=problem.head).score(query), before)
