"""The 2-D feature-space projection of a run: streaming PCA against scikit-learn, seeded t-SNE subsamples."""

import json

import numpy as np
import pandas as pd
import pytest
from sklearn.decomposition import PCA
from sklearn.manifold import TSNE

from oodviz.engine import STORES_DIRNAME, open_store
from oodviz.figures.projection import PROJECTION_COLUMNS, project_run, projection_path, streaming_pca


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_streaming_pca_equals_sklearn_in_blocks_far_from_the_origin(offset, monkeypatch):
    """Sums about a sample, in blocks: the same components and projection as sklearn's full SVD, also with
    features offset far from 0 (where sums about 0 would cancel)."""
    import oodviz.figures.projection as projection

    monkeypatch.setattr(projection, "BATCH_ROWS", 37)  # many blocks
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 12)) @ (np.eye(12) + 0.5 * rng.normal(size=(12, 12))) + offset
    mean, components, explained = streaming_pca(x.astype(np.float32))
    reference = PCA(n_components=2, svd_solver="full").fit(x.astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(mean, reference.mean_, rtol=1e-9, atol=1e-9 * max(1, offset))
    np.testing.assert_allclose(components, reference.components_, atol=1e-8)
    np.testing.assert_allclose(explained, reference.explained_variance_ratio_, rtol=1e-8)
    query = rng.normal(size=(40, 12)) + offset
    np.testing.assert_allclose((query - mean) @ components.T, reference.transform(query), atol=1e-6 * max(1, offset))


def test_streaming_pca_refuses_too_little_data():
    with pytest.raises(ValueError, match="at least 2 samples"):
        streaming_pca(np.ones((1, 3)))
    with pytest.raises(ValueError, match="n_components must be in 1..D=3"):
        streaming_pca(np.ones((5, 3)), n_components=4)


def stores_of(run_dir):
    meta = json.loads((run_dir / "meta.json").read_text())
    return {split: open_store(run_dir.parent / STORES_DIRNAME, e["store"]) for split, e in meta["splits"].items()}


def test_a_runs_pca_projection_is_sklearns_pca_of_the_id_fit_features(default_run_copy, default_results):
    frame = project_run(default_run_copy, "pca")
    assert tuple(frame.columns) == PROJECTION_COLUMNS
    assert pd.read_parquet(projection_path(default_run_copy, "pca")).equals(frame)
    # the same rows, in the same order, as scores.parquet: the projection joins the scores on them
    keys = ["split", "dataset", "index", "label", "prediction"]
    assert frame[keys].equals(default_results.scores[keys].reset_index(drop=True))
    stores = stores_of(default_run_copy)
    reference = PCA(n_components=2, svd_solver="full").fit(np.asarray(stores["id_fit"].features, dtype=np.float64))
    everything = np.concatenate([np.asarray(s.features, np.float64) for k, s in stores.items() if k != "id_fit"])
    np.testing.assert_allclose(frame[["x", "y"]].to_numpy(), reference.transform(everything), atol=1e-5)
    info = json.loads(projection_path(default_run_copy, "pca").with_suffix(".json").read_text())
    np.testing.assert_allclose(info["explained_variance_ratio"], reference.explained_variance_ratio_, rtol=1e-8)


def test_a_runs_tsne_projection_embeds_a_seeded_subsample_with_as_many_points_as_asked(default_run_copy):
    frame = project_run(default_run_copy, "tsne", max_points=150, seed=3)
    assert len(frame) == 150 and tuple(frame.columns) == PROJECTION_COLUMNS
    assert pd.read_parquet(projection_path(default_run_copy, "tsne")).equals(frame)
    # the rows are those of the subsample, and the map is sklearn's t-SNE of exactly their features
    stores = stores_of(default_run_copy)
    meta = json.loads((default_run_copy / "meta.json").read_text())["splits"]
    features = []
    for split, entry in meta.items():
        if split == "id_fit":
            continue
        rows = frame[frame.dataset == entry["dataset"]]
        position = np.searchsorted(np.asarray(stores[split].indices), rows["index"].to_numpy())
        assert np.array_equal(np.asarray(stores[split].indices)[position], rows["index"].to_numpy())
        features.append(np.asarray(stores[split].features[position], dtype=np.float32))
    expected = TSNE(n_components=2, init="pca", random_state=3, perplexity=min(30.0, 149 / 3)).fit_transform(
        np.concatenate(features)
    )
    np.testing.assert_allclose(frame[["x", "y"]].to_numpy(), expected, atol=1e-4)
    assert frame.split.nunique() == 2 and frame.dataset.nunique() == len(meta) - 1  # every set is represented
    with pytest.raises(ValueError, match="method must be one of pca, tsne, umap"):
        project_run(default_run_copy, "isomap")


def test_a_runs_umap_projection_is_umap_learns_map_of_the_seeded_subsample(default_run_copy):
    """The same subsample as t-SNE's for the same seed, embedded by umap-learn with the same parameters."""
    umap = pytest.importorskip("umap", reason="umap-learn is not installed (pip install 'oodviz[umap]')")
    frame = project_run(default_run_copy, "umap", max_points=120, seed=5)
    assert len(frame) == 120 and tuple(frame.columns) == PROJECTION_COLUMNS
    assert pd.read_parquet(projection_path(default_run_copy, "umap")).equals(frame)
    same_rows = project_run(default_run_copy, "tsne", max_points=120, seed=5)
    keys = ["split", "dataset", "index", "label", "prediction"]
    assert frame[keys].equals(same_rows[keys])
    stores = stores_of(default_run_copy)
    meta = json.loads((default_run_copy / "meta.json").read_text())["splits"]
    features = []
    for split, entry in meta.items():
        if split != "id_fit":
            rows = frame[frame.dataset == entry["dataset"]]["index"].to_numpy()
            features.append(np.asarray(stores[split].features[np.searchsorted(stores[split].indices, rows)]))
    expected = umap.UMAP(n_components=2, n_neighbors=15, random_state=5, n_jobs=1).fit_transform(
        np.concatenate(features).astype(np.float32)
    )
    np.testing.assert_allclose(frame[["x", "y"]].to_numpy(), expected, atol=1e-4)
    assert json.loads(projection_path(default_run_copy, "umap").with_suffix(".json").read_text())["n_neighbors"] == 15


def test_without_umap_learn_the_umap_projection_is_refused_and_not_offered(default_run_copy, monkeypatch):
    import sys

    from oodviz.figures.projection import available_methods

    monkeypatch.setitem(sys.modules, "umap", None)  # as if umap-learn were not installed
    assert available_methods() == ["pca", "tsne"]
    with pytest.raises(ValueError, match=r"needs umap-learn: pip install 'oodviz\[umap\]'"):
        project_run(default_run_copy, "umap", max_points=50)


def test_oodviz_project_writes_the_projection(default_run_copy, tmp_path, capsys):
    import subprocess
    import sys

    from oodviz.cli import main

    command = [sys.executable, "-m", "oodviz.cli", "project", str(default_run_copy)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"points -> {projection_path(default_run_copy, 'pca')}" in result.stderr
    assert len(pd.read_parquet(projection_path(default_run_copy, "pca"))) == sum(
        s.n for k, s in stores_of(default_run_copy).items() if k != "id_fit"
    )
    assert main(["project", str(tmp_path / "none")]) == 2  # the refusal in process: no second start of the command
    assert "has no feature stores recorded" in capsys.readouterr().err


def test_a_run_copied_without_its_feature_stores_says_which_are_gone_and_what_to_do(default_run_copy, tmp_path):
    """The map reads the run's stores: a run folder copied alone (or after `oodviz store clean`) names its splits
    whose stores are gone and how to get them back, rather than a store key and an engine module."""
    import shutil

    alone = tmp_path / "runs" / "copied"
    shutil.copytree(default_run_copy, alone)
    splits = json.loads((alone / "meta.json").read_text())["splits"]
    with pytest.raises(ValueError) as refused:
        project_run(alone, "pca")
    message = str(refused.value)
    assert (
        f"this run's {', '.join(splits)} split(s) are no longer stored under {alone.parent / STORES_DIRNAME}" in message
    )
    assert "run the same config again under this runs folder" in message and "oodviz.engine" not in message
