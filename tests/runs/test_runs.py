"""Runs as files: config validation, the run directory, background jobs, cancel, kill, queue, CLI."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import brute_force_threshold, cuda, extraction_started, slow_config, small_config, wait_for
from sklearn.metrics import average_precision_score, roc_auc_score

from oodviz.config.run import ConfigError, DatasetChoice, DetectorChoice, RunConfig
from oodviz.pipeline.job import resolve_device
from oodviz.results.metrics import ood_metrics, threshold_at_recall
from oodviz.runs.jobs import cancel, list_runs, refresh, submit
from oodviz.runs.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]


def wait_final(run: RunDir, timeout=180.0) -> dict:
    return wait_for(lambda: (s := refresh(run))["state"] in ("done", "failed", "cancelled") and s, timeout)


def run_here(config: RunConfig, runs_root: Path) -> RunDir:
    """``config`` run to its end in this process (the worker's :func:`oodviz.pipeline.worker.execute`), for tests of
    what a run does rather than of the background job's processes (:func:`submit`, tested below)."""
    from oodviz.pipeline.worker import execute

    run = RunDir.create(runs_root, config.validate().to_dict())
    execute(run)
    return run


# ---- config ---------------------------------------------------------------------------------


def test_config_round_trips_through_json_and_toml(tmp_path):
    config = small_config(seed=3, device="cpu")
    config.save(tmp_path / "run.json")
    assert RunConfig.load(tmp_path / "run.json") == config
    (tmp_path / "run.toml").write_text(
        'backbone = "digits-cnn"\nbatch_size = 128\nseed = 3\ndevice = "cpu"\n'
        'ood = ["digits-heldout", {name = "noise-uniform", params = {n = 200}}]\n'
        'detectors = ["msp", "mahalanobis", {name = "vim", params = {dim = 16}}]\n'
    )
    assert RunConfig.load(tmp_path / "run.toml") == config


def test_a_config_with_three_mistakes_reports_all_three():
    config = small_config(backbone="resnet-9000", batch_size=0)
    config.detectors.append(DetectorChoice("knn", {"kk": 5}))
    with pytest.raises(ConfigError) as caught:
        config.validate()
    problems = caught.value.problems
    assert len(problems) == 3, problems
    assert "backbone 'resnet-9000' is unknown" in problems[0]
    assert any("batch_size must be an integer >= 1, got 0" in p for p in problems)
    assert any("detectors[3] (knn)" in p and "no parameter(s) kk" in p for p in problems)
    with pytest.raises(ConfigError, match="unknown setting 'batchsize'"):
        RunConfig.from_dict({"batchsize": 3})


# ---- a run in the foreground ----------------------------------------------------------------


def test_cli_default_run_writes_a_complete_self_describing_directory(default_run):
    out = default_run.path
    run = RunDir(out)
    assert run.read_status()["state"] == "done"
    assert RunConfig.from_dict(run.read_config()) == RunConfig()
    for name in ("metrics.csv", "scores.parquet", "per_class.csv", "meta.json", "detectors.json", "events.jsonl"):
        assert (out / name).is_file(), name
    meta = json.loads((out / "meta.json").read_text())
    assert meta["device"] == str(resolve_device("auto")) and meta["torch"]  # "cuda" where a GPU is visible
    assert {"extract id_fit", "fit mahalanobis", "metrics"} <= set(meta["stages"])
    assert all(s["wall_s"] >= 0 and s["peak_cpu_rss"] > 0 for s in meta["stages"].values())
    events = run.read_events()
    assert events[-1]["event"] == "done"
    assert {"stage", "event", "cpu_rss", "device"} <= set(events[0])
    scores = pd.read_parquet(out / "scores.parquet")
    assert list(scores.columns) == ["split", "dataset", "index", "label", "prediction"] + [
        d.name for d in RunConfig().detectors
    ]
    assert set(scores.split) == {"id_test", "ood"}
    assert (scores[scores.split == "ood"].label == -1).all()
    assert len(scores[scores.split == "id_test"]) == 362  # the digits test split, classes 0-7
    # The CLI prints the near/far means of metrics.csv, one row per detector in config order.
    metrics = pd.read_csv(out / "metrics.csv")
    assert "Mean AUROC / FPR95" in default_run.stdout
    detectors = [d.name for d in RunConfig().detectors]
    printed = {line.split()[0]: line.split()[1:] for line in default_run.stdout.splitlines() if line.strip()}
    assert [name for name in printed if name in detectors] == detectors
    for name in ("msp", "knn"):  # columns: AUROC far, near, FPR95 far, near
        for value, (key, group) in zip(
            printed[name], [("auroc", "far"), ("auroc", "near"), ("fpr95", "far"), ("fpr95", "near")]
        ):
            mean = metrics[(metrics.detector == name) & (metrics.ood_dataset == f"{group} (mean)")][key].item()
            assert abs(float(value) - mean) <= 5e-4
    # knn's bank lived in the run's scratch directory, which is gone now, and is not logged as a parameter
    assert not run.scratch_path.exists()
    assert json.loads((out / "detectors.json").read_text())["knn"]["params"] == {
        "k": 50,
        "chunk_size": 16384,
        "backend": "exact",
    }


def test_metrics_csv_agrees_with_sklearn_and_a_brute_force_fpr95(default_run):
    """Every per-dataset row of metrics.csv against scikit-learn on the stored scores (OOD positive),
    FPR95 and the threshold found by trying every OOD score, and the group means by hand."""
    scores = pd.read_parquet(default_run.path / "scores.parquet")
    metrics = pd.read_csv(default_run.path / "metrics.csv")
    id_rows = scores[scores.split == "id_test"]
    detectors = [d.name for d in RunConfig().detectors]
    groups = {
        "digits-heldout": "near",
        "digits-inverted": "near",
        "digits-rotated": "near",
        "photo-patches": "far",
        "noise-gaussian": "far",
        "noise-uniform": "far",
    }
    per_dataset = metrics[~metrics.ood_dataset.str.endswith("(mean)")]
    assert list(zip(per_dataset.detector, per_dataset.ood_dataset)) == [(d, o) for d in detectors for o in groups]
    for row in per_dataset.itertuples():
        id_scores = id_rows[row.detector].to_numpy(np.float64)
        ood_scores = scores[(scores.split == "ood") & (scores.dataset == row.ood_dataset)][row.detector]
        ood_scores = ood_scores.to_numpy(np.float64)
        is_ood = np.r_[np.zeros(id_scores.size), np.ones(ood_scores.size)]
        both = np.r_[id_scores, ood_scores]
        assert row.auroc == pytest.approx(roc_auc_score(is_ood, both), abs=1e-12)
        assert row.aupr_out == pytest.approx(average_precision_score(is_ood, both), abs=1e-12)
        assert row.aupr_in == pytest.approx(average_precision_score(1 - is_ood, -both), abs=1e-12)
        threshold = brute_force_threshold(ood_scores)
        assert row.threshold == threshold
        assert row.fpr95 == pytest.approx((id_scores >= threshold).mean(), abs=1e-12)
        assert row.group == groups[row.ood_dataset]
        assert row.id_accuracy == pytest.approx((id_rows.label == id_rows.prediction).mean())
    means = metrics[metrics.ood_dataset.str.endswith("(mean)")]
    assert len(means) == len(detectors) * len(set(groups.values()))
    for row in means.itertuples():
        members = [o for o, g in groups.items() if g == row.group]
        assert row.ood_dataset == f"{row.group} (mean)" and np.isnan(row.threshold)
        for key in ("auroc", "aupr_in", "aupr_out", "fpr95"):
            rows = per_dataset[(per_dataset.detector == row.detector) & per_dataset.ood_dataset.isin(members)]
            assert getattr(row, key) == pytest.approx(sum(getattr(r, key) for r in rows.itertuples()) / len(members))


def test_per_class_csv_counts_false_alarms_at_the_pooled_95_percent_recall_threshold(default_run):
    scores = pd.read_parquet(default_run.path / "scores.parquet")
    per_class = pd.read_csv(default_run.path / "per_class.csv")
    id_rows = scores[scores.split == "id_test"]
    detectors = [d.name for d in RunConfig().detectors]
    assert list(per_class.columns) == [
        "detector",
        "class",
        "class_name",
        "n",
        "accuracy",
        "false_alarms",
        "false_alarm_rate",
        "mean_score",
        "threshold",
    ]
    assert list(zip(per_class.detector, per_class["class"])) == [(d, c) for d in detectors for c in range(8)]
    for row in per_class.itertuples():
        threshold = brute_force_threshold(scores[scores.split == "ood"][row.detector])
        members = id_rows[id_rows.label == row[2]]
        values = members[row.detector].to_numpy(np.float64)
        assert row.threshold == threshold
        assert row.class_name == row[2] and row.n == len(members)  # digits: the name is the number
        assert row.false_alarms == int(np.sum(values >= threshold))
        assert row.false_alarm_rate == pytest.approx(np.mean(values >= threshold), abs=1e-15)
        assert row.accuracy == pytest.approx(np.mean(members.label == members.prediction), abs=1e-15)
        assert row.mean_score == pytest.approx(math.fsum(values) / len(values), rel=1e-12)


@pytest.mark.parametrize("rounded", [False, True])
def test_threshold_at_recall_and_fpr95_against_trying_every_threshold(rounded):
    rng = np.random.default_rng(0)
    id_scores, ood_scores = rng.normal(size=500), rng.normal(1, size=333)
    if rounded:  # many ties, where ">=" versus ">" matters
        id_scores, ood_scores = np.round(id_scores, 1), np.round(ood_scores, 1)
    t = threshold_at_recall(ood_scores)
    assert t == brute_force_threshold(ood_scores)
    assert ood_metrics(id_scores, ood_scores)["fpr95"] == pytest.approx((id_scores >= t).mean(), abs=1e-15)


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory) -> tuple[RunDir, RunDir]:
    """Two runs submitted together to one runs root: ``small_config()``, then the same data with another detector,
    which waits in the queue for the first. Tests only read them (one that needs a finished run elsewhere copies it)."""
    root = tmp_path_factory.mktemp("two-jobs")
    first = submit(small_config(), root)
    second = submit(small_config(detectors=[DetectorChoice("energy")]), root)
    assert wait_final(first)["state"] == "done" and wait_final(second)["state"] == "done"
    return first, second


