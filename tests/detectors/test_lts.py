"""oodviz.detectors.lts: against a float64 reference written here from its paper's equations and
against pytorch-ood 0.4 on the same inputs."""

import numpy as np
import pytest
import torch
from detector_checks import assert_formula, fitted_scores, float64_arrays
from helpers import assert_same_ranking
from pytorch_ood import detector as pood
from scipy.special import logsumexp

from oodviz.detectors import create


def lts_reference(ex, w, b, percentile):
    """The paper's logit scaling in float64 (the ReLU'd activations for the ratio, as the authors' code)."""
    a = np.maximum(ex, 0)
    k = a.shape[1] - int(np.round(a.shape[1] * percentile / 100))
    ratio = a.sum(1) / np.sort(a, axis=1)[:, ::-1][:, :k].sum(1)
    return -logsumexp((ex @ w.T + b) * ratio[:, None] ** 2, axis=1)


@pytest.mark.parametrize("percentile", [95.0, 70.0])
def test_lts_matches_pytorch_ood_and_the_float64_formula(problem, percentile):
    _, ours = fitted_scores(problem, "lts", percentile=percentile)
    linear = torch.nn.Linear(problem.weight.shape[1], len(problem.bias))
    with torch.no_grad():
        linear.weight.copy_(problem.weight)
        linear.bias.copy_(problem.bias)
        theirs = pood.LTS(None, linear, p=1 - percentile / 100).predict_features(problem.eval_x).double().numpy()
    assert_same_ranking(ours, theirs, n_id=len(problem.test_x))
    _, ex, w, b = float64_arrays(problem)
    assert_formula(ours, lts_reference(ex, w, b, percentile))


def test_lts_scale_factor_is_one_without_positive_activations_and_percentile_is_checked(problem):
    det = create("lts").fit(problem.fit_batches(), head=problem.head)
    torch.testing.assert_close(det.scale_factor(-torch.ones(2, 12)), torch.ones(2))
    with pytest.raises(ValueError, match="lts: percentile=99 prunes all D=12 features"):
        create("lts", percentile=99).fit(problem.fit_batches(), head=problem.head)
    with pytest.raises(ValueError, match="percentile is in percent"):
        create("lts", percentile=100)
