"""Model-based scoring: stream a dataset's model inputs through a function on the job's device.

Detectors that run the classifier again (``odin``, ``mcd``) cannot work from the feature store;
they need the transformed images. :func:`score_inputs` reads the dataset exactly as
:func:`~oodviz.engine.extract` does (same DataLoader, same transform, same order, the same
unreadable items skipped), so its rows line up with the split's store, and hands each batch to
``score`` as ``Batch(inputs=x, labels=y)`` on the device::

    det = create("odin", model=backbone)
    result = score_inputs(lambda b: det.score(b, device="cuda"), backbone, dataset, device="cuda")
    result.scores          # CPU float32 [N], row i is dataset item result.indices[i]

What it shares with extraction (the same code, :class:`~oodviz.engine.batched.BatchedPass`): the
DataLoader and its workers, the model held on the device in eval mode for the whole pass and put
back exactly as it was afterwards (also after an error or a cancel), the CUDA out-of-memory back-off (halve the batch, retry the same
rows, keep the smaller size: the same scores as with that batch size from the start), progress
after every batch and ``should_cancel()`` before every batch. Unlike extraction it runs without
``torch.inference_mode`` (ODIN differentiates with respect to the inputs) and writes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.engine.batched import BatchedPass, Progress
from oodviz.models.placement import parse_device


@dataclass
class InputScores:
    """What :func:`score_inputs` returns: one value per readable dataset item, in dataset order."""

    scores: Tensor  # [N] float32, CPU
    labels: np.ndarray  # [N] int64
    indices: np.ndarray  # [N] int64 source index of each row (as in the store)
    skipped: int  # unreadable items left out
    batch_size_in_force: int
    oom_backoffs: int
    elapsed_s: float


def score_inputs(
    score: Callable[[Batch], Tensor],
    backbone,
    dataset,
    *,
    device="cpu",
    batch_size: int = 256,
    num_workers: int | str = 0,
    precision: str = "fp32",
    progress: Progress | None = None,
    should_cancel: Callable[[], bool] | None = None,
    what: str = "scoring",
) -> InputScores:
    """``score(Batch(inputs=x, labels=y))`` for every batch of ``dataset`` transformed by ``backbone.transform``.

    :param score: maps a batch on ``device`` (``inputs`` ``[b, ...]``, ``labels`` ``[b]``) to ``b``
        values, e.g. ``lambda batch: detector.score(batch, device=device)``
    :param backbone: has ``model`` (moved to ``device`` for the pass and restored afterwards),
        ``transform`` and ``name``; the same object the split was extracted with
    :param dataset: as for :func:`~oodviz.engine.extract`
    :param device: as for :func:`~oodviz.engine.extract`
    :param batch_size: as for :func:`~oodviz.engine.extract`
    :param num_workers: as for :func:`~oodviz.engine.extract`
    :param precision: as for :func:`~oodviz.engine.extract` (it turns on autocast around ``score``)
    :param progress: ``progress(done, total, info)`` after every batch, ``info`` as in extraction
        (``stage="score"``)
    :param should_cancel: checked before every batch; True raises :class:`~oodviz.engine.Cancelled`
    :param what: the activity named in the out-of-memory and cancel messages
    :raises torch.cuda.OutOfMemoryError: when even one sample does not fit on the device
    """
    device = parse_device(device)
    batched = BatchedPass(
        backbone,
        dataset,
        device=device,
        batch_size=batch_size,
        num_workers=num_workers,
        precision=precision,
        activity=f"{what} {getattr(backbone, 'name', 'the model')} inputs",
        stage="score",
        progress=progress,
        should_cancel=should_cancel,
    )
    scores, labels_out, indices_out = [], [], []

    def submit(x: Tensor, labels: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        inputs = Batch(inputs=x.to(device, non_blocking=True), labels=labels.to(device, non_blocking=True))
        values = torch.as_tensor(score(inputs)).detach().float().cpu().reshape(-1)
        if len(values) != len(x):
            raise ValueError(
                f"score returned {len(values)} values for a batch of {len(x)} inputs; expected one per input"
            )
        return values, labels, indices

    def collect(result: tuple[Tensor, Tensor, Tensor]) -> None:
        values, labels, indices = result
        scores.append(values)
        labels_out.append(labels)
        indices_out.append(indices)

    with batched:
        batched.run(submit, collect)
    batched.report("done")
    return InputScores(
        scores=torch.cat(scores),
        labels=torch.cat(labels_out).numpy().astype(np.int64),
        indices=torch.cat(indices_out).numpy().astype(np.int64),
        skipped=batched.skipped,
        batch_size_in_force=batched.backoff.in_force,
        oom_backoffs=batched.backoff.backoffs,
        elapsed_s=time.perf_counter() - batched.started,
    )