def test_two_ood_sets_of_one_dataset_run_under_their_titles_each_with_its_group_and_images(tmp_path):
    from oodviz.figures.thumbnails import thumbnails
    from oodviz.results.tables import load_results

    near_set = DatasetChoice("noise-uniform", {"n": 60, "noise_seed": 1}, group="near", title="uniform A")
    other = DatasetChoice("noise-uniform", {"n": 40, "noise_seed": 2}, title="uniform B")
    untitled = [DatasetChoice("noise-uniform", {"n": 60, "noise_seed": 1}), DatasetChoice("noise-uniform", {"n": 40})]
    config = small_config(device="cpu", ood=untitled)
    assert config.problems() == [
        "OOD dataset 'noise-uniform' is listed twice: give each of its entries its own title (the name its results take)"
    ]
    config.ood = [near_set, other]
    run = run_here(config, tmp_path)
    assert run.read_status()["state"] == "done"
    results = load_results(run.path)
    metrics = results.metrics
    rows = metrics[metrics.detector == "msp"].set_index("ood_dataset")
    assert rows.loc["uniform A", "group"] == "near" and rows.loc["uniform B", "group"] == "far"
    scores = results.scores
    counts = scores[scores.split == "ood"].groupby("dataset").size().to_dict()
    assert counts == {"uniform A": 60, "uniform B": 40}
    ood_a = scores[(scores.split == "ood") & (scores.dataset == "uniform A")]
    ood_b = scores[(scores.split == "ood") & (scores.dataset == "uniform B")]
    id_rows = scores[scores.split == "id_test"]
    assert rows.loc["uniform A", "auroc"] == pytest.approx(roc_auc_score(
        np.r_[np.zeros(len(id_rows)), np.ones(len(ood_a))], np.r_[id_rows.msp, ood_a.msp]))  # fmt: skip
    assert rows.loc["uniform B", "auroc"] == pytest.approx(roc_auc_score(
        np.r_[np.zeros(len(id_rows)), np.ones(len(ood_b))], np.r_[id_rows.msp, ood_b.msp]))  # fmt: skip
    # the images behind a row are its own set's: the two seeds give different noise
    first_a, first_b = (thumbnails(results, rows.head(1), size=16)[0] for rows in (ood_a, ood_b))
    assert np.asarray(first_a).tobytes() != np.asarray(first_b).tobytes()
    meta = json.loads((run.path / "meta.json").read_text())
    assert {meta["splits"][f"ood:uniform {x}"]["dataset"] for x in "AB"} == {"uniform A", "uniform B"}


