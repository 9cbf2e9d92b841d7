"""The on-disk feature store: one directory per extracted split, read through memory maps.

Layout of a split, ``<root>/<key>/``::

    features.npy      [N, D]  float32 (or float16)   penultimate features
    logits.npy        [N, C]  float32                 classifier outputs
    labels.npy        [N]     int64                   class index, -1 = OOD
    predictions.npy   [N]     int64                   argmax of logits (first maximum on ties)
    indices.npy       [N]     int64                   source index of each row in the dataset
    head_weight.npy   [C, D]  float32  (optional)     final linear layer, when the backbone has one
    head_bias.npy     [C]     float32  (optional)
    meta.json                                         what, how, how many, how long (see below)

``key`` is a shortened sha256 of a canonical JSON of everything that determines the content
(:func:`key_spec`, :func:`store_key`). A split is written under ``<key>.tmp-<pid>-<random>`` and
renamed to ``<key>`` only when every row and ``meta.json`` (with ``"complete": true``) are on
disk, so a killed extraction never leaves a directory a later run would trust; leftovers are
removed by :func:`clean_stale_tmp`. Memory stays bounded by one batch while writing: rows go
to preallocated ``.npy`` files with plain file writes (no growing arrays, no memory maps held).

Reading (:class:`FeatureStore`) maps the arrays with ``np.load(mmap_mode="r")``;
:meth:`FeatureStore.batches` streams them as :class:`oodviz.Batch` chunks that every detector
consumes directly, re-iterable for two-pass fits, optionally straight onto a GPU.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import queue
import re
import secrets
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from oodviz.batch import Batch

logger = logging.getLogger("oodviz.engine")

#: Bumped when the layout changes; part of every key, so old stores are never misread.
STORE_FORMAT = 1
#: Hex digits of sha256 kept in a key (80 bits).
KEY_LENGTH = 20
FEATURE_DTYPES = ("float32", "float16")
ARRAYS = ("features", "logits", "labels", "predictions", "indices")
#: Fields a :class:`~oodviz.Batch` carries, i.e. what ``batches(include=...)`` accepts.
BATCH_FIELDS = ("features", "logits", "labels")

_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"
_TMP_NAME = re.compile(r"^(?P<key>.+)\.tmp-(?P<pid>\d+)-(?P<token>[0-9a-f]+)$")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

# Temporary directories being written by this process (never cleaned as stale, even by a
# thread of the same process running another extraction).
_ACTIVE_TMP: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


class StoreError(ValueError):
    """A directory that is not a complete, readable feature store."""


def check_feature_dtype(feature_dtype: str) -> str:
    """``feature_dtype`` when it is one of :data:`FEATURE_DTYPES`, else a ValueError naming them."""
    if feature_dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature_dtype must be one of {FEATURE_DTYPES}, got {feature_dtype!r}")
    return feature_dtype


# ---------------------------------------------------------------------------------- keys


def _canonical(value, where: str):
    """``value`` as plain JSON types (dict keys sorted later), or a ValueError naming the path."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"key parameter {where} is {value}; use a finite number or a string")
        return value
    if isinstance(value, os.PathLike):
        return Path(value).as_posix()
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"key parameter {where} has a non-string key {k!r}; use string keys")
            out[k] = _canonical(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v, f"{where}{{}}") for v in value), key=repr)
    raise ValueError(
        f"key parameter {where} is a {type(value).__name__}, which has no canonical form; "
        "pass str, numbers, bools, None, lists or dicts of them (for example a description string)"
    )


def canonical_json(value) -> str:
    """The canonical JSON text of ``value``: sorted keys, no spaces, plain types only."""
    return json.dumps(_canonical(value, "key_params"), sort_keys=True, separators=(",", ":"), allow_nan=False)


def describe_transform(transform) -> str:
    """A stable text for a transform: its ``repr`` without memory addresses (``at 0x...``).

    torchvision's ``Compose`` reprs list every step with its parameters. A function's or bound
    method's repr names only the callable; pass ``key_params["transform"]`` to describe it.
    """
    return _ADDRESS.sub("", repr(transform))


