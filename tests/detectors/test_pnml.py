"""oodviz.detectors.pnml: against a float64 reference written here from its paper's equations and
against pytorch-ood 0.4 on the same inputs."""

import numpy as np
import pytest
import torch
from detector_checks import assert_formula, fitted_scores, float64_arrays
from helpers import assert_same_ranking
from pytorch_ood import detector as pood
from scipy.special import softmax

from oodviz.detectors import create


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
    _, ours = fitted_scores(problem, "pnml")
    assert_same_ranking(ours, pood_pnml(problem, problem.fit_x), n_id=len(problem.test_x))
    assert_formula(ours, pnml_reference(*float64_arrays(problem)))


def test_pnml_with_fewer_samples_than_features_uses_the_pseudo_inverse(problem):
    """N = 8 < D = 12: G is singular; its pseudo-inverse (the eigenpairs above the cutoff) gives kappa."""
    fit_x = problem.fit_x[:8]
    det = create("pnml").fit(problem.batches(fit_x, problem.fit_y[:8]), head=problem.head)
    ours = det.score(problem.batches(problem.eval_x)).double().numpy()
    assert det.gram_inverse_sqrt_.shape == (12, 8)
    fx, ex, w, b = float64_arrays(problem)
    assert_formula(ours, pnml_reference(fx[:8], ex, w, b))


def test_pnml_saturated_probabilities_give_finite_scores(problem):
    det = create("pnml").fit(problem.fit_batches(), head=(problem.weight * 1e3, problem.bias * 1e3))
    scores = det.score(problem.batches(problem.eval_x))
    assert torch.isfinite(scores).all() and (scores >= 0).all() and (scores <= 1).all()
    with pytest.raises(ValueError, match="needs a head of C >= 2 classes, got C = 1"):
        create("pnml").fit(problem.batches(problem.fit_x), head=(problem.weight[:1], problem.bias[:1]))
