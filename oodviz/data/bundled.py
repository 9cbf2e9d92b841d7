"""Offline datasets built from data that ships with scikit-learn: no download, no files.

**Digits** (``sklearn.datasets.load_digits``, 1797 greyscale 8x8 images, values 0..16, scaled
here to 0..255 uint8 / PIL mode ``"L"``):

- all 1797 digits are split 75/25 (1347/450), stratified by class over all ten classes, with
  ``random_state=0`` (``train_test_split``); :func:`digits_split` returns the arrays and their
  indices in ``load_digits()``. (As for every source, a dataset's ``source_index`` indexes the
  registered dataset itself; ``ds.item_name(i)`` names the ``load_digits()`` index.)
- ID = classes :data:`DIGITS_ID_CLASSES` (0..7): ``digits-train`` (1081 images) and
  ``digits-test`` (362), labels 0..7. The bundled ``digits-cnn`` model trains on ``digits-train``.
- ``digits-heldout`` (near-OOD, semantic shift): **every** image of :data:`DIGITS_HELD_OUT`
  (8 and 9, 354 images, from both splits). They are never in an ID set, so using all of
  them is safe and gives four times more OOD samples than the test split alone.
- ``digits-inverted`` and ``digits-rotated`` (near-OOD, *covariate* shift: the ID test digits,
  same classes, with intensities inverted / rotated 90 degrees counter-clockwise; 362 each).
  They are OOD in the sense that the classifier's inputs left its training distribution,
  not in the sense of new classes.

**Photo patches** (far-OOD): ``photo-patches`` cuts textured patches from the two photos in
``sklearn.datasets.load_sample_images()`` (china.jpg, flower.jpg).
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
from PIL import Image

from oodviz.data.base import Source
from oodviz.data.registry import DatasetInfo, register_dataset

DIGITS_ID_CLASSES = tuple(range(8))
DIGITS_HELD_OUT = (8, 9)
DIGITS_SPLIT_SEED = 0
DIGITS_TEST_SIZE = 0.25
DIGITS_SPLITS = ("train", "test", "heldout")


@lru_cache(maxsize=1)
def all_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All digits as uint8 ``[1797, 8, 8]`` (0..255), labels ``[1797]``, test mask ``[1797]``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    index = np.arange(len(labels))
    _, test_index = train_test_split(index, test_size=DIGITS_TEST_SIZE, stratify=labels, random_state=DIGITS_SPLIT_SEED)
    is_test = np.zeros(len(labels), dtype=bool)
    is_test[test_index] = True
    for array in (images, labels, is_test):
        array.setflags(write=False)
    return images, labels, is_test


def digits_split(split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bundled digits of one split: ``(images, labels, source_indices)``.

    :param split: ``"train"`` or ``"test"`` (ID classes 0..7 of the 75/25 stratified split),
        or ``"heldout"`` (every image of classes 8 and 9)
    :returns: images uint8 ``[N, 8, 8]`` (0..255, the pixels the datasets serve), labels int64
        ``[N]`` (the digit), source_indices int64 ``[N]`` (indices into ``load_digits()``, ascending)
    """
    if split not in DIGITS_SPLITS:
        raise ValueError(f"digits split must be one of {', '.join(DIGITS_SPLITS)}, got {split!r}")
    images, labels, is_test = all_digits()
    if split == "heldout":
        keep = np.isin(labels, DIGITS_HELD_OUT)
    else:
        keep = np.isin(labels, DIGITS_ID_CLASSES) & (is_test if split == "test" else ~is_test)
    source_indices = np.flatnonzero(keep).astype(np.int64)
    return images[source_indices].copy(), labels[source_indices].copy(), source_indices


