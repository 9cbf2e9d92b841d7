"""Writing a split: rows appended block by block, checksummed as they go, then the directory renamed into place.

A split is written under ``<key>.tmp-<pid>-<start>-<random>`` and renamed to ``<key>`` only when
every row and ``meta.json`` (with ``"complete": true`` and the files' checksums, see
:mod:`~oodviz.engine.store.integrity`) are on disk, so a killed extraction never leaves a
directory a later run would trust; leftovers are removed by :func:`clean_stale_tmp`. Memory
stays bounded by one batch while writing: rows go to preallocated ``.npy`` files with plain file
writes (no growing arrays, no memory maps held). A full disk (checked before the first row, and
``ENOSPC`` / ``EDQUOT`` on any write) removes the temporary directory and raises
:class:`~oodviz.engine.store.space.DiskFullError`; any other I/O error removes it too.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from oodviz.engine.store.integrity import file_record, new_digest
from oodviz.engine.store.keys import (
    ARRAYS,
    OLD_MARK,
    STORE_FORMAT,
    TMP_MARK,
    StoreError,
    check_feature_dtype,
    check_key,
)
from oodviz.engine.store.manage import forget_active, mark_active, scratch_name
from oodviz.engine.store.reader import FeatureStore
from oodviz.engine.store.space import DiskFullError, check_free_space, disk_full_message, is_disk_full

logger = logging.getLogger("oodviz.engine")

__all__ = ["ARRAYS", "StoreWriter"]


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
    """A preallocated ``.npy`` file of ``capacity`` rows, filled front to back by appends.

    The data bytes are hashed as they are written (:func:`~oodviz.engine.store.integrity.new_digest`);
    :meth:`finish` returns the file's checksum record.
    """

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
        self.digest = new_digest()
        self.rows = 0

    @property
    def nbytes(self) -> int:
        """The file's size when every row is written."""
        return self.offset + max(self.capacity, 1) * self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))

    def append(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=self.dtype)
        if array.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path.name}: rows of shape {array.shape[1:]} given, the store has {self.row_shape}")
        if self.rows + len(array) > self.capacity:
            raise ValueError(f"{self.path.name}: {self.rows + len(array)} rows exceed the capacity of {self.capacity}")
        data = memoryview(array).cast("B")
        self.file.write(data)
        self.digest.update(data)
        self.rows += len(array)

    def finish(self, sync: bool) -> dict:
        """Shrink the file to the rows written, close it and return its checksum record."""
        if self.rows != max(self.capacity, 1):
            self.file.flush()
            _write_header_in_place(self.file, self.rows)
        self.file.flush()
        if sync:
            os.fsync(self.file.fileno())
        self.file.close()
        return file_record(self.path, self.offset, self.digest)

    def close(self) -> None:
        if not self.file.closed:
            try:
                self.file.close()
            except OSError:  # flushing the buffer failed (full disk): the file is being discarded anyway
                pass


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

    Rows go to a temporary directory ``<root>/<key>.tmp-<pid>-<start>-<random>``; :meth:`commit`
    shrinks the arrays to the rows actually written, writes ``meta.json`` (with every file's
    checksum in ``"files"``) and renames the directory to ``<root>/<key>`` (replacing an existing
    store of that key). :meth:`abort`, leaving a ``with`` block by an exception, or an I/O error
    in :meth:`append` / :meth:`commit` removes the temporary directory.

    :param capacity: the most rows that will be appended (the dataset length)
    :param feature_dim: ``D``; :param num_classes: ``C``
    :param feature_dtype: ``"float32"`` or ``"float16"`` for ``features.npy`` (logits stay float32)
    :raises DiskFullError: when the files at ``capacity`` rows do not fit in the free space
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
        item = np.dtype(feature_dtype).itemsize
        #: bytes of the arrays at ``capacity`` rows (headers and the head left out)
        self.nbytes = self.capacity * (self.feature_dim * item + self.num_classes * 4 + 3 * 8)
        self._done = True  # nothing to abort until the directory exists
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            message = check_free_space(self.root, self.nbytes, margin_bytes=0)
            if message:
                raise DiskFullError(message)
            self.tmp_path = self.root / scratch_name(self.key, TMP_MARK)
            self.tmp_path.mkdir()
        except OSError as err:
            raise self._io_error(err) from err
        mark_active(self.tmp_path)
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
        except BaseException as err:
            self.abort()
            if isinstance(err, OSError):
                raise self._io_error(err) from err
            raise

    def _io_error(self, err: OSError) -> OSError:
        """The error to raise for ``err``: a :class:`DiskFullError` with the sizes for a full disk, else ``err``."""
        if isinstance(err, DiskFullError) or not is_disk_full(err):
            return err
        return DiskFullError(disk_full_message(self.root, self.nbytes))

    @property
    def rows(self) -> int:
        """Rows appended so far."""
        return self._files["features"].rows

    def append(self, features, logits, labels, indices, predictions=None) -> None:
        """Append ``B`` rows: features ``[B, D]``, logits ``[B, C]``, labels ``[B]``, source indices ``[B]``.

        ``predictions`` ``[B]`` defaults to ``argmax(logits, axis=1)``. Arrays or CPU tensors.
        An I/O error aborts the writer (a :class:`DiskFullError` for a full disk).
        """
        if self._done:
            raise ValueError("this StoreWriter was already committed or aborted; make a new one")
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
        try:
            for name in ARRAYS:
                self._files[name].append(arrays[name])
        except OSError as err:
            self.abort()
            raise self._io_error(err) from err

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
            records = {name: f.finish(sync) for name, f in self._files.items()}
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
                    for name, array in (("head_weight", weight), ("head_bias", bias)):
                        self._files[name] = _NpyFile(
                            self.tmp_path / f"{name}.npy", "float32", array.shape[1:], len(array)
                        )
                        self._files[name].append(array)
                        records[name] = self._files[name].finish(sync)
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
                    "files": records,
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
        except BaseException as err:
            self.abort()
            if isinstance(err, OSError):
                raise self._io_error(err) from err
            raise
        self._done = True
        forget_active(self.tmp_path)
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
        old = self.root / scratch_name(self.key, OLD_MARK)
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
        forget_active(self.tmp_path)

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