@pytest.mark.process
def test_a_second_identical_run_reuses_the_stored_features(two_jobs):
    first, second = two_jobs
    assert refresh(second)["started"] >= refresh(first)["finished"] - 0.5  # it extracted nothing while first ran
    reused = [e for e in second.read_events() if e.get("event") == "progress" and e.get("reused")]
    assert {e["stage"] for e in reused} == {
        "extract id_fit",
        "extract id_test",
        "extract ood:digits-heldout",
        "extract ood:noise-uniform",
    }
    meta = json.loads((second.path / "meta.json").read_text())
    assert all(split["reused"] for split in meta["splits"].values())
    first_meta = json.loads((first.path / "meta.json").read_text())
    assert meta["splits"]["id_fit"]["store"] == first_meta["splits"]["id_fit"]["store"]


@pytest.mark.cuda
@cuda
def test_a_run_on_device_cuda_matches_the_same_run_on_the_cpu(tmp_path):
    """The explicit twin of the default run on the GPU: same config, device "cuda" and "cpu"; same metrics
    (to within 0.01: float32 rounding of other kernels, TF32 convolutions, a sample or two at a threshold)."""
    runs = {device: submit(small_config(device=device), tmp_path / device) for device in ("cpu", "cuda")}
    for run in runs.values():
        assert wait_final(run)["state"] == "done", run.read_events()[-3:]
    assert json.loads((runs["cuda"].path / "meta.json").read_text())["device"] == "cuda"
    metrics = {device: pd.read_csv(run.path / "metrics.csv") for device, run in runs.items()}
    assert list(metrics["cuda"].detector) == list(metrics["cpu"].detector)
    assert list(metrics["cuda"].ood_dataset) == list(metrics["cpu"].ood_dataset)
    for key in ("auroc", "fpr95", "id_accuracy"):
        np.testing.assert_allclose(metrics["cuda"][key], metrics["cpu"][key], atol=0.01)


