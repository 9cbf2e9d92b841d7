"""ood_metrics against scikit-learn, a brute-force FPR95 and pytorch-ood's metrics."""

import numpy as np
import pytest
import torch
from pytorch_ood.metrics.functional import fpr_at_tpr
from sklearn.metrics import average_precision_score, roc_auc_score

from oodviz.results.metrics import ood_metrics


def _brute_force_fpr95(id_scores, ood_scores):
    """Scan thresholds from high to low: the first one flagging >= 95% of OOD (score >= t)."""
    for t in np.sort(np.unique(np.concatenate([id_scores, ood_scores])))[::-1]:
        if (ood_scores >= t).mean() >= 0.95:
            return (id_scores >= t).mean()
    return 1.0


@pytest.mark.parametrize("seed", range(5))
def test_matches_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    id_scores = rng.integers(0, 12, size=300).astype(float)  # heavy ties, also across ID and OOD
    ood_scores = rng.integers(4, 20, size=200).astype(float)
    m = ood_metrics(id_scores, ood_scores)
    y = np.r_[np.zeros(300), np.ones(200)]
    s = np.r_[id_scores, ood_scores]
    assert m["auroc"] == pytest.approx(roc_auc_score(y, s), abs=1e-9)
    assert m["aupr_out"] == pytest.approx(average_precision_score(y, s), abs=1e-9)
    assert m["aupr_in"] == pytest.approx(average_precision_score(1 - y, -s), abs=1e-9)
    assert m["fpr95"] == pytest.approx(_brute_force_fpr95(id_scores, ood_scores), abs=1e-12)
    labels = torch.tensor(np.r_[np.zeros(300), -np.ones(200)])
    assert m["fpr95"] == pytest.approx(float(fpr_at_tpr(torch.tensor(s), labels)), abs=1e-12)


def test_known_values_and_convention():
    perfect = ood_metrics([0.0, 0.1, 0.2], [0.9, 1.0])
    assert perfect == {"auroc": 1.0, "aupr_in": 1.0, "aupr_out": 1.0, "fpr95": 0.0}
    inverted = ood_metrics([0.9, 1.0], [0.0, 0.1, 0.2])  # higher score = more OOD, so this is the worst case
    assert inverted["auroc"] == 0.0 and inverted["fpr95"] == 1.0
    # OOD scores 1..20: 95% recall = 19 of 20, reached at threshold 2; an ID score of 1.5 is below it,
    # 2.5 above it. With OOD 1..40, 38 of 40 are needed: threshold 3.
    assert ood_metrics([1.5] * 10, np.arange(1, 21))["fpr95"] == 0.0
    assert ood_metrics([2.5] * 10, np.arange(1, 21))["fpr95"] == 1.0
    assert ood_metrics([2.5] * 10, np.arange(1, 41))["fpr95"] == 0.0
    assert ood_metrics([2.5] * 5 + [3.5] * 5, np.arange(1, 41))["fpr95"] == 0.5
    assert set(ood_metrics(torch.rand(5), torch.rand(5)).keys()) == {"auroc", "aupr_in", "aupr_out", "fpr95"}


def test_bad_scores_get_a_clear_error():
    with pytest.raises(ValueError, match="id_scores is empty"):
        ood_metrics([], [1.0])
    with pytest.raises(ValueError, match=r"ood_scores has 1 NaN or infinite"):
        ood_metrics([1.0, 2.0], [float("nan"), 3.0])
