"""Several layers in one pass (issue 17.3): one store per layer with the same rows, per-layer scores equal to a
single-layer run's, the combined Mahalanobis against a float64 formula written here, the "which layer?" view."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import sklearn_auroc
from kernels import assert_kernel_close, run_batch_size
from streamlit.testing.v1 import AppTest

from oodviz.columns import COMBINED, layer_column, split_column
from oodviz.config.plan import planned_stages
from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
from oodviz.config.splits import feature_store_root
from oodviz.engine.store import FeatureStore
from oodviz.pipeline.worker import execute
from oodviz.results.layers import layer_ranking
from oodviz.runs.rundir import RunDir

pytestmark = pytest.mark.kernels  # scores and features compared across runs, extractions and batch sizes
APP = str(Path(__file__).resolve().parents[2] / "app.py")
LAYERS = ["features.1", "features.4", "penultimate"]


def small_config(**changes) -> RunConfig:
    config = RunConfig(
        ood=[DatasetChoice("digits-heldout"), DatasetChoice("noise-uniform", params={"n": 200})],
        detectors=[
            DetectorChoice("msp"),
            DetectorChoice("mahalanobis"),
            DetectorChoice("knn", {"k": 5}),
            DetectorChoice("vim", {"dim": 16}),
        ],
        batch_size=run_batch_size(128),
    )
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run over three layers, and single-layer runs at features.4 and at the penultimate layer, under
    separate roots (no store shared: each run extracts its own)."""
    made = {}
    for name, config in {
        "layers": small_config(layers=list(LAYERS)),
        "features.4": small_config(
            layer="features.4", detectors=[DetectorChoice("mahalanobis"), DetectorChoice("knn", {"k": 5})]
        ),
        "penultimate": small_config(),
    }.items():
        run = RunDir.create(tmp_path_factory.mktemp(name.replace(".", "-")), config.validate().to_dict())
        assert execute(run) == "done", run.read_status()
        made[name] = run.path
    return made


def _stores(run_path, layer: str) -> dict[str, FeatureStore]:
    meta = json.loads((run_path / "meta.json").read_text())
    root = feature_store_root(RunDir(run_path))
    return {split: FeatureStore(root / key) for split, key in meta["layers"]["stores"][layer].items()}


def test_one_store_per_layer_with_the_same_rows(runs):
    stores = {layer: _stores(runs["layers"], layer) for layer in LAYERS}
    assert {stores[layer]["id_fit"].feature_dim for layer in LAYERS} == {16, 32, 64}
    first = stores[LAYERS[0]]
    for layer in LAYERS[1:]:
        assert set(stores[layer]) == set(first) == {"id_fit", "id_test", "ood:digits-heldout", "ood:noise-uniform"}
        for split, store in stores[layer].items():
            assert store.key != first[split].key and store.meta["key_spec"]["backbone"].get("layer") == (
                None if layer == "penultimate" else layer
            )
            for name in ("indices", "labels", "predictions", "logits"):
                np.testing.assert_array_equal(getattr(store, name), getattr(first[split], name))
    assert stores["penultimate"]["id_fit"].head is not None and stores["features.1"]["id_fit"].head is None


def test_per_layer_scores_equal_single_layer_runs(runs):
    scores = pd.read_parquet(runs["layers"] / "scores.parquet")
    columns = list(scores.columns[5:])
    # msp reads logits only: once; vim needs the head: at the penultimate layer only; the others per layer
    assert columns == [
        "msp",
        *(layer_column("mahalanobis", layer) for layer in LAYERS),
        *(layer_column("knn", layer) for layer in LAYERS),
        layer_column("vim", "penultimate"),
        layer_column("mahalanobis", COMBINED),
    ]
    for single, layer in (("features.4", "features.4"), ("penultimate", "penultimate")):
        other = pd.read_parquet(runs[single] / "scores.parquet")
        pd.testing.assert_frame_equal(scores.iloc[:, :5], other.iloc[:, :5])
        for detector in ("mahalanobis", "knn"):
            np.testing.assert_array_equal(scores[layer_column(detector, layer)], other[detector])
    np.testing.assert_array_equal(scores["msp"], pd.read_parquet(runs["penultimate"] / "scores.parquet")["msp"])
    meta = json.loads((runs["layers"] / "meta.json").read_text())
    assert meta["layers"]["skipped_needs_head"] == {"vim": ["features.1", "features.4"]}
    run = RunDir(runs["layers"])
    ends = [e["stage"] for e in run.read_events() if e.get("event") == "end"]
    assert ends == planned_stages(RunConfig.load(run.config_path))  # the app's "stage k of N" plan
    assert "vim needs the classifier's head" in " ".join(
        e["message"] for e in run.read_events() if e["event"] == "warning"
    )


