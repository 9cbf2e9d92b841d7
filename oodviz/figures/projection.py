"""A 2-D map of a run's feature space: the ID test and OOD features projected to two coordinates.

``project_run(run_dir, method)`` reads the run's feature stores (``meta.json`` names them) and writes
``<run>/projection-<method>.parquet``: one row per projected sample with ``split, dataset, index``
(the keys of ``scores.parquet``), ``label``, ``prediction`` and the coordinates ``x, y``; plus
``projection-<method>.json`` with how it was made, and the thumbnails the page shows on hover (a seeded
subsample, :func:`oodviz.figures.projection_map.write_hover_thumbnails`). Nothing is computed in the page.

- ``"pca"`` (default): principal components of the **ID fit** features from streaming statistics,
  one pass in batches (``n``, the sum and the ``D x D`` sum of outer products about a shift, float64),
  so memory is ``O(D^2)`` whatever ``N``; every ID test and OOD sample is projected, batch by batch:
  ``[x, y] = (f - mean) V_2`` with ``V_2`` the two leading eigenvectors of the covariance, each signed
  so that its largest-magnitude loading is positive (scikit-learn's ``svd_flip`` convention).
- ``"tsne"``: scikit-learn's t-SNE (``init="pca"``, ``random_state=seed``) of a seeded subsample of
  ``max_points`` samples drawn uniformly from the ID test and OOD rows together (all of them when
  fewer); t-SNE is ``O(n^2)``-ish and keeps its input in memory, hence the subsample.
- ``"umap"``: umap-learn's UMAP (``n_neighbors=min(15, n - 1)``, ``random_state=seed``) of the same
  seeded subsample; only when ``umap-learn`` is installed (``pip install 'oodviz[umap]'``,
  :func:`available_methods`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from oodviz import engine
from oodviz.figures.projection_map import write_hover_thumbnails
from oodviz.files import read_json_object, write_json
from oodviz.results.tables import ID_SPLIT, OOD_SPLIT, write_table

METHODS = ("pca", "tsne", "umap")
PROJECTION_COLUMNS = ("split", "dataset", "index", "label", "prediction", "x", "y")
BATCH_ROWS = 8192


def available_methods() -> list[str]:
    """The methods of :data:`METHODS` this installation can run (``umap`` needs ``umap-learn``)."""
    from importlib.util import find_spec

    return [m for m in METHODS if m != "umap" or find_spec("umap") is not None]


def embed(features: np.ndarray, method: str, seed: int) -> tuple[np.ndarray, dict]:
    """``(xy [n, 2], how it was made)``: the t-SNE or UMAP map of ``features`` ``[n, D]`` (see the module
    docstring for the parameters)."""
    if method == "tsne":
        from sklearn.manifold import TSNE

        tsne = TSNE(n_components=2, init="pca", random_state=seed, perplexity=min(30.0, (len(features) - 1) / 3))
        return tsne.fit_transform(features), {"perplexity": tsne.perplexity}
    try:
        from umap import UMAP
    except ImportError:
        raise ValueError("the umap projection needs umap-learn: pip install 'oodviz[umap]'") from None
    neighbours = min(15, len(features) - 1)
    return UMAP(n_components=2, n_neighbors=neighbours, random_state=seed, n_jobs=1).fit_transform(features), {
        "n_neighbors": neighbours
    }


def projection_path(run_dir, method: str) -> Path:
    return Path(run_dir) / f"projection-{method}.parquet"


def _blocks(features: np.ndarray):
    for start in range(0, len(features), BATCH_ROWS):
        yield np.asarray(features[start : start + BATCH_ROWS], dtype=np.float64)


def streaming_pca(features: np.ndarray, n_components: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mean [D], components [k, D], explained_variance_ratio [k])`` of ``features`` ``[N, D]`` (an array
    or memory map, read in blocks of :data:`BATCH_ROWS` rows) from float64 sums about the first row."""
    n, dim = features.shape
    if n < 2:
        raise ValueError(f"PCA needs at least 2 samples, got {n}")
    if not 0 < n_components <= dim:
        raise ValueError(f"n_components must be in 1..D={dim}, got {n_components}")
    shift = np.asarray(features[0], dtype=np.float64)  # sums about a sample: no cancellation far from 0
    total, outer = np.zeros(dim), np.zeros((dim, dim))
    for block in _blocks(features):
        centred = block - shift
        total += centred.sum(axis=0)
        outer += centred.T @ centred
    mean_shifted = total / n
    covariance = (outer - n * np.outer(mean_shifted, mean_shifted)) / (n - 1)
    eigenvalues, eigenvectors = np.linalg.eigh(covariance)
    order = np.argsort(eigenvalues)[::-1][:n_components]
    components = eigenvectors[:, order].T
    signs = np.sign(components[np.arange(n_components), np.argmax(np.abs(components), axis=1)])
    components *= np.where(signs == 0, 1.0, signs)[:, None]
    explained = eigenvalues[order] / max(eigenvalues.clip(min=0).sum(), np.finfo(float).tiny)
    return shift + mean_shifted, components, explained


