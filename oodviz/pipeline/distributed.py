"""torch.distributed for oodviz runs: the process group, contiguous shards and exact merges.

A run on several processes (``oodviz run CONFIG --nproc-per-node N`` or ``torchrun ... -m
oodviz.pipeline.worker RUN_DIR``) gets its rank, world size and local rank from the environment that
torch's elastic launcher sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``).

- :class:`World`: who this process is; :func:`join_world` starts the process group (NCCL when the run's
  device is a GPU, each local rank on ``cuda:LOCAL_RANK``; gloo on the CPU) with a collective timeout
  (``OODVIZ_DIST_TIMEOUT_S``, default 1800 s) so that a hang in a collective ends the run instead of
  blocking it forever.
- :func:`shard_bounds`: rank ``r`` of ``W`` owns rows ``[start, stop)`` of ``n`` — contiguous, disjoint,
  covering ``0..n-1`` in rank order, sizes differing by at most one (no padding, no duplicate).
- :class:`DatasetSlice`: those rows of a dataset, with their source indices kept, so that the shards
  concatenated in rank order are exactly the rows, in the order, a single process extracts.
- :func:`gather_to_root` / :func:`broadcast_from_root`: Python objects (numpy arrays, dicts) to rank 0
  and from it, through ``torch.distributed``'s object collectives.
- :func:`fit_across_ranks`: the fit of a mergeable detector (:mod:`oodviz.detectors.protocol`) split over the
  ranks: each updates on its rows, the states are gathered and merged in rank order on every rank, and every
  rank finalizes the same state (once per fit pass).
- :func:`fit_bank_across_ranks` / :func:`search_across_ranks`: knn and nnguide with the bank split over the
  ranks (each keeps its rows of the fit split as its bank shard and searches it; rank 0 merges the top-``k``
  lists exactly, :mod:`oodviz.detectors.knn`).
- :func:`merge_across_ranks`: the exact merge of a streaming statistic that each rank updated on its own
  shard (:class:`~oodviz.detectors.stats.ClassMoments`, :class:`~oodviz.detectors.stats.ClassMeans`: float64
  shifted sums, Chan-style), the same on every rank: the building block of a fit split across processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from oodviz.detectors.protocol import load_merged, on_device

DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class World:
    """This process's place in a run: ``rank`` of ``size`` processes, ``local_rank`` on its machine."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_root(self) -> bool:
        """Rank 0: owns the run directory, its status and its events log, and writes the results."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def from_env(cls, environ=None) -> World:
        """The world torchrun describes in ``environ`` (default ``os.environ``); one process when it says nothing.

        ValueError when the variables are not integers or the rank is outside ``0..WORLD_SIZE-1``."""
        env = os.environ if environ is None else environ
        try:
            rank, size = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
            local_rank = int(env.get("LOCAL_RANK", rank))
        except ValueError:
            raise ValueError(
                "RANK, WORLD_SIZE and LOCAL_RANK must be integers (torchrun sets them); "
                f"got RANK={env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r}, LOCAL_RANK={env.get('LOCAL_RANK')!r}"
            ) from None
        if size < 1 or not 0 <= rank < size or local_rank < 0:
            raise ValueError(f"RANK={rank} must be in 0..WORLD_SIZE-1 with WORLD_SIZE={size} >= 1; start with torchrun")
        return cls(rank, size, local_rank)


def collective_timeout_s(environ=None) -> float:
    """Seconds a collective may wait for the other ranks (``OODVIZ_DIST_TIMEOUT_S``, default 1800)."""
    raw = (os.environ if environ is None else environ).get("OODVIZ_DIST_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"OODVIZ_DIST_TIMEOUT_S must be a positive number of seconds, got {raw!r}")
    return value


def rank_device(device: torch.device, world: World) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` when the run is on a GPU (one GPU per process), else ``device``."""
    if device.type != "cuda" or not world.distributed:
        return device
    if world.local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"local rank {world.local_rank} has no GPU: {torch.cuda.device_count()} visible on this machine; "
            "start at most that many processes per node (--nproc-per-node)"
        )
    return torch.device("cuda", world.local_rank)


