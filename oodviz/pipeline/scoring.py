"""New images scored with a finished run's model and saved detectors (``oodviz score RUN IMAGES...``).

A run keeps its fitted detectors in ``<run>/detectors/<name>/`` (:mod:`oodviz.detectors.persist`),
written by the pipeline stage ``save detectors`` through :func:`save_run_detectors`, beside
``<run>/detectors/backbone.json``: the backbone's identity (name, weights id, layer, pooling, the
transform's description, the feature width and class count). :func:`score_images` loads the backbone
from the run's config again, refuses one whose identity differs from the one the detectors were fitted
with, and scores the image files exactly as the run scored its splits: the images are decoded as an
image folder's (RGB), extracted through the backbone's transform into a temporary feature store at the
run's precision and feature dtype, and scored by each detector from that store (the model-based ones
run the backbone on the transformed inputs).

A run over several layers (:mod:`oodviz.pipeline.layers`) also saves its per-layer detectors
(``detectors/<detector>@<layer>/``) and each layer's identity (``detectors/layers.json``): the layers the
asked detectors read are extracted in one forward pass (:func:`oodviz.engine.layers.extract_layers_or_reuse`,
one temporary store per layer), each ``<detector>@<layer>`` scores its layer's store, the detectors with a
plain name score the first layer's (as in the run), and ``mahalanobis@combined`` is the sum of the
per-layer Mahalanobis scores standardised with the means and deviations the run recorded in
``detectors.json`` (:func:`oodviz.results.layers.standardised_sum`).

For each image and detector the result says the classifier's prediction (its class name and softmax
probability), the score (**higher = more OOD**), its percentile among the run's ID test scores
(``100 x`` the share of ID test scores ``<=`` it) and the verdict at the run's threshold: ``"OOD"``
when ``score >= threshold``, the pooled threshold that flags 95% of the run's OOD samples (that of
``per_class.csv``, :func:`oodviz.results.tables.default_threshold`), else ``"ID"``.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from oodviz.columns import COMBINED, COMBINED_DETECTOR, layer_column, split_column
from oodviz.config.run import RunConfig
from oodviz.data.base import ImageDataset, Source, UnreadableImageError
from oodviz.data.folders import read_image
from oodviz.detectors import detector_class, load
from oodviz.detectors.persist import referenced_files
from oodviz.engine import extract, score_inputs
from oodviz.engine.layers import extract_layers_or_reuse
from oodviz.files import read_json_object, write_json
from oodviz.models import parse_device
from oodviz.pipeline.job import SCORE_BATCH
from oodviz.pipeline.layers import backbone_views
from oodviz.results.layers import standardised_sum
from oodviz.results.tables import (
    ID_SPLIT,
    ResultsFileError,
    check_detector,
    default_threshold,
    detectors_of,
    load_results,
)

DETECTORS_DIRNAME = "detectors"
BACKBONE_FILE = "backbone.json"
#: layer -> the identity of the backbone's view of that layer, in a run over several layers
LAYERS_FILE = "layers.json"
#: the multi-layer Mahalanobis, computed from the per-layer ones (:func:`combined_parts`)
COMBINED_COLUMN = layer_column(COMBINED_DETECTOR, COMBINED)
#: columns of :func:`score_images`'s table, one row per image and detector
SCORED_COLUMNS = (
    "file",
    "prediction",
    "class_name",
    "confidence",
    "detector",
    "score",
    "id_percentile",
    "threshold",
    "verdict",
)


class RunNotScorableError(ValueError):
    """A run whose saved detectors or model cannot score new images (unfinished, older, changed)."""


def backbone_identity(backbone) -> dict:
    """What must be the same for a saved detector to apply: the backbone's name, weights, feature source,
    transform (its ``repr``), feature width ``D`` and class count ``C``."""
    return {
        "name": backbone.name,
        "weights_id": backbone.weights_id,
        "layer": backbone.layer,
        "pooling": backbone.pooling,
        "source": backbone.source,
        "transform": repr(backbone.transform),
        "input_shape": list(backbone.input_shape),
        "feature_dim": backbone.feature_dim,
        "num_classes": backbone.num_classes,
    }


def detectors_dir(run_dir) -> Path:
    return Path(run_dir) / DETECTORS_DIRNAME


def save_run_detectors(run_dir, backbone, fitted: dict, scratch_dir, views: dict | None = None) -> dict[str, str]:
    """Save every detector of ``fitted`` (result column -> detector) under ``<run_dir>/detectors/<column>/`` and the
    backbone's identity beside them; ``views`` (layer -> the backbone's view of it, a run over several layers):
    each layer's identity too (:data:`LAYERS_FILE`). A detector's memory-mapped state inside ``scratch_dir``
    (knn's bank when the run wrote one, removed when the worker ends) is copied; a feature store's file (knn's
    bank at any layer) is referenced. Returns the detectors that could not be saved, name -> error (the others
    are saved)."""
    root = detectors_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / BACKBONE_FILE, backbone_identity(backbone))
    if views:
        write_json(root / LAYERS_FILE, {layer: backbone_identity(view) for layer, view in views.items()})
    scratch = Path(scratch_dir).resolve()
    failed = {}
    for name, detector in fitted.items():
        temporary = any(path.resolve().is_relative_to(scratch) for path in referenced_files(detector))
        try:
            detector.save(root / name, copy_files=temporary)
        except (OSError, ValueError) as error:  # one detector's state must not cost the others theirs
            failed[name] = f"{type(error).__name__}: {error}"
    return failed


# -- scoring new images -------------------------------------------------------------------------------
class FileListSource(Source):
    """The given image files, in order, without labels (decoded as an image folder's: RGB)."""

    def __init__(self, paths):
        self.paths = [str(p) for p in paths]

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def labels(self) -> np.ndarray:
        return np.full(len(self.paths), -1, dtype=np.int64)

    def load(self, index: int):
        return read_image(self.paths[index]), -1

    def item_name(self, index: int) -> str:
        return self.paths[index]


@dataclass
class ScoredImages:
    """``table``: :data:`SCORED_COLUMNS`, one row per readable image and detector (images in the order
    given, detectors in the run's order); ``unreadable``: file -> why it could not be decoded;
    ``not_loaded``: detector -> why it could not be loaded (the others scored)."""

    table: pd.DataFrame
    unreadable: dict[str, str] = field(default_factory=dict)
    not_loaded: dict[str, str] = field(default_factory=dict)


def load_saved_detectors(run_dir, names, backbone, detectors_log: dict | None) -> tuple[dict, dict[str, str]]:
    """``({name: detector}, {name: why not})``: each of ``names`` loaded from ``<run_dir>/detectors/`` (the
    model-based ones given ``backbone``). A detector that was not saved (its ``save_error`` in the run's
    ``detectors.json``), or whose files are missing, damaged or changed, is left out with why, so that one
    bad detector does not cost the others; :class:`RunNotScorableError` when none loads."""

    loaded, failed = {}, {}
    for name in names:
        directory = detectors_dir(run_dir) / name
        save_error = ((detectors_log or {}).get(name) or {}).get("save_error")
        if save_error and not directory.is_dir():
            failed[name] = f"the run could not save it ({save_error})"
            continue
        if split_column(name)[1] is not None and not (detectors_dir(run_dir) / LAYERS_FILE).is_file():
            failed[name] = "a run made before oodviz saved per-layer detectors; run its config again to score it"
            continue
        objects = {"model": backbone} if detector_class(split_column(name)[0]).needs_model else {}
        try:
            loaded[name] = load(directory, **objects)
        except (OSError, ValueError) as error:  # DetectorFileError is a ValueError
            failed[name] = f"{type(error).__name__}: {error}"
    if not loaded:
        reasons = "; ".join(f"{name}: {why}" for name, why in failed.items())
        raise RunNotScorableError(f"no saved detector of run {run_dir} could be loaded ({reasons})")
    return loaded, failed


def _check_run(run_dir, detector: str | None):
    results = load_results(run_dir)
    try:
        results.check_results("scores.parquet")
    except ResultsFileError as error:
        raise RunNotScorableError(str(error)) from error
    if not results.finished:
        raise RunNotScorableError(
            f"run {run_dir} is not finished (state {results.state!r}); score images with a finished run"
        )
    saved = detectors_dir(run_dir)
    if not (saved / BACKBONE_FILE).is_file():
        raise RunNotScorableError(
            f"run {run_dir} has no saved detectors ({saved}/ is missing: a run made before oodviz saved them); "
            "run its config again (oodviz run RUN/config.json)"
        )
    names = detectors_of(results.scores)
    if detector is not None:
        check_detector(results.scores, detector)
        names = [detector]
    return results, names


def combined_parts(record) -> tuple[dict[str, str], dict[str, dict[str, float]]] | None:
    """``({layer: per-layer column}, {layer: {"mean", "std"}})`` of ``mahalanobis@combined`` from its
    ``detectors.json`` record (:func:`oodviz.pipeline.layers.combine_layers`); None when the record lacks them."""
    if not isinstance(record, dict) or not isinstance(record.get("layers"), list):
        return None
    layers, stats = record["layers"], record.get("stats")
    if not layers or not isinstance(stats, dict) or not all(isinstance(layer, str) for layer in layers):
        return None
    for layer in layers:
        entry = stats.get(layer)
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), float) for k in ("mean", "std")):
            return None
    columns = {layer: layer_column(COMBINED_DETECTOR, layer) for layer in layers}
    return columns, {layer: stats[layer] for layer in layers}


