"""Tuning detectors on validation data (issue 17 point 2) and default detectors per backbone family (point 4).

One tuning run on the bundled digits model, end to end; its choices are checked against validation AUROC computed
here with sklearn over each grid (a float64 energy formula, and the public detector API on the run's stores)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import sklearn_auroc
from kernels import assert_kernel_close, run_batch_size
from scipy.special import logsumexp
from streamlit.testing.v1 import AppTest

from oodviz.config.defaults import default_detector_params, defaults_reason
from oodviz.config.plan import planned_stages
from oodviz.config.run import ConfigError, DatasetChoice, DetectorChoice, RunConfig
from oodviz.config.tuning import MAX_GRID_POINTS, validation_warnings
from oodviz.detectors import available, create, detector_class
from oodviz.engine import STORES_DIRNAME, open_store
from oodviz.pipeline.worker import execute
from oodviz.runs.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
REACT_GRID = [50.0, 90.0, 99.0]
KNN_GRID = [1, 5, 20]
ODIN_GRID = [1.0, 1000.0]


def tuning_config(**changes) -> RunConfig:
    """Fit on the first 800 digits-train images, validate on the last 281 (disjoint) against rotated digits."""
    config = RunConfig(
        id_fit=DatasetChoice("digits-train", subsample=800, subsample_mode="first"),
        id_val=DatasetChoice("digits-train", subsample=281, subsample_mode="last"),
        ood=[DatasetChoice("digits-heldout"), DatasetChoice("noise-uniform", params={"n": 200})],
        ood_val=DatasetChoice("digits-rotated"),
        detectors=[
            DetectorChoice("energy"),  # its default grid
            DetectorChoice("react", grid={"percentile": REACT_GRID}),
            DetectorChoice("knn", grid={"k": KNN_GRID}),
            DetectorChoice("msp"),  # nothing to tune
            DetectorChoice("odin", grid={"temperature": ODIN_GRID}),  # model-based: reruns the model on the images
        ],
        batch_size=run_batch_size(128),
        device="cpu",
    )
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory) -> RunDir:
    run = RunDir.create(tmp_path_factory.mktemp("tuning-runs"), tuning_config().to_dict())
    assert execute(run) == "done", run.read_status()
    return run


def stores_of(run: RunDir) -> dict:
    meta = json.loads((run.path / "meta.json").read_text())
    return {
        split: open_store(run.path.parent / STORES_DIRNAME, entry["store"]) for split, entry in meta["splits"].items()
    }


def test_the_run_tunes_every_gridded_detector_and_fits_the_choice(tuned_run):
    log = json.loads((tuned_run.path / "detectors.json").read_text())
    assert "tuning" not in log["msp"]  # no parameter: nothing tried
    for name in ("energy", "react", "knn", "odin"):
        tuning = log[name]["tuning"]
        assert tuning["validation"] == {"id": "digits-train", "ood": "digits-rotated"}
        assert {k: log[name]["params"][k] for k in tuning["chosen"]} == tuning["chosen"]  # fitted with the choice
    assert log["energy"]["tuning"]["grid"] == {
        "temperature": list(detector_class("energy").default_grid["temperature"])
    }
    stages = [e["stage"] for e in tuned_run.read_events() if e.get("event") == "start"]
    assert stages == planned_stages(tuning_config())
    assert {"tune energy", "tune react", "tune knn", "tune odin", "extract id_val", "extract ood_val"} <= set(stages)
    scores = pd.read_parquet(tuned_run.path / "scores.parquet")
    assert set(scores.dataset) == {
        "digits-test",
        "digits-heldout",
        "noise-uniform",
    }  # the validation splits are not scored as test sets


def test_energy_temperature_maximises_validation_auroc_float64(tuned_run):
    """Energy -T logsumexp(logits / T), float64 here, over the default grid: the run chose the best T and scored
    the test sets with it."""
    stores = stores_of(tuned_run)
    tuning = json.loads((tuned_run.path / "detectors.json").read_text())["energy"]["tuning"]

    def energy(logits, t):
        return -t * logsumexp(np.asarray(logits, np.float64) / t, axis=1)

    grid = tuning["grid"]["temperature"]
    ours = [sklearn_auroc(energy(stores["id_val"].logits, t), energy(stores["ood_val"].logits, t)) for t in grid]
    recorded = [row["auroc"] for row in tuning["results"]]
    np.testing.assert_allclose(recorded, ours, atol=1e-4)  # float32 scores vs float64
    assert tuning["chosen"] == {"temperature": grid[int(np.argmax(ours))]}
    assert tuning["auroc"] == pytest.approx(max(ours), abs=1e-4)
    chosen = tuning["chosen"]["temperature"]
    test = pd.read_parquet(tuned_run.path / "scores.parquet").query("split == 'id_test'")["energy"].to_numpy()
    np.testing.assert_allclose(test, energy(stores["id_test"].logits, chosen), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("name", "key", "grid"), [("react", "percentile", REACT_GRID), ("knn", "k", KNN_GRID)])
def test_fitted_parameters_maximise_validation_auroc(tuned_run, name, key, grid, tmp_path):
    """Each grid value refitted here with the public API on the run's ID fit store, validation AUROC by sklearn."""
    stores = stores_of(tuned_run)
    tuning = json.loads((tuned_run.path / "detectors.json").read_text())[name]["tuning"]
    from oodviz.models import load_backbone

    head = load_backbone("digits-cnn").head
    ours = []
    for value in grid:
        detector = create(name, **{key: value}, **({"bank_dir": str(tmp_path / str(value))} if name == "knn" else {}))
        detector.fit(stores["id_fit"].batches(4096), head=head)
        id_scores, ood_scores = (detector.score(stores[s].batches(4096)).numpy() for s in ("id_val", "ood_val"))
        ours.append(sklearn_auroc(id_scores, ood_scores))
    np.testing.assert_allclose([row["auroc"] for row in tuning["results"]], ours, atol=1e-9)
    assert [row["params"] for row in tuning["results"]] == [{key: v} for v in grid]
    assert tuning["chosen"] == {key: grid[int(np.argmax(ours))]}
    assert tuning["fits"] == (1 if name == "knn" else len(grid))  # knn's k only changes the score: one fit