class ArraySource(Source):
    """Images held in memory: uint8 ``[N, H, W]`` (mode ``"L"``) or ``[N, H, W, 3]`` (``"RGB"``)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray | None, classes: list[str], names=None):
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            raise ValueError(f"images must be uint8 [N, H, W] or [N, H, W, 3], got {images.dtype} {images.shape}")
        self.images = images
        self._labels = np.full(len(images), -1, np.int64) if labels is None else np.asarray(labels, np.int64)
        self.classes = classes
        self._names = names

    def __len__(self) -> int:
        return len(self.images)

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def load(self, index: int) -> tuple[Image.Image, int]:
        array = self.images[index]
        # uint8 [H, W] -> mode "L", [H, W, 3] -> "RGB" (Pillow infers it; its mode= argument is deprecated)
        return Image.fromarray(array), int(self._labels[index])

    def arrays(self, indices: np.ndarray) -> np.ndarray:
        return self.images[np.asarray(indices, dtype=np.int64)]

    def item_name(self, index: int) -> str:
        return self._names[index] if self._names is not None else f"#{index}"


def _digit_names(prefix: str, source_indices: np.ndarray) -> list[str]:
    return [f"{prefix} load_digits()[{i}]" for i in source_indices]


def load_digits_split(root: str, download: bool, split: str = "train") -> ArraySource:
    images, labels, source_indices = digits_split(split)
    if split == "heldout":
        return ArraySource(images, None, [], _digit_names("digit", source_indices))
    return ArraySource(images, labels, [str(c) for c in DIGITS_ID_CLASSES], _digit_names("digit", source_indices))


def _id_test_digits() -> tuple[np.ndarray, np.ndarray]:
    images, _, source_indices = digits_split("test")
    return images, source_indices


def load_digits_inverted(root: str, download: bool) -> ArraySource:
    images, source_indices = _id_test_digits()
    return ArraySource(255 - images, None, [], _digit_names("inverted digit", source_indices))


def load_digits_rotated(root: str, download: bool) -> ArraySource:
    images, source_indices = _id_test_digits()
    rotated = np.ascontiguousarray(np.rot90(images, k=1, axes=(1, 2)))
    return ArraySource(rotated, None, [], _digit_names("rotated digit", source_indices))


def photo_patches(
    n: int = 500, size: int = 8, channels: int = 1, window: int | None = None, seed: int = 0, min_std: float = 12.0
):
    """Textured patches from sklearn's sample photos: uint8 ``[n, size, size]`` (or ``[..., 3]``) and names.

    Each photo (427 x 640) is cut on a grid of ``window x window`` cells with a stride of
    ``min(window // 2, 16)`` and a seeded offset; each cell is box-downsampled to ``size x size``.
    ``window`` defaults to ``max(size, min(3 * size, 32))``: an 8x8 patch summarises 24x24 photo
    pixels (texture, not flat colour); 32x32 and larger crops are textured as they are. Cells whose pixel
    standard deviation after downsampling is below ``min_std`` (sky, blur) are dropped; ``n``
    of the rest are drawn with the seed.
    """
    from sklearn.datasets import load_sample_images

    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 (greyscale) or 3 (RGB), got {channels}")
    if size < 1 or n < 1:
        raise ValueError(f"size and n must be positive integers, got size={size}, n={n}")
    if window is None:
        window = max(size, min(3 * size, 32))
    if not size <= window <= 427:
        raise ValueError(f"window must be between the patch size ({size}) and the photo height (427), got {window}")
    rng = np.random.default_rng(seed)
    photos = load_sample_images()
    stride = max(1, min(window // 2, 16))
    patches, names = [], []
    for photo, path in zip(photos.images, photos.filenames):
        image = Image.fromarray(photo).convert("L" if channels == 1 else "RGB")
        height, width = photo.shape[:2]
        oy, ox = (int(v) for v in rng.integers(0, stride, size=2))
        for y in range(oy, height - window + 1, stride):
            for x in range(ox, width - window + 1, stride):
                cell = image.crop((x, y, x + window, y + window)).resize((size, size), Image.Resampling.BOX)
                array = np.asarray(cell, dtype=np.uint8)
                if array.std() >= min_std:
                    patches.append(array)
                    names.append(f"{os.path.basename(path)} y={y} x={x} {window}px")
    if len(patches) < n:
        raise ValueError(
            f"Only {len(patches)} photo patches pass min_std={min_std} with window={window}; "
            "ask for fewer (n), a smaller window or a lower min_std"
        )
    chosen = np.sort(rng.choice(len(patches), size=n, replace=False))
    return np.stack([patches[i] for i in chosen]), [names[i] for i in chosen]


def load_photo_patches(
    root: str,
    download: bool,
    n: int = 500,
    size: int = 8,
    channels: int = 1,
    window: int | None = None,
    patch_seed: int = 0,
) -> ArraySource:
    images, names = photo_patches(n=n, size=size, channels=channels, window=window, seed=patch_seed)
    return ArraySource(images, None, [], names)


def _digits_loader(split: str):
    def loader(root: str, download: bool) -> ArraySource:
        return load_digits_split(root, download, split)

    return loader


_ID = "scikit-learn's bundled 8x8 digits (classes 0-7)"
register_dataset(
    DatasetInfo("digits-train", f"{_ID}, training split (75%, stratified, seed 0)", "id", None, "bundled", "8x8 L"),
    _digits_loader("train"),
)
register_dataset(
    DatasetInfo("digits-test", f"{_ID}, test split (25%, stratified, seed 0)", "id", None, "bundled", "8x8 L"),
    _digits_loader("test"),
)
register_dataset(
    DatasetInfo(
        "digits-heldout",
        "Digits 8 and 9, never used for training (semantic shift: unseen classes)",
        "ood",
        "near",
        "bundled",
        "8x8 L",
    ),
    _digits_loader("heldout"),
)
register_dataset(
    DatasetInfo(
        "digits-inverted",
        "ID test digits with inverted intensities (covariate shift: same classes)",
        "ood",
        "near",
        "bundled",
        "8x8 L",
    ),
    load_digits_inverted,
)
register_dataset(
    DatasetInfo(
        "digits-rotated",
        "ID test digits rotated 90 degrees (covariate shift: same classes)",
        "ood",
        "near",
        "bundled",
        "8x8 L",
    ),
    load_digits_rotated,
)
register_dataset(
    DatasetInfo(
        "photo-patches",
        "Textured patches cut from scikit-learn's sample photos (china, flower)",
        "ood",
        "far",
        "bundled",
        "8x8 L (size, channels)",
    ),
    load_photo_patches,
)
