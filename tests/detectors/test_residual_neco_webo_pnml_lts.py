"""Issue 29's post-hoc detectors: residual, neco, weightedebo, pnml, lts. Each against a float64 reference written
here from its paper's equations; weightedebo, pnml and lts also against pytorch-ood 0.4 on the same inputs."""

import numpy as np
import pytest
import torch
from helpers import assert_same_ranking
from pytorch_ood import detector as pood
from scipy.special import logsumexp, softmax
from sklearn.decomposition import PCA
from sklearn.preprocessing import StandardScaler

from oodviz import Batch
from oodviz.detectors import create


def _ours(problem, name, size=97, **params):
    det = create(name, **params).fit(problem.fit_batches(size), head=problem.head)
    return det, det.score(problem.batches(problem.eval_x)).double().numpy()


def _float64(problem):
    """Fit features, eval features (ID test then OOD), head weight and bias, in numpy float64."""
    as64 = lambda t: t.double().numpy()  # noqa: E731
    return as64(problem.fit_x), as64(problem.eval_x), as64(problem.weight), as64(problem.bias)


def _assert_formula(ours, expected):
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


# ---- residual ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [None, 3, 9])
def test_residual_is_the_norm_outside_the_principal_subspace_about_the_head_origin(problem, dim):
    det, ours = _ours(problem, "residual", dim=dim)
    fx, ex, w, b = _float64(problem)
    u = -np.linalg.pinv(w) @ b  # ViM's origin, where every logit is 0
    eigenvalues, eigenvectors = np.linalg.eigh((fx - u).T @ (fx - u) / len(fx))
    kept = fx.shape[1] // 2 if dim is None else dim
    residual_space = eigenvectors[:, np.argsort(eigenvalues)[: fx.shape[1] - kept]]
    _assert_formula(ours, np.linalg.norm((ex - u) @ residual_space, axis=1))
    assert det.residual_space_.shape == (fx.shape[1], fx.shape[1] - kept)


def test_residual_is_vims_virtual_logit_over_alpha(problem):
    """The same fit as vim's first pass: vim's score plus its energy, divided by its alpha, is residual's score."""
    _, ours = _ours(problem, "residual", dim=4)
    vim = create("vim", dim=4).fit(problem.fit_batches(97), head=problem.head)
    logits = problem.logits(problem.eval_x)
    virtual_logit = (vim.score(problem.batches(problem.eval_x)) + torch.logsumexp(logits, dim=1)) / vim.alpha_
    np.testing.assert_allclose(ours, virtual_logit.double().numpy(), rtol=1e-4, atol=1e-5)


def test_residual_dim_must_leave_a_residual(problem):
    with pytest.raises(ValueError, match="residual: dim=12 must be between 1 and D-1 = 11"):
        create("residual", dim=12).fit(problem.fit_batches(), head=problem.head)
    with pytest.raises(ValueError, match="residual: dim .* must be a positive integer or None"):
        create("residual", dim=0)
    with pytest.raises(ValueError, match="residual needs the classifier's final linear layer"):
        create("residual").fit(problem.fit_batches())


# ---- neco --------------------------------------------------------------------------------------


def neco_reference(fx, ex, dim):
    """Eq. 6 of the paper in float64: standardise with the ID mean and deviations, the dim leading eigenvectors of the
    standardised features' covariance, the norm of the projection over the norm."""
    mean, deviations = fx.mean(0), fx.std(0)
    z_fit, z = (fx - mean) / deviations, (ex - mean) / deviations
    eigenvalues, eigenvectors = np.linalg.eigh(z_fit.T @ z_fit / len(fx))
    principal = eigenvectors[:, np.argsort(eigenvalues)[::-1][:dim]]
    return -np.linalg.norm(z @ principal, axis=1) / np.linalg.norm(z, axis=1)


@pytest.mark.parametrize("dim", [None, 2, 8])
def test_neco_is_the_principal_share_of_the_standardised_feature(problem, dim):
    det, ours = _ours(problem, "neco", dim=dim)
    fx, ex, _, _ = _float64(problem)
    kept = fx.shape[1] // 2 if dim is None else dim
    expected = neco_reference(fx, ex, kept)
    _assert_formula(ours, expected)
    assert det.components_.shape == (fx.shape[1], kept)
    # the authors' pipeline (scikit-learn's StandardScaler, then PCA.transform, which centres on the PCA mean)
    scaler = StandardScaler().fit(fx)
    reduced = PCA(fx.shape[1]).fit(scaler.transform(fx)).transform(scaler.transform(ex))[:, :kept]
    authors = -np.linalg.norm(reduced, axis=1) / np.linalg.norm(scaler.transform(ex), axis=1)
    _assert_formula(ours, authors)


