"""How a dataset's items are drawn from its source: the subsample modes, the draw (:func:`subsample_indices`) and its
record (:class:`Sampling`), shown in a run's details and warned about when a class is left without an image.

Numpy only, no torch: the run pages read a run's :class:`Sampling` without importing the datasets
(:mod:`oodviz.data`, whose datasets are torch ``Dataset`` objects, draws with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: ``"stratified"`` first: the default (:func:`subsample_indices`)
SUBSAMPLE_MODES = ("stratified", "first", "random", "last")


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