def join_world(world: World, device: torch.device) -> None:
    """Start the default process group: NCCL for a GPU run, gloo for a CPU one. Nothing for one process."""
    if not world.distributed or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        rank=world.rank,
        world_size=world.size,
        timeout=timedelta(seconds=collective_timeout_s()),
        **({"device_id": device} if device.type == "cuda" else {}),
    )


def leave_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``n`` that rank ``rank`` of ``size`` owns: the first ``n % size`` ranks get
    ``n // size + 1`` rows, the others ``n // size``, in rank order (``np.array_split``'s rule)."""
    if size < 1 or not 0 <= rank < size or n < 0:
        raise ValueError(f"need n >= 0 and 0 <= rank < size, got n={n}, rank={rank}, size={size}")
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class DatasetSlice:
    """Rows ``[start, stop)`` of an oodviz dataset (``dataset[i] -> (image, label, source_index)`` or None),
    with its ``name`` and ``classes``; ``source_indices`` sliced alike when the dataset has them."""

    def __init__(self, dataset, start: int, stop: int):
        if not 0 <= start <= stop <= len(dataset):
            raise ValueError(f"slice [{start}, {stop}) is outside the dataset's {len(dataset)} items")
        self.dataset, self.start, self.stop = dataset, start, stop
        self.name = dataset.name
        self.classes = getattr(dataset, "classes", None)
        source = getattr(dataset, "source_indices", None)
        self.source_indices = None if source is None else np.asarray(source)[start:stop]

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for a slice of {len(self)} items")
        return self.dataset[self.start + i]


