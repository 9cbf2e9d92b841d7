"""The bundled default backbone: a small CNN for scikit-learn's ``load_digits``.

``load_digits`` ships with scikit-learn (no download): 1,797 greyscale 8 x 8 images of the
digits 0-9 with integer pixel values ``0..16`` (16 = full ink). ``digits-cnn`` is trained on
the digits 0-7 only; 8 and 9 are held out as near-OOD.

The split (:func:`digits_arrays`) is the one of the data layer (``oodviz.data.digits_split``,
datasets ``digits-train`` / ``digits-test`` / ``digits-heldout``), repeated here so that the
model does not depend on it (a test checks they agree): all 1,797 samples are split 75/25 with
``train_test_split(test_size=0.25, random_state=0, stratify=labels)`` over the ten classes;
``"train"`` / ``"test"`` keep the classes 0-7 of each part (1,081 / 362 samples); ``"ood"``
(alias ``"heldout"``) is every sample of classes 8 and 9 (354). ``scripts/train_digits_cnn.py``
trains on ``"train"`` and records the accuracy on ``"test"`` in ``oodviz/weights/digits-cnn.json``.

Pixel convention for images: the data layer serves uint8 greyscale images
``p = round(x * 255 / 16)`` (ink bright), and the transform maps ``p`` back to ``p / 255 * 16``.
:func:`as_served` applies that round trip to arrays; the model is trained and evaluated on it,
so the recorded accuracy is what the app measures.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

#: Classes the model was trained on (the digits 0-7); 8 and 9 are near-OOD.
DIGITS_CLASSES = [str(d) for d in range(8)]
DIGITS_OOD_CLASSES = [8, 9]
#: Mean and std of ``x / 16`` over every pixel of the ``"train"`` split as served (rounded to 4 places).
DIGITS_MEAN = 0.3034
DIGITS_STD = 0.3770
DIGITS_SPLIT_SEED = 0
DIGITS_TEST_SIZE = 0.25

#: Where the bundled weights live: ``oodviz/weights``, package data (installed with the package).
WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights"
DIGITS_WEIGHTS = WEIGHTS_DIR / "digits-cnn.pt"
DIGITS_METADATA = WEIGHTS_DIR / "digits-cnn.json"


class DigitsArrays(NamedTuple):
    """One split of ``load_digits``: ``images`` float32 ``[N, 8, 8]`` in ``0..16``, ``labels``
    int64 ``[N]`` (the true digit, also 8/9 for the ``"ood"`` split) and ``index`` int64 ``[N]``
    (row in ``load_digits()``, to map a sample back to its image)."""

    images: np.ndarray
    labels: np.ndarray
    index: np.ndarray


def digits_arrays(split: str) -> DigitsArrays:
    """The ``"train"``, ``"test"`` (digits 0-7) or ``"ood"`` / ``"heldout"`` (digits 8, 9) split.

    Deterministic and offline (the data ships with scikit-learn); indices ascending. See the
    module docstring for the split rule.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if split not in ("train", "test", "ood", "heldout"):
        raise ValueError(f"split must be 'train', 'test' or 'ood' (alias 'heldout'), got {split!r}")
    data, target = load_digits(return_X_y=True)
    if split in ("ood", "heldout"):
        index = np.flatnonzero(np.isin(target, DIGITS_OOD_CLASSES))
    else:
        _, test_index = train_test_split(
            np.arange(len(target)), test_size=DIGITS_TEST_SIZE, random_state=DIGITS_SPLIT_SEED, stratify=target
        )
        is_test = np.zeros(len(target), dtype=bool)
        is_test[test_index] = True
        keep = (target < len(DIGITS_CLASSES)) & (is_test if split == "test" else ~is_test)
        index = np.flatnonzero(keep)
    return DigitsArrays(
        images=data[index].reshape(-1, 8, 8).astype(np.float32),
        labels=target[index].astype(np.int64),
        index=index.astype(np.int64),
    )


def as_served(images: np.ndarray) -> np.ndarray:
    """Digits values ``0..16`` as the app sees them: quantised to uint8 pixels and mapped back
    (``round(x * 255 / 16) * 16 / 255``), float32."""
    pixels = np.round(np.asarray(images, dtype=np.float64) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    return pixels.astype(np.float32) * np.float32(16.0 / 255.0)


def normalize_digits(images: np.ndarray | Tensor) -> Tensor:
    """Digits values ``0..16``, shape ``[N, 8, 8]`` or ``[8, 8]`` -> model input ``[N, 1, 8, 8]`` /
    ``[1, 8, 8]``: ``(x / 16 - DIGITS_MEAN) / DIGITS_STD`` as float32."""
    x = torch.as_tensor(np.asarray(images, dtype=np.float32) if not isinstance(images, Tensor) else images)
    x = x.float()
    if x.shape[-2:] != (8, 8):
        raise ValueError(f"digits images must be 8 x 8 (shape [..., 8, 8]), got shape {tuple(x.shape)}")
    return ((x / 16.0 - DIGITS_MEAN) / DIGITS_STD).unsqueeze(-3)


class DigitsTransform:
    """PIL image of any size and mode -> normalised digits input, float32 ``[1, 8, 8]``.

    Converts to greyscale, resizes to 8 x 8 with an antialiasing box filter (no-op for 8 x 8
    input), maps pixel ``p`` in ``0..255`` to ``p / 255 * 16`` and normalises like
    :func:`normalize_digits`. Picklable, so it works in DataLoader worker processes.
    """

    size = (8, 8)

    def __call__(self, image: Image.Image) -> Tensor:
        if isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        if not isinstance(image, Image.Image):
            raise ValueError(f"DigitsTransform expects a PIL image, got {type(image).__name__}")
        grey = image.convert("L")
        if grey.size != self.size:
            grey = grey.resize(self.size, Image.Resampling.BOX)
        values = np.asarray(grey, dtype=np.float32) * (16.0 / 255.0)
        return normalize_digits(values)

    def batch(self, pixels: np.ndarray) -> Tensor | None:
        """Many images at once, as tensors: uint8 greyscale ``[b, 8, 8]`` -> float32 ``[b, 1, 8, 8]``, the same
        numbers as ``self(Image.fromarray(pixels[i]))`` for every ``i``; ``None`` for other sizes or RGB
        pixels (those need PIL's resize or greyscale conversion: transform them one by one)."""
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[1:] != self.size[::-1]:
            return None
        return normalize_digits(torch.from_numpy(pixels).float() * (16.0 / 255.0))

    def __repr__(self) -> str:
        return f"DigitsTransform(greyscale, resize 8x8 box, 0..255 -> 0..16, mean={DIGITS_MEAN}, std={DIGITS_STD})"


class DigitsCNN(nn.Module):
    """Small CNN for normalised 8 x 8 digits, input ``[B, 1, 8, 8]``.

    ``conv(1->16) - ReLU - conv(16->32) - ReLU - maxpool 2 - conv(32->64) - ReLU`` (3 x 3 kernels,
    padding 1), global average pooling -> 64-d features ``[B, 64]`` -> ``fc = Linear(64, C)``.
    """

    feature_dim = 64

    def __init__(self, num_classes: int = len(DIGITS_CLASSES)):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(self.feature_dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """``x [B, 1, 8, 8]`` -> logits ``[B, C]``."""
        return self.fc(self.flatten(self.avgpool(self.features(x))))


def build_digits_cnn(num_classes: int = len(DIGITS_CLASSES)) -> DigitsCNN:
    return DigitsCNN(num_classes)
