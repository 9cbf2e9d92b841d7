"""oodviz.detectors.gmm: parity with pytorch-ood 0.4 on the same inputs, float64 reference formulas written independently here (scipy),
and bad input."""

import numpy as np
import pytest
import torch
from detector_checks import fitted_scores
from helpers import assert_same_ranking, make_problem
from pytorch_ood import detector as pood
from scipy.special import logsumexp

from oodviz.detectors import create


def _gmm_reference(fx, fy, ex, reg):
    """float64 negative log-likelihood of the class-conditional mixture, with scipy's multivariate normal."""
    from scipy.stats import multivariate_normal

    classes = np.unique(fy)
    terms = []
    for c in classes:
        xc = fx[fy == c]
        cov = np.cov(xc, rowvar=False, bias=True) + reg * np.eye(fx.shape[1])
        terms.append(np.log(len(xc) / len(fx)) + multivariate_normal(xc.mean(0), cov).logpdf(ex))
    return -logsumexp(np.stack(terms, axis=1), axis=1)


@pytest.mark.parametrize("reg", [1e-6, 0.5])
def test_gmm_matches_pytorch_ood_and_scipy(problem, reg):
    det, ours = fitted_scores(problem, "gmm", reg=reg)
    theirs = pood.GMM(None, reg=reg).fit_features(problem.fit_x, problem.fit_y).predict_features(problem.eval_x)
    assert_same_ranking(ours, theirs.double().numpy(), n_id=len(problem.test_x))
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-5)  # the same number, not just the ranking
    fx, fy, ex = problem.fit_x.double().numpy(), problem.fit_y.numpy(), problem.eval_x.double().numpy()
    np.testing.assert_allclose(ours, _gmm_reference(fx, fy, ex, reg), rtol=1e-5)


def test_gmm_is_exact_under_a_large_feature_offset():
    """Per-class shifts: features ~1e4 from the origin with unit spread give the same covariances."""
    p = make_problem(offset=1e4)
    det, ours = fitted_scores(p, "gmm", size=13)
    fx, fy, ex = p.fit_x.double().numpy(), p.fit_y.numpy(), p.eval_x.double().numpy()
    for c in range(6):
        np.testing.assert_allclose(det.class_means_[c].numpy(), fx[fy == c].mean(0), rtol=1e-12)
    np.testing.assert_allclose(ours, _gmm_reference(fx, fy, ex, 1e-6), rtol=1e-6)


def test_gmm_needs_reg_for_a_class_with_fewer_samples_than_dimensions(problem):
    y = problem.fit_y.clone()
    few = torch.nonzero(y == 4).flatten()[5:]
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[few] = False  # class 4 keeps 5 samples in D = 12: a rank-4 covariance
    batches = problem.batches(problem.fit_x[keep], y[keep])
    with pytest.raises(ValueError, match=r"covariance of class 4 \(5 samples, D=12\) is not positive definite"):
        create("gmm", reg=0).fit(batches)
    det = create("gmm", reg=1e-3).fit(batches)
    assert torch.isfinite(det.score(problem.batches(problem.eval_x))).all()
    with pytest.raises(ValueError, match="reg must be a finite number >= 0"):
        create("gmm", reg=-1)