def key_spec(
    backbone, dataset, key_params: dict | None = None, *, feature_dtype: str = "float32", precision: str = "fp32"
) -> dict:
    """Everything that determines a split's content, as a JSON-able dict (hashed by :func:`store_key`).

    Read off the backbone: ``name``, ``weights_id``, ``layer`` and ``pooling`` when it has them,
    and the transform's description (:func:`describe_transform`) unless ``key_params`` has a
    ``"transform"`` entry. Off the dataset: ``name``, ``len``, ``classes`` and, when it has
    ``source_indices`` (the items kept by subsampling), their sha256. Plus the
    extraction's ``feature_dtype`` and ``precision`` (bf16 autocast changes the features) and
    ``key_params`` as given (dataset parameters, subsample, seed, ...). Batch size, workers, device
    and ``channels_last`` are not part of it: they change speed, not content.
    """
    params = dict(key_params or {})
    backbone_spec = {"name": str(backbone.name), "weights_id": str(getattr(backbone, "weights_id", None))}
    for attr in ("layer", "pooling"):
        value = getattr(backbone, attr, None)
        if value is not None:
            backbone_spec[attr] = value
    classes = getattr(dataset, "classes", None)
    dataset_spec = {
        "name": str(dataset.name),
        "len": len(dataset),
        "classes": None if classes is None else [str(c) for c in classes],
    }
    # oodviz.data datasets know which source items they hold (subsampling): hash them in.
    source_indices = getattr(dataset, "source_indices", None)
    if source_indices is not None:
        array = np.ascontiguousarray(np.asarray(source_indices, dtype=np.int64))
        dataset_spec["source_indices_sha256"] = hashlib.sha256(array.tobytes()).hexdigest()
    spec = {
        "store_format": STORE_FORMAT,
        "backbone": backbone_spec,
        "dataset": dataset_spec,
        "feature_dtype": feature_dtype,
        "precision": precision,
        "params": params,
    }
    if "transform" not in params:
        spec["transform"] = describe_transform(getattr(backbone, "transform", None))
    return _canonical(spec, "key_spec")


def store_key(
    backbone, dataset, key_params: dict | None = None, *, feature_dtype: str = "float32", precision: str = "fp32"
) -> str:
    """The store key of a split: the first :data:`KEY_LENGTH` hex digits of sha256 of :func:`key_spec`."""
    spec = key_spec(backbone, dataset, key_params, feature_dtype=feature_dtype, precision=precision)
    return hashlib.sha256(canonical_json(spec).encode()).hexdigest()[:KEY_LENGTH]


def _check_key(key: str) -> str:
    key = str(key)
    if not key or key in (".", "..") or "/" in key or "\\" in key or os.sep in key:
        raise ValueError(f"store key must be a plain directory name (letters, digits, '-', '_'), got {key!r}")
    if _TMP_MARK in key or _OLD_MARK in key:
        raise StoreError(
            f"{key!r} is an unfinished or replaced store (its name contains {_TMP_MARK!r} or {_OLD_MARK!r}) and is never "
            "opened; extract again, and remove leftovers with oodviz.engine.clean_stale_tmp(root)"
        )
    return key


# ---------------------------------------------------------------------------------- writing


def _write_header_in_place(f, rows: int) -> None:
    """Rewrite the shape in a ``.npy`` header to ``rows`` rows, keeping the header's length."""
    f.seek(0)
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        size_bytes = 2
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        size_bytes = 4
    data_offset = f.tell()
    header_len = data_offset - 8 - size_bytes  # magic (6) + version (2) + length field
    new_shape = (rows, *shape[1:])
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran, "shape": new_shape})
    if len(text) + 1 > header_len:  # cannot happen when shrinking; guard anyway
        raise StoreError(f"cannot rewrite .npy header in place for shape {new_shape}")
    f.seek(8 + size_bytes)
    f.write((text + " " * (header_len - len(text) - 1) + "\n").encode("latin1"))
    f.truncate(data_offset + rows * dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64)))


