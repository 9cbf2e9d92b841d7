"""oodviz.detectors.cadref (Ling et al., CVPR 2025): CADRef, CARef's error split by the sign of the head's weights,
against a float64 reference written here from the paper's equations (pytorch-ood 0.4 has none)."""

import numpy as np
import pytest
from detector_checks import assert_formula, float64_arrays
from scipy.special import logsumexp, softmax

from oodviz import Batch
from oodviz.detectors import create


def _fit_score(problem, name, **params):
    det = create(name, **params).fit(problem.fit_batches(97), head=problem.head)
    return det, det.score(problem.batches(problem.eval_x)).double().numpy()


def predicted_class_means(fx, w, b):
    """The mean fit feature of each class over the rows the head predicts as it, ``[C, D]``."""
    predicted = (fx @ w.T + b).argmax(1)
    return np.stack([fx[predicted == k].mean(0) for k in range(len(w))])


def cadref_reference(fx, ex, w, b, logit_score):
    """CADRef: E+ / S(x) + E- / mean S over the fit rows, the errors split by the sign of w_c."""
    scores = {
        "energy": lambda z: logsumexp(z, axis=1),
        "maxlogit": lambda z: z.max(1),
        "msp": lambda z: softmax(z, axis=1).max(1),
    }[logit_score]
    means = predicted_class_means(fx, w, b)
    z = ex @ w.T + b
    c = z.argmax(1)
    signed = (ex - means[c]) * np.sign(w[c])
    norms = np.abs(ex).sum(1)
    e_plus, e_minus = np.maximum(signed, 0).sum(1) / norms, np.maximum(-signed, 0).sum(1) / norms
    return e_plus / scores(z) + e_minus / scores(fx @ w.T + b).mean()


@pytest.mark.parametrize("logit_score", ["energy", "maxlogit", "msp"])
def test_cadref_is_the_decoupled_error_over_the_logit_scores(problem, logit_score):
    det, ours = _fit_score(problem, "cadref", logit_score=logit_score)
    fx, ex, w, b = float64_arrays(problem)
    expected = cadref_reference(fx, ex, w, b, logit_score)
    # E+ / S(x) amplifies the float32 rounding of the batch's logits where S(x) nears 0 (max logits here cross it)
    conditioned = np.abs((ex @ w.T + b).max(1)) > 1e-2 if logit_score == "maxlogit" else np.ones(len(ex), bool)
    assert conditioned.mean() > 0.95
    assert_formula(ours[conditioned], expected[conditioned], rtol=1e-5)
    assert det.mean_logit_score_ > 0


def test_cadref_parameters_and_a_non_positive_mean_logit_score_are_refused(problem):
    with pytest.raises(ValueError, match="logit_score must be one of energy, maxlogit, msp"):
        create("cadref", logit_score="gen")
    negative = [Batch(b.features, b.logits - 100, None) for b in problem.fit_batches()]
    with pytest.raises(ValueError, match="mean energy logit score .* not positive.*logit_score='msp'"):
        create("cadref").fit(negative, head=problem.head)
    create("cadref", logit_score="msp").fit(negative, head=problem.head)  # the same data, a positive score
