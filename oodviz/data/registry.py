"""The dataset registry: name -> (:class:`DatasetInfo`, loader).

A loader is ``loader(root: str, download: bool, **params) -> Source``; its keyword parameters
(with defaults) are the dataset's own parameters, checked against its signature (names, annotated
types, signs: :func:`oodviz.params.param_problems`) by :func:`dataset_param_problems` and
:func:`load_dataset`. A loader that also takes ``model_classes`` gets the class names of the model
the data is for (``load_dataset(..., model_classes=...)``). Adding a source is one
:func:`register_dataset` call in a module imported by ``oodviz/data/__init__.py``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from oodviz.data.base import ImageDataset, Source
from oodviz.params import param_problems
from oodviz.sampling import sampling_of, subsample_indices

KINDS = ("id", "ood")
GROUPS = ("near", "far", None)
#: Loader parameters the caller supplies, not the dataset's user.
CONTEXT_PARAMS = ("root", "download", "model_classes")


@dataclass(frozen=True)
class DatasetInfo:
    """What a registered dataset is, for menus and result tables.

    - ``kind``: the role it plays by default, ``"id"`` (labelled, a classifier's training
      distribution) or ``"ood"`` (labels ``-1``). Any source can be used as OOD with
      ``load_dataset(..., as_ood=True)``.
    - ``group``: OpenOOD's grouping of an OOD set, ``"near"`` (close to the bundled ID data:
      held-out classes or a covariate shift of it) or ``"far"`` (another domain); ``None`` for ID sets.
    - ``source``: where the data comes from: ``"bundled"`` (ships with scikit-learn, offline),
      ``"generated"`` (synthesised), ``"torchvision"`` (files under ``root``, downloadable),
      ``"openood"`` (OpenOOD's list files and images under ``root``, fetched by OpenOOD's own script) or
      ``"folder"`` (the user's own images).
    - ``image``: image size and PIL mode, e.g. ``"8x8 L"`` (``"varies"`` when it does).
    """

    name: str
    description: str
    kind: str
    group: str | None
    source: str
    image: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"DatasetInfo.kind must be one of {KINDS}, got {self.kind!r}")
        if self.group not in GROUPS:
            raise ValueError(f"DatasetInfo.group must be one of {GROUPS}, got {self.group!r}")


Loader = Callable[..., Source]
_REGISTRY: dict[str, tuple[DatasetInfo, Loader]] = {}


def register_dataset(info: DatasetInfo, loader: Loader, replace: bool = False) -> None:
    """Add ``loader`` under ``info.name``; ``replace=True`` overrides an existing entry."""
    if info.name in _REGISTRY and not replace:
        raise ValueError(f"A dataset named {info.name!r} is already registered; pass replace=True to override it")
    params = inspect.signature(loader).parameters
    if "root" not in params or "download" not in params:
        raise ValueError(f"Loader for {info.name!r} must accept root and download (got {list(params)})")
    _REGISTRY[info.name] = (info, loader)


def available_datasets() -> list[str]:
    """Names of every registered dataset, for :func:`load_dataset`."""
    return list(_REGISTRY)


def _entry(name: str) -> tuple[DatasetInfo, Loader]:
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown dataset {name!r}.{hint} Choose one of: {', '.join(available_datasets())}")
    return _REGISTRY[name]


def dataset_info(name: str) -> DatasetInfo:
    """The :class:`DatasetInfo` registered under ``name``."""
    return _entry(name)[0]


def dataset_params(name: str) -> dict[str, object]:
    """The dataset's own parameters (beyond root, download and model_classes) and their defaults."""
    loader = _entry(name)[1]
    return {
        p.name: (None if p.default is inspect.Parameter.empty else p.default)
        for p in inspect.signature(loader).parameters.values()
        if p.name not in CONTEXT_PARAMS
    }


def dataset_param_problems(name: str, params: dict, where: str | None = None) -> list[str]:
    """Every problem with ``params`` for dataset ``name`` that shows without loading anything: unknown
    names, values of the wrong type (by the loader's annotations), non-finite numbers, negative counts
    and sizes. ``where`` starts each message (default ``Dataset 'name'``)."""
    return param_problems(_entry(name)[1], params, where or f"Dataset {name!r}", skip=CONTEXT_PARAMS)


def load_dataset(
    name: str,
    root: str = "data",
    download: bool = False,
    subsample: int | None = None,
    subsample_mode: str = "stratified",
    seed: int = 0,
    as_ood: bool | None = None,
    transform=None,
    model_classes: list[str] | None = None,
    **params,
) -> ImageDataset:
    """Load dataset ``name``: ``ds[i] -> (PIL image, label, source_index)`` or ``None`` (unreadable file).

    :param root: data directory for file-based sources (torchvision layouts under it)
    :param download: let torchvision sources fetch missing files (network needed)
    :param subsample: keep at most this many items (``None`` = all; more than the dataset has = all)
    :param subsample_mode: ``"stratified"`` (each class its share, drawn uniformly with ``seed``; an OOD set, without
        classes, a uniform draw), ``"random"`` (uniform, ignoring classes), ``"first"`` or ``"last"`` (the first or
        last ``subsample`` items): :func:`~oodviz.sampling.subsample_indices`; ``ds.sampling`` records it
    :param seed: seed of the ``"stratified"`` and ``"random"`` draws
    :param as_ood: ``True`` sets every label to ``-1`` and ``classes`` to ``[]``; ``False`` keeps the
        source's labels where it has them; ``None`` (default) follows the dataset's ``kind``
    :param transform: optional callable applied to each PIL image in ``__getitem__``
    :param model_classes: class names of the model the data is for (index = logit), passed to loaders
        that take them (the ``folder`` dataset's ``class_map="model"``); ignored by the others
    :param params: the dataset's own parameters, see :func:`dataset_params`
    """
    info, loader = _entry(name)
    problems = dataset_param_problems(name, params)
    if problems:
        raise ValueError("; ".join(problems))
    if not isinstance(download, bool):
        raise ValueError(f"download must be True or False, got {download!r}")
    # Validate subsampling before touching any file.
    subsample_indices(1, subsample, subsample_mode, seed)
    if "model_classes" in inspect.signature(loader).parameters:
        params = {**params, "model_classes": model_classes}
    source = loader(root=str(root), download=download, **params)
    ood = info.kind == "ood" if as_ood is None else bool(as_ood)
    labels = np.asarray(source.labels, dtype=np.int64)  # every source knows them without decoding an image
    indices = subsample_indices(len(source), subsample, subsample_mode, seed, None if ood else labels)
    sampling = sampling_of(labels, indices, [] if ood else list(source.classes), subsample_mode, seed)
    display = getattr(source, "display_name", None) or name
    return ImageDataset(display, source, indices, as_ood=ood, transform=transform, sampling=sampling)