class _NpyFile:
    """A preallocated ``.npy`` file of ``capacity`` rows, filled front to back by appends."""

    def __init__(self, path: Path, dtype, row_shape: tuple[int, ...], capacity: int):
        self.path = path
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(row_shape)
        self.capacity = capacity
        # open_memmap writes the header and sizes the (sparse) file; the map is dropped at once.
        mm = np.lib.format.open_memmap(path, mode="w+", dtype=self.dtype, shape=(max(capacity, 1), *self.row_shape))
        self.offset = mm.offset
        del mm
        self.file = open(path, "r+b")
        self.file.seek(self.offset)
        self.rows = 0

    def append(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=self.dtype)
        if array.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path.name}: rows of shape {array.shape[1:]} given, the store has {self.row_shape}")
        if self.rows + len(array) > self.capacity:
            raise ValueError(f"{self.path.name}: {self.rows + len(array)} rows exceed the capacity of {self.capacity}")
        self.file.write(memoryview(array).cast("B"))
        self.rows += len(array)

    def finish(self, sync: bool) -> None:
        if self.rows != max(self.capacity, 1):
            self.file.flush()
            _write_header_in_place(self.file, self.rows)
        self.file.flush()
        if sync:
            os.fsync(self.file.fileno())
        self.file.close()

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class StoreWriter:
    """Write one split row block by row block, then :meth:`commit` it under its key.

    Rows go to a temporary directory ``<root>/<key>.tmp-<pid>-<random>``; :meth:`commit`
    shrinks the arrays to the rows actually written, writes ``meta.json`` and renames the
    directory to ``<root>/<key>`` (replacing an existing store of that key). :meth:`abort`, or
    leaving a ``with`` block by an exception, removes the temporary directory.

    :param capacity: the most rows that will be appended (the dataset length)
    :param feature_dim: ``D``; :param num_classes: ``C``
    :param feature_dtype: ``"float32"`` or ``"float16"`` for ``features.npy`` (logits stay float32)
    """

    def __init__(
        self, root, key: str, capacity: int, feature_dim: int, num_classes: int, feature_dtype: str = "float32"
    ):
        check_feature_dtype(feature_dtype)
        if int(capacity) < 1:
            raise ValueError(f"capacity must be at least 1 row, got {capacity}")
        self.root = Path(root)
        self.key = _check_key(key)
        self.capacity = int(capacity)
        self.feature_dim = int(feature_dim)
        self.num_classes = int(num_classes)
        self.feature_dtype = feature_dtype
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp_path = self.root / f"{self.key}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        self.tmp_path.mkdir()
        with _ACTIVE_LOCK:
            _ACTIVE_TMP.add(str(self.tmp_path))
        self._done = False
        self._files: dict[str, _NpyFile] = {}
        try:
            layout = {
                "features": (feature_dtype, (self.feature_dim,)),
                "logits": ("float32", (self.num_classes,)),
                "labels": ("int64", ()),
                "predictions": ("int64", ()),
                "indices": ("int64", ()),
            }
            for name, (dtype, row_shape) in layout.items():
                self._files[name] = _NpyFile(self.tmp_path / f"{name}.npy", dtype, row_shape, self.capacity)
        except BaseException:
            self.abort()
            raise

    @property
    def rows(self) -> int:
        """Rows appended so far."""
        return self._files["features"].rows

    def append(self, features, logits, labels, indices, predictions=None) -> None:
        """Append ``B`` rows: features ``[B, D]``, logits ``[B, C]``, labels ``[B]``, source indices ``[B]``.

        ``predictions`` ``[B]`` defaults to ``argmax(logits, axis=1)``. Arrays or CPU tensors.
        """
        arrays = {
            "features": _as_numpy(features),
            "logits": _as_numpy(logits),
            "labels": _as_numpy(labels),
            "indices": _as_numpy(indices),
        }
        arrays["predictions"] = (
            np.asarray(arrays["logits"], dtype=np.float32).argmax(axis=1)
            if predictions is None
            else _as_numpy(predictions)
        )
        sizes = {name: len(a) for name, a in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"append got arrays with different numbers of rows: {sizes}")
        for name in ARRAYS:
            self._files[name].append(arrays[name])

    def commit(self, meta: dict | None = None, head: tuple | None = None, sync: bool = True) -> FeatureStore:
        """Finish the arrays, write ``meta.json`` and move the split into place; returns it opened.

        :param meta: extra metadata merged into ``meta.json`` (must be JSON-serialisable)
        :param head: ``(weight [C, D], bias [C])`` of the final linear layer, stored alongside
        :param sync: ``fsync`` files before the rename, so the store survives a power cut too
        """
        if self._done:
            raise ValueError("this StoreWriter was already committed or aborted; make a new one")
        try:
            n = self.rows
            if n == 0:
                raise ValueError("no rows were appended; a feature store needs at least one row")
            for f in self._files.values():
                f.finish(sync)
            has_head = False
            if head is not None:
                weight, bias = (_as_numpy(t).astype(np.float32) for t in head)
                if weight.shape != (self.num_classes, self.feature_dim) or bias.shape != (self.num_classes,):
                    logger.warning(
                        "not storing the head: weight %s / bias %s do not match C=%d, D=%d",
                        weight.shape,
                        bias.shape,
                        self.num_classes,
                        self.feature_dim,
                    )
                else:
                    np.save(self.tmp_path / "head_weight.npy", weight)
                    np.save(self.tmp_path / "head_bias.npy", bias)
                    has_head = True
            full_meta = dict(meta or {})
            full_meta.update(
                {
                    "format": STORE_FORMAT,
                    "key": self.key,
                    "complete": True,
                    "n": n,
                    "feature_dim": self.feature_dim,
                    "num_classes": self.num_classes,
                    "feature_dtype": self.feature_dtype,
                    "has_head": has_head,
                }
            )
            text = json.dumps(full_meta, indent=2, sort_keys=True, default=_json_default)
            with open(self.tmp_path / "meta.json", "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            if sync:
                _fsync_dir(self.tmp_path)
            final = self.root / self.key
            self._move_into_place(final)
            if sync:
                _fsync_dir(self.root)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._forget()
        return FeatureStore(final)

    def _move_into_place(self, final: Path) -> None:
        try:
            os.rename(self.tmp_path, final)
            return
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EACCES, errno.EPERM) and not final.exists():
                raise
        # A store of this key exists (an earlier or concurrent extraction): replace it. Readers
        # holding its memory maps keep reading the old, unlinked files.
        old = self.root / f"{self.key}{_OLD_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(final, old)
        os.rename(self.tmp_path, final)
        shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Drop everything written; the key's directory (if any) is untouched."""
        if self._done:
            return
        self._done = True
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.tmp_path, ignore_errors=True)
        self._forget()

    def _forget(self) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE_TMP.discard(str(self.tmp_path))

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.abort()


