"""Scores agree with pytorch-ood 0.4 (ranking and AUROC) and with float64 reference formulas."""

import numpy as np
import pytest
import torch
from helpers import assert_same_ranking
from pytorch_ood import detector as pood
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax, logsumexp, softmax
from sklearn.neighbors import NearestNeighbors

from oodviz.detectors import create


def _oodviz_scores(problem, name, **params):
    det = create(name, **params).fit(problem.fit_batches(), head=problem.head)
    return det, det.score(problem.batches(problem.eval_x)).double().numpy()


def _pood_scores(problem, name, oodviz_detector):
    """The same method in pytorch-ood 0.4, fitted on the same data, scored on the same inputs."""
    fx, fy, ex = problem.fit_x, problem.fit_y, problem.eval_x
    fit_logits, eval_logits = problem.logits(fx), problem.logits(ex)
    linear = torch.nn.Linear(fx.shape[1], len(problem.bias))
    with torch.no_grad():
        linear.weight.copy_(problem.weight)
        linear.bias.copy_(problem.bias)
    if name == "msp":
        s = pood.MaxSoftmax(None).predict_logits(eval_logits)
    elif name == "maxlogit":
        s = pood.MaxLogit(None).predict_logits(eval_logits)
    elif name == "energy":
        s = pood.EnergyBased(None, t=2.0).predict_logits(eval_logits)
    elif name == "entropy":
        s = pood.Entropy(None).predict_logits(eval_logits)
    elif name == "gen":
        s = pood.GEN(None, gamma=0.1, M=4).predict_logits(eval_logits)
    elif name == "tempscale":
        # pytorch-ood's TemperatureScaling (50 L-BFGS steps of lr 0.01) stops far from the optimum here
        # (T=0.60 against 0.13): its MaxSoftmax at the optimum that scipy finds, once oodviz's T is that one.
        optimal = _nll_optimal_temperature(problem).x
        assert oodviz_detector.temperature_ == pytest.approx(optimal, rel=1e-5)
        s = pood.MaxSoftmax(None, t=optimal).predict_logits(eval_logits)
    elif name == "klm":
        s = pood.KLMatching(None).fit_logits(fit_logits, fy).predict_logits(eval_logits)
    elif name == "mahalanobis":
        s = pood.Mahalanobis(None).fit_features(fx, fy).predict_features(ex)
    elif name == "rmd":
        s = pood.RMD(None).fit_features(fx, fy).predict_features(ex)
    elif name == "vim":
        s = pood.ViM(None, d=5, w=problem.weight, b=problem.bias).fit_features(fx, fy).predict_features(ex)
    elif name == "she":
        s = pood.SHE(None, head=linear).fit_features(fx, fy).predict_features(ex)
    elif name == "knn":
        s = pood.KNN(None, k=10).fit_features(fx, fy).predict_features(ex)
    return s.detach().double().numpy()


PARAMS = {"energy": {"temperature": 2.0}, "gen": {"m": 4}, "vim": {"dim": 5}, "knn": {"k": 10}}
NAMES = ["msp", "maxlogit", "energy", "entropy", "gen", "tempscale", "klm", "mahalanobis", "rmd", "vim", "she", "knn"]


@pytest.mark.parametrize("name", NAMES)
def test_matches_pytorch_ood(problem, name):
    det, ours = _oodviz_scores(problem, name, **PARAMS.get(name, {}))
    theirs = _pood_scores(problem, name, det)
    assert_same_ranking(ours, theirs, n_id=len(problem.test_x))


# ---- float64 reference formulas, written independently of the library ---------------------


def _np(problem):
    fx = problem.fit_x.double().numpy()
    fy = problem.fit_y.numpy()
    ex = problem.eval_x.double().numpy()
    w, b = problem.weight.double().numpy(), problem.bias.double().numpy()
    return fx, fy, ex, w, b


