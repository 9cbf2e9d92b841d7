"""A run on several processes (torch.distributed): sharded extraction and scoring, results written by rank 0.

Started by torch's elastic launcher, each process runs ``python -m oodviz.pipeline.worker RUN_DIR`` with
``RANK``/``WORLD_SIZE`` set (``oodviz run CONFIG --nproc-per-node N``, :mod:`oodviz.runs.launch`, or
``torchrun ... -m oodviz.pipeline.worker RUN_DIR``); :func:`run_rank` does one rank's share:

- **Run directory.** Rank 0 owns ``status.json``, the events log and the results. Every other rank sees the
  run through :class:`RankRunDir`: it writes no status, and its events (stage ends with its wall time and
  peak memory, progress with its device and batch size, warnings, its failure) go to the same log tagged
  ``{"event": "rank", "rank": r, "kind": <the event>}``. Each rank keeps its files under ``scratch/rank-<r>``.
- **Extraction.** Rank 0 looks for a trusted store of the split (the single-process key, checksums checked);
  when there is none, rank ``r`` of ``W`` extracts rows :func:`~oodviz.pipeline.distributed.shard_bounds` of the split
  (contiguous, disjoint, in rank order) into a shard under its scratch directory, and rank 0 concatenates the
  shards in rank order into the split's store (:func:`merge_shards`): the same key, the same rows in the same
  order as a single-process extraction, so either reuses the other's store whatever the world size. A rank
  that dies leaves shards in scratch only; the split's store is written only once every shard is complete.
  A run over several layers (``layers = [...]``, :mod:`oodviz.pipeline.layers`) does the same per layer: each rank
  extracts its rows of every layer whose store is missing in one forward pass, rank 0 merges each layer's
  shards into that layer's store (the key and rows of a single-process run's).
- **Fit.** A mergeable detector (the state protocol, :mod:`oodviz.detectors.protocol`: mahalanobis, rmd, klm,
  she, gmm, vim, react, vra, dice, fdbd, nci, tempscale, openmax, weiper) is fitted split: each rank updates on its
  contiguous rows of ``id_fit``, the float64 states are gathered and merged in rank order on every rank, and
  every rank finalizes the same state, pass after pass (:func:`~oodviz.pipeline.distributed.fit_across_ranks`). knn and
  nnguide keep this rank's rows as their bank shard (:func:`~oodviz.pipeline.distributed.fit_bank_across_ranks`). Every
  other detector is fitted by every rank on the whole store (a read of the memory-mapped store; the same
  float64 stream on every rank, so every rank holds the same state). Over several layers: per detector and
  layer (``<detector>@<layer>``), on that layer's store, as a single-process run fits them.
- **Scoring.** Each rank scores its contiguous rows of each split with the feature-based detectors; rank 0
  gathers the scores in rank order and writes them. A detector holding a bank shard searches every row of
  the split against its shard and rank 0 merges the top-``k`` lists exactly
  (:func:`~oodviz.pipeline.distributed.search_across_ranks`). Model-based detectors (odin, mcd) run on rank 0 over the
  whole split (mcd's dropout masks follow the batch sequence, so a shard would change them). Rank 0 then adds
  ``mahalanobis@combined`` (:func:`~oodviz.pipeline.layers.combine_layers`, on the stores every rank shares).
- **Saved detectors.** Rank 0 saves every detector that scored (its state is every rank's) under
  ``<run>/detectors/`` as a single-process run does, for ``oodviz score``; knn and nnguide are refitted on the
  whole store first, so that the saved one searches the whole bank.
- **Faults.** A rank that raises records why (its ``rank`` event) and exits non-zero; the launcher then stops
  the others, and rank 0, stopped by SIGTERM, marks the run failed naming that rank. A hang in a collective
  ends after ``OODVIZ_DIST_TIMEOUT_S``. Cancel (the run's ``cancel`` file) stops every rank at its next batch.
"""

from __future__ import annotations

import os
import shutil
import signal
from functools import partial
from pathlib import Path

import numpy as np
import torch

