"""The stages of a run: extract every split (or reuse its store), fit, score, metrics, analysis.

``run_pipeline(config, run, reporter)`` is what the worker process and ``oodviz run`` execute.
Results land in the run directory, each file written atomically:

- ``scores.parquet``: one row per sample of every scored split: ``split`` (``id_test`` or
  ``ood``), ``dataset``, ``index`` (the sample's index in its dataset), ``label`` (-1 for OOD),
  ``prediction``, and one column per fitted detector (higher = more OOD);
- ``metrics.csv``: one row per detector and OOD dataset, then one per detector and near/far group
  (the mean over that group's datasets): ``detector, ood_dataset, group, auroc, aupr_in,
  aupr_out, fpr95, id_accuracy, threshold``;
- ``per_class.csv``: per detector and ID class, the false-alarm rate at the threshold that flags
  95% of all OOD samples: ``detector, class, class_name, n, accuracy, false_alarms,
  false_alarm_rate, mean_score``;
- ``detectors.json``: each detector's parameters, fit time and, when it failed, its error;
- ``meta.json``: versions, device, the splits and their stores, wall time and peak memory per stage;
- ``scratch/`` while the job runs: detectors' working files (knn's bank), removed by the worker when
  it ends and by the supervisor when the worker was killed.

Detectors that run the model again (``needs_model``: odin, mcd) are made with the run's backbone,
need no fit data, and score each split in a stage of their own (``score <split> with <name>``):
the split's dataset is streamed through the backbone's transform on the job's device by
:func:`oodviz.engine.score_inputs` (batching, OOM back-off, progress, cancel), in the row order
of the split's feature store.
"""

from __future__ import annotations

import io
import platform
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import oodviz
from oodviz.metrics import ood_metrics, threshold_at_recall
from oodviz.runs.config import DatasetChoice, RunConfig
from oodviz.runs.reporter import Cancelled, Reporter, Stage
from oodviz.runs.rundir import RunDir, write_atomic, write_json

SCORE_BATCH = 4096


def resolve_device(choice: str) -> torch.device:
    """The run's device on this machine (:func:`oodviz.models.parse_device`)."""
    from oodviz.models import parse_device

    return parse_device(choice)


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


def feature_store_root(run: RunDir) -> Path:
    """Stores are shared by every run under the same runs root, so a repeated split is extracted once."""
    return run.path.parent / ".features"


def load_split(config: RunConfig, choice: DatasetChoice, as_ood: bool):
    from oodviz.data import load_dataset

    return load_dataset(
        choice.name,
        root=config.data_root,
        download=config.download,
        subsample=choice.subsample,
        subsample_mode=choice.subsample_mode,
        seed=config.seed,
        as_ood=as_ood,
        **choice.params,
    )


def _group(choice: DatasetChoice) -> str:
    from oodviz.data import dataset_info

    return choice.group or dataset_info(choice.name).group or "far"


def write_table(path: Path, frame: pd.DataFrame) -> None:
    """CSV or Parquet by suffix, written atomically."""
    buffer = io.BytesIO()
    if path.suffix == ".parquet":
        frame.to_parquet(buffer, index=False)
    else:
        frame.to_csv(buffer, index=False)
    write_atomic(path, buffer.getvalue())


def _failure(error: BaseException) -> dict:
    return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}


def _logged_params(det, choice) -> dict:
    """The parameters in force, less the model and the scratch bank directory the run chose itself."""
    return {k: v for k, v in det.get_params().items() if k != "model" and (k != "bank_dir" or k in choice.params)}


def score_with_model(det, backbone, dataset, store, config: RunConfig, device: torch.device, run: RunDir, stage: Stage):
    """Scores ``[N]`` (numpy) of a model-based detector on one split, aligned with ``store``'s rows."""
    from oodviz.engine import score_inputs

    result = score_inputs(
        lambda batch: det.score(batch, device=device),
        backbone,
        dataset,
        device=device,
        batch_size=config.batch_size,
        num_workers=config.num_workers,
        precision=config.precision,
        progress=stage.progress,
        should_cancel=run.cancel_requested,
        what=f"scoring {det.name} on",
    )
    if not np.array_equal(result.indices, np.asarray(store.indices)):
        raise ValueError(
            f"the dataset gave other items ({len(result.indices)} rows) than when its features were extracted "
            f"({store.n} rows, store {store.key}); delete that store and run again"
        )
    if result.oom_backoffs:
        stage.note(f"out of memory: batch size reduced to {result.batch_size_in_force}")
    return result.scores.numpy()


