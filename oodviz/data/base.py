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
from dataclasses import dataclass

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from oodviz.batch import OOD_LABEL

#: ``"stratified"`` first: the default (:func:`subsample_indices`)
SUBSAMPLE_MODES = ("stratified", "first", "random", "last")


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


def class_allocation(counts, total: int) -> np.ndarray:
    """Each class's share of ``total`` items, int64 like ``counts`` (items per class, ``n = counts.sum()``,
    ``0 <= total <= n``): ``total * count / n`` rounded down, plus one for each of the ``total - sum(rounded down)``
    classes with the largest remainders (ties: the lower class first), so the shares add up to ``total`` exactly
    (largest-remainder rounding) and no class gets more than it has."""
    counts = np.asarray(counts, dtype=np.int64)
    shares, remainders = np.divmod(int(total) * counts, int(counts.sum()))
    shares[np.argsort(-remainders, kind="stable")[: int(total) - int(shares.sum())]] += 1
    return shares


def subsample_indices(
    n: int, subsample: int | None, mode: str = "stratified", seed: int = 0, labels: np.ndarray | None = None
) -> np.ndarray:
    """Indices into a source of ``n`` items, int64 ``[min(n, subsample)]``, in increasing order (a store's rows
    keep the source's order).

    ``mode="stratified"`` (the default) takes from each class of ``labels`` (int64 ``[n]``, ``-1`` = no class,
    a class of its own) its share of ``subsample`` (:func:`class_allocation`), drawn uniformly at random within
    the class with one ``numpy.random.default_rng(seed)``, class by class in label order (same seed, same items);
    with ``labels=None`` (OOD sets: no classes) all items are one class, a uniform draw. ``mode="random"``
    ignores ``labels``: the same uniform draw of ``subsample`` items. ``mode="first"`` keeps the first
    ``subsample`` items; ``mode="last"`` the last ones (with ``"first"`` on the same source: two disjoint
    splits, e.g. fit and validation). A ``subsample`` of ``None`` or at least ``n`` keeps every item.
    """
    if mode not in SUBSAMPLE_MODES:
        raise ValueError(f"subsample_mode must be one of {', '.join(SUBSAMPLE_MODES)}, got {mode!r}")
    if labels is not None and len(labels) != n:
        raise ValueError(f"labels must hold one label per item ({n}), got {len(labels)}")
    if subsample is None:
        return np.arange(n, dtype=np.int64)
    if isinstance(subsample, bool) or not isinstance(subsample, (int, np.integer)):
        raise ValueError(f"subsample must be a positive integer (or None for all items), got {subsample!r}")
    if subsample <= 0:
        raise ValueError(f"subsample must be a positive integer (or None for all items), got {subsample}")
    if subsample >= n:
        return np.arange(n, dtype=np.int64)
    if mode == "first":
        return np.arange(subsample, dtype=np.int64)
    if mode == "last":
        return np.arange(n - subsample, n, dtype=np.int64)
    if mode == "random" or labels is None:
        labels = np.zeros(n, dtype=np.int64)  # one class: a uniform draw
    _, position, counts = np.unique(np.asarray(labels, dtype=np.int64), return_inverse=True, return_counts=True)
    members = np.split(np.argsort(position, kind="stable"), np.cumsum(counts)[:-1])  # each class's items, ascending
    shares = class_allocation(counts, subsample)
    rng = np.random.default_rng(seed)
    chosen = [rng.choice(items, size=int(k), replace=False) for items, k in zip(members, shares, strict=True)]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


@dataclass(frozen=True)
class Sampling:
    """How a dataset's items were taken from its source (:func:`subsample_indices`): ``mode`` and ``seed`` as
    asked, ``kept`` of the source's ``of`` items (``kept == of``: every item), ``classes`` the number of classes
    a stratified draw was stratified by (0: none, a uniform draw; OOD sets have no classes) and ``empty_classes``
    the names of the classes the source has images of and the kept items none (in any mode)."""

    mode: str
    seed: int
    kept: int
    of: int
    classes: int = 0
    empty_classes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line, e.g. "100 of 362, stratified by class (8 classes), seed 0" or "all 362 (no subsample)"."""
        if self.kept == self.of:
            return f"all {self.of:,} (no subsample)"
        how = {
            "first": "the first ones",
            "last": "the last ones",
            "random": f"uniform at random, seed {self.seed}",
            "stratified": f"stratified by class ({self.classes} classes), seed {self.seed}"
            if self.classes
            else f"uniform at random (no classes), seed {self.seed}",
        }[self.mode]
        return f"{self.kept:,} of {self.of:,}, {how}"


def sampling_of(labels: np.ndarray, indices: np.ndarray, classes: list[str], mode: str, seed: int) -> Sampling:
    """The :class:`Sampling` of the items ``indices`` of a source whose items have ``labels`` (int64, ``-1`` = no
    class; ``classes``: their names, ``[]`` for a set without classes) taken by ``mode`` with ``seed``."""
    labels = np.asarray(labels, dtype=np.int64)
    has = np.unique(labels[labels >= 0]) if classes else np.empty(0, np.int64)
    empty = np.setdiff1d(has, labels[indices])
    stratified = mode == "stratified" and len(indices) < len(labels)
    return Sampling(
        mode, int(seed), len(indices), len(labels), len(has) if stratified else 0, tuple(classes[c] for c in empty)
    )


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
