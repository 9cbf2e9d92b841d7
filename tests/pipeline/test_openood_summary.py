"""The figures of OpenOOD v1.5 benchmark runs beside the leaderboard as text (what ``oodviz bench`` prints and the app's
metrics view shows: :func:`summary_cells`), what a reader must know with them (:func:`comparison_notes`), and which
runs are benchmark runs (:func:`run_benchmark`, :func:`leaderboard_arch`). The runs' figures are made up here
(``run_figures`` stubbed): no run, no torch model."""

import math

import numpy as np
import pandas as pd
import pytest

import oodviz.pipeline.openood as openood
from oodviz.pipeline.openood import bench_summary, bench_table, benchmark_config, comparison_notes, summary_cells
from oodviz.results.leaderboard import FIGURES_COLUMNS, leaderboard_arch, published, run_benchmark
from oodviz.results.summary import title


def figures(rows: dict[str, dict]) -> pd.DataFrame:
    """A run's figures as :func:`run_figures` gives them: detector -> its figures in percent."""
    out = []
    for detector, values in rows.items():
        row = dict.fromkeys(FIGURES_COLUMNS, math.nan) | {"detector": detector, "params": None}
        out.append(row | values)
    return pd.DataFrame(out, columns=list(FIGURES_COLUMNS))


@pytest.fixture
def runs(monkeypatch):
    """Two made-up runs of cifar10: msp and entropy (no leaderboard row) in both, energy in the first only."""
    made = {
        "run-a": figures(
            {
                "msp": {"near_auroc": 80.0, "far_auroc": 90.0, "id_accuracy": 94.0},
                "entropy": {"near_auroc": 81.0, "far_auroc": 91.0, "id_accuracy": 94.0},
                "energy": {"near_auroc": 70.004, "far_auroc": 95.5, "id_accuracy": 94.0},
            }
        ),
        "run-b": figures(
            {
                "msp": {"near_auroc": 82.0, "far_auroc": 91.0, "id_accuracy": 95.0},
                "entropy": {"near_auroc": 83.0, "far_auroc": 92.0, "id_accuracy": 95.0},
            }
        ),
    }
    monkeypatch.setattr(openood, "run_figures", lambda run: made[run])
    return made


def board(benchmark: str, postprocessor: str, arch: str | None = None) -> pd.Series:
    rows = published(benchmark)
    rows = rows[(rows.postprocessor == postprocessor) & (rows.training == "CrossEntropy")]
    return rows[rows.arch == arch].iloc[0] if arch else rows.iloc[0]


def test_one_run_shows_ours_without_std_the_published_figure_and_the_signed_difference(runs):
    cells = summary_cells(bench_table(["run-a"], "cifar10")).set_index("detector")
    assert list(cells.index) == ["msp", "energy", "entropy"]  # the leaderboard's order, then the rest
    msp = board("cifar10", "MSP")
    assert cells.loc["msp", "method"] == "MSP" and cells.loc["energy", "method"] == "EBO"
    assert cells.loc["msp", "near_auroc_ours"] == "80.00"  # one run: no "± 0.00"
    assert cells.loc["msp", "near_auroc_published"] == f"{msp.near_auroc:.2f} ± {msp.near_auroc_std:.2f}"
    assert cells.loc["msp", "near_auroc_diff"] == f"{80.0 - msp.near_auroc:+.2f}"
    assert cells.loc["energy", "near_auroc_ours"] == "70.00"
    assert cells.loc["energy", "far_auroc_diff"] == f"{95.5 - board('cifar10', 'EBO').far_auroc:+.2f}"
    # entropy is not on the leaderboard: no method, no published figure, no difference
    assert cells.loc["entropy"].tolist() == ["-", "81.00", "-", "-", "91.00", "-", "-", "94.00", "-", "-"]


def test_several_runs_show_mean_and_std_where_a_detector_ran_in_two(runs):
    table = bench_table(["run-a", "run-b"], "cifar10")
    cells = summary_cells(table).set_index("detector")
    assert cells.loc["msp", "near_auroc_ours"] == f"81.00 ± {np.std([80.0, 82.0]):.2f}"  # np.std: 1.00
    assert cells.loc["msp", "id_accuracy_ours"] == "94.50 ± 0.50"
    assert cells.loc["energy", "near_auroc_ours"] == "70.00"  # in one run only: no std
    assert cells.loc["msp", "near_auroc_diff"] == f"{81.0 - board('cifar10', 'MSP').near_auroc:+.2f}"
    # the terminal's summary is the same cells, joined
    summary = bench_summary(table).set_index("detector")
    for name, heading in openood.SUMMARY_METRICS.items():
        column = f"{heading}: ours | published | diff"
        for detector in cells.index:
            parts = [cells.loc[detector, f"{name}_{part}"] for part in openood.SUMMARY_PARTS]
            assert summary.loc[detector, column] == " | ".join(parts)


