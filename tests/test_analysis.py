"""oodviz.analysis: results loading, histograms, curves, counts, failure cases, thumbnails, comparisons."""

import copy
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from conftest import synthetic_scores
from PIL import Image
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score, roc_curve

from oodviz import analysis as A
from oodviz.data import digits_split, load_dataset
from oodviz.metrics import ood_metrics, threshold_at_recall

# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scores():
    return synthetic_scores()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """The bundled default run (digits-cnn, 8x8 digits vs 6 OOD sets), made once for this module."""
    out = tmp_path_factory.mktemp("analysis") / "run"
    result = subprocess.run(
        [sys.executable, "-m", "oodviz.cli", "run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(out.parent),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return A.load_results(out)


# ---- loading ------------------------------------------------------------------------------------


def test_load_results_of_a_finished_run(real_run):
    r = real_run
    assert r.state == "done" and r.finished
    assert r.config["backbone"] == "digits-cnn"
    assert set(r.scores.columns) >= {"split", "dataset", "index", "label", "prediction", "msp", "vim"}
    assert len(r.scores) == 362 + 354 + 362 + 362 + 500 + 500 + 500
    assert list(r.metrics.columns[:4]) == ["detector", "ood_dataset", "group", "auroc"]
    assert set(r.per_class.detector) == set(A.detectors_of(r.scores))
    assert r.meta["splits"]["id_test"]["n"] == 362
    assert set(r.detectors) == set(A.detectors_of(r.scores))
    assert r.events[0]["event"] == "start" and r.events[-1]["event"] == "done"
    assert r.class_names == [str(c) for c in range(8)]
    assert A.ood_datasets_of(r.scores) == [c["name"] for c in r.config["ood"]]
    assert A.detectors_of(r.scores) == [d["name"] for d in r.config["detectors"]]


def test_load_results_of_an_unfinished_run_gives_none_for_missing_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"backbone": "x"}))
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "stage": "extract id_fit"}))
    (tmp_path / "events.jsonl").write_text('{"time": 1.0, "event": "start", "cpu_rss": 1048576}\n{"time": 2')
    (tmp_path / "metrics.csv").write_text("")  # a table that cannot be parsed counts as missing
    r = A.load_results(tmp_path)
    assert r.config == {"backbone": "x"} and r.state == "running" and not r.finished
    assert r.metrics is None and r.scores is None and r.per_class is None
    assert r.meta is None and r.detectors is None
    assert r.events == [{"time": 1.0, "event": "start", "cpu_rss": 1048576}]  # half-written last line skipped
    assert r.class_names == []
    empty = A.load_results(tmp_path / "nothing")
    assert empty.config == {} and empty.state == "failed" and empty.events == []


def test_detectors_and_datasets_of(scores):
    assert A.detectors_of(scores) == ["det", "tied"]
    assert A.ood_datasets_of(scores) == ["far-set", "near-set"]
    assert A.id_dataset_of(scores) == "id-set"
    with pytest.raises(ValueError, match="det, tied"):
        A.score_histogram(scores, "nope")


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


def test_histogram_of_the_real_run_counts_every_sample(real_run):
    hist = A.score_histogram(real_run.scores, "vim")
    assert len(hist["edges"]) == 61
    assert hist["counts"]["ID (digits-test)"].sum() == 362
    assert hist["counts"]["digits-heldout"].sum() == 354
    assert sum(c.sum() for c in hist["counts"].values()) == len(real_run.scores)


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


def test_curves_of_the_real_run_equal_metrics_csv(real_run):
    s, metrics = real_run.scores, real_run.metrics
    for detector in ("msp", "vim", "knn"):
        for dataset in A.ood_datasets_of(s):
            c = A.curves(s, detector, dataset, max_points=100)
            row = metrics[(metrics.detector == detector) & (metrics.ood_dataset == dataset)].iloc[0]
            assert c["auroc"] == pytest.approx(row.auroc, rel=1e-12)
            assert c["aupr_out"] == pytest.approx(row.aupr_out, rel=1e-12)
            assert c["fpr95"] == pytest.approx(row.fpr95, rel=1e-12)
            assert len(c["fpr"]) <= 100 and len(c["recall"]) <= 100


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


