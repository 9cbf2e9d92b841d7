"""One run's job: what the stages of :mod:`oodviz.pipeline.stages` share, and what more than one stage does with it
(fit a detector on the ID fit split, check its scores, record a detector that fails).

The job's fields are filled in stage order; each stage's docstring says which it reads and which it writes.
"""

from __future__ import annotations

import platform
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

import oodviz
from oodviz import detectors, models
from oodviz.columns import layer_column, split_column
from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
from oodviz.config.splits import run_splits
from oodviz.engine import Cancelled
from oodviz.pipeline.batchprobe import ModelBatches
from oodviz.pipeline.model_passes import fit_on_inputs
from oodviz.pipeline.reporter import Reporter, Stage
from oodviz.results.tables import ID_SPLIT, OOD_SPLIT
from oodviz.runs.rundir import RunDir

if TYPE_CHECKING:
    from oodviz.data.base import ImageDataset
    from oodviz.detectors import Detector
    from oodviz.engine import FeatureStore
    from oodviz.models import Backbone

SCORE_BATCH = 4096


def resolve_device(choice: str) -> torch.device:
    """The run's device on this machine (:func:`oodviz.models.parse_device`)."""
    return models.parse_device(choice)


class Watched:
    """Batches that report progress (rows of the current pass) and stop at the next batch on cancel."""

    def __init__(self, batches, stage: Stage):
        self.batches, self.stage = batches, stage

    @property
    def features_on_disk(self):
        return getattr(self.batches, "features_on_disk", None)

    def __iter__(self):
        done = 0
        for batch in self.batches:
            yield batch
            done += len(batch)
            self.stage.progress(done, self.batches.n, {})


def _with_scratch(choice: DetectorChoice, run: RunDir, column: str) -> dict:
    """The detector's parameters, with files it keeps (knn's bank) in the run's scratch directory, in a folder
    of its result ``column`` (one per layer), unless the config chose a place: removed when the worker ends,
    even when it is killed."""
    if "bank_dir" in detectors.detector_class(choice.name).param_names() and not choice.params.get("bank_dir"):
        return {**choice.params, "bank_dir": str(run.scratch_path / column)}
    return dict(choice.params)


@dataclass
class Job:
    """What the stages of one run share; each stage reads what the earlier ones left here.

    ``datasets`` and ``stores`` are keyed by split (``id_fit``, ``id_test``, ``ood:<name>``);
    ``layer_stores``: split -> layer -> store in a run over several layers (:mod:`oodviz.pipeline.layers`);
    ``fitted``: the detectors still in the run, in config order, by result column; ``detector_log``: what becomes
    ``detectors.json``; ``frames``: the scores table of each scored split; ``scores``: all of them
    (``scores.parquet``); ``meta``: what becomes ``meta.json``; ``tuning``: per tuned detector, what tuning
    on validation data tried and chose (:mod:`oodviz.pipeline.tuning`); ``layer_views``: the model's view per layer
    of a run over several layers, once made (:func:`oodviz.pipeline.layers.layer_views`).
    """

    config: RunConfig
    run: RunDir
    reporter: Reporter
    device: torch.device
    #: what becomes ``meta.json``: versions and device (:func:`start_job`), splits, layers, stages
    meta: dict[str, object]
    #: the run's model (``load_model``)
    backbone: Backbone | None = None
    #: split -> its dataset (``load_data``)
    datasets: dict[str, ImageDataset] = field(default_factory=dict)
    #: split -> its main feature store (``extract_splits``)
    stores: dict[str, FeatureStore] = field(default_factory=dict)
    #: split -> layer -> store, in a run over several layers (``extract_splits``)
    layer_stores: dict[str, dict[str, FeatureStore]] = field(default_factory=dict)
    #: result column -> the fitted detector still in the run, in config order (``fit_detectors``)
    fitted: dict[str, Detector] = field(default_factory=dict)
    #: result column -> what becomes its ``detectors.json`` entry (params, times, tuning, errors)
    detector_log: dict[str, dict] = field(default_factory=dict)
    #: the scores table of each scored split (``score_splits``)
    frames: list[pd.DataFrame] = field(default_factory=list)
    #: every split's scores, as ``scores.parquet`` holds them (``write_scores``)
    scores: pd.DataFrame | None = None
    #: result column -> what tuning tried and chose (``tune_detectors``)
    tuning: dict[str, dict] = field(default_factory=dict)
    #: the batch each model-based detector passes through the model (the pre-flight's or ``load_data``'s probe)
    model_batches: ModelBatches = field(default_factory=ModelBatches)
    #: layer -> the model's view with that layer's features, once made (:func:`oodviz.pipeline.layers.layer_views`)
    layer_views: dict[str, Backbone] | None = None

    @property
    def splits(self) -> list[tuple[str, DatasetChoice, bool]]:
        """``(split, dataset choice, loaded as OOD)`` of every split the run extracts."""
        return run_splits(self.config)

    def store_of(self, split: str, layer: str | None):
        """The feature store of ``split`` at ``layer``; ``None``: the split's main store."""
        return self.stores[split] if layer is None else self.layer_stores[split][layer]

    def head_of(self, split: str, layer: str | None):
        """The classifier head for the features of ``split`` at ``layer``: the backbone's for its main layer, else
        the one its store recorded."""
        return self.backbone.head if layer is None else self.store_of(split, layer).head

    @property
    def scored_splits(self) -> list[tuple[str, str, str]]:
        """``(split, scores.parquet split, dataset name)`` of every split the run scores."""
        ood = [(f"ood:{choice.result_name}", OOD_SPLIT, choice.result_name) for choice in self.config.ood]
        return [("id_test", ID_SPLIT, self.config.id_test.result_name), *ood]

    def model_pass_options(self, stage: Stage) -> dict:
        """Keyword arguments of a batched pass through the model (extraction, model-based scoring):
        the job's device and loader settings, ``stage``'s progress and the run's cancel request."""
        return {
            "device": self.device,
            "batch_size": self.config.batch_size,
            "num_workers": self.config.num_workers,
            "precision": self.config.precision,
            "progress": stage.progress,
            "should_cancel": self.run.cancel_requested,
        }

    @contextmanager
    def detector_may_fail(self, name: str, doing: str, stage: Stage) -> Iterator[None]:
        """Run the body for detector ``name``; if it raises (cancellation aside), record the failure
        and go on without the detector: its ``detectors.json`` entry gets ``error`` and
        ``traceback``, a warning ``"<name> failed to <doing>: <error>"`` is emitted and ``stage``
        is marked failed with the same message."""
        try:
            yield
        except Cancelled:
            raise
        except Exception as error:  # one detector failing must not stop the others
            choice = next(c for c in self.config.detectors if c.name == split_column(name)[0])
            entry = self.detector_log.setdefault(
                name, {"params": {k: v for k, v in choice.params.items() if k != "model"}}
            )
            entry.update(error=f"{type(error).__name__}: {error}", traceback="".join(traceback.format_exception(error)))
            self.fitted.pop(name, None)
            message = f"{name} failed to {doing}: {error}"
            self.reporter.warn(message)
            stage.failed(message)