def test_a_published_figure_without_std_shows_none(monkeypatch):
    """ImageNet-1K's leaderboard: one run per model, no std."""
    monkeypatch.setattr(openood, "run_figures", lambda run: figures({"msp": {"near_auroc": 75.0}}))
    cells = summary_cells(bench_table(["r"], "imagenet")).set_index("detector")
    assert cells.loc["msp", "near_auroc_published"] == f"{board('imagenet', 'MSP', 'ResNet50').near_auroc:.2f}"
    assert cells.loc["msp", "far_auroc_ours"] == "-" and cells.loc["msp", "far_auroc_diff"] == "-"  # not measured
    vit = summary_cells(bench_table(["r"], "imagenet", "ViT-B/16")).set_index("detector")
    assert vit.loc["msp", "near_auroc_published"] == f"{board('imagenet', 'MSP', 'ViT-B/16').near_auroc:.2f}"


def test_no_detector_ran_gives_an_empty_table_with_the_columns(monkeypatch):
    monkeypatch.setattr(openood, "run_figures", lambda run: figures({}))
    cells = summary_cells(bench_table(["r"], "cifar10"))
    assert cells.empty and list(cells.columns[:2]) == ["detector", "method"] and len(cells.columns) == 11
    assert bench_summary(bench_table(["r"], "cifar10")).empty


def test_a_run_is_a_benchmark_run_when_it_fits_on_an_openood_list():
    config = benchmark_config("cifar100", "/data", "ckpt").to_dict()
    assert run_benchmark(config) == "cifar100"
    assert title(config).startswith("openood-resnet18-32x32 on OpenOOD v1.5 cifar100 vs 6 OOD sets")  # the run list
    assert run_benchmark({"id_fit": {"name": "digits-train", "params": {}}}) is None
    assert run_benchmark({}) is None and run_benchmark(None) is None
    assert run_benchmark({"id_fit": {"name": "openood", "params": "cifar10"}}) is None  # a hand-made config
    assert leaderboard_arch("imagenet", "vit_b_16") == "ViT-B/16" and leaderboard_arch("imagenet", "swin_t") == "Swin-T"
    assert leaderboard_arch("imagenet", "resnet50") == "ResNet50"
    assert leaderboard_arch("cifar10", "openood-resnet18-32x32") is None  # the benchmark's one model: the default
    assert leaderboard_arch("imagenet", "convnext_tiny") is None


def notes_of(config, runs_list, benchmark="cifar10", arch=None) -> str:
    return " ".join(comparison_notes(config.to_dict(), bench_table(runs_list, benchmark, arch)))


def test_the_notes_say_where_the_figures_come_from_and_the_protocol_the_run_took(runs):
    config = benchmark_config("cifar10", "/data", "ckpt", detectors=["msp", "energy", "ash"])
    said = notes_of(config, ["run-a"])
    assert "OpenOOD v1.5 leaderboard (https://zjysteven.github.io/OpenOOD/)" in said
    assert "commit 28d3a40 of 2025-07-19" in said and "ResNet18, CrossEntropy training" in said
    assert "mean ± std over 3 independent training runs" in said
    assert "Ours: this run, one checkpoint (no std" in said and "publishes no FPR@95" in said
    assert "Protocol paper" in said and "'-': no figure" in said
    # of the detectors that ran (msp, energy, entropy), none has an OpenOOD variant
    assert "none of these detectors has another variant or defaults in OpenOOD" in said
    assert "Ours: mean ± std over 2 runs." in notes_of(config, ["run-a", "run-b"])
    # nothing else to say: OpenOOD's network, preprocessing, sets, all of them
    assert len(comparison_notes(config.to_dict(), bench_table(["run-a"], "cifar10"))) == 5
    openood_config = benchmark_config("cifar10", "/data", "ckpt", protocol="openood", tune=True)
    said = notes_of(openood_config, ["run-a"])
    assert "Protocol openood" in said and "parameters tuned on the validation data" in said


def test_the_notes_name_the_detectors_whose_openood_variant_differs(monkeypatch):
    monkeypatch.setattr(openood, "run_figures", lambda run: figures({"ash": {"near_auroc": 70.0}, "msp": {}}))
    config = benchmark_config("cifar10", "/data", "ckpt")
    assert "OpenOOD's variant or defaults differ for ash: protocol openood runs those" in notes_of(config, ["r"])


def test_the_notes_say_what_sets_this_run_apart_from_the_leaderboards(runs):
    config = benchmark_config("cifar10", "/data", None, weights="random")
    config.backbone = "resnet18"
    config.preprocessing = None
    config.ood = config.ood[:3]
    config.id_fit.subsample = 1000
    said = notes_of(config, ["run-a"])
    assert "This run's backbone is resnet18, not openood-resnet18-32x32" in said
    assert "Random weights: a dry run" in said
    assert "Not OpenOOD's preprocessing of cifar10" in said
    assert "Other OOD sets than the benchmark's near and far lists" in said
    assert "Subsampled (ID fit): the figures are of a sample" in said
    # ViT-B/16 on imagenet is one of the leaderboard's models: compared with its own rows, no backbone note
    vit = benchmark_config("imagenet", "/data", "ckpt")
    vit.backbone = "vit_b_16"
    said = notes_of(vit, ["run-a"], "imagenet", "ViT-B/16")
    assert "ViT-B/16, CrossEntropy training" in said and "This run's backbone" not in said
    with pytest.raises(ValueError, match="not a run of an OpenOOD v1.5 benchmark"):
        comparison_notes({"id_fit": {"name": "digits-train"}}, bench_table(["run-a"], "cifar10"))