def test_neco_times_the_max_logit_reads_the_batch_logits_or_the_head(problem):
    _, ours = _ours(problem, "neco", dim=4, max_logit=True)
    fx, ex, w, b = _float64(problem)
    _assert_formula(ours, neco_reference(fx, ex, 4) * (ex @ w.T + b).max(1))
    det = create("neco", dim=4, max_logit=True).fit(problem.fit_batches(), head=problem.head)
    features_only = [Batch(features=batch.features) for batch in problem.batches(problem.eval_x)]
    np.testing.assert_allclose(det.score(features_only).numpy(), ours, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"max_logit=True .* pass the classifier's final linear layer"):
        create("neco", max_logit=True).fit(problem.fit_batches())


def test_neco_survives_a_large_offset_and_a_constant_feature():
    """Features 1e3 from the origin standardise in float64; a constant feature gets the deviation 1 (StandardScaler's)."""
    g = torch.Generator().manual_seed(5)
    fit = 1e3 + torch.randn(400, 10, generator=g, dtype=torch.float64) * torch.linspace(
        0.05, 3, 10, dtype=torch.float64
    )
    fit[:, 3] = 1e3
    ev = 1e3 + 2 * torch.randn(50, 10, generator=g, dtype=torch.float64)
    det = create("neco", dim=3).fit(Batch(features=fit.float()))
    ours = det.score(Batch(features=ev.float())).double().numpy()
    fx, ex = fit.float().double().numpy(), ev.float().double().numpy()
    scaler = StandardScaler().fit(fx)
    reduced = PCA(10).fit(scaler.transform(fx)).transform(scaler.transform(ex))[:, :3]
    _assert_formula(ours, -np.linalg.norm(reduced, axis=1) / np.linalg.norm(scaler.transform(ex), axis=1))
    assert det.deviations_[3] == 1.0


def test_neco_parameters_are_checked(problem):
    with pytest.raises(ValueError, match="neco: dim=12 must be between 1 and D-1 = 11"):
        create("neco", dim=12).fit(problem.fit_batches())
    with pytest.raises(ValueError, match="max_logit must be True or False"):
        create("neco", max_logit="yes")


# ---- weightedebo -------------------------------------------------------------------------------


def class_weights(n_classes, seed=2):
    """VOS-like weights: mostly positive, one negative (clipped to 0 by the method)."""
    weights = torch.rand(n_classes, generator=torch.Generator().manual_seed(seed)) * 2
    weights[1] = -0.5
    return weights


def test_weightedebo_matches_pytorch_ood_and_the_float64_formula(problem):
    weights = class_weights(len(problem.bias))
    _, ours = _ours(problem, "weightedebo", weights=weights.tolist())
    logits = problem.logits(problem.eval_x)
    theirs = pood.WeightedEBO(None, weights.view(1, -1)).predict_logits(logits).double().numpy()
    assert_same_ranking(ours, theirs, n_id=len(problem.test_x))
    z = logits.double().numpy()
    _assert_formula(ours, -np.log((np.maximum(weights.double().numpy(), 0) * np.exp(z)).sum(1)))


def test_weightedebo_without_weights_is_the_energy_and_large_logits_do_not_overflow(problem):
    batches = problem.batches(problem.eval_x)
    energy = create("energy").score(batches)
    torch.testing.assert_close(create("weightedebo").score(batches), energy)
    torch.testing.assert_close(create("weightedebo", weights=[1.0] * len(problem.bias)).score(batches), energy)
    large = Batch(logits=torch.tensor([[500.0, 0.0, -3.0]]))
    weights = [0.5, 2.0, 1.0]
    score = create("weightedebo", weights=weights).score(large)
    assert torch.isfinite(score).all() and float(score) == pytest.approx(-(500 + np.log(0.5)), rel=1e-6)
    assert not torch.isfinite(pood.WeightedEBO(None, torch.tensor(weights)).predict_logits(large.logits)).all()


def test_weightedebo_weights_are_checked(problem):
    assert create("weightedebo", weights=torch.ones(1, 3)).weights == [1.0, 1.0, 1.0]  # Linear(C, 1).weight
    with pytest.raises(ValueError, match="weights must be C finite numbers"):
        create("weightedebo", weights=[1.0, float("nan")])
    with pytest.raises(ValueError, match="at least one of the weights must be positive"):
        create("weightedebo", weights=[0.0, -1.0])
    with pytest.raises(ValueError, match="2 weights for logits of 6 classes"):
        create("weightedebo", weights=[1.0, 2.0]).score(problem.batches(problem.test_x))