def _as_numpy(value) -> np.ndarray:
    if isinstance(value, Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (os.PathLike, torch.device, torch.dtype)):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(
        f"meta value of type {type(value).__name__} is not JSON-serialisable; pass str, numbers, lists or dicts"
    )


def clean_stale_tmp(root, key: str | None = None, min_age_s: float = 60.0, max_age_s: float = 6 * 3600.0) -> list[Path]:
    """Remove unfinished store directories (``<key>.tmp-<pid>-<random>``, ``<key>.old-...``) under ``root``.

    A temporary directory is stale when its writer is gone: its process id is not running on this
    machine and nothing in it changed for ``min_age_s`` seconds, or nothing in it changed for
    ``max_age_s`` seconds whatever the process id says (another machine sharing the disk, a
    reused pid). Directories being written by this process are never removed. ``key`` limits
    the clean-up to that key. Returns the removed paths. Such directories are never opened as
    stores either way; this only frees their disk space.
    """
    import psutil

    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    now = time.time()
    for entry in root.iterdir():
        name = entry.name
        if not entry.is_dir() or (_TMP_MARK not in name and _OLD_MARK not in name):
            continue
        if key is not None and not name.startswith(f"{key}."):
            continue
        with _ACTIVE_LOCK:
            if str(entry) in _ACTIVE_TMP:
                continue
        match = _TMP_NAME.match(name) or re.match(r"^(?P<key>.+)\.old-(?P<pid>\d+)-(?P<token>[0-9a-f]+)$", name)
        pid = int(match.group("pid")) if match else -1
        try:
            newest = max([entry.stat().st_mtime] + [p.stat().st_mtime for p in entry.iterdir()])
        except OSError:
            continue
        age = now - newest
        alive = pid > 0 and psutil.pid_exists(pid)
        if (not alive and age >= min_age_s) or age >= max_age_s:
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                logger.info("removed stale unfinished store %s", entry)
                removed.append(entry)
    return removed