def _mahalanobis_float64(fit: FeatureStore, rows: np.ndarray, normalize: bool = False) -> np.ndarray:
    """min_c (x - mu_c)^T Sigma^+ (x - mu_c) in float64: Sigma the covariance pooled over classes (ddof=0), its
    pseudo-inverse keeping eigenvalues above D * eps * lambda_max (oodviz's documented cutoff); ``normalize``: of
    the L2-normalised features, fit and rows (MDS++). The layers are well conditioned (features.0, the first
    conv's pooled output, is not: its covariance has rank < D, and float32 and float64 then disagree in the
    near-null directions)."""
    x, y = np.asarray(fit.features, dtype=np.float64), np.asarray(fit.labels)
    if normalize:
        x, rows = (a / np.linalg.norm(a, axis=1, keepdims=True) for a in (x, rows))
    classes = np.unique(y)
    means = np.stack([x[y == c].mean(axis=0) for c in classes])
    centred = x - means[np.searchsorted(classes, y)]
    values, vectors = np.linalg.eigh(centred.T @ centred / len(x))
    keep = values > x.shape[1] * np.finfo(np.float64).eps * values.max()
    precision = (vectors[:, keep] / values[keep]) @ vectors[:, keep].T
    diff = rows[:, None, :] - means[None]
    return np.einsum("ncd,de,nce->nc", diff, precision, diff).min(axis=1)


def test_combined_mahalanobis_is_the_sum_of_standardised_layer_scores(runs):
    scores = pd.read_parquet(runs["layers"] / "scores.parquet")
    expected = np.zeros(len(scores))
    for layer in LAYERS:
        stores = _stores(runs["layers"], layer)
        fit = stores["id_fit"]
        reference = _mahalanobis_float64(fit, np.asarray(fit.features, dtype=np.float64))
        rows = np.concatenate(
            [
                np.asarray(stores[s].features, dtype=np.float64)
                for s in ("id_test", "ood:digits-heldout", "ood:noise-uniform")
            ]
        )
        layer_scores = _mahalanobis_float64(fit, rows)
        # float32 features and scores in the run (measured: relative error below 4e-6)
        np.testing.assert_allclose(scores[layer_column("mahalanobis", layer)], layer_scores, rtol=2e-5)
        expected += (layer_scores - reference.mean()) / reference.std()
    combined = scores[layer_column("mahalanobis", COMBINED)].to_numpy()
    np.testing.assert_allclose(combined, expected, rtol=0, atol=2e-6 * np.abs(expected).max())  # measured: 2.2e-7
    log = json.loads((runs["layers"] / "detectors.json").read_text())[layer_column("mahalanobis", COMBINED)]
    assert log["layers"] == LAYERS and log["standardised_on"] == "id_fit"
    # exactly the formula on the stored per-layer columns, with the recorded ID fit means and deviations
    exact = sum(
        (scores[layer_column("mahalanobis", layer)].to_numpy(np.float64) - log["stats"][layer]["mean"])
        / log["stats"][layer]["std"]
        for layer in LAYERS
    )
    np.testing.assert_allclose(combined, exact, rtol=1e-12, atol=1e-12)
    for layer in LAYERS:
        fit = _stores(runs["layers"], layer)["id_fit"]
        reference = _mahalanobis_float64(fit, np.asarray(fit.features, dtype=np.float64))
        assert log["stats"][layer]["mean"] == pytest.approx(reference.mean(), rel=1e-4)
        assert log["stats"][layer]["std"] == pytest.approx(reference.std(), rel=1e-4)


