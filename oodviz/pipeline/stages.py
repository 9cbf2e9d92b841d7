"""The stages of a run: load the model and data, extract every split (or reuse its store), fit,
score, metrics.

``run_pipeline(config, run, reporter)`` is what the worker process and ``oodviz run`` execute: it
calls the functions of :data:`STAGES` in order on one :class:`Job`, each reporting one or more
named stages (``load model``, ``load data``, ``extract <split>``, ``fit <name>``,
``score <split> with <name>``, ``score <split>``, ``metrics``). Results land in the run
directory, each file written atomically; their schema and every table derived from the scores
belong to :mod:`oodviz.results.tables` (``scores.parquet``, ``metrics.csv``, ``per_class.csv``,
``detectors.json``, ``meta.json``) and the fitted detectors in ``detectors/`` (:mod:`oodviz.pipeline.scoring`). ``scratch/`` holds detectors' working files (knn's bank) while
the job runs; the worker removes it when it ends and the supervisor when the worker was killed.

A detector that fails to fit or to score, or gives a NaN or infinite score (:func:`finite_scores`),
does not stop the others: :meth:`Job.detector_may_fail` records it in ``detectors.json`` (error and
traceback), emits a warning, marks the stage failed and drops the detector (a score column it had
for some splits is not written). When no detector is left the run fails (:func:`require_a_detector`). Cancellation is
:class:`oodviz.engine.Cancelled`, raised at the next batch or stage and never recorded as a
detector's failure.

Detectors that run the model again (``needs_model``: odin, mcd) are made with the run's backbone,
need no fit data (those that do, adascale and gram, stream the ID fit split's images in their fit
stage), and score each split in a stage of their own (``score <split> with <name>``): the split's
dataset is streamed through the backbone's transform on the job's device by
:func:`oodviz.engine.score_inputs` (batching, OOM back-off, progress, cancel), in the row order
of the split's feature store. Those passes are :mod:`oodviz.pipeline.model_passes`.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import pandas as pd

from oodviz.columns import split_column
from oodviz.config.layers import detector_columns
from oodviz.config.plan import STEPS
from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
from oodviz.config.splits import (
    empty_classes_warning,
    feature_store_root,
    load_split,
    split_group,
    store_key_params,
)
from oodviz.config.validation import CANNOT_START, ConfigError, check_sizes
from oodviz.engine import extract_or_reuse
from oodviz.engine.store import DiskFullError, check_free_space
from oodviz.files import write_json
from oodviz.models import estimate_memory
from oodviz.pipeline import preflight
from oodviz.pipeline.batchprobe import ModelBatches, measure_for_run, sized
from oodviz.pipeline.classifier_check import check_classifier
from oodviz.pipeline.job import (
    SCORE_BATCH,
    Job,
    failed_detectors,
    finite_scores,
    fitted_detector,
    require_a_detector,
    start_job,
)
from oodviz.pipeline.layers import combine_layers, extract_layers_split, layer_views, record_layers
from oodviz.pipeline.model_passes import score_with_model
from oodviz.pipeline.reporter import Reporter, Stage
from oodviz.pipeline.scoring import save_run_detectors
from oodviz.pipeline.tuning import tune_detectors, tuned_choice
from oodviz.results.tables import (
    detectors_of,
    metrics_table,
    per_class_table,
    score_frame,
    write_table,
)
from oodviz.runs.rundir import RunDir


def _logged_params(det, choice: DetectorChoice) -> dict:
    """The parameters in force, less the model and the scratch bank directory the run chose itself."""
    return {k: v for k, v in det.get_params().items() if k != "model" and (k != "bank_dir" or k in choice.params)}


# -- the stages -------------------------------------------------------------------------------------
def load_model(job: Job) -> None:
    """The run's model. Reads ``config``; writes ``backbone``."""
    config = job.config
    with job.reporter.stage("load model") as stage:
        job.backbone = config.load_backbone()
        stage.note(f"{config.backbone}: D={job.backbone.feature_dim} features, C={job.backbone.num_classes} classes")