from oodviz.batch import Batch
from oodviz.columns import split_column
from oodviz.config.plan import STEPS
from oodviz.config.splits import feature_store_root
from oodviz.config.tuning import VALIDATION_SPLITS
from oodviz.detectors.knn import KNN
from oodviz.engine import Cancelled, extract
from oodviz.engine.extraction import trusted_store
from oodviz.engine.layers import extract_layers_or_reuse
from oodviz.engine.store import FeatureStore, StoreWriter, key_spec, store_key
from oodviz.pipeline.distributed import (
    DatasetSlice,
    World,
    barrier,
    broadcast_from_root,
    fit_across_ranks,
    fit_bank_across_ranks,
    gather_to_root,
    join_world,
    leave_world,
    rank_device,
    search_across_ranks,
    shard_bounds,
)
from oodviz.pipeline.job import SCORE_BATCH, Job, Watched, failed_detectors, finite_scores, fit_on_store, start_job
from oodviz.pipeline.layers import combine_layers, keep_layer_stores, layer_views
from oodviz.pipeline.stages import (
    STEP_FUNCTIONS,
    extract_splits,
    fit_detectors,
    save_detectors,
    score_with_models,
    store_key_params,
    write_meta,
    write_metrics,
    write_scores,
)
from oodviz.pipeline.tuning import tune_detectors, validation_scores
from oodviz.results.metrics import ood_metrics
from oodviz.results.tables import score_frame
from oodviz.runs.launch import rank_failure
from oodviz.runs.rundir import RunDir

MERGE_ROWS = 16384  # rows copied per step when shards are concatenated


class RankFailed(RuntimeError):
    """Rank 0 was stopped by the launcher (SIGTERM) because another rank failed."""


class RankRunDir(RunDir):
    """The run directory as rank ``rank`` sees it: scratch under ``scratch/rank-<r>``; ranks other than 0 write no
    status and tag their events ``{"event": "rank", "rank": r, "pid": ..., "kind": ...}`` (rank 0's are the run's own)."""

    def __init__(self, path: Path, rank: int):
        super().__init__(Path(path))
        self.rank = rank

    @property
    def scratch_path(self) -> Path:
        return self.path / "scratch" / f"rank-{self.rank}"

    def write_status(self, only_if=None, **changes) -> dict:
        if self.rank == 0:
            return super().write_status(only_if, **changes)
        return self.read_status()

    def append_event(self, event: dict) -> None:
        if self.rank == 0:
            super().append_event(event)
        else:
            tag = {"event": "rank", "rank": self.rank, "pid": os.getpid(), "kind": event.get("event")}
            super().append_event({**event, **tag})


def stop_on_sigterm(run: RunDir) -> None:
    """On rank 0: turn the launcher's SIGTERM into :class:`RankFailed` (the run then ends ``failed`` with why)."""

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        raise RankFailed(rank_failure(run))

    signal.signal(signal.SIGTERM, handler)


# -- extraction ------------------------------------------------------------------------------------------
def merge_shards(shards: list, root: Path, key: str, spec: dict):
    """Concatenate shard stores (in rank order) into the store ``<root>/<key>``; returns it opened.

    The rows are copied as they are (features, logits, labels, predictions, source indices), so the store is
    the one a single process extracts; ``meta.json`` adds ``world_size`` and each shard's rows, device, batch
    size and time. ``spec`` is the single-process :func:`~oodviz.engine.store.key_spec` of the split."""

    first = shards[0]
    total = sum(s.n for s in shards)
    writer = StoreWriter(root, key, total, first.feature_dim, first.num_classes, first.feature_dtype)
    try:
        for shard in shards:
            for start in range(0, shard.n, MERGE_ROWS):
                rows = slice(start, start + MERGE_ROWS)
                writer.append(
                    shard.features[rows], shard.logits[rows], shard.labels[rows], shard.indices[rows],
                    shard.predictions[rows],
                )  # fmt: skip
        counts = {name: sum(s.meta["counts"][name] for s in shards) for name in first.meta["counts"]}
        counts["requested"] = spec["dataset"]["len"]
        elapsed = max(s.meta["timings"]["extract_s"] for s in shards)
        meta = {
            **first.meta,
            "key_spec": spec,
            "params": spec["params"],
            "dataset": {**first.meta["dataset"], "len": spec["dataset"]["len"]},
            "counts": counts,
            "skipped": counts["skipped"],
            "timings": {"extract_s": elapsed, "items_per_s": total / elapsed if elapsed > 0 else None},
            "world_size": len(shards),
            "shards": [
                {k: s.meta.get(k) for k in ("device", "device_name", "batch_size_in_force", "oom_backoffs")}
                | {"rows": s.n, "extract_s": s.meta["timings"]["extract_s"]}
                for s in shards
            ],
        }
        return writer.commit(meta, head=first.head)
    finally:
        writer.abort()  # no-op after the commit


