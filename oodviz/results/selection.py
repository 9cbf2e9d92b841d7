"""From a selection on a chart to the samples it covers: a score range on a histogram, an operating point
(or a stretch of operating points) on a ROC curve, points on the feature-space map.

The selections are plotly's, as ``st.plotly_chart(on_select="rerun")`` returns them (a dict with
``"points"``, ``"box"`` and ``"lasso"``); what they select is computed here, from ``scores.parquet``, so
that the app and the tests agree on it. **Higher score = more OOD**; a sample is flagged as OOD at
threshold ``t`` when ``score >= t`` (the convention of :mod:`oodviz.results.metrics`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from oodviz.results.tables import ID_SPLIT, OOD_SPLIT, SCORE_META_COLUMNS, check_detector

#: columns of a selected-samples table (:func:`samples_in_range`, :func:`operating_point_samples`)
SAMPLE_COLUMNS = (*SCORE_META_COLUMNS, "score", "class_name", "predicted_name")


def selected_range(selection: dict | None) -> tuple[float, float] | None:
    """``(low, high)`` on the x axis of a plotly selection: a box's x extent, a lasso's x extent (the
    smallest range holding the drawn outline), else the x extent of the selected points; ``None`` when
    nothing is selected."""
    selection = selection or {}
    for shape in ("box", "lasso"):
        drawn = selection.get(shape) or []
        if drawn and len(drawn[0].get("x", [])):
            xs = np.asarray(drawn[0]["x"], dtype=np.float64)
            return float(xs.min()), float(xs.max())
    xs = [p["x"] for p in selection.get("points") or [] if "x" in p]
    if xs:
        return float(min(xs)), float(max(xs))
    return None


def selected_traces(selection: dict | None, names: list[str]) -> list[str] | None:
    """The names (``names``: the chart's traces in order) of the traces a plotly selection's points lie on, in
    trace order: under a box or lasso over overlaid histograms, the sets drawn there (a set hidden from its legend
    has no bars to select). ``None`` when the selection carries no points, and so cannot say."""
    numbers = {p["curve_number"] for p in (selection or {}).get("points") or [] if p.get("curve_number") is not None}
    if not numbers:
        return None
    return [name for i, name in enumerate(names) if i in numbers]


def _named(rows: pd.DataFrame, detector: str, class_names) -> pd.DataFrame:
    names = [str(c) for c in class_names or []]

    def name(c: int) -> str:
        return "OOD" if c < 0 else (names[c] if c < len(names) else str(c))

    shown = rows[list(SCORE_META_COLUMNS)].assign(score=rows[detector].to_numpy(dtype=np.float64))
    shown["class_name"] = [name(int(c)) for c in shown.label]
    shown["predicted_name"] = [name(int(c)) for c in shown.prediction]
    return shown.reset_index(drop=True)


def samples_in_range(
    scores: pd.DataFrame, detector: str, low: float, high: float, class_names=None, datasets=None, with_id=True
) -> pd.DataFrame:
    """Every sample whose ``detector`` score ``s`` has ``low <= s <= high``: ID test first (unless ``with_id`` is
    False), then each OOD set in table order (only ``datasets`` when given), each by increasing score (ties in
    table order). Columns :data:`SAMPLE_COLUMNS`; ``class_name`` is the true class (``"OOD"`` for OOD rows)."""
    check_detector(scores, detector)
    values = scores[detector].to_numpy(dtype=np.float64)
    inside = scores[(values >= low) & (values <= high)]
    if datasets is not None:
        inside = inside[(inside.split == ID_SPLIT) | inside.dataset.isin(list(datasets))]
    if not with_id:
        inside = inside[inside.split != ID_SPLIT]
    order = {name: k for k, name in enumerate(dict.fromkeys(scores.dataset[scores.split == OOD_SPLIT]))}
    rank = np.where(inside.split == ID_SPLIT, -1, inside.dataset.map(order).fillna(len(order)))
    inside = inside.assign(_set=rank).sort_values(["_set", detector], kind="stable")
    return _named(inside, detector, class_names)


def operating_point_samples(
    scores: pd.DataFrame, detector: str, threshold: float, ood_dataset: str | None, class_names=None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """What goes wrong at ``threshold``: ``(false_alarms, misses)``, the ID test samples flagged as OOD
    (``score >= threshold``) by increasing score, i.e. nearest the threshold first, and the OOD samples of
    ``ood_dataset`` (every set for ``None``) accepted as ID (``score < threshold``) by decreasing score.
    Their counts over the set sizes are the ROC point's FPR and ``1 - TPR``."""
    check_detector(scores, detector)
    values = scores[detector].to_numpy(dtype=np.float64)
    is_id = (scores.split == ID_SPLIT).to_numpy()
    is_ood = (scores.split == OOD_SPLIT).to_numpy()
    if ood_dataset is not None:
        is_ood = is_ood & (scores.dataset == ood_dataset).to_numpy()
    flagged = scores[is_id & (values >= threshold)].sort_values(detector, kind="stable")
    missed = scores[is_ood & (values < threshold)].sort_values(detector, ascending=False, kind="stable")
    return _named(flagged, detector, class_names), _named(missed, detector, class_names)


def selected_curve_thresholds(curves_by_label: dict, selection: dict | None) -> dict[str, tuple[float, float]]:
    """``{label: (lowest, highest threshold)}`` of the ROC points selected on a figure drawn by
    :func:`oodviz.figures.plots.roc_figure` from ``curves_by_label`` (its traces in the same order), read from
    each curve's float64 ``roc_thresholds`` by point index; one point gives ``(t, t)``. Points of other
    traces (the chance line) and sklearn's infinite first threshold (NaN) are left out."""
    labels = list(curves_by_label)
    chosen: dict[str, list[float]] = {}
    for point in (selection or {}).get("points") or []:
        curve, index = point.get("curve_number"), point.get("point_index")
        if curve is None or index is None or not 0 <= curve < len(labels):
            continue
        thresholds = np.asarray(curves_by_label[labels[curve]]["roc_thresholds"], dtype=np.float64)
        if 0 <= index < len(thresholds) and np.isfinite(thresholds[index]):
            chosen.setdefault(labels[curve], []).append(float(thresholds[index]))
    return {label: (min(ts), max(ts)) for label, ts in chosen.items()}


def selected_samples(frame: pd.DataFrame, selection: dict | None) -> pd.DataFrame:
    """The rows of ``frame`` (e.g. a projection, :mod:`oodviz.figures.projection`) behind the selected points of a
    figure whose every trace carries ``customdata`` whose first column is the row number in ``frame``."""
    rows = [int(np.ravel(p["customdata"])[0]) for p in (selection or {}).get("points") or [] if "customdata" in p]
    return frame.iloc[sorted({r for r in rows if 0 <= r < len(frame)})]