def load_data(job: Job) -> None:
    """Open every split's dataset (warn when a subsample left a class without an image:
    :func:`~oodviz.config.splits.empty_classes_warning`), then, before any extraction: refuse detector parameters the data's sizes
    rule out (knn ``k`` above the fit rows, vim ``dim`` >= D), warn when the ID classes are not the model's,
    refuse a run whose new feature stores would not fit on the disk, measure one batch of each model-based detector
    the pre-flight did not (:func:`oodviz.pipeline.batchprobe.measure_for_run`: their batch sizes come from it), and
    warn when a need is over the machine's limits (:mod:`oodviz.pipeline.preflight`; ``oodviz run`` refuses such a run
    before it starts, unless ``--force``).

    Reads ``config``, ``backbone``, ``model_batches``; writes ``datasets``, ``model_batches``."""

    config, backbone = job.config, job.backbone
    with job.reporter.stage("load data") as stage:
        for split, choice, as_ood in job.splits:
            job.datasets[split] = load_split(config, choice, as_ood, backbone.classes)
            warning = empty_classes_warning(split, job.datasets[split].sampling)
            if warning:
                job.reporter.warn(warning)
        problems = check_sizes(config, len(job.datasets["id_fit"]), backbone.feature_dim, backbone.num_classes)
        if problems:
            raise ConfigError(problems, CANNOT_START)
        # the pre-flight refused a model whose classes are not the ID labels: started with --force or "Run anyway"
        fit, test = job.datasets["id_fit"], job.datasets["id_test"]
        problem = check_classifier(backbone, fit, config.seed, [test.classes]).problem()
        if problem is not None:
            job.reporter.warn(problem)
        sizes = {split: len(ds) for split, ds in job.datasets.items()}
        estimate = estimate_memory(backbone, sizes, feature_dtype=config.feature_dtype)
        stage.note(estimate.describe())
        root = feature_store_root(job.run)
        layers = preflight.layer_estimates(  # a run over several layers: every layer's stores and fits
            config,
            backbone,
            sizes,
            lambda view: preflight.splits_to_extract(config, view, job.datasets, job.splits, root),
        )
        new = check_disk_space(job, estimate, layers)
        limits = preflight.machine_limits(root, job.device, preflight.disk_cap_bytes(config))
        batches = sized(measure_for_run(job, stage), limits)  # model-based detectors' batches, measured here
        report = preflight.assess(
            config, next(iter(layers.values()))[0] if layers else estimate, limits, new, layers, batches
        )
        if not report.fits:  # started anyway (--force, the app's "run anyway"): say what will not fit
            job.reporter.warn(report.message(), fixes=report.fixes)


def check_disk_space(job: Job, estimate, layers: dict | None = None) -> list[str]:
    """The splits whose main store is still to extract (reused ones cost nothing); raise
    :class:`~oodviz.engine.DiskFullError` when the free space under the feature store root is less than the
    pre-flight's disk need (:func:`oodviz.pipeline.preflight.store_disk_need`) of the new stores: ``estimate``'s
    (:func:`oodviz.models.estimate_memory`), or, for a run over several layers, every layer's (``layers``: layer ->
    ``(estimate, new splits)``, :func:`oodviz.pipeline.preflight.layer_estimates`)."""

    root = feature_store_root(job.run)
    if not layers:
        layers = {
            None: (estimate, preflight.splits_to_extract(job.config, job.backbone, job.datasets, job.splits, root))
        }
    message = check_free_space(root, preflight.store_disk_need(layers), margin_bytes=0)  # the pre-flight's number
    if message:
        raise DiskFullError(message)
    return next(iter(layers.values()))[1]


def extract_or_reuse_split(job: Job, split: str, choice: DatasetChoice, stage: Stage):
    """The feature store of one split, extracted by this process or reused (:func:`oodviz.engine.extract_or_reuse`)."""

    return extract_or_reuse(
        job.backbone,
        job.datasets[split],
        feature_store_root(job.run),
        key_params=store_key_params(job.config, choice),
        feature_dtype=job.config.feature_dtype,
        **job.model_pass_options(stage),
    )


