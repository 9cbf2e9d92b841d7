"""oodviz.detectors.neco: the principal share of the standardised feature, against a float64 reference written here
from its paper's equations."""

import numpy as np
import pytest
import torch
from detector_checks import assert_formula, fitted_scores, float64_arrays
from sklearn.decomposition import PCA
from sklearn.preprocessing import StandardScaler

from oodviz import Batch
from oodviz.detectors import create


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
    det, ours = fitted_scores(problem, "neco", dim=dim)
    fx, ex, _, _ = float64_arrays(problem)
    kept = fx.shape[1] // 2 if dim is None else dim
    expected = neco_reference(fx, ex, kept)
    assert_formula(ours, expected)
    assert det.components_.shape == (fx.shape[1], kept)
    # the authors' pipeline (scikit-learn's StandardScaler, then PCA.transform, which centres on the PCA mean)
    scaler = StandardScaler().fit(fx)
    reduced = PCA(fx.shape[1]).fit(scaler.transform(fx)).transform(scaler.transform(ex))[:, :kept]
    authors = -np.linalg.norm(reduced, axis=1) / np.linalg.norm(scaler.transform(ex), axis=1)
    assert_formula(ours, authors)


def test_neco_times_the_max_logit_reads_the_batch_logits_or_the_head(problem):
    _, ours = fitted_scores(problem, "neco", dim=4, max_logit=True)
    fx, ex, w, b = float64_arrays(problem)
    assert_formula(ours, neco_reference(fx, ex, 4) * (ex @ w.T + b).max(1))
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
    assert_formula(ours, -np.linalg.norm(reduced, axis=1) / np.linalg.norm(scaler.transform(ex), axis=1))
    assert det.deviations_[3] == 1.0


def test_neco_parameters_are_checked(problem):
    with pytest.raises(ValueError, match="neco: dim=12 must be between 1 and D-1 = 11"):
        create("neco", dim=12).fit(problem.fit_batches())
    with pytest.raises(ValueError, match="max_logit must be True or False"):
        create("neco", max_logit="yes")