def _with_scratch(choice, run: RunDir) -> dict:
    """The detector's parameters, with files it keeps (knn's bank) in the run's scratch directory
    unless the config chose a place: removed when the worker ends, even when it is killed."""
    from oodviz.detectors import detector_class

    if "bank_dir" in detector_class(choice.name).param_names() and not choice.params.get("bank_dir"):
        return {**choice.params, "bank_dir": str(run.scratch_path / choice.name)}
    return dict(choice.params)


def run_pipeline(config: RunConfig, run: RunDir, reporter: Reporter) -> None:
    from oodviz.detectors import create, detector_class
    from oodviz.engine import Cancelled as ExtractionCancelled
    from oodviz.engine import extract_or_reuse
    from oodviz.models import estimate_memory, load_backbone

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

    with reporter.stage("load model") as stage:
        backbone = load_backbone(
            config.backbone,
            weights=config.weights,
            checkpoint=config.checkpoint,
            layer=config.layer,
            pooling=config.pooling,
        )
        stage.note(f"{config.backbone}: D={backbone.feature_dim} features, C={backbone.num_classes} classes")

    splits = [("id_fit", config.id_fit, False), ("id_test", config.id_test, False)]
    splits += [(f"ood:{choice.name}", choice, True) for choice in config.ood]
    datasets = {}
    with reporter.stage("load data") as stage:
        for split, choice, as_ood in splits:
            datasets[split] = load_split(config, choice, as_ood)
        estimate = estimate_memory(backbone, {split: len(ds) for split, ds in datasets.items()})
        stage.note(estimate.describe())
        warning = estimate.warn_if_over(int(config.memory_budget_gb * 2**30))
        if warning:
            reporter.warn(warning)

    stores = {}
    for split, choice, _ in splits:
        with reporter.stage(f"extract {split}") as stage:
            store = extract_or_reuse(
                backbone,
                datasets[split],
                feature_store_root(run),
                key_params={
                    "dataset": asdict(choice),
                    "data_root": str(Path(config.data_root).resolve()),
                    "seed": config.seed,
                },
                device=device,
                batch_size=config.batch_size,
                num_workers=config.num_workers,
                precision=config.precision,
                feature_dtype=config.feature_dtype,
                progress=stage.progress,
                should_cancel=run.cancel_requested,
            )
            stores[split] = store
            stage.note(f"{'reused' if store.reused else 'extracted'} store {store.key}: {store.n} samples")
            if store.meta.get("skipped"):
                reporter.warn(f"{split}: {store.meta['skipped']} unreadable image(s) skipped")
    meta["splits"] = {
        split: {
            "dataset": choice.name,
            "group": None if not as_ood else _group(choice),
            "n": stores[split].n,
            "store": stores[split].key,
            "reused": stores[split].reused,
        }
        for split, choice, as_ood in splits
    }

    head = backbone.head
    fitted, detector_log = {}, {}
    for choice in config.detectors:
        with reporter.stage(f"fit {choice.name}") as stage:
            started = time.perf_counter()
            try:
                if detector_class(choice.name).needs_model:
                    det = create(choice.name, **{**choice.params, "model": backbone})
                    det.fit(None)  # nothing to learn: checks that the method works with this model
                else:
                    det = create(choice.name, **_with_scratch(choice, run))
                    det.fit(
                        Watched(stores["id_fit"].batches(SCORE_BATCH, device=device), stage), head=head, device=device
                    )
                fitted[choice.name] = det
                detector_log[choice.name] = {
                    "params": _logged_params(det, choice),
                    "fit_s": time.perf_counter() - started,
                }
            except Cancelled:
                raise
            except Exception as error:  # one detector failing must not stop the others
                params = {k: v for k, v in choice.params.items() if k != "model"}
                detector_log[choice.name] = {"params": params, **_failure(error)}
                reporter.warn(f"{choice.name} failed to fit: {error}")
                stage.failed(str(error))

    frames = []
    scored = [("id_test", config.id_test.name)] + [(f"ood:{c.name}", c.name) for c in config.ood]
    for split, dataset in scored:
        store = stores[split]
        model_scores = {}
        for name, det in list(fitted.items()):
            if not det.needs_model:
                continue
            with reporter.stage(f"score {split} with {name}") as stage:
                started = time.perf_counter()
                try:
                    model_scores[name] = score_with_model(
                        det, backbone, datasets[split], store, config, device, run, stage
                    )
                    detector_log[name]["score_s"] = (
                        detector_log[name].get("score_s", 0.0) + time.perf_counter() - started
                    )
                except (Cancelled, ExtractionCancelled):
                    raise
                except Exception as error:
                    detector_log[name] = {**detector_log[name], **_failure(error)}
                    reporter.warn(f"{name} failed to score {split}: {error}")
                    stage.failed(str(error))
                    del fitted[name]
        with reporter.stage(f"score {split}") as stage:
            frame = pd.DataFrame(
                {
                    "split": "id_test" if split == "id_test" else "ood",
                    "dataset": dataset,
                    "index": np.asarray(store.indices),
                    "label": np.asarray(store.labels),
                    "prediction": np.asarray(store.predictions),
                }
            )
            for i, (name, det) in enumerate(list(fitted.items())):
                if name in model_scores:
                    frame[name] = model_scores[name]
                    stage.progress(i + 1, len(fitted) or 1, {})
                    continue
                try:
                    frame[name] = det.score(store.batches(SCORE_BATCH, device=device), device=device).numpy()
                except Cancelled:
                    raise
                except Exception as error:
                    detector_log[name] = {
                        **detector_log[name],
                        "error": f"{type(error).__name__}: {error}",
                        "traceback": traceback.format_exc(),
                    }
                    reporter.warn(f"{name} failed to score {split}: {error}")
                    del fitted[name]
                stage.progress(i + 1, len(fitted) or 1, {})
            frames.append(frame)
    scores = pd.concat(frames, ignore_index=True)
    for name in set(scores.columns) - {"split", "dataset", "index", "label", "prediction"} - set(fitted):
        scores = scores.drop(columns=name)  # scored some splits, then failed: keep no partial column
    write_table(run.path / "scores.parquet", scores)
    write_json(run.path / "detectors.json", detector_log)

    with reporter.stage("metrics"):
        groups = {c.name: _group(c) for c in config.ood}
        class_names = backbone.classes or [str(k) for k in range(backbone.num_classes)]
        metrics, per_class = analyse(scores, list(fitted), groups, class_names)
        write_table(run.path / "metrics.csv", metrics)
        write_table(run.path / "per_class.csv", per_class)

    meta["stages"] = reporter.stage_summary()
    write_json(run.path / "meta.json", meta)