def test_which_layer_table_ranks_layers_by_mean_auroc(runs):
    metrics = pd.read_csv(runs["layers"] / "metrics.csv")
    ranking = layer_ranking(metrics, LAYERS)
    assert list(ranking.detector.unique()) == ["mahalanobis", "knn", "vim"]
    for detector, rows in ranking.groupby("detector", sort=False):
        per_dataset = metrics[~metrics.ood_dataset.str.endswith(" (mean)")]
        for row in rows.itertuples():
            mine = per_dataset[per_dataset.detector == layer_column(detector, row.layer)]
            assert row.auroc == pytest.approx(mine.auroc.mean(), abs=1e-12)
        assert list(rows["rank"]) == list(range(1, len(rows) + 1))
        assert list(rows.auroc) == sorted(rows.auroc, reverse=True)
    assert set(ranking[ranking.detector == "mahalanobis"].layer) == {*LAYERS, COMBINED}
    assert split_column("msp") == ("msp", None) and split_column("knn@features.1") == ("knn", "features.1")


def test_config_refuses_unknown_duplicate_and_mixed_layers():
    problems = small_config(layers=["features.4", "features.4", "featurs.0"], layer="features.1").problems()
    assert "layers lists 'features.4' twice" in problems
    assert any("set layer or layers, not both" in p for p in problems)
    assert any("has no layer 'featurs.0'; did you mean 'features.0'" in p for p in problems)
    assert small_config(layers=list(LAYERS)).problems() == []
    assert RunConfig.from_dict(small_config().to_dict()).layers == []  # a single-layer config is unchanged


def _app(run_path, monkeypatch, tab: str) -> AppTest:
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(run_path.parent))
    app = AppTest.from_file(APP, default_timeout=120)
    app.query_params["run"] = run_path.name
    app.run()
    app.session_state["results-tab"] = tab
    app.run()
    assert not app.exception
    return app


def test_the_which_layer_tab_draws_the_ranking(runs, monkeypatch):
    app = _app(runs["layers"], monkeypatch, "Which layer?")
    metrics = pd.read_csv(runs["layers"] / "metrics.csv")
    expected = layer_ranking(metrics, LAYERS)
    shown = app.dataframe[0].value
    assert list(shown.columns) == ["detector", "layer", "mean AUROC", "mean FPR95", "rank"]
    np.testing.assert_array_equal(shown["mean AUROC"], expected.auroc)
    assert list(shown.layer) == list(expected.layer) and list(shown.detector) == list(expected.detector)
    [chart] = app.get("plotly_chart")
    figure = json.loads(chart.proto.spec)
    assert [trace["name"] for trace in figure["data"]] == ["mahalanobis", "knn", "vim"]
    mahalanobis = figure["data"][0]
    assert mahalanobis["x"] == [*LAYERS, COMBINED]  # shallow to deep, the combined score last
    by_layer = expected[expected.detector == "mahalanobis"].set_index("layer")
    np.testing.assert_allclose(_values(mahalanobis["y"]), by_layer.loc[mahalanobis["x"], "auroc"], rtol=0, atol=0)
    best = by_layer.index[by_layer["rank"] == 1][0]
    assert _values(mahalanobis["marker"]["size"]).tolist() == [14 if x == best else 7 for x in mahalanobis["x"]]
    assert any("standardised on the ID fit split (in-sample)" in c.value for c in app.caption)  # no id_val here


def test_a_single_layer_run_has_no_which_layer_tab(runs, monkeypatch):
    app = _app(runs["penultimate"], monkeypatch, "Metrics")
    labels = [t.label for t in app.tabs]
    assert "Metrics" in labels and "Run details" in labels and "Which layer?" not in labels


