"""From a chart selection to its samples (oodviz.results.selection), checked against brute force over the rows."""

import numpy as np
import pandas as pd
import pytest

from oodviz.figures.plots import roc_figure
from oodviz.results.analysis import curves
from oodviz.results.selection import (
    SAMPLE_COLUMNS,
    operating_point_samples,
    samples_in_range,
    selected_curve_thresholds,
    selected_range,
    selected_samples,
)

CLASSES = ["zero", "one", "two"]


@pytest.fixture
def scores():
    rng = np.random.default_rng(3)
    parts = [
        pd.DataFrame({"split": "id_test", "dataset": "id", "label": rng.integers(0, 3, 60)}),
        pd.DataFrame({"split": "ood", "dataset": "far", "label": -1}, index=range(30)),
        pd.DataFrame({"split": "ood", "dataset": "near", "label": -1}, index=range(25)),
    ]
    frame = pd.concat(parts, ignore_index=True)
    frame["index"] = np.arange(len(frame)) * 7
    frame["prediction"] = rng.integers(0, 3, len(frame))
    shift = np.where(frame.split == "ood", 1.5, 0.0)
    frame["energy"] = (rng.normal(size=len(frame)) + shift).round(1).astype(np.float32)  # ties on purpose
    return frame[["split", "dataset", "index", "label", "prediction", "energy"]]


def test_a_box_a_lasso_or_points_give_the_x_range():
    assert selected_range({"box": [{"x": [2.5, -1.0], "y": [0, 3]}], "points": []}) == (-1.0, 2.5)
    lasso = {"lasso": [{"x": [0.2, 1.7, 0.9, -0.3], "y": [0, 1, 2, 1]}], "box": []}
    assert selected_range(lasso) == (-0.3, 1.7)
    assert selected_range({"points": [{"x": 3.0}, {"x": 1.0}], "box": [], "lasso": []}) == (1.0, 3.0)
    assert selected_range({"points": [], "box": [], "lasso": []}) is None and selected_range(None) is None


def test_samples_in_a_score_range_are_every_row_inside_per_set_lowest_first(scores):
    low, high = -0.35, 1.2
    table = samples_in_range(scores, "energy", low, high, CLASSES)
    assert tuple(table.columns) == SAMPLE_COLUMNS
    expected = []
    for dataset in ("id", "far", "near"):  # brute force: every row, set by set, sorted by (score, row)
        rows = [
            (float(r.energy), k)
            for k, r in enumerate(scores.itertuples())
            if r.dataset == dataset and low <= float(r.energy) <= high
        ]
        expected += [k for _, k in sorted(rows)]
    assert table["index"].tolist() == scores["index"].iloc[expected].tolist()
    assert np.array_equal(table.score.to_numpy(), scores.energy.iloc[expected].to_numpy(dtype=np.float64))
    ids = table[table.split == "id_test"]
    assert ids.class_name.tolist() == [CLASSES[c] for c in ids.label]
    assert table.predicted_name.tolist() == [CLASSES[c] for c in table.prediction]
    assert set(table[table.split == "ood"].class_name) == {"OOD"}
    only_near = samples_in_range(scores, "energy", low, high, CLASSES, datasets=["near"])
    assert set(only_near.dataset) == {"id", "near"}


def test_a_roc_point_selects_its_false_alarms_and_misses_with_the_curves_rates(scores):
    curve = curves(scores, "energy", "near")
    fig = roc_figure({"near": curve})
    k = len(curve["fpr"]) // 2
    threshold = float(curve["roc_thresholds"][k])
    picked = selected_curve_thresholds({"near": curve}, {"points": [{"curve_number": 0, "point_index": k}]})
    assert picked == {"near": (threshold, threshold)}
    assert fig.data[0].customdata[k] == np.float32(threshold)  # the figure's point is that threshold
    false_alarms, misses = operating_point_samples(scores, "energy", threshold, "near", CLASSES)
    n_id, n_near = (scores.split == "id_test").sum(), (scores.dataset == "near").sum()
    assert len(false_alarms) / n_id == pytest.approx(curve["fpr"][k])  # the point's own rates
    assert 1 - len(misses) / n_near == pytest.approx(curve["tpr"][k])
    assert (false_alarms.score >= threshold).all() and (misses.score < threshold).all()
    assert false_alarms.score.is_monotonic_increasing and misses.score.is_monotonic_decreasing
    several = {"points": [{"curve_number": 0, "point_index": i} for i in (1, k, k + 1)] + [{"curve_number": 1}]}
    chosen = [float(curve["roc_thresholds"][i]) for i in (1, k, k + 1)]
    assert selected_curve_thresholds({"near": curve}, several) == {"near": (min(chosen), max(chosen))}
    first = {"points": [{"curve_number": 0, "point_index": 0}]}  # sklearn's infinite threshold: no point
    assert selected_curve_thresholds({"near": curve}, first) == {}


def test_selected_points_map_back_to_their_rows_by_customdata(scores):
    selection = {"points": [{"customdata": [4, "x"]}, {"customdata": 2}, {"customdata": [4]}, {"x": 1}]}
    assert selected_samples(scores, selection)["index"].tolist() == [14, 28]