# ---- pnml --------------------------------------------------------------------------------------


def pnml_reference(fx, ex, w, b):
    """Eq. 20 of the paper over log C in float64: G = X^T X of the normalised training features, kappa from G^+, the
    head's probabilities on the normalised test feature."""
    unit = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)  # noqa: E731
    x = unit(ex)
    quadratic = np.einsum("nd,de,ne->n", x, np.linalg.pinv(unit(fx).T @ unit(fx)), x)
    kappa = (quadratic / (1 + quadratic))[:, None]
    p = softmax(x @ w.T + b, axis=1)
    return np.log((p / (p + (1 - p) * p**kappa)).sum(1)) / np.log(p.shape[1])


def pood_pnml(problem, fit_x):
    linear = torch.nn.Linear(problem.weight.shape[1], len(problem.bias))
    with torch.no_grad():
        linear.weight.copy_(problem.weight)
        linear.bias.copy_(problem.bias)
        detector = pood.PNML(None, linear).fit_features(fit_x, torch.zeros(len(fit_x), dtype=torch.long))
        return detector.predict_features(problem.eval_x).double().numpy()


def test_pnml_matches_pytorch_ood_and_the_float64_formula(problem):
    _, ours = _ours(problem, "pnml")
    assert_same_ranking(ours, pood_pnml(problem, problem.fit_x), n_id=len(problem.test_x))
    _assert_formula(ours, pnml_reference(*_float64(problem)))


def test_pnml_with_fewer_samples_than_features_uses_the_pseudo_inverse(problem):
    """N = 8 < D = 12: G is singular; its pseudo-inverse (the eigenpairs above the cutoff) gives kappa."""
    fit_x = problem.fit_x[:8]
    det = create("pnml").fit(problem.batches(fit_x, problem.fit_y[:8]), head=problem.head)
    ours = det.score(problem.batches(problem.eval_x)).double().numpy()
    assert det.gram_inverse_sqrt_.shape == (12, 8)
    fx, ex, w, b = _float64(problem)
    _assert_formula(ours, pnml_reference(fx[:8], ex, w, b))


def test_pnml_saturated_probabilities_give_finite_scores(problem):
    det = create("pnml").fit(problem.fit_batches(), head=(problem.weight * 1e3, problem.bias * 1e3))
    scores = det.score(problem.batches(problem.eval_x))
    assert torch.isfinite(scores).all() and (scores >= 0).all() and (scores <= 1).all()
    with pytest.raises(ValueError, match="needs a head of C >= 2 classes, got C = 1"):
        create("pnml").fit(problem.batches(problem.fit_x), head=(problem.weight[:1], problem.bias[:1]))


# ---- lts ---------------------------------------------------------------------------------------


def lts_reference(ex, w, b, percentile):
    """The paper's logit scaling in float64 (the ReLU'd activations for the ratio, as the authors' code)."""
    a = np.maximum(ex, 0)
    k = a.shape[1] - int(np.round(a.shape[1] * percentile / 100))
    ratio = a.sum(1) / np.sort(a, axis=1)[:, ::-1][:, :k].sum(1)
    return -logsumexp((ex @ w.T + b) * ratio[:, None] ** 2, axis=1)


@pytest.mark.parametrize("percentile", [95.0, 70.0])
def test_lts_matches_pytorch_ood_and_the_float64_formula(problem, percentile):
    _, ours = _ours(problem, "lts", percentile=percentile)
    linear = torch.nn.Linear(problem.weight.shape[1], len(problem.bias))
    with torch.no_grad():
        linear.weight.copy_(problem.weight)
        linear.bias.copy_(problem.bias)
        theirs = pood.LTS(None, linear, p=1 - percentile / 100).predict_features(problem.eval_x).double().numpy()
    assert_same_ranking(ours, theirs, n_id=len(problem.test_x))
    _, ex, w, b = _float64(problem)
    _assert_formula(ours, lts_reference(ex, w, b, percentile))


def test_lts_scale_factor_is_one_without_positive_activations_and_percentile_is_checked(problem):
    det = create("lts").fit(problem.fit_batches(), head=problem.head)
    torch.testing.assert_close(det.scale_factor(-torch.ones(2, 12)), torch.ones(2))
    with pytest.raises(ValueError, match="lts: percentile=99 prunes all D=12 features"):
        create("lts", percentile=99).fit(problem.fit_batches(), head=problem.head)
    with pytest.raises(ValueError, match="percentile is in percent"):
        create("lts", percentile=100)
