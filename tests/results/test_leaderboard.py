"""oodviz.results.leaderboard: the shipped OpenOOD v1.5 leaderboard, oodviz's figures in its shape, side by side."""

import inspect
import json
import math

import numpy as np
import pandas as pd
import pytest
from helpers import brute_force_threshold
from sklearn.metrics import roc_auc_score

from oodviz.results import leaderboard as L
from oodviz.results import tables as R

# ---- the shipped table ----------------------------------------------------------------------------------------

#: rows of each file at zjysteven/OpenOOD@28d3a40 (results/cifar10.csv, cifar100.csv, imagenet200_ood.csv,
#: imagenet1k_ood.csv), header left out
ROWS = {"cifar10": 61, "cifar100": 57, "imagenet200": 56, "imagenet": 97}


def test_the_shipped_table_has_the_benchmarks_rows_and_columns_it_claims():
    for benchmark, count in ROWS.items():
        board = L.published(benchmark)
        assert list(board.columns) == list(L.PUBLISHED_COLUMNS)
        assert len(board) == count and set(board.benchmark) == {benchmark}
        for name in L.PUBLISHED_METRICS:
            assert board[name].dtype == np.float64 and board[f"{name}_std"].dtype == np.float64
            assert board[name].dropna().between(0, 100).all() and (board[f"{name}_std"].dropna() >= 0).all()
        assert board.near_auroc.notna().all() and board.far_auroc.notna().all()  # every row publishes AUROC
        # every postprocessor is mapped, to a detector or to None: none is dropped by a name the mapping lacks
        assert set(board.postprocessor) <= set(L.OPENOOD_DETECTORS)
        # one row per method of the post-hoc (CrossEntropy) rows of each model: compare() can match them
        post_hoc = board[board.training == L.STANDARD_TRAINING]
        assert not post_hoc.duplicated(["arch", "postprocessor"]).any()
        assert L.DEFAULT_ARCH[benchmark] in set(post_hoc.arch)
        assert board.attrs["source"]["source"]["commit"] == "28d3a40b613c452af379e687f46cbb426a9ea36b"
    assert set(L.published("imagenet").arch) == {"ResNet50", "ViT-B/16", "Swin-T", "RegNet_Y_16GF"}
    # ImageNet-1K is one run per model: no std anywhere
    assert L.published("imagenet")[[f"{m}_std" for m in L.PUBLISHED_METRICS]].isna().all().all()
    # the three others are means over training runs: every CrossEntropy row has a std
    assert L.published("cifar10").query("training == 'CrossEntropy'").near_auroc_std.notna().all()
    # no FPR@95 is published: the table claims none
    assert not any("fpr" in column for column in L.PUBLISHED_COLUMNS)
    with pytest.raises(ValueError, match="unknown OpenOOD benchmark 'imagenet1k'; choose one of: cifar10, cifar100"):
        L.published("imagenet1k")


def row(benchmark, postprocessor, arch=None, training="CrossEntropy"):
    board = L.published(benchmark)
    arch = arch or L.DEFAULT_ARCH[benchmark]
    (found,) = board[(board.postprocessor == postprocessor) & (board.arch == arch) & (board.training == training)].index
    return board.loc[found]