# ---------------------------------------------------------------------------------- reading


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
        self.key = _check_key(self.path.name)
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
        if not self.meta.get("complete") or self.meta.get("format") != STORE_FORMAT:
            raise StoreError(
                f"{self.path} is incomplete or in store format {self.meta.get('format')!r} (this oodviz reads "
                f"{STORE_FORMAT}); delete it and extract again"
            )
        self.n = int(self.meta["n"])
        self.feature_dim = int(self.meta["feature_dim"])
        self.num_classes = int(self.meta["num_classes"])
        self.feature_dtype = str(self.meta["feature_dtype"])
        #: True when :func:`oodviz.engine.extract_or_reuse` returned this store without extracting
        self.reused = False
        self._arrays: dict[str, np.ndarray] = {}
        expected = {
            "features": (self.n, self.feature_dim),
            "logits": (self.n, self.num_classes),
            "labels": (self.n,),
            "predictions": (self.n,),
            "indices": (self.n,),
        }
        for name, shape in expected.items():
            array = self._array(name)
            if array.shape != shape:
                raise StoreError(
                    f"{self.path / (name + '.npy')} has shape {array.shape}, meta.json says {shape}; "
                    f"the store is damaged: delete {self.path} and extract again"
                )

    def _array(self, name: str) -> np.ndarray:
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
        return self._array("features")

    @property
    def logits(self) -> np.ndarray:
        """``[N, C]`` float32 logits (read-only memory map)."""
        return self._array("logits")

    @property
    def labels(self) -> np.ndarray:
        """``[N]`` int64 labels, ``-1`` = OOD (read-only memory map)."""
        return self._array("labels")

    @property
    def predictions(self) -> np.ndarray:
        """``[N]`` int64 ``argmax`` of the logits (read-only memory map)."""
        return self._array("predictions")

    @property
    def indices(self) -> np.ndarray:
        """``[N]`` int64 source index of each row (read-only memory map)."""
        return self._array("indices")

    @property
    def head(self) -> tuple[Tensor, Tensor] | None:
        """The final linear layer ``(weight [C, D], bias [C])`` as CPU float32 tensors, or ``None``."""
        if not self.meta.get("has_head"):
            return None
        return (
            torch.from_numpy(np.load(self.path / "head_weight.npy")),
            torch.from_numpy(np.load(self.path / "head_bias.npy")),
        )

    def nbytes(self, include: Sequence[str] = BATCH_FIELDS, dtype: torch.dtype = torch.float32) -> int:
        """Bytes the ``include`` fields take as tensors of ``dtype`` (labels as int64)."""
        width = {"features": self.feature_dim, "logits": self.num_classes, "labels": 1}
        size = {"features": dtype.itemsize, "logits": dtype.itemsize, "labels": 8}
        return sum(self.n * width[f] * size[f] for f in _check_include(include))

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


def _check_include(include: Sequence[str]) -> tuple[str, ...]:
    if isinstance(include, str):
        include = (include,)
    include = tuple(include)
    unknown = [f for f in include if f not in BATCH_FIELDS]
    if unknown or not include:
        raise ValueError(
            f"include must name some of {BATCH_FIELDS} (what a Batch carries), got {include!r}; "
            "predictions and indices are read as store.predictions / store.indices"
        )
    return include


def _check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