def _refuse_changed(now: dict, saved: dict) -> None:
    changed = [key for key in saved if now.get(key) != saved[key]]
    if changed:
        raise RunNotScorableError(
            f"the run's model is not the one its detectors were fitted with ({', '.join(changed)} changed, e.g. "
            f"the checkpoint file was replaced); run the config again to fit them to this model"
        )


def _run_backbone(config, identity: dict):
    """The run's backbone loaded again, refused unless its identity is ``identity`` (``backbone.json``)."""
    backbone = config.load_backbone()
    _refuse_changed(backbone_identity(backbone), identity)
    return backbone


def _extract_images(run_dir, config, backbone, detectors: dict, dataset, root, options: dict) -> dict:
    """Layer -> the store of the images at that layer, and ``None`` -> the store the plain-named detectors score.
    A single-layer run (or only plain-named detectors that read no features): the run's backbone's store. A run
    over several layers: every layer the detectors read, and the run's first layer when a plain-named detector
    reads features (the run scored it there), in one forward pass, each layer's view refused unless its identity
    is the one the run saved (:data:`LAYERS_FILE`)."""

    layers = {split_column(name)[1] for name in detectors} - {None}
    plain = [d for name, d in detectors.items() if split_column(name)[1] is None and not d.needs_model]
    if config.layers and any("features" in d.fields_to_read(fitting=False) for d in plain):
        layers.add(config.layers[0])
    key = {"files": dataset.source.paths}
    if not layers:
        return {None: extract(backbone, dataset, root, key, feature_dtype=config.feature_dtype, sync=False, **options)}
    saved, problem = read_json_object(detectors_dir(run_dir) / LAYERS_FILE)
    if problem:
        raise RunNotScorableError(f"{detectors_dir(run_dir) / LAYERS_FILE}: {problem}")
    views = backbone_views(backbone, [layer for layer in config.layers if layer in layers], config.pooling_at)
    for layer, view in views.items():
        if not isinstance(saved.get(layer), dict):
            raise RunNotScorableError(f"{detectors_dir(run_dir) / LAYERS_FILE} lacks layer {layer!r}: run again")
        _refuse_changed(backbone_identity(view), saved[layer])
    stores = extract_layers_or_reuse(
        views, dataset, root, key, feature_dtype=config.feature_dtype, sync=False, **options
    )
    return {None: stores.get(config.layers[0], next(iter(stores.values()))), **stores}


