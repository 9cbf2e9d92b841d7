"""Dataset sources behind one registry: ``available_datasets()``, ``dataset_info(name)``, ``load_dataset(name)``.

``load_dataset(name, root="data", download=False, subsample=None, subsample_mode="stratified", seed=0,
as_ood=None, transform=None, **params)`` returns an :class:`ImageDataset`:
``ds[i] -> (PIL image, label, source_index)`` (label ``-1`` = OOD; ``source_index`` indexes the full
dataset before subsampling), or ``None`` for an unreadable image file (counted in ``ds.skipped``).

Sources (one module each): bundled scikit-learn digits and photo patches (:mod:`.bundled`, offline),
seeded noise (:mod:`.noise`), torchvision datasets under ``root`` (:mod:`.torchvision_sets`), the
Fashion-MNIST preset's ID / held-out / shifted sets and 28x28 digits (:mod:`.fashion`), the
user's image folders (:mod:`.folders`) and OpenOOD v1.5's benchmarks from a data root in OpenOOD's
layout (:mod:`.openood`). Add one with :func:`register_dataset`.
"""

from oodviz.data.base import ImageDataset, Source, UnreadableImageError
from oodviz.data.registry import (
    DatasetInfo,
    available_datasets,
    dataset_info,
    dataset_param_problems,
    dataset_params,
    load_dataset,
    register_dataset,
)
from oodviz.sampling import Sampling, subsample_indices

# Importing a source module registers its datasets (in this order in available_datasets()).
from oodviz.data import bundled, noise, torchvision_sets, fashion, folders, openood  # noqa: F401  isort: skip
from oodviz.data.bundled import DIGITS_HELD_OUT, DIGITS_ID_CLASSES, digits_split
from oodviz.data.class_map import CLASS_MAPS, class_mismatch
from oodviz.data.fashion import FASHION_HELD_OUT, FASHION_ID_CLASSES, FASHION_ID_NAMES, fashion_split
from oodviz.data.folders import IMAGE_EXTENSIONS
from oodviz.data.torchvision_sets import DatasetNotFoundError

__all__ = [
    "CLASS_MAPS",
    "DIGITS_HELD_OUT",
    "DIGITS_ID_CLASSES",
    "FASHION_HELD_OUT",
    "FASHION_ID_CLASSES",
    "FASHION_ID_NAMES",
    "IMAGE_EXTENSIONS",
    "DatasetInfo",
    "DatasetNotFoundError",
    "ImageDataset",
    "Sampling",
    "Source",
    "UnreadableImageError",
    "available_datasets",
    "class_mismatch",
    "dataset_info",
    "dataset_param_problems",
    "dataset_params",
    "digits_split",
    "fashion_split",
    "load_dataset",
    "register_dataset",
    "subsample_indices",
]