def test_a_failing_detector_is_recorded_and_the_others_go_on(tmp_path):
    config = small_config(detectors=[DetectorChoice("mcd"), DetectorChoice("msp")])  # digits-cnn has no dropout
    run = run_here(config, tmp_path)
    assert run.read_status()["state"] == "done"
    log = json.loads((run.path / "detectors.json").read_text())
    assert "mcd needs dropout layers to sample from" in log["mcd"]["error"]
    assert "error" not in log["msp"]
    assert set(pd.read_csv(run.path / "metrics.csv").detector) == {"msp"}


def test_a_detector_failing_to_score_is_recorded_like_one_failing_to_fit(tmp_path):
    """One failure path: mcd cannot fit (the model has no dropout) and odin cannot score id_test (its images changed
    after extraction); each gets error and traceback in detectors.json, a warning and a failed stage;
    msp goes on, and odin is not scored again."""
    from dataclasses import replace

    from oodviz.pipeline import stages as pipeline
    from oodviz.pipeline.reporter import Reporter

    config = small_config(detectors=[DetectorChoice("mcd"), DetectorChoice("msp"), DetectorChoice("odin")])
    run = RunDir.create(tmp_path, config.to_dict())
    job = pipeline.start_job(config, run, Reporter(run))
    for stage in pipeline.STAGES:
        stage(job)
        if stage is pipeline.fit_detectors:  # odin re-reads the images: 50 of them no longer match the 362 stored
            job.datasets["id_test"] = pipeline.load_split(config, replace(config.id_test, subsample=50), as_ood=False)
    log = json.loads((run.path / "detectors.json").read_text())
    assert log["mcd"]["error"].startswith("ValueError: mcd needs dropout layers to sample from")
    assert log["odin"]["error"].startswith("ValueError: the dataset gave other items (50 rows)")
    for name in ("mcd", "odin"):
        assert log[name]["traceback"].startswith("Traceback (most recent call last)")
        assert log[name]["traceback"].rstrip().endswith(log[name]["error"])
    assert log["odin"]["fit_s"] >= 0 and "error" not in log["msp"]
    warnings = [e["message"] for e in run.read_events() if e["event"] == "warning"]
    failures = [w for w in warnings if " failed to " in w]
    assert [w.split(":")[0] for w in failures] == ["mcd failed to fit", "odin failed to score id_test"]
    stages = json.loads((run.path / "meta.json").read_text())["stages"]
    assert (stages["fit mcd"]["error"], stages["score id_test with odin"]["error"]) == tuple(failures)
    assert not any("error" in stages[name] for name in ("fit msp", "fit odin", "score id_test", "metrics"))
    assert not any(name.endswith("with odin") for name in stages if name.startswith("score ood:"))
    assert list(pd.read_parquet(run.path / "scores.parquet").columns[5:]) == ["msp"]
    assert set(pd.read_csv(run.path / "metrics.csv").detector) == {"msp"}


