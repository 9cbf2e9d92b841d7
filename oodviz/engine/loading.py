"""How a batched pass reads its data: whole batches of in-memory pixels, or DataLoader workers.

- :func:`batch_transform`: an array-backed dataset (``dataset.arrays(start, stop)`` gives uint8 pixels: the
  bundled digits, Fashion-MNIST, generated noise) whose transform has a ``batch`` method is transformed a
  batch at a time as tensors (:class:`ArrayBatches`), the same numbers as one PIL image at a time;
- :func:`auto_workers`: what ``num_workers="auto"`` means for a dataset, a device and this machine's cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.utils.data import Dataset

#: the ``num_workers`` value that lets :func:`auto_workers` choose
AUTO_WORKERS = "auto"
#: at most this many workers on a GPU job (JPEG decoding and resizing for one GPU), and on a CPU job
MAX_WORKERS_CUDA, MAX_WORKERS_CPU = 16, 4


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def batch_transform(dataset, transform) -> Callable | None:
    """``transform.batch`` when ``dataset`` is array-backed (``dataset.arrays(start, stop)`` gives uint8 pixels)
    and the transform takes those pixels a batch at a time (``transform.batch(pixels)`` is not None for the
    first item); else ``None`` (items go one by one through ``transform``)."""
    batch = getattr(transform, "batch", None)
    arrays = getattr(dataset, "arrays", None)
    if batch is None or arrays is None or len(dataset) == 0:
        return None
    first = arrays(0, 1)
    if first is None or batch(first[0]) is None:
        return None
    return batch


def auto_workers(dataset, transform, device: torch.device, cpus: int | None = None) -> int:
    """The DataLoader workers for ``num_workers="auto"``: a function of the CPU cores and the kind of dataset.

    - 0 for an array-backed dataset transformed a batch at a time (:func:`batch_transform`): the pixels are
      in memory and one tensor operation per batch is faster than handing batches between processes;
    - on a GPU job, ``cpus - 1`` capped at :data:`MAX_WORKERS_CUDA`: decoding and resizing files (image
      folders, torchvision sets) is what keeps a GPU waiting, and the main process only feeds the device;
    - on a CPU job, ``cpus // 4`` capped at :data:`MAX_WORKERS_CPU` (at least 1 with 2 cores or more): the
      forward pass needs the cores, one worker per four keeps decoding off the main thread.
    """
    cpus = usable_cpus() if cpus is None else cpus
    if batch_transform(dataset, transform) is not None or cpus < 2:
        return 0
    if device.type == "cuda":
        return min(MAX_WORKERS_CUDA, cpus - 1)
    return max(1, min(MAX_WORKERS_CPU, cpus // 4))


class ArrayBatches(Dataset):
    """Batch ``k`` of an array-backed dataset, transformed at once: ``(x [b, ...], labels [b], source_indices [b], 0)``."""

    def __init__(self, dataset, batch: Callable, batch_size: int):
        self.dataset, self.batch, self.batch_size = dataset, batch, batch_size

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def __getitem__(self, k: int):
        start = k * self.batch_size
        pixels, labels, indices = self.dataset.arrays(start, min(start + self.batch_size, len(self.dataset)))
        x = self.batch(pixels)
        if x is None:  # one array, one shape: the first batch decided for all
            raise ValueError(
                f"the transform took the first items of {self.dataset.name!r} as arrays but not items {start}+"
            )
        return x, torch.from_numpy(labels), torch.from_numpy(indices), 0