def test_default_threshold_flags_95_percent_of_ood(scores):
    t = A.default_threshold(scores, "det")
    ood_v = scores.loc[scores.split == "ood", "det"].to_numpy()
    assert t == threshold_at_recall(ood_v)
    assert A.counts_at_threshold(scores, "det", t)["total"]["miss_rate"] <= 0.05
    assert A.default_threshold(scores, "det", "near-set") == threshold_at_recall(
        scores.loc[scores.dataset == "near-set", "det"].to_numpy()
    )


def test_per_class_at_threshold_matches_direct_computation(scores):
    threshold = 0.5
    names = ["zero", "one", "two", "three"]
    table = A.per_class_at_threshold(scores, "det", threshold, names)
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
        assert row.mean_score == pytest.approx(v.mean())
    rates = table.false_alarm_rate.to_numpy()
    assert np.all(np.diff(rates) <= 0) and sorted(table["class"]) == [0, 1, 2, 3]


def test_per_class_of_the_real_run_equals_per_class_csv(real_run):
    s, stored = real_run.scores, real_run.per_class
    for detector in ("msp", "mahalanobis", "nci"):
        table = A.per_class_at_threshold(s, detector, A.default_threshold(s, detector), real_run.class_names)
        expected = stored[stored.detector == detector].set_index("class")
        got = table.set_index("class").loc[expected.index]
        np.testing.assert_array_equal(got.false_alarms, expected.false_alarms)
        np.testing.assert_array_equal(got.n, expected.n)
        np.testing.assert_allclose(got.false_alarm_rate, expected.false_alarm_rate, rtol=1e-12)
        np.testing.assert_allclose(got.mean_score, expected.mean_score, rtol=1e-6)
        assert list(got.class_name) == [str(c) for c in expected.class_name]


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


# ---- thumbnails ---------------------------------------------------------------------------------


def _upscaled(pixels: np.ndarray, factor: int) -> np.ndarray:
    big = np.repeat(np.repeat(pixels, factor, axis=0), factor, axis=1)
    return np.stack([big] * 3, axis=-1)


def test_thumbnails_of_the_real_run_are_the_dataset_pixels_upscaled(real_run):
    flagged, accepted = A.failure_cases(real_run.scores, "vim", k=3)
    images = A.thumbnails(real_run, pd.concat([flagged, accepted]), size=64)
    assert len(images) == 6
    assert all(im.size == (64, 64) and im.mode == "RGB" and im.info["oodviz"] == "ok" for im in images)
    test_images = digits_split("test")[0]  # digits-test serves these pixels, source index = position
    for image, index in zip(images[:3], flagged["index"]):
        np.testing.assert_array_equal(np.asarray(image), _upscaled(test_images[index], 8))
    for image, (dataset, index) in zip(images[3:], zip(accepted["dataset"], accepted["index"])):
        choice = next(c for c in real_run.config["ood"] if c["name"] == dataset)
        ds = load_dataset(dataset, as_ood=True, **choice["params"])
        item = ds[int(np.flatnonzero(ds.source_indices == index)[0])][0]
        expected = np.asarray(item.convert("RGB").resize((64, 64), Image.Resampling.NEAREST))
        np.testing.assert_array_equal(np.asarray(image), expected)
    # the heldout digits come from both splits: check one against the raw pixels too
    heldout = real_run.scores[real_run.scores.dataset == "digits-heldout"].iloc[[5]]
    (image,) = A.thumbnails(real_run.config, heldout, size=32)
    np.testing.assert_array_equal(np.asarray(image), _upscaled(digits_split("heldout")[0][heldout["index"].iloc[0]], 4))


def test_thumbnails_map_source_indices_of_a_subsampled_dataset(real_run):
    config = copy.deepcopy(real_run.config)
    config["id_test"].update(subsample=40, subsample_mode="random")
    ds = load_dataset("digits-test", subsample=40, subsample_mode="random", seed=config["seed"])
    assert not np.array_equal(ds.source_indices, np.arange(40))  # positions differ from source indices
    picks = [3, 0, 39]
    rows = pd.DataFrame({"split": "id_test", "dataset": "digits-test", "index": ds.source_indices[picks]})
    images = A.thumbnails(config, rows, size=16)
    raw = digits_split("test")[0]
    for image, pick in zip(images, picks):
        np.testing.assert_array_equal(np.asarray(image), _upscaled(raw[ds.source_indices[pick]], 2))
    left_out = int(np.setdiff1d(np.arange(362), ds.source_indices)[0])
    gone = pd.DataFrame({"split": ["id_test"], "dataset": ["digits-test"], "index": [left_out]})
    assert A.thumbnails(config, gone)[0].info["oodviz"] == "missing"  # not in the subsample any more