def test_a_cancel_request_raises_the_engines_cancelled_at_the_next_stage(tmp_path):
    from oodviz.engine import Cancelled
    from oodviz.pipeline.reporter import Reporter

    run = RunDir.create(tmp_path, small_config().to_dict())
    reporter = Reporter(run)
    with reporter.stage("first") as stage:
        stage.progress(1, 2)
    run.request_cancel()
    with pytest.raises(Cancelled, match="cancelled by the user"), reporter.stage("second"):
        pass
    assert [e["stage"] for e in run.read_events() if e["event"] == "start"] == ["first"]


# ---- background jobs: kill, cancel, queue, restart -------------------------------------------


@pytest.mark.process
def test_kill_9_of_the_worker_mid_extraction_fails_the_run_readably_and_stores_nothing(tmp_path):
    run = submit(slow_config(), tmp_path)
    wait_for(lambda: extraction_started(run, "ood:noise-gaussian"))
    bank = run.scratch_path / "knn" / "bank.f32"  # what a killed knn fit would leave behind
    bank.parent.mkdir(parents=True)
    bank.write_bytes(b"x" * 1024)
    os.kill(run.read_status()["worker_pid"], signal.SIGKILL)
    status = wait_final(run, timeout=30)
    assert status["state"] == "failed"
    assert "killed by signal 9 (SIGKILL) — likely out of memory" in status["error"]
    batch = run.read_config()["batch_size"]  # the retry the app offers: a quarter of the batch, as data
    assert [(fix["kind"], fix["value"]) for fix in status["fixes"]] == [("batch_size", max(batch // 4, 1))]
    assert not run.scratch_path.exists()  # the supervisor removed the dead worker's scratch files
    from oodviz.engine import list_stores

    half_written = [p for p in (tmp_path / ".features").iterdir() if ".tmp-" in p.name]
    assert len(half_written) == 1 and (half_written[0] / "features.npy").exists()
    trusted = list_stores(tmp_path / ".features")
    assert sorted(store.meta["dataset"]["name"] for store in trusted) == ["digits-test", "digits-train"]


@pytest.mark.process
def test_cancel_stops_within_a_batch_and_keeps_the_run_readable(tmp_path):
    run = submit(slow_config(), tmp_path)
    wait_for(lambda: extraction_started(run, "ood:noise-gaussian"))
    asked = time.monotonic()
    cancel(run)
    status = wait_final(run, timeout=30)
    assert status["state"] == "cancelled"
    assert time.monotonic() - asked < 5  # a 64-image batch takes milliseconds; no forced kill was needed
    assert wait_for(lambda: "exit_code" in refresh(run) and refresh(run))["exit_code"] == 0  # stopped by itself
    assert run.read_events()[-1]["event"] == "cancelled"
    assert RunConfig.from_dict(run.read_config()) == slow_config()


@pytest.mark.process
def test_two_jobs_submitted_together_both_complete_in_order(two_jobs):
    a, b = two_jobs
    assert a.path != b.path
    assert wait_final(a)["state"] == "done" and wait_final(b)["state"] == "done"
    assert refresh(b)["started"] >= refresh(a)["finished"] - 0.5  # b waited for a
    assert any(e.get("stage") == "queued" for e in b.read_events())


@pytest.mark.process
def test_a_restarted_reader_relists_every_run_and_detects_a_dead_supervisor(two_jobs, tmp_path):
    done = RunDir(tmp_path / two_jobs[0].run_id)  # a finished run, as ``submit`` left it
    shutil.copytree(two_jobs[0].path, done.path)
    orphan = submit(slow_config(), tmp_path)
    wait_for(lambda: refresh(orphan)["state"] == "running")
    os.killpg(
        os.getpgid(refresh(orphan)["supervisor_pid"]), signal.SIGKILL
    )  # the whole job, as a machine restart would
    listing = subprocess.run(
        [sys.executable, "-m", "oodviz.cli", "runs", "--runs-root", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout  # a fresh process: nothing in memory
    assert done.run_id in listing and orphan.run_id in listing
    assert [r.run_id for r in list_runs(tmp_path)] == [orphan.run_id, done.run_id]
    status = refresh(orphan)
    assert status["state"] == "failed" and status["error"].startswith("the supervisor was killed")
    assert json.loads(orphan.status_path.read_text())["state"] == "running"  # readers derive it, never write


def test_a_torchvision_model_with_random_weights_end_to_end_on_image_folders(tmp_path):
    """resnet18 (random weights, a dry run) on a 2-class image folder against a flat OOD folder."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("fit", 8), ("test", 4)):
        for k, colour in enumerate(((200, 40, 40), (40, 40, 200))):
            folder = tmp_path / split / f"class-{k}"
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = np.clip(np.array(colour) + rng.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    (tmp_path / "ood").mkdir()
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(tmp_path / "ood" / f"{i}.png")
    (tmp_path / "ood" / "broken.png").write_bytes(b"not an image")
    config = RunConfig(
        backbone="resnet18",
        weights="random",
        id_fit=DatasetChoice("folder", {"path": str(tmp_path / "fit")}),
        id_test=DatasetChoice("folder", {"path": str(tmp_path / "test")}),
        ood=[DatasetChoice("folder", {"path": str(tmp_path / "ood")}, group="far")],
        detectors=[DetectorChoice("msp"), DetectorChoice("mahalanobis"), DetectorChoice("knn", {"k": 3})],
        batch_size=4,
    )
    run = run_here(config, tmp_path / "runs")
    assert run.read_status()["state"] == "done", run.read_status()
    scores = pd.read_parquet(run.path / "scores.parquet")
    assert (scores.split == "id_test").sum() == 8 and (scores.split == "ood").sum() == 5  # the broken file skipped
    assert set(scores.label[scores.split == "id_test"]) == {0, 1}
    assert np.isfinite(scores[["msp", "mahalanobis", "knn"]].to_numpy()).all()
    assert any("1 unreadable image(s) skipped" in e.get("message", "") for e in run.read_events())
    meta = json.loads((run.path / "meta.json").read_text())
    assert meta["splits"]["id_fit"]["n"] == 16


def test_a_subsample_that_leaves_a_class_without_an_image_is_a_run_warning_in_the_cli_and_the_run_details(
    tmp_path, capsys
):
    """`oodviz run` with an ID test folder of 8 classes (3 images each) subsampled to 5: stratified, so 5 classes
    get one image and 3 none, which the run warns about (its events, the CLI's output) and its meta records for
    the run details (mode, seed, N of M, the classes left out)."""
    from PIL import Image

    from oodviz.cli import main
    from oodviz.results.tables import sampling_table

    for k in range(8):
        for i in range(3):
            folder = tmp_path / "test" / str(k)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8), 30 * k + i, np.uint8)).save(folder / f"{i}.png")
    config = small_config(
        id_fit=DatasetChoice("digits-train", subsample=300),
        id_test=DatasetChoice("folder", {"path": str(tmp_path / "test"), "mode": "L"}, subsample=5),
        ood=[DatasetChoice("noise-uniform", params={"n": 40}, subsample=20)],
        detectors=[DetectorChoice("msp")],
        device="cpu",
    )
    config.save(tmp_path / "run.json")
    code = main(["run", str(tmp_path / "run.json"), "--out", str(tmp_path / "runs" / "run")])
    err = capsys.readouterr().err
    assert code == 0, err
    expected = "id_test: its subsample (5 of 24, stratified by class (8 classes), seed 0) holds no image of 3 class(es): 5, 6, 7"
    assert f"WARNING {expected}" in err
    run = RunDir(tmp_path / "runs" / "run")
    warnings = [e["message"] for e in run.read_events() if e.get("event") == "warning"]
    assert [w for w in warnings if w.startswith(expected)] and not [w for w in warnings if "id_fit:" in w]
    scores = pd.read_parquet(run.path / "scores.parquet")
    assert sorted(scores.label[scores.split == "id_test"]) == [0, 1, 2, 3, 4]
    meta = json.loads((run.path / "meta.json").read_text())
    assert meta["splits"]["id_test"]["sampling"] == {
        "mode": "stratified",
        "seed": 0,
        "kept": 5,
        "of": 24,
        "classes": 8,
        "empty_classes": ["5", "6", "7"],
    }
    table = sampling_table(meta).set_index("split")
    assert table.loc["id_fit", "images"] == "300 of 1,081, stratified by class (8 classes), seed 0"
    assert table.loc["ood:noise-uniform", "images"] == "20 of 40, uniform at random (no classes), seed 0"
    assert table.loc["id_test", "classes without an image"] == "5, 6, 7"


def test_the_stages_run_in_the_one_order_the_plan_lists():
    """One list of steps (:data:`oodviz.config.plan.STEPS`): the single-process stages and a sharded rank's follow
    it step for step, so the plan the app shows cannot drift from what runs."""
    from types import SimpleNamespace

    from oodviz.config.plan import STEPS
    from oodviz.pipeline.sharded import sharded_stages
    from oodviz.pipeline.stages import STAGES, STEP_FUNCTIONS

    assert [stage.__name__ for stage in STAGES] == [step for step, _ in STEPS]
    assert set(STEP_FUNCTIONS) == {step for step, _ in STEPS}
    ranked = sharded_stages(SimpleNamespace(rank=0, size=2))
    names = [getattr(getattr(s, "func", s), "__name__", "") for s in ranked]
    assert names == [
        "load_model",
        "load_data",
        "extract_splits",
        "tune_detectors",
        "fit_detectors",
        "score_sharded_splits",
        "combine_layers",
        "save_whole_banks",
        "write_scores",
        "write_metrics",
        "write_meta",
    ]
