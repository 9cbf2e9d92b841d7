"""Model-based scoring: stream a dataset's model inputs through a function on the job's device.

Detectors that run the classifier again (``odin``, ``mcd``) cannot work from the feature store;
they need the transformed images. :func:`score_inputs` reads the dataset exactly as
:func:`~oodviz.engine.extract` does (same DataLoader, same transform, same order, the same
unreadable items skipped), so its rows line up with the split's store, and hands each batch to
``score`` as ``Batch(inputs=x, labels=y)`` on the device::

    det = create("odin", model=backbone)
    result = score_inputs(lambda b: det.score(b, device="cuda"), backbone, dataset, device="cuda")
    result.scores          # CPU float32 [N], row i is dataset item result.indices[i]

What it shares with extraction (the same code): the DataLoader and its workers, the model held
on the device in eval mode for the whole pass and put back exactly as it was afterwards (also
after an error or a cancel), the CUDA out-of-memory back-off (halve the batch, retry the same
rows, keep the smaller size: the same scores as with that batch size from the start), progress
after every batch and ``should_cancel()`` before every batch. Unlike extraction it runs without
``torch.inference_mode`` (ODIN differentiates with respect to the inputs) and writes nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.engine.extract import (
    PRECISIONS,
    Backoff,
    Cancelled,
    Progress,
    _check_device,
    _check_options,
    _close_loader,
    make_loader,
    model_on_device,
    progress_info,
)


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
    num_workers: int = 0,
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
    :param device, batch_size, num_workers, precision: as for :func:`~oodviz.engine.extract`
        (``precision`` turns on autocast around ``score``)
    :param progress: ``progress(done, total, info)`` after every batch, ``info`` as in extraction
        (``stage="score"``)
    :param should_cancel: checked before every batch; True raises :class:`Cancelled`
    :param what: the activity named in the out-of-memory message
    :raises torch.cuda.OutOfMemoryError: when even one sample does not fit on the device
    """
    device = _check_device(device)
    _check_options(batch_size, num_workers, precision, "float32")
    total = len(dataset)
    if total == 0:
        raise ValueError(f"dataset {dataset.name!r} is empty; nothing to score (check its path and subsample)")
    started = time.perf_counter()
    done = skipped = 0
    backoff = Backoff(batch_size, device, f"{what} {getattr(backbone, 'name', 'the model')} inputs")
    scores, labels_out, indices_out = [], [], []

    def report(stage: str) -> None:
        if progress is not None:
            progress(done, total, progress_info(stage, done, started, backoff, skipped))

    autocast_dtype = PRECISIONS[precision]
    autocast = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    loader_iter = None
    try:
        with model_on_device(getattr(backbone, "model", None), device), autocast:
            loader = make_loader(dataset, getattr(backbone, "transform", None), batch_size, num_workers, device)
            loader_iter = iter(loader)
            for x, labels, indices, dropped in loader_iter:
                if should_cancel is not None and should_cancel():
                    raise Cancelled(f"{what} cancelled after {done} of {total} items")
                skipped += dropped
                done += dropped
                if x is not None:
                    x_device = x.to(device, non_blocking=True)
                    y_device = labels.to(device, non_blocking=True)

                    def submit(a: int, b: int) -> Tensor:
                        values = score(Batch(inputs=x_device[a:b], labels=y_device[a:b]))  # noqa: B023
                        values = torch.as_tensor(values).detach().float().cpu().reshape(-1)
                        if len(values) != b - a:
                            raise ValueError(
                                f"score returned {len(values)} values for a batch of {b - a} inputs; expected one per input"
                            )
                        return values

                    for start, stop, values in backoff.chunks(len(x), submit):
                        scores.append(values)
                        labels_out.append(labels[start:stop])
                        indices_out.append(indices[start:stop])
                        done += stop - start
                report("score")
            _close_loader(loader_iter)
            loader_iter = None
    finally:
        if loader_iter is not None:
            _close_loader(loader_iter)
    if not scores:
        raise ValueError(
            f"no readable items in dataset {dataset.name!r}: all {total} were unreadable (None); check the files"
        )
    report("done")
    return InputScores(
        scores=torch.cat(scores),
        labels=torch.cat(labels_out).numpy().astype(np.int64),
        indices=torch.cat(indices_out).numpy().astype(np.int64),
        skipped=skipped,
        batch_size_in_force=backoff.in_force,
        oom_backoffs=backoff.backoffs,
        elapsed_s=time.perf_counter() - started,
    )