def test_odin_temperature_maximises_validation_auroc_on_the_images(tuned_run):
    """odin reruns the model: here on the validation images through the public API, AUROC by sklearn."""
    import torch

    from oodviz import Batch
    from oodviz.data import load_dataset
    from oodviz.models import load_backbone

    backbone = load_backbone("digits-cnn")
    config = tuning_config()

    def inputs(choice, as_ood):
        dataset = load_dataset(
            choice.name, subsample=choice.subsample, subsample_mode=choice.subsample_mode, as_ood=as_ood
        )
        return Batch(inputs=torch.stack([backbone.transform(dataset[i][0]) for i in range(len(dataset))]))

    val_id, val_ood = inputs(config.id_val, False), inputs(config.ood_val, True)
    ours = []
    for temperature in ODIN_GRID:
        odin = create("odin", model=backbone, temperature=temperature)
        ours.append(sklearn_auroc(odin.score(val_id).numpy(), odin.score(val_ood).numpy()))
    tuning = json.loads((tuned_run.path / "detectors.json").read_text())["odin"]["tuning"]
    np.testing.assert_allclose([row["auroc"] for row in tuning["results"]], ours, atol=1e-6)
    assert tuning["chosen"] == {"temperature": ODIN_GRID[int(np.argmax(ours))]} and tuning["fits"] == 1


def test_set_params_rescores_a_fitted_detector_as_a_new_fit(problem, tmp_path):
    fitted = create("knn", k=5, bank_dir=str(tmp_path / "a")).fit(problem.fit_batches())
    fresh = create("knn", k=20, bank_dir=str(tmp_path / "b")).fit(problem.fit_batches())
    np.testing.assert_array_equal(
        fitted.set_params(k=20).score(problem.batches(problem.eval_x)), fresh.score(problem.batches(problem.eval_x))
    )
    with pytest.raises(ValueError, match="chunk_size changes what fit learns; make a new detector and fit it"):
        fitted.set_params(chunk_size=7)
    with pytest.raises(ValueError, match="k=5000 exceeds the 1200 in-distribution samples"):
        fitted.set_params(k=5000)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        fitted.set_params(k=0)


