"""oodviz.detectors.weightedebo: against a float64 reference written here from its paper's equations and
against pytorch-ood 0.4 on the same inputs."""

import numpy as np
import pytest
import torch
from detector_checks import assert_formula, fitted_scores
from helpers import assert_same_ranking
from pytorch_ood import detector as pood

from oodviz import Batch
from oodviz.detectors import create


def class_weights(n_classes, seed=2):
    """VOS-like weights: mostly positive, one negative (clipped to 0 by the method)."""
    weights = torch.rand(n_classes, generator=torch.Generator().manual_seed(seed)) * 2
    weights[1] = -0.5
    return weights


def test_weightedebo_matches_pytorch_ood_and_the_float64_formula(problem):
    weights = class_weights(len(problem.bias))
    _, ours = fitted_scores(problem, "weightedebo", weights=weights.tolist())
    logits = problem.logits(problem.eval_x)
    theirs = pood.WeightedEBO(None, weights.view(1, -1)).predict_logits(logits).double().numpy()
    assert_same_ranking(ours, theirs, n_id=len(problem.test_x))
    z = logits.double().numpy()
    assert_formula(ours, -np.log((np.maximum(weights.double().numpy(), 0) * np.exp(z)).sum(1)))


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
