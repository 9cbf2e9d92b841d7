"""oodviz.results.tables: the result schema, the derived tables (metrics, per-class, group means, best detector), loading."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from helpers import brute_force_threshold, synthetic_scores
from sklearn.metrics import average_precision_score, roc_auc_score

from oodviz.results import tables as R


@pytest.fixture(scope="module")
def scores():
    return synthetic_scores()


GROUPS = {"far-set": "far", "near-set": "near"}


# ---- the scores table ---------------------------------------------------------------------------


def test_detectors_and_datasets_of(scores):
    assert R.detectors_of(scores) == ["det", "tied"]
    assert R.ood_datasets_of(scores) == ["far-set", "near-set"]
    assert R.id_dataset_of(scores) == "id-set"
    with pytest.raises(ValueError, match="No scores for detector 'nope'; this run has: det, tied"):
        R.check_detector(scores, "nope")
    with pytest.raises(ValueError, match="No scores for detector 'label'"):
        R.check_detector(scores, "label")  # a column, but not a detector's
    with pytest.raises(ValueError, match="it has: far-set, near-set"):
        R.default_threshold(scores, "det", "id-set")
    with pytest.raises(ValueError, match="split must be 'id_test' or 'ood', got 'id_fit'"):
        R.score_frame("id_fit", "digits-train", [0], [1], [1])


def test_score_frame_is_the_meta_columns_of_scores_parquet():
    frame = R.score_frame("ood", "noise", np.array([4, 7]), np.array([-1, -1]), np.array([2, 0]))
    assert list(frame.columns) == ["split", "dataset", "index", "label", "prediction"]
    assert frame.to_dict("list") == {
        "split": ["ood", "ood"],
        "dataset": ["noise", "noise"],
        "index": [4, 7],
        "label": [-1, -1],
        "prediction": [2, 0],
    }


@pytest.mark.parametrize("detector", ["det", "tied"])
def test_default_threshold_is_the_highest_that_flags_95_percent_of_ood(scores, detector):
    pooled = scores.loc[scores.split == "ood", detector].to_numpy(np.float64)
    t = R.default_threshold(scores, detector)
    assert t == brute_force_threshold(pooled)
    assert (pooled >= t).mean() >= 0.95 > (pooled > t).mean()  # the next higher threshold misses too many
    near = scores.loc[scores.dataset == "near-set", detector].to_numpy(np.float64)
    assert R.default_threshold(scores, detector, "near-set") == brute_force_threshold(near)
    assert R.default_threshold(scores, detector, recall=0.5) == brute_force_threshold(pooled, recall=0.5)


# ---- metrics.csv --------------------------------------------------------------------------------


def test_metrics_table_agrees_with_sklearn_and_a_brute_force_fpr95(scores):
    table = R.metrics_table(scores, GROUPS)
    assert list(table.columns) == [
        "detector",
        "ood_dataset",
        "group",
        "auroc",
        "aupr_in",
        "aupr_out",
        "fpr95",
        "id_accuracy",
        "aurc",
        "risk_at_95_coverage",
        "threshold",
    ]
    assert list(zip(table.detector, table.ood_dataset)) == [
        (d, o) for d in ("det", "tied") for o in ("far-set", "near-set", "far (mean)", "near (mean)")
    ]
    id_rows = scores[scores.split == "id_test"]
    accuracy = np.mean(id_rows.label.to_numpy() == id_rows.prediction.to_numpy())
    for row in table.itertuples():
        # one dataset per group: its mean row is that dataset's
        dataset = {"far (mean)": "far-set", "near (mean)": "near-set"}.get(row.ood_dataset, row.ood_dataset)
        id_v = id_rows[row.detector].to_numpy(np.float64)
        ood_v = scores.loc[scores.dataset == dataset, row.detector].to_numpy(np.float64)
        y, both = np.r_[np.zeros(id_v.size), np.ones(ood_v.size)], np.r_[id_v, ood_v]
        assert row.group == GROUPS[dataset]
        assert row.auroc == pytest.approx(roc_auc_score(y, both), abs=1e-12)
        assert row.aupr_out == pytest.approx(average_precision_score(y, both), abs=1e-12)
        assert row.aupr_in == pytest.approx(average_precision_score(1 - y, -both), abs=1e-12)
        assert row.fpr95 == pytest.approx(np.mean(id_v >= brute_force_threshold(ood_v)), abs=1e-15)
        assert row.id_accuracy == pytest.approx(accuracy, abs=1e-15)
        if row.ood_dataset.endswith("(mean)"):
            assert math.isnan(row.threshold)
        else:
            assert row.threshold == brute_force_threshold(ood_v)


def test_group_means_average_the_datasets_of_each_group(scores):
    both_far = R.metrics_table(scores, {"far-set": "far", "near-set": "far"})
    assert list(both_far.ood_dataset) == ["far-set", "near-set", "far (mean)"] * 2
    for detector in ("det", "tied"):
        rows = both_far[both_far.detector == detector].set_index("ood_dataset")
        for key in ("auroc", "aupr_in", "aupr_out", "fpr95"):
            expected = (rows.loc["far-set", key] + rows.loc["near-set", key]) / 2
            assert rows.loc["far (mean)", key] == pytest.approx(expected, abs=1e-15)
    wide = R.group_means(R.metrics_table(scores, GROUPS), values=("auroc", "fpr95"))
    assert list(wide.index) == ["det", "tied"]
    assert list(wide.columns) == [("auroc", "far"), ("auroc", "near"), ("fpr95", "far"), ("fpr95", "near")]
    id_v = scores.loc[scores.split == "id_test", "tied"].to_numpy(np.float64)
    near = scores.loc[scores.dataset == "near-set", "tied"].to_numpy(np.float64)
    y = np.r_[np.zeros(id_v.size), np.ones(near.size)]
    assert wide.loc["tied", ("auroc", "near")] == pytest.approx(roc_auc_score(y, np.r_[id_v, near]), abs=1e-12)


def test_best_detector_ranks_by_the_mean_over_datasets_not_the_group_means():
    """b wins on the mean AUROC over its three datasets (0.733 > 0.73); a would win on the group means
    (0.795 > 0.675) or on every row averaged (0.756 > 0.71)."""
    metrics = pd.DataFrame(
        {
            "detector": ["a"] * 5 + ["b"] * 5,
            "ood_dataset": ["n1", "f1", "f2", "near (mean)", "far (mean)"] * 2,
            "auroc": [0.99, 0.6, 0.6, 0.99, 0.6, 0.5, 0.85, 0.85, 0.5, 0.85],
            "fpr95": [0.1, 0.5, 0.6, 0.1, 0.55, 0.7, 0.2, 0.4, 0.7, 0.3],
        }
    )
    best = R.best_detector(metrics)
    assert best["best_detector"] == "b"
    assert best["best_auroc"] == pytest.approx(2.2 / 3) and best["best_fpr95"] == pytest.approx(1.3 / 3)


def test_an_empty_metrics_table_keeps_its_columns(scores):
    no_detectors = scores[["split", "dataset", "index", "label", "prediction"]]
    assert list(R.metrics_table(no_detectors, GROUPS).columns) == list(R.METRICS_COLUMNS)
    assert list(R.per_class_table(no_detectors, []).columns) == list(R.PER_CLASS_FILE_COLUMNS)
    assert len(R.metrics_table(no_detectors, GROUPS)) == 0


# ---- per_class.csv ------------------------------------------------------------------------------


def test_per_class_at_threshold_matches_direct_computation(scores):
    threshold = 0.5
    names = ["zero", "one", "two", "three"]
    table = R.per_class_at_threshold(scores, "det", threshold, names)
    assert list(table.columns) == [
        "class",
        "class_name",
        "n",
        "accuracy",
        "false_alarms",
        "false_alarm_rate",
        "mean_score",
    ]
    id_rows = scores[scores.split == "id_test"]
    for row in table.itertuples():
        rows = id_rows[id_rows.label == row[1]]
        v = rows["det"].to_numpy(np.float64)
        assert row.class_name == names[row[1]] and row.n == len(rows) == 50
        assert row.false_alarms == int((v >= threshold).sum())
        assert row.false_alarm_rate == pytest.approx((v >= threshold).mean())
        assert row.accuracy == pytest.approx((rows.label == rows.prediction).mean())
        assert row.mean_score == pytest.approx(math.fsum(v) / v.size, rel=1e-12)
    rates = table.false_alarm_rate.to_numpy()
    assert np.all(np.diff(rates) <= 0) and sorted(table["class"]) == [0, 1, 2, 3]
    by_class = R.per_class_at_threshold(scores, "det", threshold, names, worst_first=False)
    assert list(by_class["class"]) == [0, 1, 2, 3]
    pd.testing.assert_frame_equal(by_class, table.sort_values("class").reset_index(drop=True))


def test_per_class_table_uses_each_detectors_pooled_threshold(scores):
    table = R.per_class_table(scores, ["zero", "one"])  # classes 2 and 3 have no name: their number
    assert list(table.columns) == list(R.PER_CLASS_FILE_COLUMNS)
    assert list(zip(table.detector, table["class"])) == [(d, c) for d in ("det", "tied") for c in range(4)]
    assert list(table.class_name) == ["zero", "one", "2", "3"] * 2
    id_rows = scores[scores.split == "id_test"]
    for row in table.itertuples():
        threshold = brute_force_threshold(scores.loc[scores.split == "ood", row.detector])
        v = id_rows.loc[id_rows.label == row[2], row.detector].to_numpy(np.float64)
        assert row.threshold == threshold
        assert row.false_alarms == np.sum(v >= threshold) and row.n == v.size == 50
    assert R.class_names_of(table) == ["zero", "one", "2", "3"]


# ---- loading ------------------------------------------------------------------------------------


def test_load_results_of_a_finished_run(default_results):
    r = default_results
    assert r.state == "done" and r.finished
    assert r.config["backbone"] == "digits-cnn"
    assert set(r.scores.columns) >= {"split", "dataset", "index", "label", "prediction", "msp", "vim"}
    assert len(r.scores) == 362 + 354 + 362 + 362 + 500 + 500 + 500
    assert list(r.metrics.columns[:4]) == ["detector", "ood_dataset", "group", "auroc"]
    assert set(r.per_class.detector) == set(R.detectors_of(r.scores))
    assert r.meta["splits"]["id_test"]["n"] == 362
    assert set(r.detectors) == set(R.detectors_of(r.scores))
    assert r.events[0]["event"] == "start" and r.events[-1]["event"] == "done"
    assert r.class_names == [str(c) for c in range(8)]
    assert R.ood_datasets_of(r.scores) == [c["name"] for c in r.config["ood"]]
    assert R.detectors_of(r.scores) == [d["name"] for d in r.config["detectors"]]


def test_load_results_of_an_unfinished_run_gives_none_for_missing_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"backbone": "x"}))
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "stage": "extract id_fit"}))
    (tmp_path / "events.jsonl").write_text('{"time": 1.0, "event": "start", "cpu_rss": 1048576}\n{"time": 2')
    (tmp_path / "metrics.csv").write_text("")  # a table that cannot be parsed counts as missing
    r = R.load_results(tmp_path)
    assert r.config == {"backbone": "x"} and r.state == "running" and not r.finished
    assert r.metrics is None and r.scores is None and r.per_class is None
    assert r.meta is None and r.detectors is None
    assert r.events == [{"time": 1.0, "event": "start", "cpu_rss": 1048576}]  # half-written last line skipped
    assert r.class_names == []
    empty = R.load_results(tmp_path / "nothing")
    assert empty.config == {} and empty.state == "damaged" and empty.events == []
    assert empty.status["error"] == "damaged: status.json is missing"


def test_written_tables_read_back_unchanged(tmp_path, scores):
    for name in ("scores.parquet", "metrics.csv"):
        R.write_table(tmp_path / name, scores)
        back = R.read_table(tmp_path / name)
        pd.testing.assert_frame_equal(back, scores, check_dtype=name.endswith(".parquet"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left