def test_first_and_last_subsamples_are_disjoint_parts_of_a_source():
    from oodviz.data import load_dataset
    from oodviz.sampling import subsample_indices

    np.testing.assert_array_equal(subsample_indices(10, 3, "last"), [7, 8, 9])
    fit = load_dataset("digits-train", subsample=800, subsample_mode="first")
    val = load_dataset("digits-train", subsample=281, subsample_mode="last")
    fit_items = {fit[i][2] for i in range(len(fit))}
    val_items = {val[i][2] for i in range(len(val))}
    assert len(fit_items) == 800 and len(val_items) == 281 and not fit_items & val_items


def test_validation_warnings_name_the_overlap_and_the_fix():
    assert validation_warnings(tuning_config()) == []
    assert validation_warnings(RunConfig()) == []  # no tuning, nothing to say
    [warning] = validation_warnings(tuning_config(ood_val=DatasetChoice("noise-uniform", params={"n": 200})))
    assert warning.startswith(
        "the OOD validation set noise-uniform is also the OOD test set noise-uniform (same dataset and parameters): "
    )
    assert "ood[" not in warning and "not a test set" in warning
    other_seed = DatasetChoice("noise-uniform", params={"n": 200, "noise_seed": 1})
    assert validation_warnings(tuning_config(ood_val=other_seed)) == []  # other images: a distinct set
    [warning] = validation_warnings(tuning_config(id_val=DatasetChoice("digits-train", subsample=281)))
    assert "share images with the ID fit set" in warning and '"last"' in warning
    [warning] = validation_warnings(tuning_config(id_val=DatasetChoice("digits-test")))
    assert "is the ID test set" in warning


def app_on(runs_root: Path, run: str, monkeypatch) -> AppTest:
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(runs_root))
    app = AppTest.from_file(str(REPO / "app.py"), default_timeout=60)
    app.query_params["run"] = run
    return app


def test_the_app_shows_the_choice_and_warns_when_validation_ood_is_a_test_set(tuned_run, monkeypatch):
    runs_root = tuned_run.path.parent
    app = app_on(runs_root, tuned_run.path.name, monkeypatch)
    app.session_state["results-tab"] = "Run details"
    app.run()
    assert not app.exception
    assert not [w for w in app.warning if "Tuning:" in w.value]
    log = json.loads((tuned_run.path / "detectors.json").read_text())
    [table] = [
        d.value
        for d in app.dataframe
        if "validation AUROC" in d.value.columns and "chosen" in d.value.columns and "detector" in d.value.columns
    ]
    shown = table.set_index("detector")
    assert list(shown.index) == ["energy", "react", "knn", "odin"]
    for name in shown.index:
        key, value = next(iter(log[name]["tuning"]["chosen"].items()))
        assert shown.loc[name, "chosen"] == f"{key}={value}"
        assert shown.loc[name, "validation AUROC"] == pytest.approx(log[name]["tuning"]["auroc"])
    # the run details say how each split was sampled: tuning holds out the last ID fit images, fits on the first
    [sampled] = [d.value for d in app.dataframe if "images" in d.value.columns and "split" in d.value.columns]
    images = sampled.set_index("split")["images"]
    assert images["id_fit"] == "800 of 1,081, the first ones" and images["id_val"] == "281 of 1,081, the last ones"

    overlapping = runs_root / "overlap"
    shutil.copytree(tuned_run.path, overlapping)
    config = RunConfig.load(overlapping / "config.json")
    config.ood_val = DatasetChoice("digits-heldout")  # = ood[0]
    config.save(overlapping / "config.json")
    app = app_on(runs_root, "overlap", monkeypatch)
    app.run()
    assert not app.exception
    assert [w for w in app.warning if "Tuning:" in w.value and "also the OOD test set digits-heldout (" in w.value]