class StoreBatches:
    """A re-iterable stream of :class:`oodviz.Batch` over a :class:`FeatureStore` (see :meth:`FeatureStore.batches`).

    ``len()`` is the number of batches; ``n`` the number of rows.
    """

    def __init__(
        self, store: FeatureStore, batch_size=4096, device=None, include=BATCH_FIELDS, dtype=torch.float32, prefetch=2
    ):
        self.store = store
        self.batch_size = _check_batch_size(batch_size)
        self.device = None if device is None else torch.device(device)
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here; use device=None (CPU)")
        self.include = _check_include(include)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch dtype (features and logits), got {dtype}")
        self.dtype = dtype
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer (0 = no reader thread), got {prefetch!r}")
        self.prefetch = prefetch
        self.n = store.n

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    @property
    def features_on_disk(self) -> np.ndarray:
        """The ``[N, D]`` features these batches yield, in order, as the store's read-only memory map
        (what a detector that must keep every feature, knn, can use instead of a copy)."""
        return self.store.features

    def __iter__(self) -> Iterator[Batch]:
        ranges = [(s, min(s + self.batch_size, self.n)) for s in range(0, self.n, self.batch_size)]
        if self.device is not None and self.device.type == "cuda":
            return self._iter_cuda(ranges)
        return self._iter_host(ranges)

    def _open(self) -> dict[str, _RowFile]:
        files = {}
        try:
            for field in self.include:
                files[field] = _RowFile(self.store.path / f"{field}.npy", self.store._array(field))
        except BaseException:
            for f in files.values():
                f.close()
            raise
        return files

    # Host path: each chunk is read into a fresh array, converted to dtype on the way.
    def _iter_host(self, ranges) -> Iterator[Batch]:
        files = self._open()

        def read(r, _slot):
            start, stop = r
            return {field: f.read(start, stop) for field, f in files.items()}

        chunks = _prefetched(ranges, read, self.prefetch, slots=None)
        try:
            for chunk in chunks:
                tensors = {field: torch.from_numpy(array) for field, array in chunk.items()}
                for field in ("features", "logits"):
                    if field in tensors and tensors[field].dtype != self.dtype:
                        tensors[field] = tensors[field].to(self.dtype)
                if self.device is not None:
                    tensors = {f: t.to(self.device) for f, t in tensors.items()}
                yield Batch(**tensors)
        finally:
            chunks.close()  # stops and joins the reader thread before the files close
            for f in files.values():
                f.close()

    # CUDA path: pinned staging slots reused round-robin, each guarded by the event of its last copy.
    def _iter_cuda(self, ranges) -> Iterator[Batch]:
        device = self.device
        n_slots = self.prefetch + 2
        rows = min(self.batch_size, self.n)
        files = self._open()
        staging = [
            {
                field: torch.empty((rows, *f.row_shape), dtype=_torch_dtype(f.dtype), pin_memory=True)
                for field, f in files.items()
            }
            for _ in range(n_slots)
        ]
        events: list[torch.cuda.Event | None] = [None] * n_slots

        def read(r, slot_index):
            event = events[slot_index]
            if event is not None:
                event.synchronize()  # the previous host-to-device copy out of this slot is done
            start, stop = r
            for field, f in files.items():
                f.read(start, stop, out=staging[slot_index][field].numpy())
            return slot_index, stop - start

        chunks = _prefetched(ranges, read, self.prefetch, slots=n_slots)
        try:
            for slot_index, m in chunks:
                slot = staging[slot_index]
                tensors = {f: slot[f][:m].to(device, non_blocking=True) for f in self.include}
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                events[slot_index] = event
                for field in ("features", "logits"):
                    if field in tensors and tensors[field].dtype != self.dtype:
                        tensors[field] = tensors[field].to(self.dtype)
                yield Batch(**tensors)
        finally:
            chunks.close()
            for event in events:
                if event is not None:
                    event.synchronize()  # no copy may still read a staging buffer once it is freed
            for f in files.values():
                f.close()


class _RowFile:
    """Rows ``[start, stop)`` of a ``.npy`` file by positioned reads (no memory map, no page faults)."""

    def __init__(self, path: Path, mapped: np.ndarray):
        self.dtype = mapped.dtype
        self.row_shape = tuple(mapped.shape[1:])
        self.offset = int(mapped.offset)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        self.file = open(path, "rb", buffering=0)

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        rows = stop - start
        if out is None:
            out = np.empty((rows, *self.row_shape), dtype=self.dtype)
        view = memoryview(out[:rows]).cast("B")
        want, got = rows * self.row_bytes, 0
        self.file.seek(self.offset + start * self.row_bytes)
        while got < want:
            n = self.file.readinto(view[got:])
            if not n:
                raise StoreError(
                    f"{self.file.name} ends early (row {start + got // self.row_bytes}); the store is damaged: extract again"
                )
            got += n
        return out[:rows]

    def close(self) -> None:
        self.file.close()


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype


