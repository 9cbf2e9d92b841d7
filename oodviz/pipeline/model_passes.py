"""The passes of a run that stream a split's images through the backbone for a model-based detector.

Detectors that run the model again (``needs_model``) read no feature store: :func:`fit_on_inputs`
fits those that learn from in-distribution inputs (adascale, gram) on the ID fit split's images, and
:func:`score_with_model` scores a split's images, both through :func:`oodviz.engine.score_inputs`
(batching, OOM back-off, progress, cancel) with the job's device and loader settings
(``Job.model_pass_options``) and the detector's own batch size: from its measured peak and the memory available
when it first runs (``Job.model_batches``, :class:`oodviz.pipeline.batchprobe.ModelBatches`), recorded with the
batch size in force after any out-of-memory back-off under ``batch`` in ``detectors.json``.
:mod:`oodviz.pipeline.stages` calls them from its fit and score stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from oodviz.engine import score_inputs
from oodviz.pipeline.reporter import Stage

if TYPE_CHECKING:
    from oodviz.pipeline.job import Job


def pass_options(job: Job, detector, stage: Stage) -> dict:
    """``Job.model_pass_options`` with ``detector``'s own batch size (noted on ``stage`` the first time)."""
    first = detector.name not in job.model_batches.records
    rows = job.model_batches.rows(detector, job.config.batch_size, job.device)
    record = job.model_batches.records[detector.name]
    if first:
        how = "from its measured peak and the memory available" if record["measured"] else record["why"]
        stage.note(f"{detector.name}: {rows:,} rows at once ({how}; the run's batch size is {job.config.batch_size:,})")
    return {**job.model_pass_options(stage), "batch_size": rows}


def ran(job: Job, detector, result) -> None:
    """Record the batch size in force after ``result``'s pass (``detectors.json``'s ``batch``)."""
    job.model_batches.ran(detector.name, result.batch_size_in_force, result.oom_backoffs)
    if detector.name in job.detector_log:
        job.detector_log[detector.name]["batch"] = job.model_batches.records[detector.name]


def fit_on_inputs(job: Job, detector, stage: Stage) -> None:
    """Fit a model-based detector that learns from ID inputs (adascale, gram; see
    :mod:`oodviz.detectors.model_fit`): one batched pass of the ID fit split's images per fit pass."""

    head = job.backbone.head
    detector.fit_begin(None if head is None else tuple(t.detach().float().to(job.device) for t in head))
    for pass_index in range(detector.fit_passes):
        result = score_inputs(
            detector.fit_step,
            job.backbone,
            job.datasets["id_fit"],
            what=f"fitting {detector.name} on",
            **pass_options(job, detector, stage),
        )
        ran(job, detector, result)
        detector.end_pass(pass_index, result.scores)


def score_with_model(job: Job, detector, split: str, stage: Stage) -> np.ndarray:
    """Scores ``[N]`` of a model-based detector on one split, aligned with the split's store rows."""

    store = job.stores[split]
    result = score_inputs(
        lambda batch: detector.score(batch, device=job.device),
        job.backbone,
        job.datasets[split],
        what=f"scoring {detector.name} on",
        **pass_options(job, detector, stage),
    )
    ran(job, detector, result)
    if not np.array_equal(result.indices, np.asarray(store.indices)):
        raise ValueError(
            f"the dataset gave other items ({len(result.indices)} rows) than when its features were extracted "
            f"({store.n} rows, store {store.key}); delete that store and run again"
        )
    if result.oom_backoffs:
        stage.note(f"out of memory: batch size reduced to {result.batch_size_in_force}")
    return result.scores.numpy()