def _readable(paths) -> tuple[list[str], dict[str, str]]:
    """The files of ``paths`` that can be scored, and file -> why not for the others: an image that cannot be
    decoded, or a name that is not UTF-8 text (the table's ``file`` column is text; such a name comes from the
    command line with its bytes as surrogate escapes, :func:`os.fsdecode`)."""
    readable, unreadable = [], {}
    for path in map(str, paths):
        try:
            path.encode()
        except UnicodeEncodeError:
            unreadable[path] = "its name is not UTF-8 text, which the table's file column needs; rename the file"
            continue
        try:
            read_image(path)
            readable.append(path)
        except UnreadableImageError as error:
            unreadable[path] = str(error.__cause__ or error)
    return readable, unreadable


def score_images(run_dir, paths, detector: str | None = None, device: str = "cpu") -> ScoredImages:
    """Score the image files ``paths`` with the finished run ``run_dir``'s model and saved detectors
    (all of them, or ``detector``); see the module docstring for what each row says.
    :class:`RunNotScorableError` for a run that cannot score; unreadable files and detectors that cannot
    be loaded (:func:`load_saved_detectors`) are listed, not fatal."""

    if not paths:
        raise ValueError("score_images: give at least one image file")
    results, names = _check_run(run_dir, detector)
    config = RunConfig.from_dict(results.config)
    identity, problem = read_json_object(detectors_dir(run_dir) / BACKBONE_FILE)
    if problem:
        raise RunNotScorableError(f"{detectors_dir(run_dir) / BACKBONE_FILE}: {problem}")
    combined = combined_parts((results.detectors or {}).get(COMBINED_COLUMN)) if COMBINED_COLUMN in names else None
    wanted = [name for name in names if name != COMBINED_COLUMN] + list(combined[0].values() if combined else [])
    backbone = _run_backbone(config, identity)
    detectors, not_loaded = load_saved_detectors(run_dir, list(dict.fromkeys(wanted)), backbone, results.detectors)
    if COMBINED_COLUMN in names and (combined is None or not set(combined[0].values()) <= set(detectors)):
        not_loaded[COMBINED_COLUMN] = (
            "its per-layer Mahalanobis detectors or their statistics (detectors.json) are missing"
        )
    names = [name for name in names if name in detectors or (name == COMBINED_COLUMN and name not in not_loaded)]
    files, unreadable = _readable(paths)
    if not files:
        return ScoredImages(pd.DataFrame(columns=list(SCORED_COLUMNS)), unreadable, not_loaded)
    device = parse_device(device)
    dataset = ImageDataset("images", FileListSource(files))
    options = {"device": device, "batch_size": config.batch_size, "precision": config.precision}
    with tempfile.TemporaryDirectory(prefix="oodviz-score-") as root:
        stores = _extract_images(run_dir, config, backbone, detectors, dataset, root, options)
        main = stores[None]
        logits = torch.from_numpy(np.array(main.logits, dtype=np.float32))
        rows = np.asarray(main.indices)
        per_detector = {}
        for name, saved in detectors.items():
            if saved.needs_model:
                scored = score_inputs(lambda b, d=saved: d.score(b, device=device), backbone, dataset, **options)
                if not np.array_equal(scored.indices, rows):
                    raise ValueError(f"{name}: the images read differently for the model pass; score them again")
                per_detector[name] = scored.scores.numpy()
            else:
                store = stores[split_column(name)[1]]
                per_detector[name] = saved.score(store.batches(SCORE_BATCH, device=device), device=device).numpy()
    if COMBINED_COLUMN in names:  # the run's formula on the same per-layer scores, with its recorded statistics
        columns, stats = combined
        per_detector[COMBINED_COLUMN] = standardised_sum(
            {layer: per_detector[c] for layer, c in columns.items()}, stats
        )
    probabilities = logits.softmax(dim=1)
    predictions = probabilities.argmax(dim=1).numpy()
    class_names = backbone.classes or results.class_names
    id_rows = results.scores[results.scores.split == ID_SPLIT]
    table = []
    for name in names:
        id_scores = np.sort(id_rows[name].to_numpy(dtype=np.float64))
        threshold = default_threshold(results.scores, name)
        for row, score in enumerate(per_detector[name]):
            prediction = int(predictions[row])
            table.append(
                {
                    "file": files[rows[row]],
                    "prediction": prediction,
                    "class_name": class_names[prediction] if prediction < len(class_names) else str(prediction),
                    "confidence": float(probabilities[row, prediction]),
                    "detector": name,
                    "score": float(score),
                    "id_percentile": 100.0 * np.searchsorted(id_scores, float(score), side="right") / len(id_scores),
                    "threshold": threshold,
                    "verdict": "OOD" if float(score) >= threshold else "ID",
                }
            )
    return ScoredImages(pd.DataFrame(table, columns=list(SCORED_COLUMNS)), unreadable, not_loaded)