def gather_to_root(value, world: World) -> list | None:
    """Every rank's ``value`` (picklable), in rank order, on rank 0; None on the other ranks."""
    if not world.distributed:
        return [value]
    gathered = [None] * world.size if world.is_root else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def all_gather(value, world: World) -> list:
    """Every rank's ``value`` (picklable), in rank order, on every rank."""
    if not world.distributed:
        return [value]
    gathered = [None] * world.size
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_from_root(value, world: World):
    """Rank 0's ``value`` (picklable) on every rank."""
    if not world.distributed:
        return value
    box = [value if world.is_root else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def merge_across_ranks(state, world: World):
    """Every rank's ``state`` merged, in rank order, on every rank: ``state_0.merge(state_1)...merge(state_{W-1})``.

    ``state`` is a streaming statistic with ``merge(other) -> self`` that this rank updated with its shard
    (:class:`~oodviz.detectors.stats.ClassMoments` or :class:`~oodviz.detectors.stats.ClassMeans`), its tensors
    on the CPU. Every rank merges the same gathered states in the same order, so every rank ends with the same
    float64 statistics, those of one accumulator that saw every shard up to rounding (``ClassMoments`` merges
    shifted sums, so a large offset does not cancel). One process: ``state`` itself.
    """
    if not world.distributed:
        return state
    release = getattr(state, "release", None)
    if release is not None:  # settled, without its scratch buffers: what goes over the wire is the statistic
        release()
    merged, *others = all_gather(state, world)
    for other in others:
        merged.merge(other)
    return merged


def fit_across_ranks(detector, batches, world: World, head=None, device=None):
    """Fit a mergeable ``detector`` (``detector.mergeable``) on the union of every rank's ``batches``; returns it.

    Per fit pass: ``update`` on this rank's ``batches`` (a re-iterable: a two-pass detector reads it again),
    ``state_dict()`` to the CPU, gathered from every rank (``all_gather_object``), loaded and merged in rank order
    on every rank (:func:`~oodviz.detectors.protocol.load_merged`) on ``device``, then ``finalize()``. The states
    are sums (float64, Chan-style shifted sums for scatters), so this equals a fit of one process on all the rows
    in rank order up to float64 rounding, and every rank holds the same fitted detector. Gathering the states
    rather than an ``all_reduce`` keeps the shifted sums exact (a shifted scatter is not a plain sum) and costs
    ``W`` states per rank, one ``D x D`` each at most. One process: an ordinary fit of ``batches``.

    A rank whose ``update`` raises still takes part in the gather (with its error), so no rank waits for it in
    a collective: that rank raises its own error, every other rank a ValueError naming it."""

    target = torch.device("cpu") if device is None else torch.device(device)
    while True:
        error = None
        try:
            detector.update(batches, head=head, device=device)
            mine = on_device(detector.state_dict(), "cpu")
        except Exception as raised:  # told to the other ranks, then raised here
            error, mine = raised, f"rank {world.rank}: {type(raised).__name__}: {raised}"
        states = all_gather(mine, world)
        _gathered_or_raise(error, states, f"{detector.name}: the fit")
        load_merged(detector, [on_device(state, target) for state in states]).finalize()
        if not detector.fit_in_progress:
            return detector


def _gathered_or_raise(error, states: list, what: str):
    """Raise ``error`` (this rank's) or a ValueError naming the ranks whose gathered value is an error string."""
    if error is not None:
        raise error
    failed = [state for state in states if isinstance(state, str)]
    if failed:
        raise ValueError(f"{what} failed on another rank: {'; '.join(failed)}")


def fit_bank_across_ranks(detector, batches, world: World, head=None, device=None):
    """Fit knn or nnguide (a :class:`~oodviz.detectors.knn.KNN`) with the bank split over the ranks; returns it.

    Each rank keeps this rank's ``batches`` (its contiguous rows of the fit split, none empty) as its bank shard
    (:meth:`~oodviz.detectors.knn.KNN.fit_shard`); the shards' rows are all-gathered and ``k`` is checked against
    their sum, the bank's rows. Score with :func:`search_across_ranks`. One process: an ordinary fit. A rank whose
    fit raises still takes part in the gather (with its error), so no rank waits for it."""
    if not world.distributed:
        return detector.fit(batches, head=head, device=device)
    error, mine = None, 0
    try:
        mine = len(detector.fit_shard(batches, head=head, device=device).bank_)
    except Exception as raised:  # told to the other ranks, then raised here
        error, mine = raised, f"rank {world.rank}: {type(raised).__name__}: {raised}"
    rows = all_gather(mine, world)
    _gathered_or_raise(error, rows, f"{detector.name}: the fit of a bank shard")
    detector.check_bank_rows(sum(rows))
    return detector


def search_across_ranks(detector, batches, world: World, device=None):
    """Scores ``[N]`` (CPU float32) of all the queries ``batches`` against a bank split over the ranks
    (:func:`fit_bank_across_ranks`), on rank 0; None on the others.

    Every rank searches every query against its shard (:meth:`~oodviz.detectors.knn.KNN.top_similarities`,
    ``[N, k]``), rank 0 gathers the ``W`` lists, keeps the ``k`` largest of their union
    (:meth:`~oodviz.detectors.knn.KNN.merge_top`: exact, each bank row being in one shard) and applies
    :meth:`~oodviz.detectors.knn.KNN.scores_from_top` with its own per-query numbers. Bytes gathered on rank 0:
    ``4 W N k``. A rank whose search raises sends its error instead: rank 0 then raises a ValueError naming it,
    the others return None. One process: ``detector.score(batches)``."""
    if not world.distributed:
        return detector.score(batches, device=device)
    error, extra = None, None
    try:
        mine, extra = detector.top_similarities(batches, device)
    except Exception as raised:  # told to rank 0
        error, mine = raised, f"rank {world.rank}: {type(raised).__name__}: {raised}"
    parts = gather_to_root(mine, world)
    if not world.is_root:
        return None
    _gathered_or_raise(error, parts, f"{detector.name}: the search of a bank shard")
    return detector.scores_from_top(detector.merge_top(parts, detector.k), extra)