def _nll_optimal_temperature(problem):
    """scipy's minimum of the mean NLL of the fit labels over T, on float64 logits of the float32 features."""
    fx, fy, _, w, b = _np(problem)
    fit_logits = fx @ w.T + b
    nll = lambda t: -log_softmax(fit_logits / t, axis=1)[np.arange(len(fy)), fy].mean()  # noqa: E731
    return minimize_scalar(nll, bounds=(0.01, 100), method="bounded", options={"xatol": 1e-10})


def _class_gaussians(fx, fy):
    classes = np.unique(fy)
    means = np.stack([fx[fy == c].mean(0) for c in classes])
    centred = fx - means[fy]
    return means, centred.T @ centred / len(fx)


def _mahalanobis_reference(problem):
    fx, fy, ex, _, _ = _np(problem)
    means, cov = _class_gaussians(fx, fy)
    precision = np.linalg.inv(cov)
    d = np.stack([np.einsum("nd,de,ne->n", ex - m, precision, ex - m) for m in means], axis=1)
    return d.min(1), ex, fx


def reference(problem, name):
    fx, fy, ex, w, b = _np(problem)
    z = ex @ w.T + b
    if name == "msp":
        return -softmax(z, axis=1).max(1)
    if name == "maxlogit":
        return -z.max(1)
    if name == "energy":
        return -2.0 * logsumexp(z / 2.0, axis=1)
    if name == "entropy":
        p = softmax(z, axis=1)
        return -(p * np.log(p)).sum(1)
    if name == "gen":
        p = np.sort(softmax(z, axis=1), axis=1)[:, ::-1][:, :4]
        return (p**0.1 * (1 - p) ** 0.1).sum(1)
    if name == "tempscale":
        return -softmax(z / _nll_optimal_temperature(problem).x, axis=1).max(1)
    if name == "klm":
        fp = softmax(fx @ w.T + b, axis=1)
        pred = fp.argmax(1)
        templates = np.stack([fp[pred == c].mean(0) for c in np.unique(pred)])
        p = softmax(z, axis=1)
        kl = np.stack([(p * (np.log(p) - np.log(t))).sum(1) for t in templates], axis=1)
        return kl.min(1)
    if name == "mahalanobis":
        return _mahalanobis_reference(problem)[0]
    if name == "rmd":
        md, _, _ = _mahalanobis_reference(problem)
        mu0 = fx.mean(0)
        cov0 = np.cov(fx, rowvar=False, bias=True)
        md0 = np.einsum("nd,de,ne->n", ex - mu0, np.linalg.inv(cov0), ex - mu0)
        return md - md0
    if name == "vim":
        u = -np.linalg.pinv(w) @ b
        centred = fx - u
        eigenvalues, eigenvectors = np.linalg.eigh(centred.T @ centred / len(fx))
        residual = eigenvectors[:, np.argsort(eigenvalues)[: fx.shape[1] - 5]]
        alpha = (fx @ w.T + b).max(1).mean() / np.linalg.norm(centred @ residual, axis=1).mean()
        return alpha * np.linalg.norm((ex - u) @ residual, axis=1) - logsumexp(z, axis=1)
    if name == "she":
        correct = (fx @ w.T + b).argmax(1) == fy
        patterns = np.stack([fx[correct & (fy == c)].mean(0) for c in np.unique(fy)])
        return -(ex * patterns[z.argmax(1)]).sum(1)
    if name == "knn":
        bank = fx / np.linalg.norm(fx, axis=1, keepdims=True)
        query = ex / np.linalg.norm(ex, axis=1, keepdims=True)
        distances, _ = NearestNeighbors(n_neighbors=10).fit(bank).kneighbors(query)
        return distances[:, -1]
    raise KeyError(name)


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("name", ["mahalanobis", "rmd"])
def test_normalize_is_the_method_on_l2_normalised_features(problem, name):
    """MDS++ / RMDS++: pytorch-ood's method fitted and scored on unit vectors, and the float64 formula on them."""
    det, ours = _oodviz_scores(problem, name, normalize=True)
    unit = lambda x: torch.nn.functional.normalize(x, dim=1)  # noqa: E731
    method = pood.Mahalanobis if name == "mahalanobis" else pood.RMD
    theirs = method(None).fit_features(unit(problem.fit_x), problem.fit_y).predict_features(unit(problem.eval_x))
    assert_same_ranking(ours, theirs.double().numpy(), n_id=len(problem.test_x))
    fx, fy, ex, _, _ = _np(problem)
    fx, ex = _unit(fx), _unit(ex)
    means, cov = _class_gaussians(fx, fy)
    precision = np.linalg.inv(cov)
    expected = np.stack([np.einsum("nd,de,ne->n", ex - m, precision, ex - m) for m in means], axis=1).min(1)
    if name == "rmd":
        mu0, cov0 = fx.mean(0), np.cov(fx, rowvar=False, bias=True)
        expected -= np.einsum("nd,de,ne->n", ex - mu0, np.linalg.inv(cov0), ex - mu0)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    # Not the plain method: the normalisation changes the ranking.
    assert abs(np.corrcoef(ours, _oodviz_scores(problem, name)[1])[0, 1]) < 0.999
    assert det.get_params() == {"normalize": True}


