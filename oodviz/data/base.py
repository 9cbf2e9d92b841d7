"""What every dataset source returns: an :class:`ImageDataset` over a :class:`Source`.

A *source* is the full underlying dataset: ``len(source)`` images, each loaded by
``source.load(i) -> (PIL image, label)`` (label ``-1`` when the source has none), plus
``source.labels`` (int64 ``[len(source)]``), ``source.classes`` and ``source.item_name(i)``.
Sources that read files raise :class:`UnreadableImageError` for a file that cannot be
decoded. *Array-backed* sources (images held in or generated as arrays) also serve many items
at once without PIL: ``source.arrays(indices) -> uint8 [b, H, W] or [b, H, W, 3]``, the pixels
``load`` would have wrapped in a PIL image (``None`` for every other source).

:class:`ImageDataset` is what :func:`oodviz.data.load_dataset` hands out. It adds subsampling
(``source_index`` always points into the full source), OOD relabelling (``as_ood``), an
optional transform, and turns unreadable files into ``None`` items counted in ``skipped``:

    len(ds); ds[i] -> (image, label, source_index) | None
"""

from __future__ import annotations

import operator

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from oodviz.batch import OOD_LABEL
from oodviz.sampling import Sampling


class UnreadableImageError(OSError):
    """An image file that exists in a source's listing but cannot be read or decoded."""


class Source:
    """The full underlying dataset. Subclasses implement ``__len__``, ``load`` and ``labels``."""

    #: class names, index = label; ``[]`` when the source has no labels
    classes: list[str] = []

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def labels(self) -> np.ndarray:
        """int64 ``[len(self)]``: the label of every item without loading it (``-1`` = none)."""
        raise NotImplementedError

    def load(self, index: int) -> tuple[Image.Image, int]:
        """Image ``index`` (``0 <= index < len(self)``) and its label; may raise :class:`UnreadableImageError`."""
        raise NotImplementedError

    def item_name(self, index: int) -> str:
        """A human-readable identifier of item ``index`` (a file path where there is one)."""
        return f"#{index}"

    def arrays(self, indices: np.ndarray) -> np.ndarray | None:
        """uint8 ``[b, H, W]`` (mode ``"L"``) or ``[b, H, W, 3]`` (``"RGB"``): the pixels of items ``indices``,
        exactly those ``load`` serves, for array-backed sources; ``None`` (the default) for the others."""
        return None


class ImageDataset(Dataset):
    """A (possibly subsampled) view of a :class:`Source`; ``ds[i] -> (image, label, source_index)``.

    - ``image``: a PIL image, or ``transform(image)`` when a transform is set;
    - ``label``: class index in ``0..len(classes)-1``, or ``-1`` (OOD / no label);
    - ``source_index``: the index of the item in the full source, before subsampling.

    ``ds[i]`` is ``None`` when the underlying file cannot be read; ``skipped`` counts the distinct
    items found unreadable so far *in this process* (with DataLoader workers each worker has its
    own copy, so count the ``None`` items in the batches instead), ``skipped_indices`` lists their
    source indices. ``sampling``: how its items were taken from the source (:class:`Sampling`, set by
    :func:`oodviz.data.load_dataset`; ``None``: not recorded).
    """

    def __init__(
        self,
        name: str,
        source: Source,
        indices: np.ndarray | None = None,
        as_ood: bool = False,
        transform=None,
        sampling: Sampling | None = None,
    ):
        self.name = name
        self.sampling = sampling
        self.source = source
        self.as_ood = bool(as_ood)
        self.transform = transform
        self.source_indices = (
            np.arange(len(source), dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
        )
        self._skipped: set[int] = set()

    @property
    def classes(self) -> list[str]:
        """Class names (index = label); ``[]`` for OOD sets and sources without labels."""
        return [] if self.as_ood else list(self.source.classes)

    @property
    def labels(self) -> np.ndarray:
        """int64 ``[len(self)]``: every item's label, read without loading images (``-1`` = OOD)."""
        if self.as_ood:
            return np.full(len(self), OOD_LABEL, dtype=np.int64)
        return np.asarray(self.source.labels, dtype=np.int64)[self.source_indices]

    @property
    def skipped(self) -> int:
        return len(self._skipped)

    @property
    def skipped_indices(self) -> list[int]:
        """Source indices of the items found unreadable so far, sorted."""
        return sorted(self._skipped)

    def item_name(self, index: int) -> str:
        """Human-readable identifier (file path where there is one) of item ``index`` of this view."""
        return self.source.item_name(int(self.source_indices[self._position(index)]))

    def __len__(self) -> int:
        return len(self.source_indices)

    def arrays(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Items ``start..stop-1`` of this view at once: ``(pixels uint8 [b, H, W(, 3)], labels int64 [b],
        source_indices int64 [b])``, the same items ``self[i]`` gives one by one, without PIL; ``None`` when
        the source is not array-backed or this view has its own transform."""
        if self.transform is not None:
            return None
        source_indices = self.source_indices[start:stop]
        pixels = self.source.arrays(source_indices)
        if pixels is None:
            return None
        if self.as_ood:
            labels = np.full(len(source_indices), OOD_LABEL, dtype=np.int64)
        else:
            labels = np.asarray(self.source.labels, dtype=np.int64)[source_indices]
        return pixels, labels, source_indices

    def _position(self, index) -> int:
        i = operator.index(index)
        n = len(self.source_indices)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for dataset {self.name!r} of {n} items")
        return i

    def __getitem__(self, index):
        source_index = int(self.source_indices[self._position(index)])
        try:
            image, label = self.source.load(source_index)
        except UnreadableImageError:
            self._skipped.add(source_index)
            return None
        if self.as_ood:
            label = OOD_LABEL
        if self.transform is not None:
            image = self.transform(image)
        return image, int(label), source_index

    def __repr__(self) -> str:
        return f"ImageDataset(name={self.name!r}, items={len(self)}, of={len(self.source)}, as_ood={self.as_ood})"
