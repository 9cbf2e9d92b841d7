"""``oodviz bench openood-v1.5``: OpenOOD v1.5's protocol end to end over a small synthetic data root in OpenOOD's
exact layout (the list files where OpenOOD's ``DATA_INFO`` puts them, ``<path> <label>`` lines, images under
``images_classic/``) with randomly initialised ``ResNet18_32x32`` checkpoints saved under OpenOOD's key names."""

import numpy as np
import pandas as pd
import pytest
from helpers import OOD_IMAGES, checkpoint, write_cifar10_root
from sklearn.metrics import roc_auc_score

from oodviz.cli import main
from oodviz.pipeline.openood import bench_summary
from oodviz.results.leaderboard import published
from oodviz.results.tables import load_results
from oodviz.runs.jobs import list_runs

NEAR = ("cifar100", "tin")
FAR = ("mnist", "svhn", "texture", "places365")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    root = tmp / "openood"
    sizes = write_cifar10_root(root)
    checkpoints = [checkpoint(tmp / f"s{seed}.ckpt", seed) for seed in (0, 1)]
    argv = ["bench", "openood-v1.5", "cifar10", "--data-root", str(root), "--checkpoint", *checkpoints]
    argv += [
        "--detectors",
        "msp,energy,mahalanobis,ash",
        "--device",
        "cpu",
        "--batch-size",
        "64",
        "--protocol",
        "openood",
    ]
    argv += ["--runs-root", str(tmp / "runs"), "--csv", str(tmp / "bench.csv")]
    argv.append("--force")  # random weights on random images: the classifier check refuses them, rightly
    code = main(argv)
    return {"code": code, "tmp": tmp, "root": root, "sizes": sizes, "checkpoints": checkpoints}


@pytest.mark.process
def test_every_set_is_read_in_its_role_with_openoods_preprocessing(bench):
    assert bench["code"] == 0
    runs = sorted(list_runs(bench["tmp"] / "runs"), key=lambda run: run.read_config()["checkpoint"])
    assert [run.read_config()["checkpoint"] for run in runs] == bench["checkpoints"]
    for run in runs:
        results = load_results(run.path)
        splits = results.meta["splits"]
        assert (
            splits["id_fit"]["n"] == bench["sizes"]["id_train"] and splits["id_test"]["n"] == bench["sizes"]["id_test"]
        )
        groups = {name: splits[f"ood:{name}"]["group"] for name in NEAR + FAR}
        assert groups == {**dict.fromkeys(NEAR, "near"), **dict.fromkeys(FAR, "far")}
        assert all(splits[f"ood:{name}"]["n"] == OOD_IMAGES for name in NEAR + FAR)
        assert set(splits) == {"id_fit", "id_test", *(f"ood:{name}" for name in NEAR + FAR)}  # no validation lists
        config = results.config
        assert config["backbone"] == "openood-resnet18-32x32" and config["preprocessing"] == "openood:cifar10"
        # --protocol openood: recorded, and each detector ran with OpenOOD's parameters (its ASH is ASH-B)
        assert config["protocol"] == "openood" and config["detectors"][3] == {
            "name": "ash",
            "params": {"variant": "b"},
            "grid": None,
        }
        assert results.detectors["ash"]["params"]["variant"] == "b"


@pytest.mark.process
def test_the_table_is_the_mean_and_std_over_seeds_of_near_and_far_means_beside_the_leaderboard(bench):
    table = pd.read_csv(bench["tmp"] / "bench.csv")
    runs = sorted(list_runs(bench["tmp"] / "runs"), key=lambda run: run.read_config()["checkpoint"])
    per_seed = {"near": [], "far": []}
    for run in runs:
        scores = load_results(run.path).scores
        id_scores = scores.loc[scores.split == "id_test", "msp"].to_numpy()
        for group, names in (("near", NEAR), ("far", FAR)):
            aurocs = []
            for name in names:
                ood = scores.loc[(scores.split == "ood") & (scores.dataset == name), "msp"].to_numpy()
                labels = np.r_[np.zeros(len(id_scores)), np.ones(len(ood))]
                aurocs.append(roc_auc_score(labels, np.r_[id_scores, ood]))
            per_seed[group].append(100 * np.mean(aurocs))  # OpenOOD: the plain mean over the group's sets
    msp = table[table.detector == "msp"].iloc[0]
    for group in ("near", "far"):
        assert msp[f"{group}_auroc_ours"] == pytest.approx(np.mean(per_seed[group]), abs=1e-9)
        assert msp[f"{group}_auroc_ours_std"] == pytest.approx(np.std(per_seed[group]), abs=1e-9)
    board = published("cifar10")
    row = board[(board.postprocessor == "MSP") & (board.arch == "ResNet18") & (board.training == "CrossEntropy")]
    assert msp.near_auroc_published == pytest.approx(row.near_auroc.iloc[0])
    assert msp.near_auroc_diff == pytest.approx(msp.near_auroc_ours - row.near_auroc.iloc[0])
    assert msp.status == "compared" and msp.runs == 2
    summary = bench_summary(table).set_index("detector")
    assert list(summary.index) == [
        "msp",
        "mahalanobis",
        "energy",
        "ash",
    ]  # the detectors that ran, in leaderboard order
    near = f"{msp.near_auroc_ours:.2f} ± {msp.near_auroc_ours_std:.2f} | {row.near_auroc.iloc[0]:.2f} ± "
    assert summary.loc["msp", "near AUROC: ours | published | diff"].startswith(near)
    energy = table[table.postprocessor == "EBO"].iloc[0]
    assert energy.detector == "energy" and energy.status == "compared"
    # a leaderboard method oodviz has but did not run here, and one oodviz lacks
    assert table[table.detector == "knn"].status.iloc[0] == "not in these results"
    assert "no oodviz detector" in set(table.status)


@pytest.mark.process
def test_a_missing_image_or_list_stops_the_bench_before_any_work_naming_the_set_and_archive(tmp_path, capsys):
    root = tmp_path / "openood"
    write_cifar10_root(root)
    (root / "images_classic" / "svhn" / "test" / "svhn_3.png").unlink()
    ckpt = checkpoint(tmp_path / "s0.ckpt", 0)
    argv = ["bench", "openood-v1.5", "cifar10", "--data-root", str(root), "--checkpoint", ckpt]
    argv += ["--detectors", "msp", "--device", "cpu", "--runs-root", str(tmp_path / "runs")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cifar10 far/svhn: 1 of the 12 images named by benchmark_imglist/cifar10/test_svhn.txt are missing" in err
    assert "images_classic/svhn/test/svhn_3.png" in err and "--datasets svhn" in err
    assert not (tmp_path / "runs").exists() or not list_runs(tmp_path / "runs")
    (root / "benchmark_imglist" / "cifar10" / "test_tin.txt").unlink()
    assert main(argv) == 2
    assert "cifar10 near/tin: list file benchmark_imglist/cifar10/test_tin.txt is missing" in capsys.readouterr().err


def test_the_bench_needs_a_checkpoint_or_random_weights(tmp_path, capsys):
    argv = ["bench", "openood-v1.5", "cifar10", "--data-root", str(tmp_path)]
    assert main(argv) == 2
    assert "needs --checkpoint" in capsys.readouterr().err
    assert main([*argv[:2], "cifar11", "--data-root", str(tmp_path), "--weights", "random"]) == 2
    assert "Did you mean 'cifar10'?" in capsys.readouterr().err
