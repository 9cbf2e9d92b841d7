"""Synthetic noise images (far-OOD): ``noise-gaussian`` and ``noise-uniform``.

Item ``i`` is drawn from its own generator, ``numpy.random.default_rng([noise_seed, kind, i])``,
so it is the same image in every epoch, in every DataLoader worker and in every subsample
(pytorch-ood's noise sets draw from the global RNG state, which each worker inherits, so
workers return duplicate images). Parameters: ``n`` items (default 500), ``size`` (an int or
``(height, width)``, default 8) and ``channels`` (1 = mode ``"L"``, 3 = ``"RGB"``), so the same
sets fit the bundled 8x8 digits model and 32x32 RGB models.

- gaussian: pixel = clip(round(255 * N(0.5, 0.25^2)), 0, 255)
- uniform: pixel uniform on the integers 0..255
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from oodviz.data.base import Source
from oodviz.data.registry import DatasetInfo, register_dataset

NOISE_KINDS = {"gaussian": 1, "uniform": 2}


def _size(size) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        height = width = int(size)
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        height, width = (int(v) for v in size)
    else:
        raise ValueError(f"size must be an int or (height, width), got {size!r}")
    if height < 1 or width < 1:
        raise ValueError(f"size must be positive, got {size!r}")
    return height, width


class NoiseSource(Source):
    """``n`` noise images of ``size`` and ``channels``; item ``i`` depends only on (noise_seed, kind, i)."""

    classes: list[str] = []

    def __init__(self, kind: str, n: int = 500, size=8, channels: int = 1, noise_seed: int = 0):
        if kind not in NOISE_KINDS:
            raise ValueError(f"noise kind must be one of {', '.join(NOISE_KINDS)}, got {kind!r}")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n (number of noise images) must be a positive integer, got {n!r}")
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 (greyscale, mode 'L') or 3 (RGB), got {channels!r}")
        if isinstance(noise_seed, bool) or not isinstance(noise_seed, (int, np.integer)) or noise_seed < 0:
            raise ValueError(f"noise_seed must be a non-negative integer, got {noise_seed!r}")
        self.kind = kind
        self.n = int(n)
        self.height, self.width = _size(size)
        self.channels = channels
        self.noise_seed = int(noise_seed)

    def __len__(self) -> int:
        return self.n

    @property
    def labels(self) -> np.ndarray:
        return np.full(self.n, -1, dtype=np.int64)

    def array(self, index: int) -> np.ndarray:
        """Item ``index`` as uint8 ``[H, W]`` (channels 1) or ``[H, W, 3]``."""
        rng = np.random.default_rng([self.noise_seed, NOISE_KINDS[self.kind], int(index)])
        shape = (self.height, self.width) if self.channels == 1 else (self.height, self.width, 3)
        if self.kind == "gaussian":
            values = np.round(255.0 * rng.normal(0.5, 0.25, size=shape))
            return values.clip(0, 255).astype(np.uint8)
        return rng.integers(0, 256, size=shape, dtype=np.uint8)

    def load(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.array(index)), -1

    def arrays(self, indices: np.ndarray) -> np.ndarray:
        shape = (self.height, self.width) if self.channels == 1 else (self.height, self.width, 3)
        out = np.empty((len(indices), *shape), dtype=np.uint8)
        for row, index in enumerate(indices):
            out[row] = self.array(int(index))
        return out

    def item_name(self, index: int) -> str:
        return f"{self.kind} noise #{index} (seed {self.noise_seed})"


def load_gaussian(root: str, download: bool, n: int = 500, size=8, channels: int = 1, noise_seed: int = 0):
    return NoiseSource("gaussian", n=n, size=size, channels=channels, noise_seed=noise_seed)


def load_uniform(root: str, download: bool, n: int = 500, size=8, channels: int = 1, noise_seed: int = 0):
    return NoiseSource("uniform", n=n, size=size, channels=channels, noise_seed=noise_seed)


register_dataset(
    DatasetInfo(
        "noise-gaussian",
        "Gaussian pixel noise, mean 0.5, std 0.25 (seeded per image)",
        "ood",
        "far",
        "generated",
        "8x8 L (size, channels)",
    ),
    load_gaussian,
)
register_dataset(
    DatasetInfo(
        "noise-uniform",
        "Uniform pixel noise on 0..255 (seeded per image)",
        "ood",
        "far",
        "generated",
        "8x8 L (size, channels)",
    ),
    load_uniform,
)
