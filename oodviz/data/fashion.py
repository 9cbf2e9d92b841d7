"""The Fashion-MNIST preset's datasets: 8 ID classes, 2 held-out classes, shifted copies, 28x28 digits.

The images are the real Fashion-MNIST (Zalando, MIT licence: 60,000 train + 10,000 test
greyscale 28 x 28 images of 10 clothing classes), read through torchvision's ``FashionMNIST``
by the ``fashion-mnist`` source (:mod:`.torchvision_sets`): from ``<root>/FashionMNIST/raw/``,
else from Debian's package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``,
unpacked into the data root on first use), else downloaded when ``download=True``.

**Classes.** :data:`FASHION_HELD_OUT` = (6 Shirt, 9 Ankle boot) are held out; the other eight,
:data:`FASHION_ID_CLASSES` = (0, 1, 2, 3, 4, 5, 7, 8), keep their Fashion-MNIST order and are
relabelled 0..7: T-shirt/top, Trouser, Pullover, Dress, Coat, Sandal, Sneaker, Bag
(:data:`FASHION_ID_NAMES`). Each held-out class has close relatives among the ID classes
(a shirt looks like a T-shirt, a pullover or a coat; an ankle boot like a sneaker or a sandal),
so they test whether a detector notices a *new class* rather than a new kind of picture.

==========================  ========================================================  =====  ======
name                        what                                                      items  group
==========================  ========================================================  =====  ======
``fashion-mnist-id``        the 8 ID classes, ``split="train"`` (48,000) / ``"test"``  8,000  ID
``fashion-mnist-heldout``   Shirt and Ankle boot of ``split`` (default ``"test"``)    2,000  near
``fashion-mnist-inverted``  the ID test images with inverted intensities              8,000  near
``fashion-mnist-rotated``   the ID test images rotated 90 degrees counter-clockwise  8,000  near
``digits-28``               all 1,797 bundled 8x8 digits, upscaled MNIST-style        1,797  far
==========================  ========================================================  =====  ======

The inverted and rotated sets are a *covariate* shift (same classes, the classifier's inputs
left its training distribution), grouped as near-OOD like ``digits-inverted`` /
``digits-rotated``. ``digits-28`` is the classic Fashion-MNIST vs MNIST pair without MNIST's
download: each bundled digit is resized to 20 x 20 (bilinear) and centred in a 28 x 28 black
frame, as MNIST draws its digits. Photo patches and noise at 28 x 28 complete the preset
(``photo-patches`` / ``noise-*`` with ``size=28``).

``source_index`` of every item indexes the registered dataset; ``item_name`` names the
Fashion-MNIST split, its index there and the original class.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from PIL import Image

from oodviz.data.bundled import ArraySource, all_digits
from oodviz.data.registry import DatasetInfo, register_dataset
from oodviz.data.torchvision_sets import load_torchvision

#: Fashion-MNIST's ten classes, index = its label (as torchvision names them).
FASHION_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
#: Held out as near-OOD: Shirt and Ankle boot.
FASHION_HELD_OUT = (6, 9)
#: The ID classes, in Fashion-MNIST order; ID label ``k`` is Fashion-MNIST class ``FASHION_ID_CLASSES[k]``.
FASHION_ID_CLASSES = tuple(c for c in range(10) if c not in FASHION_HELD_OUT)
FASHION_ID_NAMES = [FASHION_CLASSES[c] for c in FASHION_ID_CLASSES]
FASHION_SPLITS = ("train", "test")
#: Counts of the real files: 60,000 / 10,000 images, 6,000 / 1,000 per class.
FASHION_SIZES = {"train": 60_000, "test": 10_000}

_cache: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
_lock = threading.Lock()


def fashion_arrays(split: str, root: str = "data", download: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """All of one Fashion-MNIST split: images uint8 ``[N, 28, 28]`` and labels int64 ``[N]`` (0..9).

    Read once per (data root, split) and process through torchvision's ``FashionMNIST`` (see
    the module docstring for where the files are looked for); read-only arrays.
    """

    if split not in FASHION_SPLITS:
        raise ValueError(f"Fashion-MNIST split must be one of {', '.join(FASHION_SPLITS)}, got {split!r}")
    key = (os.path.abspath(root), split)
    with _lock:
        if key not in _cache:
            source = load_torchvision("fashion-mnist", root, download, split=split)
            images = source.dataset.data.numpy()
            labels = np.asarray(source.labels, dtype=np.int64)
            for array in (images, labels):
                array.setflags(write=False)
            _cache[key] = images, labels
        return _cache[key]


def fashion_split(
    split: str, root: str = "data", download: bool = False, held_out: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ID (or held-out) part of a Fashion-MNIST split: ``(images, labels, source_indices)``.

    :param split: ``"train"`` or ``"test"``
    :param held_out: ``False``: the 8 ID classes, labels remapped to 0..7 (:data:`FASHION_ID_NAMES`);
        ``True``: Shirt and Ankle boot, labels their Fashion-MNIST class (6 or 9)
    :returns: images uint8 ``[N, 28, 28]``, labels int64 ``[N]``, source_indices int64 ``[N]``
        (indices into the Fashion-MNIST split, ascending)
    """
    images, labels = fashion_arrays(split, root, download)
    classes = FASHION_HELD_OUT if held_out else FASHION_ID_CLASSES
    source_indices = np.flatnonzero(np.isin(labels, classes)).astype(np.int64)
    kept = labels[source_indices]
    if not held_out:
        remap = np.full(10, -1, dtype=np.int64)
        remap[list(FASHION_ID_CLASSES)] = np.arange(len(FASHION_ID_CLASSES))
        kept = remap[kept]
    return images[source_indices], kept, source_indices