@pytest.mark.parametrize(
    "benchmark, postprocessor, arch, training, expected",
    [
        # results/cifar10.csv:       CrossEntropy,MSP,88.03 ± 0.25,90.73 ± 0.43,95.06 ± 0.30,No,ResNet18,100 epochs
        ("cifar10", "MSP", None, "CrossEntropy", (88.03, 0.25, 90.73, 0.43, 95.06, 0.30)),
        # results/cifar10.csv:       CrossEntropy,MDS,84.20 ± 2.40,89.72 ± 1.36,95.06 ± 0.30,No,ResNet18,100 epochs
        ("cifar10", "MDS", None, "CrossEntropy", (84.20, 2.40, 89.72, 1.36, 95.06, 0.30)),
        # results/cifar100.csv:      CrossEntropy,KNN,80.18 ± 0.15,82.40 ± 0.17,77.25 ± 0.10,No,ResNet18,100 epochs
        ("cifar100", "KNN", None, "CrossEntropy", (80.18, 0.15, 82.40, 0.17, 77.25, 0.10)),
        # results/cifar100.csv:      CIDER,KNN,73.10 ± 0.39,80.49 ± 0.68,/,No,ResNet18,100 epochs  ('/': not reported)
        ("cifar100", "KNN", None, "CIDER", (73.10, 0.39, 80.49, 0.68, math.nan, math.nan)),
        # results/imagenet200_ood.csv: CrossEntropy,VIM,78.68 ± 0.24,91.26 ± 0.19,86.37 ± 0.08,No,ResNet18,90 epochs
        ("imagenet200", "VIM", None, "CrossEntropy", (78.68, 0.24, 91.26, 0.19, 86.37, 0.08)),
        # results/imagenet1k_ood.csv: CrossEntropy,MSP,76.02,85.23,76.18,No,ResNet50,torchvision ckpt
        ("imagenet", "MSP", None, "CrossEntropy", (76.02, math.nan, 85.23, math.nan, 76.18, math.nan)),
        # results/imagenet1k_ood.csv: CrossEntropy,MDS++,72.02,93.32,76.17,No,ResNet50,torchvision ckpt
        ("imagenet", "MDS++", None, "CrossEntropy", (72.02, math.nan, 93.32, math.nan, 76.17, math.nan)),
        # results/imagenet1k_ood.csv: CrossEntropy,EBO,62.41,78.98,81.14,No,ViT-B/16,torchvision ckpt
        ("imagenet", "EBO", "ViT-B/16", "CrossEntropy", (62.41, math.nan, 78.98, math.nan, 81.14, math.nan)),
    ],
)
def test_figures_are_those_of_the_source(benchmark, postprocessor, arch, training, expected):
    found = row(benchmark, postprocessor, arch, training)
    got = tuple(found[f"{m}{s}"] for m in L.PUBLISHED_METRICS for s in ("", "_std"))
    assert got == pytest.approx(expected, nan_ok=True, abs=0)


def test_a_row_keeps_its_published_description():
    found = row("imagenet", "MDS++")
    assert (found.description, found.outlier_data, found.detector) == ("torchvision ckpt", "No", "mahalanobis")
    assert found.detector_params == {"normalize": True}
    assert row("cifar10", "MSP").description == "100 epochs"
    # the caller's copies: changing one changes no later answer
    L.published("imagenet").detector_params.iloc[0]["x"] = 1
    assert "x" not in L.published("imagenet").detector_params.iloc[0]


def test_the_source_says_where_when_and_what_is_missing():
    source = L.source()
    assert source["source"]["repository"] == "https://github.com/zjysteven/OpenOOD"
    assert source["source"]["branch"] == "leaderboard"
    assert set(source["source"]["files"]) == set(L.BENCHMARKS)
    assert all(len(entry["sha256"]) == 64 for entry in source["source"]["files"].values())
    assert source["read_on"] == "2026-12-02" and source["units"] == "percent"
    assert "2306.09301" in source["paper"]
    assert any("FPR@95" in line for line in source["missing"])
    # OpenOOD's near/far sets (openood/evaluation_api/datasets.py)
    assert source["ood_sets"]["cifar10"] == {
        "near": ["cifar100", "tin"],
        "far": ["mnist", "svhn", "texture", "places365"],
    }
    assert source["ood_sets"]["imagenet"]["near"] == ["ssb_hard", "ninco"]
    json.dumps(source)  # plain data


# ---- the mapping to oodviz's detectors ------------------------------------------------------------------------


def test_each_openood_method_maps_to_an_oodviz_detector_that_exists_with_its_parameters():
    from oodviz import detectors

    named = {v[0] for v in L.OPENOOD_DETECTORS.values() if v is not None}
    assert named <= set(detectors.available())
    for target in L.OPENOOD_DETECTORS.values():
        if target is not None:
            assert set(target[1]) <= set(detectors.detector_class(target[0]).param_names())
    # the defaults compare() assumes for a detector without recorded parameters are the classes' own
    for name, defaults in L.DETECTOR_DEFAULTS.items():
        signature = inspect.signature(detectors.detector_class(name).__init__).parameters
        assert defaults == {key: signature[key].default for key in defaults}
    # the ones a reader would guess wrong
    assert L.OPENOOD_DETECTORS["EBO"] == ("energy", {})
    assert L.OPENOOD_DETECTORS["MLS"] == ("maxlogit", {})
    assert L.OPENOOD_DETECTORS["VIM"] == ("vim", {})
    assert L.OPENOOD_DETECTORS["AdaSCALE-L"] == ("adascale", {"variant": "l"})
    assert L.OPENOOD_DETECTORS["MCD"] is None  # Maximum Classifier Discrepancy, not oodviz's Monte-Carlo dropout
    assert L.OPENOOD_DETECTORS["MDSEns"] == ("mds_ensemble", {}) and L.OPENOOD_DETECTORS["OpenGAN"] is None
    # a detector shared by two methods says which of them each is
    for name in {v[0] for v in L.OPENOOD_DETECTORS.values() if v is not None}:
        variants = [v[1] for v in L.OPENOOD_DETECTORS.values() if v is not None and v[0] == name]
        if len(variants) > 1:
            assert all(variants) and len({json.dumps(v, sort_keys=True) for v in variants}) == len(variants)