def _values(array) -> np.ndarray:
    """A plotly JSON array: a list, or ``{"dtype", "bdata"}`` (base64 of the raw values)."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"])
    return np.asarray(array)


def test_only_the_missing_layers_are_extracted_and_equal_single_layer_stores(tmp_path):
    """A layer whose store exists is reused; the others come from one pass and equal single-layer extractions at
    another batch size: the same rows, features and logits to float32 rounding (other batch shapes, other kernels)."""
    from oodviz.data import load_dataset
    from oodviz.engine import extract_or_reuse
    from oodviz.engine.layers import extract_layers_or_reuse

    backbone = RunConfig().load_backbone()
    dataset = load_dataset("digits-test", subsample=100)
    views = {"features.1": backbone.with_layer("features.1"), "features.4": backbone.with_layer("features.4", "max")}
    views["penultimate"] = backbone
    before = extract_or_reuse(views["features.4"], dataset, tmp_path / "a", {"k": 1})
    stores = extract_layers_or_reuse(views, dataset, tmp_path / "a", {"k": 1}, batch_size=run_batch_size(32))
    assert [s.reused for s in stores.values()] == [False, True, False]
    assert stores["features.4"].path == before.path
    for layer, view in views.items():
        alone = extract_or_reuse(view, dataset, tmp_path / "b", {"k": 1}, batch_size=7)
        assert alone.key == stores[layer].key
        for name in ("labels", "predictions", "indices"):
            np.testing.assert_array_equal(getattr(alone, name), getattr(stores[layer], name))
        for name in ("features", "logits"):
            assert_kernel_close(getattr(alone, name), getattr(stores[layer], name), err_msg=f"{layer} {name}")
    assert stores["penultimate"].meta["backbone"]["layer"] is None
    assert stores["features.1"].meta["backbone"]["layer"] == "features.1"


def test_a_store_is_keyed_by_the_pooling_its_layer_resolves_to(tmp_path):
    """``pooling`` unset resolves to avg on a CNN's layer (Backbone.default_pooling): a store made with it is the store
    of an explicit "avg" (reused, not extracted again), and not the store of "max". The run's views are made as the
    worker makes them
    (:func:`~oodviz.pipeline.layers.backbone_views` with ``RunConfig.pooling_at``)."""
    from oodviz.data import load_dataset
    from oodviz.engine import extract_or_reuse, store_key
    from oodviz.pipeline.layers import backbone_views

    dataset = load_dataset("digits-test", subsample=50)
    layers = ["features.1", "penultimate"]

    def views(pooling):
        config = RunConfig(layers=layers, pooling=pooling, detectors=[])
        return backbone_views(config.load_backbone(), config.layers, config.pooling_at)

    unset, avg, maxed = views(None), views({"features.1": "avg"}), views("max")
    assert [view.pooling for view in unset.values()] == ["avg", "avg"]
    keys = {
        name: {layer: store_key(v, dataset, {"k": 1}) for layer, v in made.items()}
        for name, made in (("unset", unset), ("avg", avg), ("max", maxed))
    }
    assert keys["unset"] == keys["avg"] and keys["max"]["features.1"] != keys["unset"]["features.1"]
    first = extract_or_reuse(unset["features.1"], dataset, tmp_path, {"k": 1})
    again = extract_or_reuse(avg["features.1"], dataset, tmp_path, {"k": 1})
    assert (first.reused, again.reused, again.path) == (False, True, first.path)
    assert not extract_or_reuse(maxed["features.1"], dataset, tmp_path, {"k": 1}).reused


def test_the_form_takes_several_layers_from_its_layers_list():
    from oodviz.ui.form import FormValues, config_from_form, form_values_from_config

    config = config_from_form(FormValues(layers=["features.1", "features.4", "penultimate"]))
    assert (config.layer, config.layers) == (None, LAYERS) and config.problems() == []
    assert form_values_from_config(config).layers == LAYERS
    single = config_from_form(FormValues(layers=["features.4"]))
    assert (single.layer, single.layers) == ("features.4", [])
    assert form_values_from_config(single).layers == ["features.4"]
    for default in ([], ["penultimate"]):  # the penultimate layer alone is the default features
        assert (
            config_from_form(FormValues(layers=default)).layer,
            config_from_form(FormValues(layers=default)).layers,
        ) == (None, [])


def test_oodviz_score_scores_one_per_layer_detector_of_a_multi_layer_run(runs, tmp_path):
    """``--detector knn@features.1``: that layer's knn on one image, as the run scored it, to float32 rounding: a
    batch of one image instead of the run's, and oneDNN picks other convolution kernels for other batch shapes on
    some CPUs. Compared as the squared distance ``2 - 2 cos`` of unit vectors (scale 4), whose rounding does not grow
    as the distance shrinks."""
    from oodviz.data import load_dataset
    from oodviz.pipeline.scoring import score_images

    image, _, index = load_dataset("digits-test")[0]
    image.save(tmp_path / "digit.png")
    scored = score_images(runs["layers"], [tmp_path / "digit.png"], detector="knn@features.1").table
    assert list(scored.detector) == ["knn@features.1"]
    scores = pd.read_parquet(runs["layers"] / "scores.parquet")
    row = scores[(scores.split == "id_test") & (scores["index"] == index)]
    assert_kernel_close(scored.score.iloc[0] ** 2, float(row["knn@features.1"].iloc[0]) ** 2, scale=4.0)


def test_oodviz_score_leaves_out_per_layer_detectors_it_cannot_load_and_says_why(runs, tmp_path, capsys):
    """Copies of the run (beside it: the same stores). Without knn@features.1 and mahalanobis@features.4: the others
    score, mahalanobis@combined is left out (one of its layers is missing). As a run made before per-layer
    detectors were saved (no layers.json, no per-layer directory): msp scores. stderr names each with why, exit 1."""
    import shutil

    from oodviz.cli import main as cli_main
    from oodviz.data import load_dataset
    from oodviz.pipeline.scoring import LAYERS_FILE, detectors_dir

    image, _, _ = load_dataset("digits-test")[0]
    image.save(tmp_path / "digit.png")
    columns = list(pd.read_parquet(runs["layers"] / "scores.parquet").columns[5:])

    def score_copy(name: str, remove: list[str]) -> tuple[list[str], str]:
        copy = runs["layers"].parent / name
        shutil.copytree(runs["layers"], copy)
        for path in (detectors_dir(copy) / part for part in remove):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        assert cli_main(["score", str(copy), str(tmp_path / "digit.png"), "--out", str(tmp_path / f"{name}.csv")]) == 1
        return list(pd.read_csv(tmp_path / f"{name}.csv").detector), capsys.readouterr().err

    scored, errors = score_copy("copy-without-two", ["knn@features.1", "mahalanobis@features.4"])
    for name in ("knn@features.1", "mahalanobis@features.4"):
        assert f"not loaded: {name}: DetectorFileError: " in errors and "does not exist" in errors
    assert "not loaded: mahalanobis@combined: its per-layer Mahalanobis detectors" in errors
    left = {"knn@features.1", "mahalanobis@features.4", layer_column("mahalanobis", COMBINED)}
    assert scored == [name for name in columns if name not in left]
    per_layer = [name for name in columns if split_column(name)[1] not in (None, COMBINED)]
    scored, errors = score_copy("copy-as-old", [LAYERS_FILE, *per_layer])
    assert scored == ["msp"]
    for name in per_layer:
        assert f"not loaded: {name}: a run made before oodviz saved per-layer detectors" in errors


# -- tuning per layer, the combined score standardised on id_val, oodviz score over every layer ----------------
TUNED_LAYERS = ["features.4", "penultimate"]
KNN_GRID = [1, 5, 20]


@pytest.fixture(scope="module")
def tuned_layers(tmp_path_factory):
    """A tuning run over two layers: fit on the first 800 digits-train images, validate on the last 281 against
    rotated digits; mahalanobis tries its default grid (normalize False/True), knn k in KNN_GRID."""
    config = small_config(
        id_fit=DatasetChoice("digits-train", subsample=800, subsample_mode="first"),
        id_val=DatasetChoice("digits-train", subsample=281, subsample_mode="last"),
        ood=[DatasetChoice("noise-uniform", params={"n": 100})],
        ood_val=DatasetChoice("digits-rotated"),
        layers=list(TUNED_LAYERS),
        detectors=[DetectorChoice("msp"), DetectorChoice("mahalanobis"), DetectorChoice("knn", grid={"k": KNN_GRID})],
    )
    run = RunDir.create(tmp_path_factory.mktemp("tuned-layers"), config.validate().to_dict())
    assert execute(run) == "done", run.read_status()
    return run


@pytest.mark.parametrize(("name", "key", "grid"), [("mahalanobis", "normalize", [False, True]), ("knn", "k", KNN_GRID)])
def test_each_layer_gets_the_choice_that_maximises_its_validation_auroc(tuned_layers, name, key, grid, tmp_path):
    """Per layer, each grid value refitted here with the public API on that layer's ID fit store, validation AUROC
    by sklearn on that layer's id_val / ood_val stores: the run chose each layer's argmax and fitted it."""
    from oodviz.detectors import create

    log = json.loads((tuned_layers.path / "detectors.json").read_text())
    assert "tuning" not in log["msp"]
    for layer in TUNED_LAYERS:
        column = layer_column(name, layer)
        tuning, stores = log[column]["tuning"], _stores(tuned_layers.path, layer)
        ours = []
        for value in grid:
            bank = {"bank_dir": str(tmp_path / f"{layer}-{value}")} if name == "knn" else {}
            detector = create(name, **{key: value}, **bank)
            detector.fit(stores["id_fit"].batches(4096), head=stores["id_fit"].head)
            ours.append(
                sklearn_auroc(*(detector.score(stores[s].batches(4096)).numpy() for s in ("id_val", "ood_val")))
            )
        assert tuning["layer"] == layer and [row["params"] for row in tuning["results"]] == [{key: v} for v in grid]
        np.testing.assert_allclose([row["auroc"] for row in tuning["results"]], ours, atol=1e-9)
        assert tuning["chosen"] == {key: grid[int(np.argmax(ours))]}
        assert log[column]["params"][key] == tuning["chosen"][key]  # fitted with this layer's choice
    stages = [e["stage"] for e in tuned_layers.read_events() if e.get("event") == "end"]
    assert stages == planned_stages(RunConfig.load(tuned_layers.config_path))
    assert {f"tune {layer_column(name, layer)}" for layer in TUNED_LAYERS} <= set(stages)


def test_combined_mahalanobis_is_standardised_on_id_val(tuned_layers, monkeypatch):
    """sum_l (s_l - mean_l) / std_l with mean_l, std_l (ddof=0) of layer l's float64 Mahalanobis on the held-out
    id_val images (each layer with the normalize tuning chose for it)."""
    scores = pd.read_parquet(tuned_layers.path / "scores.parquet")
    log = json.loads((tuned_layers.path / "detectors.json").read_text())
    record = log[layer_column("mahalanobis", COMBINED)]
    assert record["standardised_on"] == "id_val" and record["reference"].startswith("held-out")
    assert "on the id_val split" in record["formula"] and record["layers"] == TUNED_LAYERS
    expected = np.zeros(len(scores))
    for layer in TUNED_LAYERS:
        stores = _stores(tuned_layers.path, layer)
        normalize = log[layer_column("mahalanobis", layer)]["params"]["normalize"]
        val = _mahalanobis_float64(stores["id_fit"], np.asarray(stores["id_val"].features, np.float64), normalize)
        rows = np.concatenate([np.asarray(stores[s].features, np.float64) for s in ("id_test", "ood:noise-uniform")])
        layer_scores = _mahalanobis_float64(stores["id_fit"], rows, normalize)
        np.testing.assert_allclose(scores[layer_column("mahalanobis", layer)], layer_scores, rtol=2e-5)
        assert record["stats"][layer]["mean"] == pytest.approx(val.mean(), rel=1e-4)
        assert record["stats"][layer]["std"] == pytest.approx(val.std(), rel=1e-4)
        expected += (layer_scores - val.mean()) / val.std()
    combined = scores[layer_column("mahalanobis", COMBINED)].to_numpy()
    np.testing.assert_allclose(combined, expected, rtol=0, atol=2e-6 * np.abs(expected).max())
    app = _app(tuned_layers.path, monkeypatch, "Which layer?")
    assert any("standardised on the held-out ID validation images" in c.value for c in app.caption)


def test_oodviz_score_reproduces_every_column_of_a_multi_layer_run_bit_for_bit(tuned_layers, tmp_path):
    """Every ID test image written as a PNG file and scored by ``oodviz score``: each column of scores.parquet,
    per-layer and combined, to the very bits (the same images in the same batches; one pass over both layers); the
    saved per-layer knn references its layer's ID fit store as its bank (no copy)."""
    from oodviz.data import load_dataset
    from oodviz.detectors import load
    from oodviz.pipeline.scoring import detectors_dir, score_images
    from oodviz.results.tables import detectors_of

    dataset = load_dataset("digits-test")
    files = []
    for i in range(len(dataset)):
        image, _, index = dataset[i]
        files.append(tmp_path / f"{index:04d}.png")
        image.save(files[-1])
    scored = score_images(tuned_layers.path, files)
    stored = pd.read_parquet(tuned_layers.path / "scores.parquet").query("split == 'id_test'")
    assert not scored.not_loaded and np.array_equal(stored["index"], np.arange(len(files)))
    names = detectors_of(stored)
    assert list(scored.table.detector.unique()) == names and layer_column("mahalanobis", COMBINED) in names
    for name in names:
        mine = scored.table[scored.table.detector == name]
        assert list(mine.file) == [str(f) for f in files]
        assert np.array_equal(mine.score.to_numpy(), stored[name].to_numpy(np.float64)), name
    for layer in TUNED_LAYERS:
        knn_dir = detectors_dir(tuned_layers.path) / layer_column("knn", layer)
        bank = Path(load(knn_dir).bank_.filename)
        assert bank == (_stores(tuned_layers.path, layer)["id_fit"].path / "features.npy").resolve()
        assert not any(p.suffix == ".npy" for p in knn_dir.iterdir())