def sharded_stores(job: Job, split: str, choice, stage, world: World, views: dict) -> dict:
    """Layer -> the store of ``split`` at that layer (``views``: layer -> Backbone view of the run's model, as
    :func:`oodviz.pipeline.layers.layer_views` makes them; ``{None: backbone}`` for a one-layer run): each reused
    when rank 0 trusts it, the others extracted in shards (every missing layer in one forward pass, as a single
    process does, :func:`oodviz.engine.layers.extract_layers_or_reuse`) and merged per layer by rank 0."""

    config, dataset = job.config, job.datasets[split]
    root = feature_store_root(job.run)
    key_params = store_key_params(config, choice)
    content = {"feature_dtype": config.feature_dtype, "precision": config.precision}
    keys = {layer: store_key(view, dataset, key_params, **content) for layer, view in views.items()}
    found = None
    if world.is_root:
        found = {layer: trusted_store(root, key, "cheap") for layer, key in keys.items()}
        found = {layer: (store is not None, warning) for layer, (store, warning) in found.items()}
    found = broadcast_from_root(found, world)
    missing = [layer for layer in views if not found[layer][0]]
    if missing:
        start, stop = shard_bounds(len(dataset), world.rank, world.size)
        stage.note(f"rank {world.rank} of {world.size}: rows {start}..{stop - 1} of {len(dataset)}")
        shard_root = job.run.scratch_path / "shards" / keys[missing[0]]
        shards = None
        if stop > start or not len(dataset):  # an empty split: extract's own error, on every rank
            part, shard_params = DatasetSlice(dataset, start, stop), {**key_params, "shard": [start, stop]}
            options = {**job.model_pass_options(stage), "feature_dtype": config.feature_dtype}
            options["sync"] = False  # a shard lives until the merge; the merged store is synced
            if job.config.layers:  # every missing layer in one forward pass, as extract_layers_split does
                shards = extract_layers_or_reuse({layer: views[layer] for layer in missing}, part, shard_root,
                                                 shard_params, **options)  # fmt: skip
            else:
                shards = {None: extract(job.backbone, part, shard_root, shard_params, **options)}
            shards = {layer: str(store.path) for layer, store in shards.items()}
        paths = gather_to_root(shards, world)
        if world.is_root:
            for layer in missing:
                parts = [FeatureStore(p[layer]) for p in paths if p is not None]
                merge_shards(parts, root, keys[layer], key_spec(views[layer], dataset, key_params, **content))
        barrier(world)
        shutil.rmtree(shard_root, ignore_errors=True)
    stores = {}
    for layer, key in keys.items():
        stores[layer] = store = FeatureStore(Path(root) / key)
        store.reused, store.reuse_warning = found[layer]
    if not missing:
        store = next(iter(stores.values()))
        stage.progress(store.n, store.n, {"stage": "reused", "batch_size": store.meta.get("batch_size_in_force")})
    return stores


def sharded_split(job: Job, split: str, choice, stage, world: World):
    """The store of ``split`` (:func:`sharded_stores`); in a run over several layers, the first layer's, the others
    in ``job.layer_stores[split]`` (:func:`oodviz.pipeline.layers.keep_layer_stores`)."""
    if not job.config.layers:
        return sharded_stores(job, split, choice, stage, world, {None: job.backbone})[None]
    return keep_layer_stores(job, split, sharded_stores(job, split, choice, stage, world, layer_views(job)))


# -- scoring ---------------------------------------------------------------------------------------------
def store_rows(store, start: int, stop: int, device: torch.device):
    """Batches of rows ``[start, stop)`` of ``store`` (features and logits float32, labels), on ``device``."""
    for first in range(start, stop, SCORE_BATCH):
        rows = slice(first, min(first + SCORE_BATCH, stop))
        yield Batch(
            features=torch.from_numpy(np.array(store.features[rows], dtype=np.float32)),
            logits=torch.from_numpy(np.array(store.logits[rows])),
            labels=torch.from_numpy(np.array(store.labels[rows])),
        ).to(device)