def start_job(config: RunConfig, run: RunDir, reporter: Reporter) -> Job:
    """The job of ``config`` on its device, with the versions and device in its ``meta``."""
    device = resolve_device(config.device)
    reporter.device = device
    meta = {
        "oodviz": oodviz.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU",
        "stages": {},
    }
    return Job(config, run, reporter, device, meta)


def fitted_detector(job: Job, choice: DetectorChoice, stage: Stage, layer: str | None = None, fit_features=None):
    if detectors.detector_class(choice.name).needs_model:
        detector = detectors.create(choice.name, **{**choice.params, "model": job.backbone})
        if detector.needs_fit:
            fit_on_inputs(job, detector, stage)
        else:
            detector.fit(None)  # nothing to learn: checks that the method works with this model
        return detector
    column = choice.name if layer is None else layer_column(choice.name, layer)
    detector = detectors.create(choice.name, **_with_scratch(choice, job.run, column))
    (fit_features or fit_on_store)(job, detector, stage, layer)
    return detector


def fit_on_store(job: Job, detector, stage: Stage, layer: str | None = None) -> None:
    """Fit ``detector`` on the whole ID fit store (of ``layer``; None: the run's main one), reading only the
    fields it uses."""
    fields = detector.fields_to_read(fitting=True)
    store = job.store_of("id_fit", layer)
    batches = Watched(store.batches(SCORE_BATCH, device=job.device, include=fields), stage)
    detector.fit(batches, head=job.head_of("id_fit", layer), device=job.device)


def finite_scores(detector, name: str, split: str, values: np.ndarray) -> np.ndarray:
    """``values`` when every score is finite; else ValueError naming how many are NaN or infinite and
    what to change (a detector's metrics and tables are meaningless with them)."""
    bad = int(values.size - np.isfinite(values).sum())
    if bad:
        tunable = [k for k in detector.get_params() if k not in ("model", "bank_dir")]
        fix = "try another temperature" if "temperature" in tunable else f"try other parameters ({', '.join(tunable)})"
        raise ValueError(f"{name} gave {bad} non-finite scores on {split} (of {values.size}); {fix}")
    return values


def require_a_detector(job: Job) -> None:
    """RuntimeError naming each failed detector and why when none is left: the run has no results."""
    if not job.fitted:
        reasons = "; ".join(f"{name}: {entry['error']}" for name, entry in job.detector_log.items() if "error" in entry)
        raise RuntimeError(f"every detector failed ({reasons})")


def failed_detectors(job: Job) -> list[str]:
    """Detectors (result columns) that failed to fit or to score, in config order."""
    return [name for name, entry in job.detector_log.items() if "error" in entry]