def test_compare_matches_a_single_layer_run_with_the_same_layer_of_a_run_over_several(runs):
    """Run A over three layers against run B at the penultimate layer: mahalanobis@penultimate is B's mahalanobis
    (the same scores: their deltas 0), msp is msp; the detectors at other layers and the combined one are listed
    with why, not dropped without a word (they were)."""
    from oodviz.results.analysis import compare_runs, unmatched_detectors
    from oodviz.results.tables import load_results

    a, b = load_results(runs["layers"]), load_results(runs["penultimate"])
    table = compare_runs(a, b)
    means = table[table.ood_dataset.str.endswith(" (mean)")]
    assert list(means.detector.unique()) == [
        "msp",
        layer_column("mahalanobis", "penultimate"),
        layer_column("knn", "penultimate"),
        layer_column("vim", "penultimate"),
    ]
    assert (table.auroc_delta == 0).all() and (table.fpr95_delta == 0).all()
    unmatched = {(u["run"], u["detector"]): u["why"] for u in unmatched_detectors(a, b)}
    assert unmatched == {
        **{
            ("A", layer_column(d, layer)): f"run B has {d} at penultimate, not at {layer}"
            for d in ("mahalanobis", "knn")
            for layer in ("features.1", "features.4")
        },
        ("A", layer_column("mahalanobis", COMBINED)): f"run B has mahalanobis at penultimate, not at {COMBINED}",
    }
    backwards = {(u["run"], u["detector"]) for u in unmatched_detectors(b, a)}
    assert backwards == {("B", name) for _, name in unmatched}


