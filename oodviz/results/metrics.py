"""OOD metrics, OOD as the positive class (the convention of pytorch-ood 0.4 and OpenOOD v1.5).

Scores: higher = more OOD. With ``n`` ID and ``m`` OOD scores:

- ``auroc``: area under the ROC curve of OOD-vs-ID (``sklearn.metrics.roc_auc_score``; ties count
  one half);
- ``aupr_out``: average precision with OOD positive (``average_precision_score(is_ood, score)``);
- ``aupr_in``: average precision with ID positive and the negated score;
- ``fpr95``: the fraction of ID samples flagged as OOD at the highest threshold that flags at least
  95% of the OOD samples, i.e. the false-positive rate at the first ROC point with TPR >= 0.95.

All four are fractions in ``[0, 1]``, computed in float64.

Selective classification (:func:`risk_coverage`, :func:`aurc`, :func:`risk_at_coverage`): the score as a
reject rule on the ID test set, the classifier's error rate among the accepted samples against their share.
"""

from __future__ import annotations

import math

import numpy as np

RECALL_LEVEL = 0.95


def _as_scores(name: str, scores) -> np.ndarray:
    if hasattr(scores, "detach"):
        scores = scores.detach().cpu().numpy()
    values = np.asarray(scores, dtype=np.float64).reshape(-1)
    if values.size == 0:
        raise ValueError(f"ood_metrics: {name} is empty; it needs at least one score.")
    bad = ~np.isfinite(values)
    if bad.any():
        raise ValueError(
            f"ood_metrics: {name} has {int(bad.sum())} NaN or infinite score(s); "
            "fix the detector input (non-finite features or logits) before computing metrics."
        )
    return values


def fpr_at_recall(is_ood: np.ndarray, scores: np.ndarray, recall: float = RECALL_LEVEL) -> float:
    """False-positive rate (ID flagged) at the first threshold reaching ``recall`` of the OOD samples."""
    # here, not at import: the app reads metrics without scikit-learn (a third of its import time)
    from sklearn.metrics import roc_curve

    fpr, tpr, _ = roc_curve(is_ood, scores, drop_intermediate=False)
    return float(fpr[np.searchsorted(tpr, recall, side="left")])


def threshold_at_recall(ood_scores, recall: float = RECALL_LEVEL) -> float:
    """The highest threshold ``t`` with ``mean(ood_scores >= t) >= recall``: flagging ``score >= t``
    catches at least ``recall`` of the OOD samples. ``fpr95`` is the fraction of ID scores ``>= t``."""
    values = np.sort(_as_scores("ood_scores", ood_scores))[::-1]
    needed = max(1, math.ceil(recall * values.size - 1e-9))  # -1e-9: 0.95 * 20 must be 19, not 19.000000000000004
    return float(values[needed - 1])


def ood_metrics(id_scores, ood_scores) -> dict[str, float]:
    """``{"auroc", "aupr_in", "aupr_out", "fpr95"}`` for ID and OOD scores (higher = more OOD)."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    id_values = _as_scores("id_scores", id_scores)
    ood_values = _as_scores("ood_scores", ood_scores)
    scores = np.concatenate([id_values, ood_values])
    is_ood = np.concatenate([np.zeros(id_values.size, dtype=np.int8), np.ones(ood_values.size, dtype=np.int8)])
    return {
        "auroc": float(roc_auc_score(is_ood, scores)),
        "aupr_in": float(average_precision_score(1 - is_ood, -scores)),
        "aupr_out": float(average_precision_score(is_ood, scores)),
        "fpr95": fpr_at_recall(is_ood, scores),
    }


# -- selective classification -------------------------------------------------------------------------
COVERAGE_LEVEL = 0.95


def risk_coverage(scores, errors) -> dict[str, np.ndarray]:
    """The classifier's risk against coverage when the detector's score is a reject rule on ID samples.

    Accepting the samples with ``score <= t`` (the least OOD-looking first) covers ``coverage(t)`` of
    them with risk ``risk(t)`` = the error rate among the accepted. One point per distinct score
    (tied samples are accepted together: a threshold cannot split them), by increasing coverage.

    :param scores: ``[n]`` detector scores of the ID test samples, higher = more OOD
    :param errors: ``[n]`` booleans, the classifier's prediction is wrong
    :returns: ``{"thresholds", "coverage", "risk"}``, float64 arrays ``[k]`` (``k`` distinct scores);
        the last point has coverage 1 and the classifier's error rate as risk
    """
    values = _as_scores("scores", scores)
    wrong = np.asarray(errors, dtype=bool).reshape(-1)
    if wrong.shape != values.shape:
        raise ValueError(f"risk_coverage: {values.size} scores but {wrong.size} error flags; give one per sample")
    order = np.argsort(values, kind="stable")
    values, wrong = values[order], wrong[order]
    last_of_tie = np.flatnonzero(np.append(values[1:] != values[:-1], True))  # index of each threshold's last sample
    accepted = last_of_tie + 1.0
    return {
        "thresholds": values[last_of_tie],
        "coverage": accepted / values.size,
        "risk": np.cumsum(wrong, dtype=np.float64)[last_of_tie] / accepted,
    }


def aurc(curve: dict) -> float:
    """Area under the risk–coverage curve of :func:`risk_coverage`: each point's risk times the coverage
    it adds, ``sum_j risk_j (coverage_j - coverage_{j-1})``. Without ties this is the usual
    ``1/n sum_k risk(k most confident)`` (Geifman et al. 2019); lower is better; in ``[0, 1]``."""
    return float(np.sum(curve["risk"] * np.diff(curve["coverage"], prepend=0.0)))


def risk_at_coverage(curve: dict, coverage: float = COVERAGE_LEVEL) -> float:
    """The risk at the lowest threshold that accepts at least ``coverage`` of the samples."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    index = np.searchsorted(curve["coverage"], coverage - 1e-12, side="left")  # -1e-12: 0.95 of 20 is 19/20
    return float(curve["risk"][index])
