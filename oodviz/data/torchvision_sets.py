"""torchvision datasets read from their usual files under ``root`` (or downloaded with ``download=True``).

==============  ======================================================  ==================
name            files torchvision reads (``root`` = the data root)       split
==============  ======================================================  ==================
mnist           ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``  train / test
fashion-mnist   ``FashionMNIST/raw/`` (same four files)                  train / test
kmnist          ``KMNIST/raw/`` (same four files)                        train / test
cifar10         ``cifar-10-batches-py/data_batch_{1..5}, test_batch, batches.meta``  train / test
cifar100        ``cifar-100-python/train, test, meta``                   train / test
svhn            ``{split}_32x32.mat`` directly in ``root``               train / test / extra
dtd             ``dtd/dtd/images/<class>/*.jpg`` + ``dtd/dtd/labels/{split}{partition}.txt``  train / val / test
==============  ======================================================  ==================

torchvision needs all four MNIST-style files whatever the split; when only the ``.gz``
archives are there (copied from another machine), they are unpacked next to themselves, as
torchvision's own download does.

Fashion-MNIST is also looked for where Debian's package ``dataset-fashion-mnist`` puts it
(:data:`SYSTEM_DIRS`: ``/usr/share/datasets/fashion-mnist/*-ubyte.gz``, the same four archives
torchvision downloads). The search order is: the data root, then that system copy, then (only
with ``download=True``) torchvision's download. The system folder is never written to: its
archives are unpacked into ``<root>/FashionMNIST/raw/`` on first use (about 55 MB), where
torchvision reads them from then on. CIFAR and SVHN files are checked against torchvision's md5
sums: files that exist but fail the check raise a ValueError (delete them and download again).

Images come back as torchvision returns them (PIL ``"L"`` 28x28 for the MNIST family, ``"RGB"``
32x32 for CIFAR/SVHN, ``"RGB"`` of varying size for DTD). SVHN and DTD are registered as OOD
sets (labels ``-1`` unless ``as_ood=False``); the others as ID sets.
"""

from __future__ import annotations

import gzip
import os
import pickle
import shutil
from dataclasses import dataclass

import numpy as np
from PIL import Image

from oodviz.data.base import Source, UnreadableImageError
from oodviz.data.registry import DatasetInfo, register_dataset

#: The four files of an MNIST-style set, all needed whatever the split (and their ``.gz`` archives).
MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


#: Read-only system folders holding a dataset's ``.gz`` archives (Debian/Ubuntu packages), by dataset name.
SYSTEM_DIRS: dict[str, str] = {"fashion-mnist": "/usr/share/datasets/fashion-mnist"}
#: The package that fills each folder of :data:`SYSTEM_DIRS`.
SYSTEM_PACKAGES: dict[str, str] = {"fashion-mnist": "dataset-fashion-mnist"}


class DatasetNotFoundError(FileNotFoundError):
    """A file-based dataset whose files are not under the data root (and were not downloaded)."""


#: The torchvision classes of the MNIST-style sets (idx files under ``<root>/<class name>/raw``).
_MNIST_CLASSES = ("MNIST", "FashionMNIST", "KMNIST")


@dataclass(frozen=True)
class _Spec:
    """How one torchvision dataset lays out its files and takes its split."""

    name: str
    class_name: str
    splits: tuple[str, ...]
    download_size: str

    def folder(self, root: str, split: str, partition: int) -> str:
        """Directory holding the files, as torchvision computes it."""
        if self.class_name in _MNIST_CLASSES:
            return os.path.join(root, self.class_name, "raw")
        if self.class_name == "CIFAR10":
            return os.path.join(root, "cifar-10-batches-py")
        if self.class_name == "CIFAR100":
            return os.path.join(root, "cifar-100-python")
        if self.class_name == "DTD":
            return os.path.join(root, "dtd", "dtd")
        return root  # SVHN: the .mat files sit directly in root

    def files(self, split: str, partition: int) -> list[str]:
        """Files torchvision checks for, relative to :meth:`folder` (all of them, whatever the split)."""
        from torchvision import datasets

        if self.class_name in _MNIST_CLASSES:
            return list(MNIST_FILES)
        if self.class_name in ("CIFAR10", "CIFAR100"):
            cls = getattr(datasets, self.class_name)
            return [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
        if self.class_name == "SVHN":
            return [datasets.SVHN.split_list[split][1]]
        return [os.path.join("labels", f"{split}{partition}.txt"), "images"]


_SPECS = {
    spec.name: spec
    for spec in (
        _Spec("mnist", "MNIST", ("train", "test"), "about 12 MB"),
        _Spec("fashion-mnist", "FashionMNIST", ("train", "test"), "about 30 MB"),
        _Spec("kmnist", "KMNIST", ("train", "test"), "about 21 MB"),
        _Spec("cifar10", "CIFAR10", ("train", "test"), "about 163 MB"),
        _Spec("cifar100", "CIFAR100", ("train", "test"), "about 161 MB"),
        _Spec("svhn", "SVHN", ("train", "test", "extra"), "182 MB train, 64 MB test, 1.3 GB extra"),
        _Spec("dtd", "DTD", ("train", "val", "test"), "about 625 MB"),
    )
}


#: Where each MNIST-style set's files sit under the data root: ``<root>/<folder>/raw``.
MNIST_FOLDERS = {name: spec.class_name for name, spec in _SPECS.items() if spec.class_name in _MNIST_CLASSES}


def _unpack_gz(folder: str, names: list[str]) -> None:
    """Unpack ``name.gz`` into ``name`` for each missing ``name`` whose archive is there."""
    for name in names:
        target = os.path.join(folder, name)
        archive = target + ".gz"
        if not os.path.exists(target) and os.path.isfile(archive):
            partial = target + ".partial"
            with gzip.open(archive, "rb") as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, target)