def test_normalize_must_be_a_bool():
    with pytest.raises(ValueError, match="normalize must be True or False"):
        create("mahalanobis", normalize="yes")


@pytest.mark.parametrize("name", NAMES)
def test_matches_float64_formula(problem, name):
    _, ours = _oodviz_scores(problem, name, **PARAMS.get(name, {}))
    expected = reference(problem, name)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * scale)


def test_tempscale_finds_the_nll_optimum(problem):
    best = _nll_optimal_temperature(problem)
    det = create("tempscale").fit(problem.fit_batches())
    assert det.temperature_ == pytest.approx(best.x, rel=1e-5)
    assert det.nll_ == pytest.approx(best.fun, rel=1e-6)  # logits rounded to float32 on both sides
    assert det.temperature_ != pytest.approx(1.0, abs=0.05)  # the fit moved T
    theirs = pood.TemperatureScaling(None).fit_logits(problem.logits(problem.fit_x), problem.fit_y)
    fx, fy, _, w, b = _np(problem)
    nll = lambda t: -log_softmax((fx @ w.T + b) / t, axis=1)[np.arange(len(fy)), fy].mean()  # noqa: E731
    assert nll(det.temperature_) < nll(theirs.t.item()) - 1e-3  # pytorch-ood's L-BFGS stops short of it


def test_knn_chunked_search_equals_exact_search(problem):
    """Tiny chunks (a partial top-k carried across 180+ chunks) give the exact k-th distance."""
    det = create("knn", k=10, chunk_size=7).fit(problem.fit_batches())
    np.testing.assert_allclose(
        det.score(problem.batches(problem.eval_x)).numpy(), reference(problem, "knn"), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("gap", [0.0, 30.0, 120.0])
def test_gen_over_every_class_equals_the_float64_sum_even_where_float32_underflows(gap):
    """M >= C: the sum over every class without sorting; rows whose top logit lies ``gap`` above the others (at
    120 every other exp(z_j - z_top) underflows float32, and p_top rounds to 1) keep every term, the top's
    (1 - p)^gamma included, as the float64 formula in log space gives them."""
    from scipy.special import log_softmax

    from oodviz import Batch
    from oodviz.detectors import create

    rng = np.random.default_rng(1)
    z = rng.normal(size=(300, 10)) * 2
    z[:100, 3] += gap
    log_p = log_softmax(z, axis=1)  # float64
    with np.errstate(divide="ignore"):  # p_top rounds to 1 in float64 too at gap 120: replaced below
        log_1mp = np.log1p(-np.exp(log_p))
    top = log_p.argmax(1)
    log_1mp[np.arange(len(z)), top] = np.logaddexp.reduce(
        np.where(np.arange(10) == top[:, None], -np.inf, log_p), axis=1
    )  # log(1 - p_top) = log sum of the others, exact
    expected = np.exp(0.1 * (log_p + log_1mp)).sum(1)
    ours = create("gen", m=100).score([Batch(logits=torch.tensor(z, dtype=torch.float32))]).double().numpy()
    np.testing.assert_allclose(ours, expected, rtol=2e-5)