# -- config errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ood_val": None}, "set ood_val too, or neither"),
        ({"id_val": None}, "set id_val too, or neither"),
        (
            {"grid": {"percentile": [90.0]}, "id_val": None, "ood_val": None},
            "a grid needs validation data: set id_val and ood_val",
        ),
        (
            {"grid": {"sparsity": [0.5]}},
            "grid names 'sparsity', which is not a parameter to tune; its parameters: percentile",
        ),
        ({"grid": {"percentile": []}}, "grid.percentile must be a non-empty list of values, e.g. [90.0], got []"),
        ({"grid": {"percentile": 90}}, "grid.percentile must be a non-empty list of values"),
        ({"grid": {"percentile": [90.0, 90.0]}}, "grid.percentile lists a value twice"),
        ({"grid": {"percentile": [90.0, "high"]}}, "grid.percentile[1]: percentile must be a number"),
        ({"grid": {"percentile": [90.0, 150.0]}}, "grid.percentile[1]: "),
        ({"grid": [90.0]}, "grid must be a table {parameter = [values]}"),
        (
            {"params": {"percentile": 80.0}, "grid": {"percentile": [90.0]}},
            "percentile is set in params and in grid; remove it from one of them",
        ),
        (
            {"grid": {"percentile": list(np.linspace(1, 99, MAX_GRID_POINTS + 1))}},
            f"more than {MAX_GRID_POINTS}; shorten its lists",
        ),
    ],
)
def test_bad_grids_and_half_set_validation_are_config_errors_naming_the_fix(change, message):
    change = dict(change)
    react = DetectorChoice("react", change.pop("params", {}), change.pop("grid", None))
    config = tuning_config(detectors=[react], **change)
    with pytest.raises(ConfigError) as caught:
        config.validate()
    assert any(message in problem for problem in caught.value.problems), caught.value.problems


def test_a_grid_reads_from_a_toml_config(tmp_path):
    (tmp_path / "run.toml").write_text(
        'id_val = {name = "digits-train", subsample = 281, subsample_mode = "last"}\n'
        'ood_val = {name = "digits-rotated"}\n'
        '[[detectors]]\nname = "knn"\ngrid = {k = [1, 5, 20]}\n'
        '[[detectors]]\nname = "energy"\n'
    )
    config = RunConfig.load(tmp_path / "run.toml").validate()
    assert config.detectors == [DetectorChoice("knn", grid={"k": [1, 5, 20]}), DetectorChoice("energy")]
    assert config.ood_val == DatasetChoice("digits-rotated")
    assert RunConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_every_default_grid_is_a_valid_tuning_config():
    gridded = [name for name in available() if detector_class(name).default_grid]
    assert {"energy", "react", "ash", "scale", "knn", "odin"} <= set(gridded)
    tuning_config(detectors=[DetectorChoice(name) for name in gridded]).validate()
    explicit = [
        DetectorChoice(name, grid={k: list(v) for k, v in detector_class(name).default_grid.items()})
        for name in gridded
    ]
    tuning_config(detectors=explicit).validate()


# -- defaults per backbone family -----------------------------------------------------------------
def test_default_detectors_follow_the_backbone_family():
    standard = [name for name in available() if detector_class(name).in_defaults]
    for cnn in ("digits-cnn", "resnet50", "convnext_tiny"):
        assert [(d.name, d.params) for d in RunConfig(backbone=cnn).detectors] == [(n, {}) for n in standard]
    for transformer in ("vit_b_16", "swin_t"):
        for config in (RunConfig(backbone=transformer), RunConfig.from_dict({"backbone": transformer})):
            chosen = {d.name: d.params for d in config.detectors}
            assert list(chosen) == [n for n in standard if n not in ("ash", "gradnorm")]
            assert chosen["mahalanobis"] == chosen["rmd"] == {"normalize": True}
            assert all(p == {} for n, p in chosen.items() if n not in ("mahalanobis", "rmd"))
    assert RunConfig(backbone="vit_b_16", detectors=[DetectorChoice("ash")]).detectors == [DetectorChoice("ash")]
    assert default_detector_params("torchscript") == default_detector_params("resnet18")  # unknown: a CNN
    assert "84.42/97.27" in defaults_reason("resnet50") and "81.36/96.53" in defaults_reason("resnet50")
    assert "81.71" in defaults_reason("vit_b_16") and "53.21/51.56" in defaults_reason("swin_t")


