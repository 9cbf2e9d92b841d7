"""oodviz.detectors.residual: the norm outside the principal subspace, against a float64 reference written here
from its paper's equations."""

import numpy as np
import pytest
import torch
from detector_checks import assert_formula, fitted_scores, float64_arrays

from oodviz.detectors import create


@pytest.mark.parametrize("dim", [None, 3, 9])
def test_residual_is_the_norm_outside_the_principal_subspace_about_the_head_origin(problem, dim):
    det, ours = fitted_scores(problem, "residual", dim=dim)
    fx, ex, w, b = float64_arrays(problem)
    u = -np.linalg.pinv(w) @ b  # ViM's origin, where every logit is 0
    eigenvalues, eigenvectors = np.linalg.eigh((fx - u).T @ (fx - u) / len(fx))
    kept = fx.shape[1] // 2 if dim is None else dim
    residual_space = eigenvectors[:, np.argsort(eigenvalues)[: fx.shape[1] - kept]]
    assert_formula(ours, np.linalg.norm((ex - u) @ residual_space, axis=1))
    assert det.residual_space_.shape == (fx.shape[1], fx.shape[1] - kept)


def test_residual_is_vims_virtual_logit_over_alpha(problem):
    """The same fit as vim's first pass: vim's score plus its energy, divided by its alpha, is residual's score."""
    _, ours = fitted_scores(problem, "residual", dim=4)
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
