"""The Fashion-MNIST preset's backbone: a small CNN for 28 x 28 greyscale clothing images.

``fashion-cnn`` is trained on 8 of Fashion-MNIST's 10 classes (:data:`FASHION_CLASSES`, in
Fashion-MNIST order, labels 0..7); Shirt (6) and Ankle boot (9) are held out as near-OOD. The
data come from the data layer (``oodviz.data.fashion_split``, datasets ``fashion-mnist-id`` /
``fashion-mnist-heldout``); the class list is repeated here so that the model does not depend
on the data layer (a test checks they agree). ``scripts/train_fashion_cnn.py`` trains it on
the 48,000 ID training images and records the accuracy on the 8,000 ID test images in
``oodviz/weights/fashion-cnn.json``.

Input convention: a uint8 greyscale pixel ``p`` becomes ``(p / 255 - FASHION_MEAN) / FASHION_STD``;
:class:`FashionTransform` converts any PIL image to greyscale and resizes it to 28 x 28 first.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from oodviz.models.digits import WEIGHTS_DIR

#: The 8 classes the model was trained on (Fashion-MNIST classes 0-5, 7, 8, relabelled 0..7).
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Sneaker", "Bag"]
#: Held out as near-OOD (Fashion-MNIST labels 6 and 9).
FASHION_OOD_CLASSES = ["Shirt", "Ankle boot"]
#: Mean and std of ``p / 255`` over every pixel of the 48,000 ID training images (rounded to 4 places).
FASHION_MEAN = 0.2784
FASHION_STD = 0.3520

FASHION_WEIGHTS = WEIGHTS_DIR / "fashion-cnn.pt"
FASHION_METADATA = WEIGHTS_DIR / "fashion-cnn.json"


def normalize_fashion(images: np.ndarray | Tensor) -> Tensor:
    """uint8-range pixels ``0..255``, shape ``[N, 28, 28]`` or ``[28, 28]`` -> model input ``[N, 1, 28, 28]``
    / ``[1, 28, 28]``: ``(p / 255 - FASHION_MEAN) / FASHION_STD`` as float32."""
    x = images.float() if isinstance(images, Tensor) else torch.from_numpy(np.array(images, dtype=np.float32))
    if x.shape[-2:] != (28, 28):
        raise ValueError(f"Fashion-MNIST images must be 28 x 28 (shape [..., 28, 28]), got shape {tuple(x.shape)}")
    return ((x / 255.0 - FASHION_MEAN) / FASHION_STD).unsqueeze(-3)


class FashionTransform:
    """PIL image of any size and mode -> normalised input, float32 ``[1, 28, 28]``.

    Converts to greyscale (``"L"``) and resizes to 28 x 28 with bilinear interpolation (Pillow
    antialiases when shrinking; no-op for 28 x 28 input), then normalises like
    :func:`normalize_fashion`. Picklable, so it works in DataLoader worker processes.
    """

    size = (28, 28)
    #: The normalisation, per channel, in units of ``p / 255`` (read by e.g. ODIN to step in pixel units).
    mean = (FASHION_MEAN,)
    std = (FASHION_STD,)

    def __call__(self, image: Image.Image) -> Tensor:
        if isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        if not isinstance(image, Image.Image):
            raise ValueError(f"FashionTransform expects a PIL image, got {type(image).__name__}")
        grey = image.convert("L")
        if grey.size != self.size:
            grey = grey.resize(self.size, Image.Resampling.BILINEAR)
        return normalize_fashion(np.asarray(grey, dtype=np.uint8))

    def batch(self, pixels: np.ndarray) -> Tensor | None:
        """Many images at once, as tensors: uint8 greyscale ``[b, 28, 28]`` -> float32 ``[b, 1, 28, 28]``, the
        same numbers as ``self(Image.fromarray(pixels[i]))`` for every ``i``; ``None`` for other sizes or RGB
        pixels (those need PIL's resize or greyscale conversion: transform them one by one)."""
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[1:] != self.size[::-1]:
            return None
        return normalize_fashion(torch.from_numpy(pixels))

    def __repr__(self) -> str:
        return f"FashionTransform(greyscale, resize 28x28 bilinear, p / 255, mean={FASHION_MEAN}, std={FASHION_STD})"


def _block(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]


class FashionCNN(nn.Module):
    """Small CNN for normalised 28 x 28 greyscale images, input ``[B, 1, 28, 28]``.

    ``block(1->16) - maxpool 2 - block(16->32) - maxpool 2 - block(32->64) - block(64->128)``, where
    a block is conv 3 x 3 (padding 1, no bias) - BatchNorm - ReLU; global average pooling of the
    7 x 7 maps -> 128-d features ``[B, 128]`` -> ``fc = Linear(128, C)``. About 98,000 parameters;
    small enough to train on 2 CPU cores in minutes.
    """

    feature_dim = 128

    def __init__(self, num_classes: int = len(FASHION_CLASSES)):
        super().__init__()
        self.features = nn.Sequential(
            *_block(1, 16),
            nn.MaxPool2d(2),  # 14 x 14
            *_block(16, 32),
            nn.MaxPool2d(2),  # 7 x 7
            *_block(32, 64),
            *_block(64, self.feature_dim),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(self.feature_dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """``x [B, 1, 28, 28]`` -> logits ``[B, C]``."""
        return self.fc(self.flatten(self.avgpool(self.features(x))))


def build_fashion_cnn(num_classes: int = len(FASHION_CLASSES)) -> FashionCNN:
    return FashionCNN(num_classes)