# ---- compare() ------------------------------------------------------------------------------------------------


def test_compare_gives_ours_published_and_the_difference_and_keeps_unpublished_detectors():
    ours = pd.DataFrame(
        {
            "detector": ["msp", "energy", "mahalanobis", "mahalanobis", "entropy"],
            "near_auroc": [77.0, 70.5, 60.0, 73.0, 66.0],
            "far_auroc": [84.0, 90.0, 70.0, 93.0, 80.0],
            "near_fpr95": [60.0, 65.0, 80.0, 70.0, 75.0],
            "id_accuracy": [76.13] * 5,  # far_fpr95 left out: not measured
            "params": [None, {}, {"normalize": False}, {"normalize": True}, None],
        }
    )
    table = L.compare(ours, "imagenet")
    by = table.set_index(table.postprocessor.fillna(table.detector))
    # MSP (imagenet1k_ood.csv: CrossEntropy,MSP,76.02,85.23,76.18,No,ResNet50,torchvision ckpt)
    msp = by.loc["MSP"]
    assert (msp.detector, msp.status, msp.arch) == ("msp", L.COMPARED, "ResNet50")
    assert msp.near_auroc_ours == 77.0 and msp.near_auroc_published == 76.02
    assert msp.near_auroc_diff == pytest.approx(77.0 - 76.02, abs=1e-12)
    assert msp.far_auroc_diff == pytest.approx(84.0 - 85.23, abs=1e-12)
    assert msp.id_accuracy_diff == pytest.approx(76.13 - 76.18, abs=1e-12)
    assert math.isnan(msp.near_auroc_published_std)  # ImageNet-1K: one run
    # FPR@95: ours kept, nothing published, no difference
    assert msp.near_fpr95_ours == 60.0 and math.isnan(msp.near_fpr95_published) and math.isnan(msp.near_fpr95_diff)
    assert math.isnan(msp.far_fpr95_ours)  # a column ours lacks
    # EBO is energy (CrossEntropy,EBO,75.89,89.47,76.18,...)
    assert by.loc["EBO", "detector"] == "energy" and by.loc["EBO", "far_auroc_diff"] == pytest.approx(90.0 - 89.47)
    # mahalanobis with normalize=False is MDS (55.44, 74.25), with normalize=True MDS++ (72.02, 93.32)
    assert by.loc["MDS", "near_auroc_ours"] == 60.0 and by.loc["MDS", "near_auroc_diff"] == pytest.approx(60 - 55.44)
    assert by.loc["MDS++", "near_auroc_ours"] == 73.0 and by.loc["MDS++", "far_auroc_diff"] == pytest.approx(93 - 93.32)
    # an oodviz detector with no published row: kept, with NaN published figures and a status saying so
    entropy = by.loc["entropy"]
    assert entropy.status == L.NOT_PUBLISHED and entropy.near_auroc_ours == 66.0
    assert math.isnan(entropy.near_auroc_published) and math.isnan(entropy.near_auroc_diff)
    assert table.iloc[-1].detector == "entropy"  # after the leaderboard's rows
    # leaderboard rows: of oodviz detectors this frame lacks, and of methods oodviz does not have
    assert by.loc["KNN", "status"] == L.NOT_RUN and math.isnan(by.loc["KNN", "near_auroc_ours"])
    assert by.loc["KNN", "near_auroc_published"] == row("imagenet", "KNN").near_auroc
    assert by.loc["NAC", "status"] == L.NOT_RUN and by.loc["NAC", "detector"] == "nac"
    # every post-hoc ResNet-50 row of the leaderboard, in its order, then ours: oodviz has each of their methods
    expected = L.published("imagenet").query("training == 'CrossEntropy' and arch == 'ResNet50'").postprocessor
    assert list(table.postprocessor.iloc[:-1]) == list(expected)
    assert list(table.status.value_counts().sort_index().index) == sorted({L.COMPARED, L.NOT_PUBLISHED, L.NOT_RUN})
    # CIFAR-10's rows have methods oodviz lacks (OpenGAN, OTOD)
    cifar = L.compare(ours, "cifar10").set_index("postprocessor")
    assert cifar.loc["OpenGAN", "status"] == cifar.loc["OTOD", "status"] == L.NO_DETECTOR
    assert cifar.loc["OpenGAN", "detector"] is None


