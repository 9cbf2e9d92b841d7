"""The unit of data every detector consumes.

A :class:`Batch` carries what a classifier produced for ``B`` inputs:

- ``features``: penultimate-layer features, float tensor ``[B, D]``;
- ``logits``: classifier outputs, float tensor ``[B, C]``;
- ``labels``: integer class labels ``[B]`` in ``0..C-1``; ``-1`` marks an OOD (or unlabelled
  outlier) sample, which detectors ignore when fitting;
- ``inputs`` (optional): the model inputs themselves, float tensor ``[B, ...]`` (for images
  ``[B, C_in, H, W]``, already transformed and normalised), for the detectors that run the model
  again (``odin``, ``mcd``).

Any of them may be ``None``; a detector says which ones it needs. Feature maps
(``[B, C, H, W]``) or token sequences (``[B, T, D]``) are rejected rather than flattened: pool
them first (the original out-of-memory report behind oodviz was 49 x 1024 ViT tokens per image
silently flattened into 50,176-dimensional "features").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

OOD_LABEL = -1
#: the tensor fields of a Batch
FIELDS = ("features", "logits", "labels", "inputs")


def _as_tensor(name: str, value) -> Tensor | None:
    if value is None or isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise TypeError(f"Batch.{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")


def non_blocking_copy(source: torch.device, source_pinned: bool, target: torch.device) -> bool:
    """Whether a copy from ``source`` to ``target`` may be asynchronous: only host -> device from pinned memory.

    A device -> host copy with ``non_blocking=True`` returns before the data has arrived, and the
    host would read whatever the (pinned) pages held before; a device -> device copy across devices
    is ordered on the source's stream only. Both block. Pageable host memory is copied synchronously
    by CUDA anyway.
    """
    return source.type == "cpu" and target.type != "cpu" and source_pinned


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    # "cuda" means the current CUDA device; a tensor reports "cuda:0".
    return actual.type == wanted.type and (wanted.index is None or actual.index == wanted.index)


@dataclass(frozen=True)
class Batch:
    """Features ``[B, D]``, logits ``[B, C]``, labels ``[B]`` (``-1`` = OOD) and model inputs ``[B, ...]`` of ``B`` samples."""

    features: Tensor | None = None
    logits: Tensor | None = None
    labels: Tensor | None = None
    inputs: Tensor | None = None

    def __post_init__(self):
        for name in ("features", "logits", "labels", "inputs"):
            object.__setattr__(self, name, _as_tensor(name, getattr(self, name)))
        for name in ("features", "logits"):
            value = getattr(self, name)
            if value is not None and value.ndim != 2:
                hint = (
                    " Pool feature maps [B, C, H, W] or tokens [B, T, D] to [B, D] first "
                    "(for example with mean over the spatial or token axis)."
                    if name == "features" and value.ndim > 2
                    else ""
                )
                raise ValueError(
                    f"Batch.{name} must be 2-D [B, {name[0].upper()}], got shape {tuple(value.shape)}.{hint}"
                )
            if value is not None and not value.is_floating_point():
                raise ValueError(f"Batch.{name} must be a floating-point tensor, got {value.dtype}")
        if self.labels is not None:
            if self.labels.ndim != 1:
                raise ValueError(f"Batch.labels must be 1-D [B], got shape {tuple(self.labels.shape)}")
            if self.labels.is_floating_point() or self.labels.is_complex() or self.labels.dtype == torch.bool:
                raise ValueError(
                    f"Batch.labels must be an integer tensor (class index, -1 = OOD), got {self.labels.dtype}"
                )
        if self.inputs is not None:
            if self.inputs.ndim < 2:
                raise ValueError(
                    f"Batch.inputs must be [B, ...] with at least 2 axes (images: [B, C, H, W]), got shape {tuple(self.inputs.shape)}"
                )
            if not self.inputs.is_floating_point():
                raise ValueError(
                    f"Batch.inputs must be a floating-point tensor (the transformed model input), got {self.inputs.dtype}"
                )
        sizes = {name: len(t) for name in FIELDS if (t := getattr(self, name)) is not None}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the number of samples: {sizes}")

    def __len__(self) -> int:
        for t in (self.features, self.logits, self.labels, self.inputs):
            if t is not None:
                return len(t)
        return 0

    @property
    def device(self) -> torch.device | None:
        """Device of the first tensor present (inputs, then features, logits, labels)."""
        for t in (self.inputs, self.features, self.logits, self.labels):
            if t is not None:
                return t.device
        return None

    def to(self, device: torch.device | str) -> Batch:
        """This batch with every tensor on ``device``: asynchronous only from pinned host memory to a device,
        so a tensor moved to the host can be read at once (see ``non_blocking_copy``)."""
        device = torch.device(device)
        tensors = [t for t in (self.features, self.logits, self.labels, self.inputs) if t is not None]
        if all(_same_device(t.device, device) for t in tensors):
            return self

        def move(t: Tensor | None) -> Tensor | None:
            if t is None:
                return None
            pinned = t.device.type == "cpu" and t.is_pinned()
            return t.to(device, non_blocking=non_blocking_copy(t.device, pinned, device))

        return Batch(move(self.features), move(self.logits), move(self.labels), move(self.inputs))