def extract_splits(job: Job, open_split=None) -> None:
    """One stage per split: its feature store, extracted or reused (by ``open_split(job, split, choice, stage)``;
    a sharded run passes its own, :mod:`oodviz.pipeline.sharded`; by default every layer of a run over several
    layers in one pass, :mod:`oodviz.pipeline.layers`); the splits go into ``meta``, each with how it was sampled
    (:class:`~oodviz.sampling.Sampling`).

    Reads ``config``, ``backbone``, ``datasets``; writes ``stores``, ``layer_stores``, ``meta["splits"]``,
    ``meta["layers"]``."""
    if open_split is None:
        open_split = extract_layers_split if job.config.layers else extract_or_reuse_split
    for split, choice, _ in job.splits:
        with job.reporter.stage(f"extract {split}") as stage:
            store = open_split(job, split, choice, stage)
            job.stores[split] = store
            if store.reuse_warning:
                job.reporter.warn(f"{split}: {store.reuse_warning}")
            stage.note(f"{'reused' if store.reused else 'extracted'} store {store.key}: {store.n} samples")
            if store.meta.get("skipped"):
                job.reporter.warn(f"{split}: {store.meta['skipped']} unreadable image(s) skipped")
    job.meta["splits"] = {
        split: {
            "dataset": choice.result_name,
            "group": split_group(choice) if as_ood else None,
            "n": job.stores[split].n,
            "store": job.stores[split].key,
            "reused": job.stores[split].reused,
            "sampling": asdict(job.datasets[split].sampling),
        }
        for split, choice, as_ood in job.splits
    }
    if job.layer_stores:
        record_layers(job)


def fit_detectors(job: Job, fit_features=None) -> None:
    """One stage per detector (per detector and layer, :func:`oodviz.pipeline.layers.detector_columns`): fit it
    on the ID fit split (model-based ones only check the model), with the parameters tuning chose for that
    column (at that layer) when it was tuned.
    ``fit_features(job, detector, stage, layer)`` fits a feature-based one (default :func:`fit_on_store`).

    Reads ``config``, ``stores``, ``layer_stores``, ``tuning``; writes ``fitted``, ``detector_log``."""
    for column, choice, layer in detector_columns(job.config):
        choice = tuned_choice(job, choice, column)
        with job.reporter.stage(f"fit {column}") as stage, job.detector_may_fail(column, "fit", stage):
            started = time.perf_counter()
            job.fitted[column] = detector = fitted_detector(job, choice, stage, layer, fit_features)
            job.detector_log[column] = {
                "params": _logged_params(detector, choice),
                "fit_s": time.perf_counter() - started,
            }
            if column in job.tuning:
                job.detector_log[column]["tuning"] = job.tuning[column]
    require_a_detector(job)


def score_splits(job: Job) -> None:
    """Per scored split: a stage per model-based detector, then one that scores the features with
    the others and collects the split's scores table.

    Reads ``fitted``, ``stores``, ``layer_stores``, ``datasets`` (model-based detectors); writes ``frames`` and, for a
    detector that fails, ``detector_log``."""
    for split, kind, dataset in job.scored_splits:
        model_scores = score_with_models(job, split)
        job.frames.append(split_scores(job, split, kind, dataset, model_scores))


def score_with_models(job: Job, split: str) -> dict[str, np.ndarray]:
    """Scores of each model-based detector on ``split``, one stage each (``score <split> with <name>``)."""
    model_scores = {}
    for name, detector in list(job.fitted.items()):
        if not detector.needs_model:
            continue
        with (
            job.reporter.stage(f"score {split} with {name}") as stage,
            job.detector_may_fail(name, f"score {split}", stage),
        ):
            started = time.perf_counter()
            model_scores[name] = finite_scores(detector, name, split, score_with_model(job, detector, split, stage))
            log = job.detector_log[name]
            log["score_s"] = log.get("score_s", 0.0) + time.perf_counter() - started
    return model_scores