def test_compare_picks_the_model_and_tells_variants_apart():
    ours = pd.DataFrame({"detector": ["energy", "adascale"], "near_auroc": [60.0, 85.0]})  # adascale: default "a"
    table = L.compare(ours, "imagenet", arch="ViT-B/16").set_index("postprocessor")
    # imagenet1k_ood.csv: CrossEntropy,EBO,62.41,78.98,81.14,No,ViT-B/16,torchvision ckpt
    assert table.loc["EBO", "near_auroc_published"] == 62.41 and table.loc["EBO", "arch"] == "ViT-B/16"
    resnet = L.compare(ours, "imagenet").set_index("postprocessor")
    # CrossEntropy,AdaSCALE-A,84.42,... and CrossEntropy,AdaSCALE-L,84.27,... (ResNet50)
    assert resnet.loc["AdaSCALE-A", "status"] == L.COMPARED
    assert resnet.loc["AdaSCALE-A", "near_auroc_diff"] == pytest.approx(85.0 - 84.42)
    assert resnet.loc["AdaSCALE-L", "status"] == L.NOT_RUN
    # CIFAR-10's default model is OpenOOD's ResNet-18 (CrossEntropy,MLS,87.52 ± 0.47,91.10 ± 0.89,...)
    cifar = L.compare(pd.DataFrame({"detector": ["maxlogit"], "far_auroc": [92.0]}), "cifar10").set_index(
        "postprocessor"
    )
    assert cifar.loc["MLS", "far_auroc_published"] == 91.10 and cifar.loc["MLS", "far_auroc_published_std"] == 0.89
    assert cifar.loc["MLS", "far_auroc_diff"] == pytest.approx(92.0 - 91.10)


def test_compare_refuses_what_it_cannot_match():
    ours = pd.DataFrame({"detector": ["msp"], "near_auroc": [80.0]})
    with pytest.raises(ValueError, match="no 'CrossEntropy' rows of model 'ResNet18'; it has: RegNet_Y_16GF, ResNet50"):
        L.compare(ours, "imagenet", arch="ResNet18")
    with pytest.raises(ValueError, match="unknown OpenOOD benchmark"):
        L.compare(ours, "svhn")
    with pytest.raises(ValueError, match="needs a 'detector' column"):
        L.compare(ours.rename(columns={"detector": "name"}), "cifar10")
    twice = pd.DataFrame({"detector": ["mahalanobis", "mahalanobis"], "params": [None, {"normalize": False}]})
    with pytest.raises(ValueError, match=r"2 rows of ours run as MDS \(mahalanobis\)"):
        L.compare(twice, "cifar10")


# ---- oodviz's figures in the leaderboard's shape --------------------------------------------------------------

#: two near sets and two far sets with different separations from the ID scores, so that any mix-up of the groups
#: (or a mean over all four sets) gives other figures
SHIFTS = {"near-a": 0.4, "far-a": 2.5, "near-b": 0.8, "far-b": 3.5}
GROUPS = {"near-a": "near", "far-a": "far", "near-b": "near", "far-b": "far"}