def analyse(scores: pd.DataFrame, detectors: list[str], groups: dict[str, str], class_names: list[str]):
    """Metrics per detector and OOD dataset (plus near/far means) and per-class false alarms.

    ``scores``: the ``scores.parquet`` table; ``groups``: OOD dataset -> ``"near"``/``"far"``.
    The per-class threshold is the one that flags 95% of all OOD samples pooled together.
    """
    id_rows = scores[scores.split == "id_test"]
    ood_rows = scores[scores.split == "ood"]
    id_accuracy = float((id_rows.label == id_rows.prediction).mean())
    metric_rows, class_rows = [], []
    for name in detectors:
        per_dataset = []
        for dataset, rows in ood_rows.groupby("dataset", sort=False):
            values = ood_metrics(id_rows[name].to_numpy(), rows[name].to_numpy())
            threshold = threshold_at_recall(rows[name].to_numpy())
            per_dataset.append(
                {
                    "detector": name,
                    "ood_dataset": dataset,
                    "group": groups[dataset],
                    **values,
                    "id_accuracy": id_accuracy,
                    "threshold": threshold,
                }
            )
        metric_rows += per_dataset
        table = pd.DataFrame(per_dataset)
        for group, rows in table.groupby("group", sort=True):
            means = rows[["auroc", "aupr_in", "aupr_out", "fpr95"]].mean()
            metric_rows.append(
                {
                    "detector": name,
                    "ood_dataset": f"{group} (mean)",
                    "group": group,
                    **means.to_dict(),
                    "id_accuracy": id_accuracy,
                    "threshold": np.nan,
                }
            )
        threshold = threshold_at_recall(ood_rows[name].to_numpy())
        for label, rows in id_rows.groupby("label", sort=True):
            flagged = rows[name].to_numpy() >= threshold
            class_rows.append(
                {
                    "detector": name,
                    "class": int(label),
                    "class_name": class_names[int(label)] if 0 <= label < len(class_names) else str(label),
                    "n": len(rows),
                    "accuracy": float((rows.label == rows.prediction).mean()),
                    "false_alarms": int(flagged.sum()),
                    "false_alarm_rate": float(flagged.mean()),
                    "mean_score": float(rows[name].mean()),
                    "threshold": threshold,
                }
            )
    return pd.DataFrame(metric_rows), pd.DataFrame(class_rows)
