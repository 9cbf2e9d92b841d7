"""Reading a split: :class:`FeatureStore` maps the arrays with ``np.load(mmap_mode="r")``.

:func:`open_store` opens a store that must exist, :func:`find_store` one that may, and
:func:`list_stores` every complete store under a root; unfinished and damaged directories are
never opened as stores. ``store.batches()`` streams a split as :class:`oodviz.Batch` chunks
(:mod:`oodviz.engine.store.batches`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from oodviz.engine.store.batches import BATCH_FIELDS, DeviceSplit, StoreBatches, check_include
from oodviz.engine.store.integrity import verify_store
from oodviz.engine.store.keys import OLD_MARK, STORE_FORMAT, TMP_MARK, StoreError, check_key

logger = logging.getLogger("oodviz.engine")


class FeatureStore:
    """One extracted split on disk, read through memory maps.

    Attributes: ``path``, ``key``, ``meta`` (the parsed ``meta.json``), ``n`` (rows),
    ``feature_dim`` (``D``), ``num_classes`` (``C``), ``feature_dtype``; the arrays
    ``features`` ``[N, D]``, ``logits`` ``[N, C]``, ``labels``, ``predictions``, ``indices``
    ``[N]`` (read-only ``np.memmap``); ``head`` (``(weight [C, D], bias [C])`` tensors or ``None``).

    Use :func:`open_store` (or the return value of :func:`oodviz.engine.extract`) to get one.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.key = check_key(self.path.name)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise StoreError(
                f"{self.path} is not a complete feature store (no meta.json); extract the split again "
                "(an interrupted extraction never gets one)"
            )
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise StoreError(f"{meta_path} cannot be read ({err}); delete {self.path} and extract again") from None
        if not isinstance(self.meta, dict):
            raise StoreError(f"{meta_path} is not a JSON object; delete {self.path} and extract again")
        if not self.meta.get("complete") or self.meta.get("format") != STORE_FORMAT:
            raise StoreError(
                f"{self.path} is incomplete or in store format {self.meta.get('format')!r} (this oodviz reads "
                f"{STORE_FORMAT}); delete it and extract again"
            )
        try:
            self.n = int(self.meta["n"])
            self.feature_dim = int(self.meta["feature_dim"])
            self.num_classes = int(self.meta["num_classes"])
            self.feature_dtype = str(self.meta["feature_dtype"])
        except (KeyError, TypeError, ValueError) as err:
            raise StoreError(f"{meta_path} lacks a valid {err}; delete {self.path} and extract again") from None
        #: True when :func:`oodviz.engine.extract_or_reuse` returned this store without extracting
        self.reused = False
        #: Set by :func:`oodviz.engine.extract_or_reuse` when it found this split's store damaged and
        #: extracted it again: what was wrong (a message for the run's events), else ``None``
        self.reuse_warning: str | None = None
        self._arrays: dict[str, np.ndarray] = {}
        expected = {
            "features": (self.n, self.feature_dim),
            "logits": (self.n, self.num_classes),
            "labels": (self.n,),
            "predictions": (self.n,),
            "indices": (self.n,),
        }
        for name, shape in expected.items():
            array = self.array(name)
            if array.shape != shape:
                raise StoreError(
                    f"{self.path / (name + '.npy')} has shape {array.shape}, meta.json says {shape}; "
                    f"the store is damaged: delete {self.path} and extract again"
                )

    def array(self, name: str) -> np.ndarray:
        """The array ``name`` (one of ``features``, ``logits``, ``labels``, ``predictions``, ``indices``)
        as a read-only memory map, opened once; a :class:`StoreError` when its file cannot be read."""
        array = self._arrays.get(name)
        if array is None:
            file = self.path / f"{name}.npy"
            try:
                array = np.load(file, mmap_mode="r")
            except (OSError, ValueError) as err:
                raise StoreError(f"{file} cannot be read ({err}); delete {self.path} and extract again") from None
            self._arrays[name] = array
        return array

    @property
    def features(self) -> np.ndarray:
        """``[N, D]`` features (read-only memory map)."""
        return self.array("features")

    @property
    def logits(self) -> np.ndarray:
        """``[N, C]`` float32 logits (read-only memory map)."""
        return self.array("logits")

    @property
    def labels(self) -> np.ndarray:
        """``[N]`` int64 labels, ``-1`` = OOD (read-only memory map)."""
        return self.array("labels")

    @property
    def predictions(self) -> np.ndarray:
        """``[N]`` int64 ``argmax`` of the logits (read-only memory map)."""
        return self.array("predictions")

    @property
    def indices(self) -> np.ndarray:
        """``[N]`` int64 source index of each row (read-only memory map)."""
        return self.array("indices")

    @property
    def head(self) -> tuple[Tensor, Tensor] | None:
        """The final linear layer ``(weight [C, D], bias [C])`` as CPU float32 tensors, or ``None``."""
        if not self.meta.get("has_head"):
            return None
        return (
            torch.from_numpy(np.load(self.path / "head_weight.npy")),
            torch.from_numpy(np.load(self.path / "head_bias.npy")),
        )

    def verify(self, full: bool = False) -> list[str]:
        """What is wrong with the files against the checksums taken when they were written; empty when intact.

        Cheap unless ``full``: a file whose size and mtime match its record is trusted unread, any
        other is rehashed (:mod:`oodviz.engine.store.integrity`). ``full`` rehashes every file.
        """
        return verify_store(self.path, self.meta, full=full)

    def nbytes(self, include: Sequence[str] = BATCH_FIELDS, dtype: torch.dtype = torch.float32) -> int:
        """Bytes the ``include`` fields take as tensors of ``dtype`` (labels as int64)."""
        width = {"features": self.feature_dim, "logits": self.num_classes, "labels": 1}
        size = {"features": dtype.itemsize, "logits": dtype.itemsize, "labels": 8}
        return sum(self.n * width[f] * size[f] for f in check_include(include))

    def batches(
        self,
        batch_size: int = 4096,
        device=None,
        include: Sequence[str] = BATCH_FIELDS,
        dtype: torch.dtype = torch.float32,
        prefetch: int = 2,
    ) -> StoreBatches:
        """The split as a re-iterable stream of :class:`oodviz.Batch` of ``batch_size`` rows.

        Each ``iter()`` starts over at row 0, so two-pass detector fits work. Tensors are fresh
        copies (writable, independent of the file) of ``dtype`` (labels int64). ``device=None``
        yields CPU tensors; a CUDA device stages each chunk in pinned memory and copies it
        asynchronously, casting float16 features on the device. A background thread reads the
        next ``prefetch`` chunks from disk while the current one is consumed (``0`` = no thread).
        Memory: ``O((prefetch + 2) * batch_size * (D + C))`` whatever ``N`` is.
        """
        return StoreBatches(self, batch_size=batch_size, device=device, include=include, dtype=dtype, prefetch=prefetch)

    def to_device(
        self,
        device,
        include: Sequence[str] = BATCH_FIELDS,
        dtype: torch.dtype = torch.float32,
        max_fraction: float = 0.5,
    ) -> DeviceSplit:
        """Copy the ``include`` fields of the whole split to ``device`` (the "buffer to GPU" option).

        Faster for repeated fits when the split fits comfortably: raises a ValueError when it
        would take more than ``max_fraction`` of the device's free memory (stream with
        ``batches(device=...)`` instead, same results with bounded memory).
        """
        return DeviceSplit(self, device, include=include, dtype=dtype, max_fraction=max_fraction)

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"FeatureStore({str(self.path)!r}, n={self.n}, D={self.feature_dim}, C={self.num_classes}, {self.feature_dtype})"


def open_store(root, key: str) -> FeatureStore:
    """The complete store ``<root>/<key>``; a :class:`StoreError` (a ValueError) if absent or unfinished."""
    key = check_key(key)
    path = Path(root) / key
    if not path.is_dir():
        raise StoreError(f"no feature store {key!r} under {root}; extract it first (oodviz.engine.extract)")
    return FeatureStore(path)


def find_store(root, key: str) -> FeatureStore | None:
    """The complete store ``<root>/<key>``, or ``None`` when there is none (or it is damaged: logged)."""
    path = Path(root) / check_key(key)
    if not path.is_dir():
        return None
    try:
        return FeatureStore(path)
    except StoreError as err:
        logger.warning("ignoring damaged feature store: %s", err)
        return None


def list_stores(root) -> list[FeatureStore]:
    """Every complete store directly under ``root`` (unfinished and damaged ones are skipped), by name."""
    root = Path(root)
    if not root.is_dir():
        return []
    stores = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and TMP_MARK not in entry.name and OLD_MARK not in entry.name:
            store = find_store(root, entry.name)
            if store is not None:
                stores.append(store)
    return stores
