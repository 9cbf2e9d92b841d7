"""oodviz.results.analysis: histograms, curves, counts at a threshold, failure cases, comparisons, memory."""

import numpy as np
import pandas as pd
import pytest
from helpers import synthetic_scores
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score, roc_curve

from oodviz.results import analysis as A
from oodviz.results.metrics import ood_metrics
from oodviz.results.tables import ood_datasets_of

# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scores():
    return synthetic_scores()


# ---- histogram ----------------------------------------------------------------------------------


def test_histogram_counts_equal_numpy_on_clipped_values(scores):
    data = scores.copy()
    data.loc[0, "det"] = 1e6  # outliers: clipped into the end bins
    data.loc[210, "det"] = -1e6
    hist = A.score_histogram(data, "det", bins=30)
    values = data["det"].to_numpy(np.float64)
    lo, hi = np.percentile(values, [0.5, 99.5])
    np.testing.assert_allclose(hist["edges"], np.linspace(lo, hi, 31))
    assert list(hist["counts"]) == ["ID (id-set)", "far-set", "near-set"]
    assert hist["id_label"] == "ID (id-set)"
    masks = {
        "ID (id-set)": data.split == "id_test",
        "far-set": data.dataset == "far-set",
        "near-set": data.dataset == "near-set",
    }
    for label, mask in masks.items():
        v = data.loc[mask, "det"].to_numpy(np.float64)
        expected = np.histogram(np.clip(v, lo, hi), bins=hist["edges"])[0]
        np.testing.assert_array_equal(hist["counts"][label], expected)
        assert hist["counts"][label].sum() == mask.sum() == hist["n"][label]
    assert sum(c.sum() for c in hist["counts"].values()) == len(data)
    assert hist["counts"]["ID (id-set)"][-1] >= 1 and hist["counts"]["far-set"][0] >= 1  # the two outliers
    assert hist["clipped_low"] == int((values < lo).sum()) and hist["clipped_high"] == int((values > hi).sum())


def test_histogram_of_constant_scores_and_nan(scores):
    data = scores.copy()
    data["det"] = 2.0
    data.loc[5, "det"] = np.nan
    hist = A.score_histogram(data, "det", bins=4)
    np.testing.assert_allclose(hist["edges"], [1.5, 1.75, 2.0, 2.25, 2.5])
    np.testing.assert_array_equal(hist["counts"]["ID (id-set)"], [0, 0, 199, 0])
    assert hist["n_nan"] == 1


def test_histogram_of_the_default_run_counts_every_sample(default_results):
    hist = A.score_histogram(default_results.scores, "vim")
    assert len(hist["edges"]) == 61
    assert hist["counts"]["ID (digits-test)"].sum() == 362
    assert hist["counts"]["digits-heldout"].sum() == 354
    assert sum(c.sum() for c in hist["counts"].values()) == len(default_results.scores)


# ---- curves -------------------------------------------------------------------------------------


def _points(x, y):
    return {(float(a), float(b)) for a, b in zip(x, y)}


@pytest.mark.parametrize("detector", ["det", "tied"])
def test_curves_match_sklearn_and_keep_exact_points(scores, detector):
    c = A.curves(scores, detector, "far-set", max_points=15)
    id_v = scores.loc[scores.split == "id_test", detector].to_numpy(np.float64)
    ood_v = scores.loc[scores.dataset == "far-set", detector].to_numpy(np.float64)
    y = np.r_[np.zeros(id_v.size), np.ones(ood_v.size)]
    s = np.r_[id_v, ood_v]
    assert c["auroc"] == pytest.approx(roc_auc_score(y, s), abs=1e-15)
    assert c["aupr_out"] == pytest.approx(average_precision_score(y, s), abs=1e-15)
    assert {k: c[k] for k in ("auroc", "aupr_in", "aupr_out", "fpr95")} == ood_metrics(id_v, ood_v)
    assert (c["n_id"], c["n_ood"]) == (200, 150)

    fpr, tpr, thr = roc_curve(y, s, drop_intermediate=False)
    assert 2 <= len(c["fpr"]) <= 15
    assert _points(c["fpr"], c["tpr"]) <= _points(fpr, tpr)  # every kept point is on sklearn's curve
    assert (c["fpr"][0], c["tpr"][0]) == (0.0, 0.0) and (c["fpr"][-1], c["tpr"][-1]) == (1.0, 1.0)
    assert np.all(np.diff(c["fpr"]) >= 0) and np.all(np.diff(c["tpr"]) >= 0)
    for f, t, th in zip(c["fpr"][1:], c["tpr"][1:], c["roc_thresholds"][1:]):  # the threshold of each kept point
        assert f == np.mean(id_v >= th) and t == np.mean(ood_v >= th)
    assert np.isnan(c["roc_thresholds"][0])  # sklearn's infinite first threshold

    precision, recall, _ = precision_recall_curve(y, s)
    assert len(c["recall"]) <= 15
    assert _points(c["recall"], c["precision"]) <= _points(recall, precision)
    assert np.all(np.diff(c["recall"]) >= 0)
    assert (c["recall"][0], c["precision"][0]) == (0.0, 1.0) and c["recall"][-1] == 1.0


