"""oodviz.detectors.caref (Ling et al., CVPR 2025): CARef against a float64 reference written here from the paper's
equations (pytorch-ood 0.4 has none)."""

import numpy as np
import pytest
import torch
from detector_checks import assert_formula, float64_arrays

from oodviz import Batch
from oodviz.detectors import create


def _fit_score(problem, name, **params):
    det = create(name, **params).fit(problem.fit_batches(97), head=problem.head)
    return det, det.score(problem.batches(problem.eval_x)).double().numpy()


def predicted_class_means(fx, w, b):
    """The mean fit feature of each class over the rows the head predicts as it, ``[C, D]``."""
    predicted = (fx @ w.T + b).argmax(1)
    return np.stack([fx[predicted == k].mean(0) for k in range(len(w))])


def caref_reference(fx, ex, w, b):
    """CARef: |x - mu_c|_1 / |x|_1 with c the predicted class."""
    means = predicted_class_means(fx, w, b)
    c = (ex @ w.T + b).argmax(1)
    return np.abs(ex - means[c]).sum(1) / np.abs(ex).sum(1)


def test_caref_is_the_relative_l1_error_from_the_predicted_class_mean(problem):
    det, ours = _fit_score(problem, "caref")
    fx, ex, w, b = float64_arrays(problem)
    assert_formula(ours, caref_reference(fx, ex, w, b), rtol=1e-5)
    np.testing.assert_allclose(det.class_means_.numpy(), predicted_class_means(fx, w, b), rtol=1e-12)


def test_the_predicted_class_comes_from_the_batch_logits_when_present(problem):
    """Batch logits that predict class 0 for every row (the head would not): the other classes have no mean."""
    class_0 = torch.zeros(len(problem.bias))
    class_0[0] = 1.0
    only_class_0 = [Batch(b.features, class_0.expand(len(b), -1)) for b in problem.fit_batches()]
    with pytest.raises(ValueError, match=r"caref cannot fit: class\(es\) 1, 2, 3, 4, 5 have no fit samples predicted"):
        create("caref").fit(only_class_0, head=problem.head)


def test_an_all_zero_feature_scores_finite(problem):
    det = create("caref").fit(problem.fit_batches(), head=problem.head)
    zero = Batch(np.zeros((1, problem.fit_x.shape[1]), dtype=np.float32))
    assert np.isfinite(det.score(zero).numpy()).all()
