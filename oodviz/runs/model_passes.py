"""The passes of a run that stream a split's images through the backbone for a model-based detector.

Detectors that run the model again (``needs_model``) read no feature store: :func:`fit_on_inputs`
fits those that learn from in-distribution inputs (adascale, gram) on the ID fit split's images, and
:func:`score_with_model` scores a split's images, both through :func:`oodviz.engine.score_inputs`
(batching, OOM back-off, progress, cancel) with the job's device and loader settings
(``Job.model_pass_options``). :mod:`oodviz.runs.pipeline` calls them from its fit and score stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from oodviz.runs.reporter import Stage

if TYPE_CHECKING:
    from oodviz.runs.pipeline import Job


def fit_on_inputs(job: Job, detector, stage: Stage) -> None:
    """Fit a model-based detector that learns from ID inputs (adascale, gram; see
    :mod:`oodviz.detectors.model_fit`): one batched pass of the ID fit split's images per fit pass."""
    from oodviz.engine import score_inputs

    head = job.backbone.head
    detector.fit_begin(None if head is None else tuple(t.detach().float().to(job.device) for t in head))
    for pass_index in range(detector.fit_passes):
        result = score_inputs(
            detector.fit_step,
            job.backbone,
            job.datasets["id_fit"],
            what=f"fitting {detector.name} on",
            **job.model_pass_options(stage),
        )
        detector.end_pass(pass_index, result.scores)


def score_with_model(job: Job, detector, split: str, stage: Stage) -> np.ndarray:
    """Scores ``[N]`` of a model-based detector on one split, aligned with the split's store rows."""
    from oodviz.engine import score_inputs

    store = job.stores[split]
    result = score_inputs(
        lambda batch: detector.score(batch, device=job.device),
        job.backbone,
        job.datasets[split],
        what=f"scoring {detector.name} on",
        **job.model_pass_options(stage),
    )
    if not np.array_equal(result.indices, np.asarray(store.indices)):
        raise ValueError(
            f"the dataset gave other items ({len(result.indices)} rows) than when its features were extracted "
            f"({store.n} rows, store {store.key}); delete that store and run again"
        )
    if result.oom_backoffs:
        stage.note(f"out of memory: batch size reduced to {result.batch_size_in_force}")
    return result.scores.numpy()