def test_curves_without_downsampling_are_sklearns_curve(scores):
    c = A.curves(scores, "det", "near-set", max_points=10_000)
    id_v = scores.loc[scores.split == "id_test", "det"].to_numpy(np.float64)
    ood_v = scores.loc[scores.dataset == "near-set", "det"].to_numpy(np.float64)
    y, s = np.r_[np.zeros(id_v.size), np.ones(ood_v.size)], np.r_[id_v, ood_v]
    fpr, tpr, _ = roc_curve(y, s)
    np.testing.assert_array_equal(c["fpr"], fpr)
    np.testing.assert_array_equal(c["tpr"], tpr)
    precision, recall, _ = precision_recall_curve(y, s)
    np.testing.assert_array_equal(c["recall"], recall[::-1])
    np.testing.assert_array_equal(c["precision"], precision[::-1])
    # the trapezoid area under the drawn ROC line is the AUROC
    assert np.trapezoid(c["tpr"], c["fpr"]) == pytest.approx(c["auroc"], abs=1e-12)


def test_curves_pooled_over_all_ood(scores):
    c = A.curves(scores, "det", None)
    id_v = scores.loc[scores.split == "id_test", "det"].to_numpy(np.float64)
    ood_v = scores.loc[scores.split == "ood", "det"].to_numpy(np.float64)
    assert c["auroc"] == ood_metrics(id_v, ood_v)["auroc"] and c["n_ood"] == 250
    with pytest.raises(ValueError, match="far-set, near-set"):
        A.curves(scores, "det", "other")


def test_curves_of_the_default_run_are_sklearns(default_results):
    s = default_results.scores
    for detector in ("msp", "vim", "knn"):
        for dataset in ood_datasets_of(s):
            c = A.curves(s, detector, dataset, max_points=100)
            id_v = s.loc[s.split == "id_test", detector].to_numpy(np.float64)
            ood_v = s.loc[(s.split == "ood") & (s.dataset == dataset), detector].to_numpy(np.float64)
            y, both = np.r_[np.zeros(id_v.size), np.ones(ood_v.size)], np.r_[id_v, ood_v]
            assert c["auroc"] == pytest.approx(roc_auc_score(y, both), abs=1e-12)
            assert c["aupr_out"] == pytest.approx(average_precision_score(y, both), abs=1e-12)
            fpr, tpr, _ = roc_curve(y, both)
            assert 2 <= len(c["fpr"]) <= 100 and len(c["recall"]) <= 100
            assert _points(c["fpr"], c["tpr"]) <= _points(fpr, tpr)


# ---- at a threshold -----------------------------------------------------------------------------