class ShardRows:
    """Rows ``[start, stop)`` of ``store`` as a re-iterable of batches (:func:`store_rows`): a two-pass fit reads
    them again."""

    def __init__(self, store, start: int, stop: int, device: torch.device):
        self.store, self.start, self.stop, self.device = store, start, stop, device
        self.n = stop - start

    def __iter__(self):
        return store_rows(self.store, self.start, self.stop, self.device)

    @property
    def features_on_disk(self) -> np.ndarray:
        """The rows' features as a read-only memory map of the store (knn keeps it as its bank shard, no copy)."""
        return self.store.features[self.start : self.stop]


def fit_sharded(job: Job, detector, stage, layer: str | None, world: World) -> None:
    """A mergeable detector: fitted on this rank's rows of ``id_fit``, merged across the ranks; knn and nnguide:
    this rank's rows are its bank shard (when every rank has rows); any other: on the whole store, by every rank.
    ``layer``: the layer of a run over several layers (its own store and head), None for the run's main store."""
    store = job.store_of("id_fit", layer)
    bank = isinstance(detector, KNN) and store.n >= world.size
    if not (world.distributed and (detector.mergeable or bank)):
        fit_on_store(job, detector, stage, layer)
        return
    start, stop = shard_bounds(store.n, world.rank, world.size)
    what = "its bank shard" if bank else "updates on"
    stage.note(f"fit split: rank {world.rank} of {world.size}: {what} rows {start}..{stop - 1} of {store.n}")
    rows = Watched(ShardRows(store, start, stop, job.device), stage)
    fit = fit_bank_across_ranks if bank else fit_across_ranks
    fit(detector, rows, world, head=job.head_of("id_fit", layer), device=job.device)


def holds_bank_shard(detector) -> bool:
    return isinstance(detector, KNN) and detector.holds_shard


def scores_on_root(job: Job, detector, split: str, stage, world: World, layer: str | None = None) -> np.ndarray | None:
    """The scores of every row of ``split`` (its store at ``layer``, None: the main one) on rank 0 (None on the
    others), checked finite; rank 0 raises when any rank failed, the others never do (they send their error), so
    every rank goes through the same collectives.

    A feature-based detector: each rank scores its contiguous rows, rank 0 gathers them in rank order; one holding
    a bank shard: every rank searches every row against its shard, rank 0 merges the top-``k`` lists
    (:func:`~oodviz.pipeline.distributed.search_across_ranks`); a model-based one: rank 0 alone, on the split's images."""
    store = job.store_of(split, layer)
    if detector.needs_model:
        return validation_scores(job, detector, split, stage) if world.is_root else None
    if holds_bank_shard(detector):
        values = search_across_ranks(detector, store_rows(store, 0, store.n, job.device), world, job.device)
        values = None if values is None else values.numpy()
    else:
        start, stop = shard_bounds(store.n, world.rank, world.size)
        try:
            rows = store_rows(store, start, stop, job.device)
            mine = detector.score(rows, device=job.device).numpy() if stop > start else np.zeros(0, np.float32)
        except Cancelled:
            raise
        except Exception as error:  # told to rank 0
            mine = f"rank {world.rank}: {type(error).__name__}: {error}"
        parts = gather_to_root(mine, world)
        values = None
        if world.is_root:
            failed = [part for part in parts if isinstance(part, str)]
            if failed:
                raise RuntimeError("; ".join(failed))
            values = np.concatenate(parts)
    return None if values is None else finite_scores(detector, detector.name, split, values)


def score_sharded_splits(job: Job, world: World) -> None:
    """Per scored split: model-based detectors on rank 0, then every other detector by :func:`scores_on_root`;
    rank 0 writes the split's scores table. Every rank then drops the detectors that failed anywhere."""

    for split, kind, dataset in job.scored_splits:
        model_scores = score_with_models(job, split) if world.is_root else {}
        with job.reporter.stage(f"score {split}") as stage:
            store, frame = job.stores[split], None
            if world.is_root:
                frame = score_frame(kind, dataset, store.indices, store.labels, store.predictions)
            for name, detector in list(job.fitted.items()):
                if name in model_scores:
                    frame[name] = model_scores[name]
                elif detector.needs_model:
                    continue
                elif world.is_root:
                    with job.detector_may_fail(name, f"score {split}", stage):
                        frame[name] = scores_on_root(job, detector, split, stage, world, split_column(name)[1])
                else:
                    scores_on_root(job, detector, split, stage, world, split_column(name)[1])
            if world.is_root:
                job.frames.append(frame)
            kept = broadcast_from_root(list(job.fitted), world)
            job.fitted = {name: det for name, det in job.fitted.items() if name in kept}