def _names(prefix: str, split: str, labels: np.ndarray, source_indices: np.ndarray) -> list[str]:
    return [f"{prefix}fashion-mnist {split}[{i}] {FASHION_CLASSES[c]}" for i, c in zip(source_indices, labels)]


def _check_split(split: str) -> None:
    if split not in FASHION_SPLITS:
        raise ValueError(f"split must be one of {', '.join(FASHION_SPLITS)}, got {split!r}")


def load_fashion_id(root: str, download: bool, split: str = "train") -> ArraySource:
    _check_split(split)
    images, labels, source_indices = fashion_split(split, root, download)
    original = np.asarray(FASHION_ID_CLASSES)[labels]
    return ArraySource(images, labels, list(FASHION_ID_NAMES), _names("", split, original, source_indices))


def load_fashion_heldout(root: str, download: bool, split: str = "test") -> ArraySource:
    _check_split(split)
    images, labels, source_indices = fashion_split(split, root, download, held_out=True)
    return ArraySource(images, None, [], _names("", split, labels, source_indices))


def _id_test(root: str, download: bool) -> tuple[np.ndarray, list[str]]:
    images, labels, source_indices = fashion_split("test", root, download)
    return images, _names("", "test", np.asarray(FASHION_ID_CLASSES)[labels], source_indices)


def load_fashion_inverted(root: str, download: bool) -> ArraySource:
    images, names = _id_test(root, download)
    return ArraySource(255 - images, None, [], [f"inverted {n}" for n in names])


def load_fashion_rotated(root: str, download: bool) -> ArraySource:
    images, names = _id_test(root, download)
    rotated = np.ascontiguousarray(np.rot90(images, k=1, axes=(1, 2)))
    return ArraySource(rotated, None, [], [f"rotated {n}" for n in names])


def digits_28(box: int = 20, size: int = 28) -> np.ndarray:
    """Every bundled 8x8 digit (``load_digits()`` order, 1797) MNIST-style: uint8 ``[1797, size, size]``.

    Each digit (ink bright, 0..255) is resized to ``box x box`` with bilinear interpolation and
    centred in a black ``size x size`` frame (MNIST: a 20 x 20 box in 28 x 28).
    """
    if not 1 <= box <= size:
        raise ValueError(f"box must be between 1 and size ({size}), got {box}")
    images = all_digits()[0]
    out = np.zeros((len(images), size, size), dtype=np.uint8)
    top = (size - box) // 2
    for i, image in enumerate(images):
        resized = Image.fromarray(image).resize((box, box), Image.Resampling.BILINEAR)
        out[i, top : top + box, top : top + box] = np.asarray(resized)
    return out


def load_digits_28(root: str, download: bool) -> ArraySource:
    images = digits_28()
    labels = all_digits()[1]
    return ArraySource(images, None, [], [f"digit {d} load_digits()[{i}] at 28x28" for i, d in enumerate(labels)])


_ID = "Fashion-MNIST, 8 classes (Shirt and Ankle boot held out), relabelled 0-7"
register_dataset(
    DatasetInfo(
        "fashion-mnist-id", f"{_ID}; split train (48,000) or test (8,000)", "id", None, "torchvision", "28x28 L"
    ),
    load_fashion_id,
)
register_dataset(
    DatasetInfo(
        "fashion-mnist-heldout",
        "Fashion-MNIST Shirt and Ankle boot, never trained on (semantic shift: unseen classes)",
        "ood",
        "near",
        "torchvision",
        "28x28 L",
    ),
    load_fashion_heldout,
)
register_dataset(
    DatasetInfo(
        "fashion-mnist-inverted",
        "Fashion-MNIST ID test images with inverted intensities (covariate shift: same classes)",
        "ood",
        "near",
        "torchvision",
        "28x28 L",
    ),
    load_fashion_inverted,
)
register_dataset(
    DatasetInfo(
        "fashion-mnist-rotated",
        "Fashion-MNIST ID test images rotated 90 degrees (covariate shift: same classes)",
        "ood",
        "near",
        "torchvision",
        "28x28 L",
    ),
    load_fashion_rotated,
)
register_dataset(
    DatasetInfo(
        "digits-28",
        "scikit-learn's bundled digits upscaled MNIST-style to 28x28 (far-OOD for Fashion-MNIST)",
        "ood",
        "far",
        "bundled",
        "28x28 L",
    ),
    load_digits_28,
)