def test_counts_at_threshold_match_direct_computation(scores):
    threshold = float(scores["det"].iloc[17])  # a score that exists: ">=" counts it as flagged
    counts = A.counts_at_threshold(scores, "det", threshold)
    id_v = scores.loc[scores.split == "id_test", "det"].to_numpy()
    assert counts["id"]["dataset"] == "id-set" and counts["id"]["n"] == 200
    assert counts["id"]["false_alarms"] == int((id_v >= threshold).sum())
    assert counts["id"]["false_alarm_rate"] == pytest.approx((id_v >= threshold).mean())
    missed_total = 0
    for name, n in (("far-set", 150), ("near-set", 100)):
        v = scores.loc[scores.dataset == name, "det"].to_numpy()
        missed = int((v < threshold).sum())
        missed_total += missed
        assert counts["ood"][name] == {"n": n, "detected": n - missed, "missed": missed, "miss_rate": missed / n}
    assert list(counts["ood"]) == list(pd.unique(scores.loc[scores.split == "ood", "dataset"]))  # config order
    assert counts["total"] == {
        "n_id": 200,
        "n_ood": 250,
        "false_alarms": counts["id"]["false_alarms"],
        "false_alarm_rate": counts["id"]["false_alarm_rate"],
        "detected": 250 - missed_total,
        "missed": missed_total,
        "miss_rate": missed_total / 250,
    }
    table = A.counts_table(counts)
    assert list(table["set"]) == ["ID (id-set)", "far-set", "near-set", "all OOD"]
    assert list(table["wrong"]) == [
        counts["id"]["false_alarms"],
        counts["ood"]["far-set"]["missed"],
        counts["ood"]["near-set"]["missed"],
        missed_total,
    ]


# ---- failure cases ------------------------------------------------------------------------------


def test_failure_cases_are_the_top_and_bottom_k(scores):
    flagged, accepted = A.failure_cases(scores, "det", k=7, class_names=["a", "b", "c", "d"])
    id_rows = scores[scores.split == "id_test"]
    ood_rows = scores[scores.split == "ood"]
    top = id_rows.iloc[np.argsort(-id_rows["det"].to_numpy(), kind="stable")[:7]]
    bottom = ood_rows.iloc[np.argsort(ood_rows["det"].to_numpy(), kind="stable")[:7]]
    assert list(flagged["rank"]) == list(range(1, 8)) and list(accepted["rank"]) == list(range(1, 8))
    assert list(flagged["row"]) == list(top.index) and list(accepted["row"]) == list(bottom.index)
    np.testing.assert_array_equal(flagged["score"], np.sort(id_rows["det"].to_numpy(np.float64))[::-1][:7])
    np.testing.assert_array_equal(accepted["score"], np.sort(ood_rows["det"].to_numpy(np.float64))[:7])
    np.testing.assert_array_equal(flagged["index"], top["index"])
    np.testing.assert_array_equal(flagged["prediction"], top["prediction"])
    assert list(flagged["correct"]) == list(top.label == top.prediction)
    assert list(flagged["class_name"]) == ["abcd"[c] for c in top.label]
    assert list(accepted["class_name"]) == ["OOD"] * 7
    assert list(accepted["predicted_name"]) == ["abcd"[c] for c in bottom.prediction]


def test_failure_cases_filtered_by_class_and_dataset(scores):
    flagged, accepted = A.failure_cases(scores, "det", k=5, id_class=2, ood_dataset="near-set")
    id_rows = scores[(scores.split == "id_test") & (scores.label == 2)]
    near = scores[scores.dataset == "near-set"]
    assert set(flagged.label) == {2} and set(accepted.dataset) == {"near-set"}
    np.testing.assert_array_equal(flagged["score"], np.sort(id_rows["det"].to_numpy(np.float64))[::-1][:5])
    np.testing.assert_array_equal(accepted["score"], np.sort(near["det"].to_numpy(np.float64))[:5])
    assert "class_name" not in flagged  # no class names given
    few, _ = A.failure_cases(scores, "det", k=500, id_class=3)
    assert len(few) == 50


# ---- comparing runs and memory ------------------------------------------------------------------