def validation_auroc_across_ranks(job: Job, detector, stage, world: World, layer: str | None = None) -> float:
    """Tuning's AUROC of a fitted detector on the validation splits (at ``layer``), scored as the test splits are
    (:func:`scores_on_root`): rank 0's AUROC on every rank, or its error as a ValueError on every rank."""

    scores, outcome = [], None
    for split, _, _ in VALIDATION_SPLITS:
        try:
            scores.append(scores_on_root(job, detector, split, stage, world, layer))
        except Cancelled:
            raise
        except Exception as error:  # rank 0 only; its message goes to every rank
            outcome = outcome or f"{type(error).__name__}: {error}"
    if world.is_root and outcome is None:
        try:
            outcome = float(ood_metrics(*scores)["auroc"])
        except Exception as error:
            outcome = f"{type(error).__name__}: {error}"
    outcome = broadcast_from_root(outcome, world)
    if isinstance(outcome, str):
        raise ValueError(outcome)
    return outcome


def save_whole_banks(job: Job) -> None:
    """Rank 0's :func:`~oodviz.pipeline.stages.save_detectors`, after refitting each detector that holds a bank shard on
    the whole ID fit store of its layer (a saved knn must search the whole bank: knn's is then the store itself,
    nnguide's is written in rank 0's scratch)."""
    for name, detector in job.fitted.items():
        if holds_bank_shard(detector):
            with job.reporter.stage(f"fit {name} on the whole bank (to save it)") as stage:
                fit_on_store(job, detector, stage, split_column(name)[1])
    save_detectors(job)


# -- the run ---------------------------------------------------------------------------------------------
def on_root(stage, world: World):
    def run(job: Job) -> None:
        if world.is_root:
            stage(job)

    run.__name__ = stage.__name__
    return run


def sharded_stages(world: World) -> tuple:
    """The stages of one rank, in the order of :data:`oodviz.config.plan.STEPS`: the single-process ones
    (:data:`oodviz.pipeline.stages.STEP_FUNCTIONS`) with extraction, tuning, fitting and scoring split over the
    ranks and the writing steps on rank 0."""
    fit = partial(fit_sharded, world=world)
    steps = {
        **STEP_FUNCTIONS,
        "extract_splits": partial(extract_splits, open_split=partial(sharded_split, world=world)),
        "tune_detectors": partial(
            tune_detectors, fit_features=fit, auroc_of=partial(validation_auroc_across_ranks, world=world)
        ),
        "fit_detectors": partial(fit_detectors, fit_features=fit),
        "score_splits": partial(score_sharded_splits, world=world),
        "combine_layers": on_root(combine_layers, world),
        "save_detectors": on_root(save_whole_banks, world),
        "write_scores": on_root(write_scores, world),
        "write_metrics": on_root(write_metrics, world),
        "write_meta": on_root(write_meta, world),
    }
    return tuple(steps[step] for step, _ in STEPS)


def run_rank(world: World):
    """The pipeline of one rank, as :func:`oodviz.pipeline.worker.execute` takes it: ``(config, run, reporter) ->
    failed detectors``. It joins the process group on the rank's device and leaves it at the end."""

    def pipeline(config, run, reporter) -> list[str]:
        job = start_job(config, run, reporter)
        job.device = reporter.device = rank_device(job.device, world)
        job.meta.update(device=str(job.device), world_size=world.size)
        join_world(world, job.device)
        try:
            for stage in sharded_stages(world):
                stage(job)
            barrier(world)  # nobody leaves (and tears the group down) before rank 0 has written the results
        except Exception as error:
            if run.cancel_requested():  # a peer that stopped for the cancel breaks this rank's collective
                raise Cancelled("cancelled by the user") from error
            raise
        finally:
            leave_world()
        return failed_detectors(job)

    return pipeline