def test_the_app_names_what_compare_could_not_match(runs, tmp_path, monkeypatch):
    """The Compare page of the two runs (``/compare?a=layers&b=penultimate``) names each detector it left out."""
    import shutil

    from app_nav import on_page

    for name in ("layers", "penultimate"):
        shutil.copytree(runs[name], tmp_path / name)
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(tmp_path))
    app = on_page(AppTest.from_file(APP, default_timeout=60), "compare", a="layers", b="penultimate")
    assert not app.exception
    assert [s.value for s in app.selectbox if s.label in ("Run A", "Run B")] == ["layers", "penultimate"]
    [note] = [c.value for c in app.caption if c.value.startswith("Not compared")]
    assert "mahalanobis@features.1 (run A: run B has mahalanobis at penultimate, not at features.1)" in note
    [deltas] = [d.value for d in app.dataframe if "AUROC B − A" in d.value.columns]
    assert "mahalanobis@penultimate" in set(deltas.detector)


def test_depth_order_places_layers_by_the_models_module_order():
    from oodviz.results.layers import depth_order

    names = ["features", "features.0", "features.1", "features.4", "avgpool", "fc"]
    assert depth_order(["penultimate", "features.4", "features.1"], names) == [
        "features.1",
        "features.4",
        "penultimate",
    ]
    assert depth_order(["features.4", "avgpool"], names) == ["features.4", "avgpool"]
    assert depth_order(["features.4", "penultimate"], []) is None  # no module names: the depth is unknown


def test_which_layer_runs_shallow_to_deep_whatever_order_the_layers_were_picked_in(tmp_path, monkeypatch):
    """Layers picked deep to shallow: the run records the model's order, and the chart's axis follows it and says
    so (it said 'shallow to deep' while following the order picked)."""
    config = small_config(layers=["penultimate", "features.4", "features.1"], detectors=[DetectorChoice("mahalanobis")])
    run = RunDir.create(tmp_path / "runs", config.validate().to_dict())
    assert execute(run) == "done", run.read_status()
    meta = json.loads((run.path / "meta.json").read_text())
    assert meta["layers"]["depth_order"] == LAYERS
    app = _app(run.path, monkeypatch, "Which layer?")
    [chart] = app.get("plotly_chart")
    figure = json.loads(chart.proto.spec)
    assert figure["data"][0]["x"] == [*LAYERS, COMBINED]
    assert figure["layout"]["xaxis"]["title"]["text"] == "layer (shallow to deep)"