def _mnist_family(spec: _Spec) -> bool:
    return spec.name in MNIST_FOLDERS


def _missing(spec: _Spec, root: str, split: str, partition: int) -> list[str]:
    """The files torchvision needs that are not under ``root`` (``.gz`` archives there are unpacked first)."""
    folder = spec.folder(root, split, partition)
    names = spec.files(split, partition)
    if _mnist_family(spec):
        processed = os.path.join(os.path.dirname(folder), "processed")
        if all(os.path.isfile(os.path.join(processed, f)) for f in ("training.pt", "test.pt")):
            return []  # torchvision's legacy cache, which it reads instead of raw/
        if os.path.isdir(folder):
            _unpack_gz(folder, names)
    return [n for n in names if not os.path.exists(os.path.join(folder, n))]


def system_copy(name: str) -> str | None:
    """The system folder (:data:`SYSTEM_DIRS`) holding every archive of dataset ``name``, or ``None``."""
    folder = SYSTEM_DIRS.get(name)
    if folder is None or name not in _SPECS:
        return None
    names = _SPECS[name].files("train", 1)
    return folder if all(os.path.isfile(os.path.join(folder, f + ".gz")) for f in names) else None


def _use_system_copy(spec: _Spec, root: str, split: str, partition: int) -> bool:
    """Unpack the system copy of ``spec`` into the data root when the root lacks files; True if it did.

    The system folder is only read. The archives are unpacked to ``<name>.partial`` and renamed
    into place, so an interrupted unpack leaves nothing torchvision would trust.
    """
    source = system_copy(spec.name)
    if source is None or not _missing(spec, root, split, partition):
        return False
    folder = spec.folder(root, split, partition)
    try:
        os.makedirs(folder, exist_ok=True)
        for name in spec.files(split, partition):
            target = os.path.join(folder, name)
            if os.path.exists(target):
                continue
            partial = target + ".partial"
            with gzip.open(os.path.join(source, name + ".gz"), "rb") as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, target)
    except OSError as error:
        raise DatasetNotFoundError(
            f"{spec.name!r} is installed in {source} (package {SYSTEM_PACKAGES.get(spec.name)}), but unpacking it "
            f"into the data root {os.path.abspath(folder)} failed ({error}). Choose a writable data root "
            "(data_root in the run config, 'Data root' in the app), or unpack the four .gz files there by hand."
        ) from error
    return True


def _how_to_get(spec: _Spec) -> str:
    hint = (
        f"Pass download=True (a run config's `download = true`, or 'Allow downloads' in the app) to fetch it with torchvision ({spec.download_size}), "
        "or put the files there by hand."
    )
    package = SYSTEM_PACKAGES.get(spec.name)
    if package:
        hint += (
            f" On Debian/Ubuntu, `sudo apt-get install {package}` installs it offline in "
            f"{SYSTEM_DIRS[spec.name]}, where oodviz finds it."
        )
    return hint


def _check_files(spec: _Spec, root: str, split: str, partition: int) -> None:
    missing = _missing(spec, root, split, partition)
    if missing:
        folder = spec.folder(root, split, partition)
        names = spec.files(split, partition)
        raise DatasetNotFoundError(
            f"Dataset {spec.name!r} (split {split!r}) is not under {os.path.abspath(folder)}: missing "
            f"{', '.join(missing)} (expected there: {', '.join(names)}). {_how_to_get(spec)}"
        )


def _construct(spec: _Spec, root: str, split: str, download: bool, partition: int):
    from torchvision import datasets

    cls = getattr(datasets, spec.class_name)
    if spec.class_name == "SVHN":
        return cls(root, split=split, download=download)
    if spec.class_name == "DTD":
        return cls(root, split=split, partition=partition, download=download)
    return cls(root, train=split == "train", download=download)