def split_scores(job: Job, split: str, kind: str, dataset: str, model_scores: dict) -> pd.DataFrame:
    """The scores table of ``split`` (stage ``score <split>``): every feature-based detector scores the
    split's store; model-based ones bring ``model_scores``."""
    store = job.stores[split]
    with job.reporter.stage(f"score {split}") as stage:
        frame = score_frame(kind, dataset, store.indices, store.labels, store.predictions)
        names = list(job.fitted)
        for done, name in enumerate(names, start=1):
            if name in model_scores:
                frame[name] = model_scores[name]
            else:
                with job.detector_may_fail(name, f"score {split}", stage):
                    fields = job.fitted[name].fields_to_read(fitting=False)
                    layer = split_column(name)[1]
                    batches = job.store_of(split, layer).batches(SCORE_BATCH, device=job.device, include=fields)
                    values = job.fitted[name].score(batches, device=job.device).numpy()
                    frame[name] = finite_scores(job.fitted[name], name, split, values)
            stage.progress(done, len(names), {})
    return frame


def save_detectors(job: Job) -> None:
    """``detectors/``: every fitted detector (per layer too, ``<detector>@<layer>``) and the backbone's identity,
    each layer's in a run over several layers (:func:`oodviz.pipeline.scoring.save_run_detectors`), for ``oodviz score``;
    a detector that cannot be saved keeps its results and says why in ``detectors.json``.

    Reads ``fitted``, ``backbone``; writes ``detectors/`` and ``detector_log`` (save errors)."""

    with job.reporter.stage("save detectors") as stage:
        views = layer_views(job) if job.config.layers else {}
        failed = save_run_detectors(job.run.path, job.backbone, job.fitted, job.run.scratch_path, views)
        for name, error in failed.items():
            job.detector_log[name]["save_error"] = error
            job.reporter.warn(f"{name} could not be saved (oodviz score will not have it): {error}")
        stage.note(f"saved {len(job.fitted) - len(failed)} detector(s) in {job.run.path.name}/detectors")


def write_scores(job: Job) -> None:
    """``scores.parquet`` (only the detectors that scored every split) and ``detectors.json``. Reads ``frames``,
    ``detector_log``; writes ``scores`` and the two files."""
    require_a_detector(job)
    scores = pd.concat(job.frames, ignore_index=True)
    partial = [name for name in detectors_of(scores) if "error" in job.detector_log.get(name, {})]
    job.scores = scores.drop(columns=partial)  # scored some splits, then failed: keep no partial column
    write_table(job.run.path / "scores.parquet", job.scores)
    write_json(job.run.path / "detectors.json", job.detector_log)


def write_metrics(job: Job) -> None:
    """``metrics.csv`` and ``per_class.csv`` from the scores (:mod:`oodviz.results.tables`). Reads ``scores``,
    ``backbone`` (class names); writes the two files."""
    with job.reporter.stage("metrics"):
        groups = {choice.result_name: split_group(choice) for choice in job.config.ood}
        backbone = job.backbone
        class_names = backbone.classes or [str(k) for k in range(backbone.num_classes)]
        write_table(job.run.path / "metrics.csv", metrics_table(job.scores, groups))
        write_table(job.run.path / "per_class.csv", per_class_table(job.scores, class_names))


def write_meta(job: Job) -> None:
    """``meta.json``. Reads ``meta`` and the reporter's stage summary; writes the file."""
    job.meta["stages"] = job.reporter.stage_summary()
    write_json(job.run.path / "meta.json", job.meta)


#: Each step of :data:`oodviz.config.plan.STEPS` by its name.
STEP_FUNCTIONS = {
    step.__name__: step
    for step in (
        load_model,
        load_data,
        extract_splits,
        tune_detectors,
        fit_detectors,
        score_splits,
        combine_layers,
        save_detectors,
        write_scores,
        write_metrics,
        write_meta,
    )
}
#: The stages in the order of :data:`oodviz.config.plan.STEPS`.
STAGES = tuple(STEP_FUNCTIONS[step] for step, _ in STEPS)


def run_pipeline(config: RunConfig, run: RunDir, reporter: Reporter, batch_peaks: list | None = None) -> list[str]:
    """Run every stage of :data:`STAGES` on ``config``'s job, writing its results into ``run``; returns
    the detectors that failed (:func:`failed_detectors`). RuntimeError when every detector failed.
    ``batch_peaks``: the pre-flight's :class:`~oodviz.pipeline.batchprobe.BatchPeak` (measured in this process)."""
    job = start_job(config, run, reporter)
    job.model_batches = ModelBatches(batch_peaks)
    for stage in STAGES:
        stage(job)
    return failed_detectors(job)