def synthetic_run(seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    n_id = 300
    label = np.arange(n_id) % 5
    prediction = np.where(rng.random(n_id) < 0.2, (label + 1) % 5, label)
    frames = [R.score_frame(R.ID_SPLIT, "id-set", np.arange(n_id), label, prediction).assign(a=rng.normal(0, 1, n_id))]
    for i, (name, shift) in enumerate(SHIFTS.items()):
        n = 120 + 40 * i
        frame = R.score_frame(R.OOD_SPLIT, name, np.arange(n), np.full(n, -1), rng.integers(0, 5, n))
        frames.append(frame.assign(a=rng.normal(shift, 1, n)))
    scores = pd.concat(frames, ignore_index=True)
    scores["b"] = -scores.a + 0.5 * rng.normal(0, 1, len(scores))  # a second detector, worse than chance
    return scores


def independent_figures(scores, detector, sets):
    """AUROC by sklearn and FPR95 by brute force, per set, then the plain mean, in percent."""
    id_scores = scores.loc[scores.split == R.ID_SPLIT, detector].to_numpy(np.float64)
    aurocs, fprs = [], []
    for name in sets:
        ood = scores.loc[scores.dataset == name, detector].to_numpy(np.float64)
        truth = np.r_[np.zeros(id_scores.size), np.ones(ood.size)]
        aurocs.append(roc_auc_score(truth, np.r_[id_scores, ood]))
        fprs.append(np.mean(id_scores >= brute_force_threshold(ood)))
    return 100 * np.mean(aurocs), 100 * np.mean(fprs)


def test_near_and_far_means_are_over_each_groups_own_sets():
    scores = synthetic_run()
    metrics = R.metrics_table(scores, GROUPS)
    figures = L.figures_from_metrics(metrics).set_index("detector")
    assert list(figures.columns) == [c for c in L.FIGURES_COLUMNS if c != "detector"]
    id_rows = scores[scores.split == R.ID_SPLIT]
    accuracy = 100 * np.mean(id_rows.label.to_numpy() == id_rows.prediction.to_numpy())
    for detector in ("a", "b"):
        near = independent_figures(scores, detector, ["near-a", "near-b"])
        far = independent_figures(scores, detector, ["far-a", "far-b"])
        got = figures.loc[detector]
        assert (got.near_auroc, got.near_fpr95) == pytest.approx(near, abs=1e-9)
        assert (got.far_auroc, got.far_fpr95) == pytest.approx(far, abs=1e-9)
        assert got.id_accuracy == pytest.approx(accuracy, abs=1e-12)
        assert (got.near_sets, got.far_sets) == ("near-a, near-b", "far-a, far-b")
        assert got.params is None
    # the two groups differ enough that a mix-up would show
    assert figures.loc["a", "far_auroc"] - figures.loc["a", "near_auroc"] > 20
    # regrouped: OpenOOD's sets only (far-b left out, near-b counted as far)
    regrouped = L.figures_from_metrics(metrics, {"near-a": "near", "near-b": "far", "far-a": "far", "far-b": None})
    got = regrouped.set_index("detector").loc["a"]
    assert (got.near_auroc, got.near_fpr95) == pytest.approx(independent_figures(scores, "a", ["near-a"]), abs=1e-9)
    assert (got.far_auroc, got.far_fpr95) == pytest.approx(
        independent_figures(scores, "a", ["near-b", "far-a"]), abs=1e-9
    )
    assert (got.near_sets, got.far_sets) == ("near-a", "far-a, near-b")  # in run order
    # a group with no set: NaN, not a mean over nothing
    only_near = L.figures_from_metrics(metrics, {"near-a": "near"}).set_index("detector").loc["a"]
    assert math.isnan(only_near.far_auroc) and only_near.far_sets == ""
    with pytest.raises(ValueError, match="groups must map each OOD dataset to 'near', 'far' or None"):
        L.figures_from_metrics(metrics, {"near-a": "close"})


def test_run_figures_reads_a_run_directory_with_its_detectors_parameters(tmp_path):
    scores = synthetic_run(seed=1)
    R.write_table(tmp_path / "metrics.csv", R.metrics_table(scores, GROUPS))
    R.write_table(tmp_path / "scores.parquet", scores)
    (tmp_path / "status.json").write_text(json.dumps({"state": "done"}))
    logged = {"a": {"params": {"normalize": True}, "fit_s": 0.1}, "b": {"params": {}, "fit_s": 0.1}}
    (tmp_path / "detectors.json").write_text(json.dumps(logged))
    figures = L.run_figures(tmp_path).set_index("detector")
    near = independent_figures(scores, "a", ["near-a", "near-b"])
    assert (figures.loc["a", "near_auroc"], figures.loc["a", "near_fpr95"]) == pytest.approx(near, abs=1e-9)
    assert figures.loc["a", "params"] == {"normalize": True} and figures.loc["b", "params"] == {}
    same = L.run_figures(R.load_results(tmp_path))  # a loaded run gives the same
    pd.testing.assert_frame_equal(same, L.run_figures(str(tmp_path)))
    # and it goes straight into compare()
    table = L.compare(same.assign(detector=["mahalanobis", "msp"]), "cifar10")
    assert table.loc[table.postprocessor == "MDS", "status"].item() == L.NOT_RUN  # normalize=True is not MDS
    assert table.loc[table.postprocessor == "MSP", "status"].item() == L.COMPARED


def test_run_figures_of_a_run_without_metrics_says_so(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({"state": "running"}))
    with pytest.raises(ValueError, match="has no metrics yet \\(state 'running'\\)"):
        L.run_figures(tmp_path)
    (tmp_path / "status.json").write_text(json.dumps({"state": "done"}))
    (tmp_path / "metrics.csv").write_text("not,a\nmetrics,table\n")
    with pytest.raises(R.ResultsFileError, match="metrics.csv lacks the column"):
        L.run_figures(tmp_path)
