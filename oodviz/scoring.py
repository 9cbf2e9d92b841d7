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

For each image and detector the result says the classifier's prediction (its class name and softmax
probability), the score (**higher = more OOD**), its percentile among the run's ID test scores
(``100 x`` the share of ID test scores ``<=`` it) and the verdict at the run's threshold: ``"OOD"``
when ``score >= threshold``, the pooled threshold that flags 95% of the run's OOD samples (that of
``per_class.csv``, :func:`oodviz.results.default_threshold`), else ``"ID"``.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from oodviz.data.base import ImageDataset, Source, UnreadableImageError
from oodviz.data.folders import read_image
from oodviz.detectors.persist import referenced_files
from oodviz.layers import split_column
from oodviz.results import ID_SPLIT, check_detector, default_threshold, detectors_of, load_results
from oodviz.runs.rundir import write_json

DETECTORS_DIRNAME = "detectors"
BACKBONE_FILE = "backbone.json"
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
SCORE_BATCH = 4096


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


def save_run_detectors(run_dir, backbone, fitted: dict, scratch_dir) -> dict[str, str]:
    """Save every detector of ``fitted`` (name -> detector) under ``<run_dir>/detectors/<name>/`` and the
    backbone's identity beside them. A detector's memory-mapped state inside ``scratch_dir`` (knn's bank
    when the run wrote one, removed when the worker ends) is copied; a feature store's file is referenced.
    Returns the detectors that could not be saved, name -> error (the others are saved)."""
    root = detectors_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / BACKBONE_FILE, backbone_identity(backbone))
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
    given, detectors in the run's order); ``unreadable``: file -> why it could not be decoded."""

    table: pd.DataFrame
    unreadable: dict[str, str] = field(default_factory=dict)


def _check_run(run_dir, detector: str | None):
    results = load_results(run_dir)
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
    # a run over several layers saves only the detectors of its main features (oodviz.runs.layers)
    names = [name for name in detectors_of(results.scores) if split_column(name)[1] is None]
    if detector is not None:
        check_detector(results.scores, detector)
        if split_column(detector)[1] is not None:
            raise RunNotScorableError(
                f"{detector} was fitted on layer {split_column(detector)[1]!r} of a run over several layers; oodviz "
                f"score reads the run's main features only ({', '.join(names) or 'none saved'})"
            )
        names = [detector]
    missing = [n for n in names if not (saved / n).is_dir()]
    if missing:
        raise RunNotScorableError(f"run {run_dir} has scores but no saved detector for {', '.join(missing)}")
    return results, names


def _run_backbone(config, identity: dict):

    backbone = config.load_backbone()
    now = backbone_identity(backbone)
    changed = [key for key in identity if now.get(key) != identity[key]]
    if changed:
        raise RunNotScorableError(
            f"the run's model is not the one its detectors were fitted with ({', '.join(changed)} changed, e.g. "
            f"the checkpoint file was replaced); run the config again to fit them to this model"
        )
    return backbone


def _readable(paths) -> tuple[list[str], dict[str, str]]:
    readable, unreadable = [], {}
    for path in map(str, paths):
        try:
            read_image(path)
            readable.append(path)
        except UnreadableImageError as error:
            unreadable[path] = str(error.__cause__ or error)
    return readable, unreadable


def score_images(run_dir, paths, detector: str | None = None, device: str = "cpu") -> ScoredImages:
    """Score the image files ``paths`` with the finished run ``run_dir``'s model and saved detectors
    (all of them, or ``detector``); see the module docstring for what each row says.
    :class:`RunNotScorableError` for a run that cannot score; unreadable files are listed, not fatal."""
    from oodviz.detectors import detector_class, load
    from oodviz.engine import extract, score_inputs
    from oodviz.models import parse_device
    from oodviz.runs.config import RunConfig
    from oodviz.runs.rundir import read_json_object

    if not paths:
        raise ValueError("score_images: give at least one image file")
    results, names = _check_run(run_dir, detector)
    config = RunConfig.from_dict(results.config)
    identity, problem = read_json_object(detectors_dir(run_dir) / BACKBONE_FILE)
    if problem:
        raise RunNotScorableError(f"{detectors_dir(run_dir) / BACKBONE_FILE}: {problem}")
    backbone = _run_backbone(config, identity)
    files, unreadable = _readable(paths)
    if not files:
        return ScoredImages(pd.DataFrame(columns=list(SCORED_COLUMNS)), unreadable)
    device = parse_device(device)
    dataset = ImageDataset("images", FileListSource(files))
    options = {"device": device, "batch_size": config.batch_size, "precision": config.precision}
    with tempfile.TemporaryDirectory(prefix="oodviz-score-") as root:
        store = extract(
            backbone, dataset, root, {"files": files}, feature_dtype=config.feature_dtype, sync=False, **options
        )
        logits = torch.from_numpy(np.array(store.logits, dtype=np.float32))
        rows = np.asarray(store.indices)
        per_detector = {}
        for name in names:
            if detector_class(name).needs_model:
                model_detector = load(detectors_dir(run_dir) / name, model=backbone)
                scored = score_inputs(
                    lambda b, d=model_detector: d.score(b, device=device), backbone, dataset, **options
                )
                if not np.array_equal(scored.indices, rows):
                    raise ValueError(f"{name}: the images read differently for the model pass; score them again")
                per_detector[name] = scored.scores.numpy()
            else:
                saved = load(detectors_dir(run_dir) / name)
                per_detector[name] = saved.score(store.batches(SCORE_BATCH, device=device), device=device).numpy()
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
    return ScoredImages(pd.DataFrame(table, columns=list(SCORED_COLUMNS)), unreadable)