def test_the_app_states_the_family_defaults_and_why(tmp_path, monkeypatch):
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(tmp_path))
    app = AppTest.from_file(str(REPO / "app.py"), default_timeout=60)
    app.run()
    assert not app.exception
    assert any(defaults_reason("digits-cnn") in c.value for c in app.caption)


@pytest.mark.process
@pytest.mark.kernels
def test_a_sharded_run_tunes_like_one_process(tuned_run, tmp_path):
    """Two gloo processes on the single-process run's stores: each grid point fitted split over the ranks (knn: bank
    shards), the validation splits scored by rank slices (odin: rank 0 on the images); the same grid results,
    choices and scores as one process, to float32 rounding (ranks run one thread each, sum their shards in another
    order, and odin's forward passes run at other batch shapes)."""
    import os
    import subprocess
    import sys

    config = tmp_path / "tuning.json"
    tuning_config().save(config)
    shutil.copytree(tuned_run.path.parent / STORES_DIRNAME, tmp_path / "runs" / STORES_DIRNAME)
    out = tmp_path / "runs" / "two"
    command = [sys.executable, "-m", "oodviz.cli", "run", str(config), "--nproc-per-node", "2", "--out", str(out)]
    result = subprocess.run(
        command, env=dict(os.environ, OODVIZ_DIST_TIMEOUT_S="120"), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    single = json.loads((tuned_run.path / "detectors.json").read_text())
    sharded = json.loads((out / "detectors.json").read_text())
    for name in ("energy", "react", "knn", "odin"):
        a, b = single[name]["tuning"], sharded[name]["tuning"]
        assert b["chosen"] == a["chosen"] and b["grid"] == a["grid"] and b["fits"] == a["fits"], name
        assert [row["params"] for row in b["results"]] == [row["params"] for row in a["results"]], name
        np.testing.assert_allclose([row["auroc"] for row in b["results"]], [row["auroc"] for row in a["results"]],
                                   rtol=0, atol=1e-6, err_msg=name)  # fmt: skip
    expected, found = (pd.read_parquet(run / "scores.parquet") for run in (tuned_run.path, out))
    assert list(found.columns) == list(expected.columns)
    for name in ("energy", "react", "knn", "msp", "odin"):
        assert_kernel_close(found[name], expected[name], err_msg=name)


def test_validation_folders_are_confined_to_the_data_dirs_like_every_split(tmp_path):
    from oodviz.ui.access import AccessPolicy, PathRefused

    allowed = (tmp_path / "allowed").resolve()
    (allowed / "val").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    policy = AccessPolicy(serve_others=True, token="t" * 32, data_dirs=(allowed,))
    inside = tuning_config(id_val=DatasetChoice("folder", {"path": "val"}))
    assert policy.confine_config(inside).id_val.params["path"] == str(allowed / "val")
    outside = tuning_config(ood_val=DatasetChoice("folder", {"path": str(tmp_path / "outside")}))
    with pytest.raises(PathRefused, match="OOD validation folder"):
        policy.confine_config(outside)


def test_the_tuning_tables_read_a_damaged_detectors_json_without_failing():
    from oodviz.ui.tuning import grid_table, tuning_table

    table = tuning_table({"knn": {"tuning": {"validation": "x", "results": 3}}, "msp": "garbage", "energy": {}})
    assert table.to_dict("records") == [
        {
            "detector": "knn",
            "chosen": "none (every point failed)",
            "validation AUROC": None,
            "points tried": 0,
            "validation sets": "? vs ?",
        }
    ]
    record = {
        "chosen": {"k": 5},
        "results": [{"params": {"k": 1}, "auroc": 0.5}, {"params": {"k": 5}, "auroc": 0.9}, 7],
    }
    assert grid_table(record).to_dict("records") == [
        {"k": 1, "validation AUROC": 0.5, "error": "", "chosen": False},
        {"k": 5, "validation AUROC": 0.9, "error": "", "chosen": True},
    ]
    assert tuning_table(None).empty