def test_thumbnails_placeholder_for_a_dataset_that_cannot_be_opened(real_run, tmp_path):
    config = copy.deepcopy(real_run.config)
    config["ood"].append(
        {
            "name": "folder",
            "params": {"path": str(tmp_path / "moved-away")},
            "subsample": None,
            "subsample_mode": "first",
            "group": None,
        }
    )
    rows = pd.DataFrame(
        {
            "split": ["ood", "ood", "ood", "id_test"],
            "dataset": ["folder", "not-in-config", "digits-heldout", "digits-test"],
            "index": [0, 0, 0, 0],
        }
    )
    images = A.thumbnails(config, rows, size=48)
    assert [im.info["oodviz"] for im in images] == ["missing", "missing", "ok", "ok"]
    missing = np.asarray(images[0])
    assert missing.shape == (48, 48, 3)
    np.testing.assert_array_equal(missing[0, 0], A.PLACEHOLDER_GREY)
    share_grey = np.all(missing == A.PLACEHOLDER_GREY, axis=-1).mean()
    assert 0.7 < share_grey < 1.0  # grey with the text "missing" drawn on it
    np.testing.assert_array_equal(np.asarray(images[1]), missing)


def test_fit_image_letterboxes_and_shrinks():
    wide = Image.fromarray(np.arange(32, dtype=np.uint8).reshape(4, 8) * 8)
    out = np.asarray(A.fit_image(wide, 16))
    assert out.shape == (16, 16, 3)
    np.testing.assert_array_equal(out[:4], 255)  # white bands above and below
    np.testing.assert_array_equal(out[12:], 255)
    np.testing.assert_array_equal(out[4:12, :, 0], np.repeat(np.repeat(np.asarray(wide), 2, 0), 2, 1))
    big = A.fit_image(Image.new("RGB", (200, 100), (10, 200, 30)), 64)
    assert big.size == (64, 64) and big.getpixel((32, 32)) == (10, 200, 30) and big.getpixel((32, 2)) == (255, 255, 255)


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


def test_compare_a_real_run_with_itself(real_run):
    table = A.compare_runs(real_run, real_run)
    assert len(table) == len(real_run.metrics)
    assert (table.auroc_delta == 0).all() and (table.fpr95_delta == 0).all()


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


def test_memory_timeline_of_the_real_run(real_run):
    table = A.memory_timeline(real_run.events)
    with_memory = [e for e in real_run.events if "cpu_rss" in e]
    assert len(table) == len(with_memory) and table.time_s.iloc[0] == 0.0
    assert np.all(np.diff(table.time_s) >= 0)
    np.testing.assert_allclose(table.cpu_rss_mib, [e["cpu_rss"] / 2**20 for e in with_memory])
    assert "extract id_fit" in set(table.stage)


def test_thumbnail_datasets_are_cached_in_a_bounded_lru(real_run, monkeypatch):
    A.clear_dataset_cache()
    rows = real_run.scores.groupby("dataset").head(2)  # two rows of each of the 7 datasets
    A.thumbnails(real_run, rows, size=8)
    assert len(A._DATASET_CACHE) == 7
    cached = dict(A._DATASET_CACHE)
    A.thumbnails(real_run, rows, size=8)
    assert all(A._DATASET_CACHE[k] is ds for k, ds in cached.items())  # re-used, not re-opened
    monkeypatch.setattr(A, "DATASET_CACHE_SIZE", 3)
    A.clear_dataset_cache()
    images = A.thumbnails(real_run, rows, size=8)
    assert len(A._DATASET_CACHE) == 3 and all(im.info["oodviz"] == "ok" for im in images)
    assert list(A._DATASET_CACHE)[-1][0] == rows["dataset"].iloc[-1]  # most recently used last
    A.clear_dataset_cache()
    assert not A._DATASET_CACHE