def _prefetched(ranges, read, prefetch: int, slots: int | None):
    """Yield ``read(range, slot)`` for each range, ``prefetch`` ahead in a reader thread.

    ``slots``: with a number, ``read`` writes into slot ``i % slots``; at most ``prefetch`` read
    slots wait in the queue, plus the one being consumed, so with ``slots >= prefetch + 2`` a slot
    is never overwritten while its batch is in use (``read`` also waits on the slot's copy event).
    """
    if prefetch == 0:
        for i, r in enumerate(ranges):
            yield read(r, None if slots is None else i % slots)
        return
    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()
    done = object()

    def worker():
        try:
            for i, r in enumerate(ranges):
                if stop.is_set():
                    return
                item = read(r, None if slots is None else i % slots)
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            ready.put(done)
        except BaseException as err:  # handed to the consumer, raised there
            ready.put(err)

    thread = threading.Thread(target=worker, name="oodviz-store-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                ready.get(timeout=0.05)
            except queue.Empty:
                pass
        thread.join()


class DeviceSplit:
    """A whole split held on one device, with the same ``batches()`` as :class:`FeatureStore`.

    Made by :meth:`FeatureStore.to_device`. Batches are views of the device tensors (no copies):
    do not modify them in place.
    """

    def __init__(
        self, store: FeatureStore, device, include=BATCH_FIELDS, dtype=torch.float32, max_fraction: float = 0.5
    ):
        self.store = store
        self.device = torch.device(device)
        self.include = _check_include(include)
        need = store.nbytes(self.include, dtype)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={device!r} but CUDA is not available here")
            free, _total = torch.cuda.mem_get_info(self.device)
            if need > max_fraction * free:
                raise ValueError(
                    f"the split needs {need / 2**30:.2f} GiB on {self.device}, more than {max_fraction:.0%} of the "
                    f"{free / 2**30:.2f} GiB free; stream it with store.batches(device={str(self.device)!r}) instead "
                    "(same results, bounded memory) or raise max_fraction"
                )
        self.tensors: dict[str, Tensor] = {}
        for field in self.include:
            array = store._array(field)
            want = torch.int64 if field == "labels" else dtype
            self.tensors[field] = torch.empty((store.n, *array.shape[1:]), dtype=want, device=self.device)
        start = 0
        for batch in store.batches(batch_size=16384, device=self.device, include=self.include, dtype=dtype):
            for field in self.include:
                value = getattr(batch, field)
                self.tensors[field][start : start + len(value)] = value
            start += len(batch)
        self.n = store.n

    def batches(self, batch_size: int = 65536, include: Sequence[str] | None = None) -> _DeviceBatches:
        """Re-iterable :class:`oodviz.Batch` views of ``batch_size`` rows of the ``include`` fields."""
        include = self.include if include is None else _check_include(include)
        missing = [f for f in include if f not in self.tensors]
        if missing:
            raise ValueError(f"{missing} were not copied to the device; call store.to_device(include=...) with them")
        return _DeviceBatches(self, _check_batch_size(batch_size), include)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class _DeviceBatches:
    def __init__(self, split: DeviceSplit, batch_size: int, include: tuple[str, ...]):
        self.split, self.batch_size, self.include = split, batch_size, include

    def __len__(self) -> int:
        return math.ceil(self.split.n / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for start in range(0, self.split.n, self.batch_size):
            yield Batch(**{f: self.split.tensors[f][start : start + self.batch_size] for f in self.include})


def open_store(root, key: str) -> FeatureStore:
    """The complete store ``<root>/<key>``; a :class:`StoreError` (a ValueError) if absent or unfinished."""
    key = _check_key(key)
    path = Path(root) / key
    if not path.is_dir():
        raise StoreError(f"no feature store {key!r} under {root}; extract it first (oodviz.engine.extract)")
    return FeatureStore(path)


def find_store(root, key: str) -> FeatureStore | None:
    """The complete store ``<root>/<key>``, or ``None`` when there is none (or it is damaged: logged)."""
    path = Path(root) / _check_key(key)
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
        if entry.is_dir() and _TMP_MARK not in entry.name and _OLD_MARK not in entry.name:
            store = find_store(root, entry.name)
            if store is not None:
                stores.append(store)
    return stores
