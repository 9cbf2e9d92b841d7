"""Class names of a dataset against a model's: say when they differ, map them when asked.

An image folder's labels are the positions of its sorted subfolder names, which need not be the
model's class indices: a folder of ``cat/`` and ``dog/`` images labels cats 0, which an ImageNet model
calls "tench". :func:`class_mismatch` says so before a run; ``load_dataset("folder", path=...,
class_map="model", model_classes=backbone.classes)`` labels each image with the index of its folder's
name among the model's classes instead (matched case-insensitively, surrounding spaces ignored).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from oodviz.data.base import Source

#: Values of the folder dataset's ``class_map``: ``None`` (labels = sorted folder positions) or ``"model"``.
CLASS_MAPS = (None, "model")


def _key(name: str) -> str:
    return str(name).strip().casefold()


def class_mismatch(dataset_classes: Sequence[str], model_classes: Sequence[str] | None) -> str | None:
    """A warning when labelled data and the model disagree on what the labels mean, else ``None``.

    ``None`` when the model has no class names, the data no classes, or every dataset class ``i`` is the
    model's class ``i`` (compared case-insensitively). Otherwise the text names the dataset classes that
    are not model classes (or, when all are, that their order differs) and says that accuracy and the
    per-class tables are meaningless.
    """
    if not model_classes or not dataset_classes:
        return None
    model_keys = [_key(c) for c in model_classes]
    if all(i < len(model_keys) and _key(c) == model_keys[i] for i, c in enumerate(dataset_classes)):
        return None
    missing = [c for c in dataset_classes if _key(c) not in model_keys]
    if missing:
        shown = ", ".join(repr(c) for c in missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        what = f"{len(missing)} of the {len(dataset_classes)} ID classes are not classes of the model: {shown}"
    else:
        what = "the ID classes are classes of the model but at other indices (label i is not the model's class i)"
    return (
        f"{what}. Accuracy and the per-class tables compare the labels with the model's predictions, so they "
        "are meaningless for this data (the OOD scores are not affected). For an image folder whose subfolders "
        'are named after the model\'s classes, set class_map = "model" in its params.'
    )


def model_class_labels(dataset_classes: Sequence[str], model_classes: Sequence[str] | None) -> np.ndarray:
    """int64 ``[len(dataset_classes)]``: the index of each dataset class among ``model_classes``
    (case-insensitive); a ValueError naming the classes that are not the model's."""
    if not model_classes:
        raise ValueError(
            'class_map="model" needs a model with class names (the bundled models, torchvision weights); '
            "this model has none: leave class_map unset"
        )
    index = {}
    for i, name in enumerate(model_classes):
        index.setdefault(_key(name), i)  # the first of two same names (ImageNet has two "crane"s)
    missing = [c for c in dataset_classes if _key(c) not in index]
    if missing:
        close = ", ".join(repr(c) for c in list(model_classes)[:10])
        raise ValueError(
            f'class_map="model": folder(s) {", ".join(repr(c) for c in missing[:10])} are not classes of the model; '
            f"rename them to model class names (e.g. {close}{', ...' if len(model_classes) > 10 else ''}) "
            "or leave class_map unset"
        )
    return np.asarray([index[_key(c)] for c in dataset_classes], dtype=np.int64)


class ModelClassSource(Source):
    """``inner`` with its labels replaced by the model's class indices (:func:`model_class_labels`);
    ``classes`` becomes the model's class list, so label ``i`` is named ``classes[i]``."""

    def __init__(self, inner: Source, model_classes: Sequence[str]):
        self.inner = inner
        self.mapping = model_class_labels(inner.classes, model_classes)
        self.classes = [str(c) for c in model_classes]
        labels = np.asarray(inner.labels, dtype=np.int64)
        self._labels = np.where(labels >= 0, self.mapping[np.maximum(labels, 0)], labels)

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def load(self, index: int) -> tuple[Image.Image, int]:
        image, _ = self.inner.load(index)
        return image, int(self._labels[index])

    def item_name(self, index: int) -> str:
        return self.inner.item_name(index)

    @property
    def display_name(self) -> str | None:
        return getattr(self.inner, "display_name", None)