def _stores(run_dir) -> tuple[dict, list[tuple[str, str, str]]]:
    """The run's stores by split and ``(split key, scores split, dataset)`` of each projected split."""

    meta, problem = read_json_object(Path(run_dir) / "meta.json")
    if problem or "splits" not in meta:
        raise ValueError(f"run {run_dir} has no feature stores recorded ({problem or 'meta.json without splits'})")
    root = Path(run_dir).parent / engine.STORES_DIRNAME
    gone = [split for split, entry in meta["splits"].items() if not (root / str(entry["store"])).is_dir()]
    if gone:
        raise ValueError(
            f"the features of this run's {', '.join(gone)} split(s) are no longer stored under {root} (removed by "
            f"`oodviz store clean`, or the run was copied without its runs folder's {engine.STORES_DIRNAME}); run the same "
            "config again under this runs folder to extract them (this run's results stay), then compute the map"
        )
    stores = {split: engine.open_store(root, entry["store"]) for split, entry in meta["splits"].items()}
    projected = [
        (split, ID_SPLIT if split == "id_test" else OOD_SPLIT, entry["dataset"])
        for split, entry in meta["splits"].items()
        if split == "id_test" or split.startswith("ood:")  # not id_fit, nor a tuning run's validation splits
    ]
    return stores, projected


def _frame(store, kind: str, dataset: str, rows: np.ndarray, xy: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "split": kind,
            "dataset": dataset,
            "index": np.asarray(store.indices)[rows],
            "label": np.asarray(store.labels)[rows],
            "prediction": np.asarray(store.predictions)[rows],
            "x": xy[:, 0],
            "y": xy[:, 1],
        }
    )


def project_run(run_dir, method: str = "pca", max_points: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Compute the run's 2-D projection with ``method`` (see the module docstring), write it and its hover
    thumbnails beside the results and return it (columns :data:`PROJECTION_COLUMNS`, splits in run order)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    stores, projected = _stores(run_dir)
    info = {"method": method}
    frames = []
    if method == "pca":
        mean, components, explained = streaming_pca(stores["id_fit"].features)
        info.update(fitted_on="id_fit", explained_variance_ratio=explained.tolist())
        for split, kind, dataset in projected:
            store = stores[split]
            xy = np.concatenate([(block - mean) @ components.T for block in _blocks(store.features)])
            frames.append(_frame(store, kind, dataset, np.arange(store.n), xy))
    else:
        sizes = [stores[split].n for split, _, _ in projected]
        chosen = np.sort(np.random.default_rng(seed).permutation(sum(sizes))[: int(max_points)])
        starts = np.concatenate([[0], np.cumsum(sizes)])
        picks = [chosen[(chosen >= lo) & (chosen < hi)] - lo for lo, hi in zip(starts[:-1], starts[1:], strict=True)]
        features = np.concatenate(
            [np.asarray(stores[s].features[rows], dtype=np.float32) for (s, _, _), rows in zip(projected, picks)]
        )
        if len(features) < 5:
            raise ValueError(f"{method} needs at least 5 samples, got {len(features)}")
        xy, how = embed(features, method, seed)
        info.update(max_points=int(max_points), seed=seed, **how)
        offset = 0
        for (split, kind, dataset), rows in zip(projected, picks, strict=True):
            frames.append(_frame(stores[split], kind, dataset, rows, xy[offset : offset + len(rows)]))
            offset += len(rows)
    frame = pd.concat(frames, ignore_index=True)[list(PROJECTION_COLUMNS)]
    config, _ = read_json_object(Path(run_dir) / "config.json")
    info["hover_thumbnails"] = write_hover_thumbnails(run_dir, method, frame, config)
    write_table(projection_path(run_dir, method), frame)
    write_json(projection_path(run_dir, method).with_suffix(".json"), {**info, "n": len(frame)})
    return frame
