"""Writing a split: rows appended block by block, then the directory renamed into place.

A split is written under ``<key>.tmp-<pid>-<random>`` and renamed to ``<key>`` only when every
row and ``meta.json`` (with ``"complete": true``) are on disk, so a killed extraction never leaves
a directory a later run would trust; leftovers are removed by :func:`clean_stale_tmp`. Memory
stays bounded by one batch while writing: rows go to preallocated ``.npy`` files with plain file
writes (no growing arrays, no memory maps held).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from oodviz.engine.store.keys import OLD_MARK, STORE_FORMAT, TMP_MARK, StoreError, check_feature_dtype, check_key
from oodviz.engine.store.reader import FeatureStore

logger = logging.getLogger("oodviz.engine")

#: The arrays of a split, one ``<name>.npy`` each, ``N`` rows.
ARRAYS = ("features", "logits", "labels", "predictions", "indices")

_TMP_NAME = re.compile(r"^(?P<key>.+)\.tmp-(?P<pid>\d+)-(?P<token>[0-9a-f]+)$")

# Temporary directories being written by this process (never cleaned as stale, even by a
# thread of the same process running another extraction).
_ACTIVE_TMP: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


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
        self.key = check_key(key)
        self.capacity = int(capacity)
        self.feature_dim = int(feature_dim)
        self.num_classes = int(num_classes)
        self.feature_dtype = feature_dtype
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp_path = self.root / f"{self.key}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
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
        old = self.root / f"{self.key}{OLD_MARK}{os.getpid()}-{secrets.token_hex(4)}"
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
        if not entry.is_dir() or (TMP_MARK not in name and OLD_MARK not in name):
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