def test_compare_runs_deltas():
    a = pd.DataFrame(
        {
            "detector": ["msp", "msp", "vim"],
            "ood_dataset": ["x", "y", "x"],
            "group": ["near", "far", "near"],
            "auroc": [0.8, 0.9, 0.95],
            "fpr95": [0.5, 0.3, 0.2],
        }
    )
    b = pd.DataFrame(
        {
            "detector": ["vim", "msp", "knn"],
            "ood_dataset": ["x", "x", "x"],
            "group": ["near"] * 3,
            "auroc": [0.97, 0.75, 0.9],
            "fpr95": [0.1, 0.6, 0.3],
        }
    )
    table = A.compare_runs(a, b)
    assert list(table.columns) == [
        "detector",
        "ood_dataset",
        "group",
        "auroc_a",
        "auroc_b",
        "auroc_delta",
        "fpr95_a",
        "fpr95_b",
        "fpr95_delta",
    ]
    assert list(zip(table.detector, table.ood_dataset)) == [("msp", "x"), ("vim", "x")]  # pairs both have, A's order
    np.testing.assert_allclose(table.auroc_delta, [0.75 - 0.8, 0.97 - 0.95])
    np.testing.assert_allclose(table.fpr95_delta, [0.6 - 0.5, 0.1 - 0.2])
    np.testing.assert_allclose(table.auroc_a, [0.8, 0.95])
    np.testing.assert_allclose(table.fpr95_b, [0.6, 0.1])
    assert A.compare_runs(a, None).empty


def test_compare_the_default_run_with_a_changed_copy(default_results):
    """Run B: the real run's metrics without msp, vim's AUROC up 0.01 and FPR95 down 0.02."""
    a = default_results.metrics
    b = a[a.detector != "msp"].copy()
    vim = b.detector == "vim"
    b.loc[vim, "auroc"] += 0.01
    b.loc[vim, "fpr95"] -= 0.02
    b = b.iloc[::-1]  # B's row order does not matter
    table = A.compare_runs(default_results, b)
    kept = a[a.detector != "msp"]
    assert list(zip(table.detector, table.ood_dataset)) == list(zip(kept.detector, kept.ood_dataset))
    assert list(table.group) == list(kept.group)  # the near/far mean rows are compared too
    on_vim = (table.detector == "vim").to_numpy()
    np.testing.assert_allclose(table.auroc_delta[on_vim], 0.01, atol=1e-12)
    np.testing.assert_allclose(table.fpr95_delta[on_vim], -0.02, atol=1e-12)
    assert (table.auroc_delta[~on_vim] == 0).all() and (table.fpr95_delta[~on_vim] == 0).all()
    np.testing.assert_array_equal(table.auroc_a, kept.auroc)


def test_memory_timeline_converts_to_mib_and_seconds():
    events = [
        {"time": 100.0, "stage": "load", "event": "start", "cpu_rss": 512 * 2**20},
        {
            "time": 101.5,
            "stage": "extract",
            "event": "progress",
            "cpu_rss": 600 * 2**20,
            "gpu_allocated": 2**30,
            "gpu_reserved": 2 * 2**30,
            "gpu_peak": 3 * 2**30,
        },
        {"time": 103.0, "stage": None, "event": "done"},  # no snapshot: skipped
    ]
    table = A.memory_timeline(events)
    assert list(table.columns) == [
        "time_s",
        "stage",
        "event",
        "cpu_rss_mib",
        "gpu_allocated_mib",
        "gpu_reserved_mib",
        "gpu_peak_mib",
    ]
    np.testing.assert_allclose(table.time_s, [0.0, 1.5])
    np.testing.assert_allclose(table.cpu_rss_mib, [512, 600])
    assert np.isnan(table.gpu_allocated_mib[0]) and table.gpu_allocated_mib[1] == 1024 and table.gpu_peak_mib[1] == 3072
    cpu_only = A.memory_timeline(events[:1])
    assert list(cpu_only.columns) == ["time_s", "stage", "event", "cpu_rss_mib"]
    assert A.memory_timeline([]).empty


def test_memory_timeline_of_the_default_run(default_results):
    table = A.memory_timeline(default_results.events)
    with_memory = [e for e in default_results.events if "cpu_rss" in e]
    assert len(table) == len(with_memory) and table.time_s.iloc[0] == 0.0
    assert np.all(np.diff(table.time_s) >= 0)
    np.testing.assert_allclose(table.cpu_rss_mib, [e["cpu_rss"] / 2**20 for e in with_memory])
    assert "extract id_fit" in set(table.stage)
