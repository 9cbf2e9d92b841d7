"""What the detectors' tests share: a detector fitted and scored on a synthetic problem (the ``problem`` fixtures),
that problem's arrays in float64 for the reference formulas, the comparison with such a formula, and the rank and
AUROC measures the model-based detectors are held to against pytorch-ood."""

import numpy as np
import torch
from scipy.stats import spearmanr

from oodviz.detectors import create
from oodviz.results.metrics import ood_metrics


def fitted_scores(problem, name, size=97, **params):
    """Detector ``name`` fitted on ``problem``'s ID fit rows in batches of ``size`` (with its head), and its scores
    of the eval rows (ID test, then OOD) as float64."""
    det = create(name, **params).fit(problem.fit_batches(size), head=problem.head)
    return det, det.score(problem.batches(problem.eval_x)).double().numpy()


def float64_arrays(problem):
    """Fit features, eval features (ID test then OOD), head weight and bias, in numpy float64."""
    as64 = lambda t: t.double().numpy()  # noqa: E731
    return as64(problem.fit_x), as64(problem.eval_x), as64(problem.weight), as64(problem.bias)


def assert_formula(ours, expected, rtol=1e-4):
    """``ours`` (float32 arithmetic) equals a float64 reference to ``rtol``, and to ``rtol / 10`` of its largest
    value near zero."""
    np.testing.assert_allclose(ours, expected, rtol=rtol, atol=rtol / 10 * np.abs(expected).max())


def spearman(a, b) -> float:
    return spearmanr(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)).statistic


def auroc(scores, n_id) -> float:
    """AUROC (OOD positive) of scores whose first ``n_id`` are the ID samples."""
    scores = torch.as_tensor(np.asarray(scores, dtype=np.float64))
    return ood_metrics(scores[:n_id], scores[n_id:])["auroc"]