class TorchvisionSource(Source):
    """A torchvision dataset object behind the :class:`Source` interface."""

    def __init__(self, name: str, dataset, classes: list[str], labels: np.ndarray, files: list | None = None):
        self.name = name
        self.dataset = dataset
        self.classes = classes
        self._labels = labels
        self._files = files

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def load(self, index: int) -> tuple[Image.Image, int]:
        try:
            image, label = self.dataset[index]
        except OSError as error:  # DTD reads one JPEG per item; a missing or corrupt one is skipped
            raise UnreadableImageError(f"cannot read {self.item_name(index)}: {error}") from error
        return image, int(label)

    def item_name(self, index: int) -> str:
        if self._files is not None:
            return str(self._files[index])
        return f"{self.name} #{index}"


def load_torchvision(
    name: str, root: str, download: bool, split: str = "test", partition: int = 1
) -> TorchvisionSource:
    """Open torchvision dataset ``name`` (a key of the table above) from ``root``."""
    spec = _SPECS[name]
    if split not in spec.splits:
        raise ValueError(f"{name} has splits {', '.join(spec.splits)}, got split={split!r}")
    if spec.class_name == "DTD" and (isinstance(partition, bool) or partition not in range(1, 11)):
        raise ValueError(f"dtd partition must be an integer 1..10, got {partition!r}")
    _use_system_copy(spec, root, split, partition)  # data root first, then a system copy, then the download
    if not download:
        _check_files(spec, root, split, partition)
    try:
        dataset = _construct(spec, root, split, download, partition)
    except RuntimeError as error:
        if download:
            # torchvision raises RuntimeError (or URLError, an OSError) when fetching fails
            raise DatasetNotFoundError(
                f"Downloading {name!r} into {os.path.abspath(root)} failed ({error}). Check the network "
                f"connection, or put the files under {os.path.abspath(spec.folder(root, split, partition))} by hand."
            ) from error
        folder = os.path.abspath(spec.folder(root, split, partition))
        raise ValueError(
            f"torchvision refused the {name!r} files under {folder}: {error} They exist but do not match "
            "torchvision's checksums (a partial download or a different version); delete them and load "
            "with download=True to fetch fresh copies."
        ) from error
    except OSError as error:
        if not download:
            raise
        raise DatasetNotFoundError(
            f"Downloading {name!r} into {os.path.abspath(root)} failed ({error}). Check the network "
            f"connection, or put the files under {os.path.abspath(spec.folder(root, split, partition))} by hand."
        ) from error
    except (AssertionError, ValueError, TypeError, KeyError, EOFError, pickle.UnpicklingError) as error:
        # torchvision's parsers assert on malformed MNIST headers and fail in various ways on bad pickles / .mat files
        folder = os.path.abspath(spec.folder(root, split, partition))
        raise ValueError(
            f"The {name!r} files under {folder} could not be parsed ({type(error).__name__}: {error}); they look "
            "corrupt or truncated. Delete them and load with download=True to fetch fresh copies."
        ) from error
    files = None
    if spec.class_name == "SVHN":
        labels = np.asarray(dataset.labels, dtype=np.int64)
        classes = [str(d) for d in range(10)]
    elif spec.class_name == "DTD":
        # torchvision keeps DTD's labels and paths in private attributes; read them to avoid decoding every JPEG
        labels = np.asarray(dataset._labels, dtype=np.int64)
        classes = list(dataset.classes)
        files = list(dataset._image_files)
    else:
        labels = np.asarray(dataset.targets, dtype=np.int64)
        classes = list(dataset.classes)
    return TorchvisionSource(name, dataset, classes, labels, files)


def _loader(name: str):
    if name == "dtd":

        def loader(root: str, download: bool, split: str = "test", partition: int = 1) -> TorchvisionSource:
            return load_torchvision(name, root, download, split=split, partition=partition)

    else:

        def loader(root: str, download: bool, split: str = "test") -> TorchvisionSource:
            return load_torchvision(name, root, download, split=split)

    return loader


for _name, _kind, _group, _image, _description in (
    ("mnist", "id", None, "28x28 L", "MNIST handwritten digits (10 classes)"),
    ("fashion-mnist", "id", None, "28x28 L", "Fashion-MNIST clothing images (10 classes)"),
    ("kmnist", "id", None, "28x28 L", "Kuzushiji-MNIST cursive Japanese characters (10 classes)"),
    ("cifar10", "id", None, "32x32 RGB", "CIFAR-10 small photos (10 classes)"),
    ("cifar100", "id", None, "32x32 RGB", "CIFAR-100 small photos (100 classes)"),
    ("svhn", "ood", "far", "32x32 RGB", "SVHN street-view house numbers (far-OOD for CIFAR; as_ood=False for labels)"),
    ("dtd", "ood", "far", "varies RGB", "Describable Textures (47 classes; far-OOD; as_ood=False for labels)"),
):
    register_dataset(DatasetInfo(_name, _description, _kind, _group, "torchvision", _image), _loader(_name))
