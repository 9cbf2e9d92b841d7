"""Saving a fitted detector to a directory and loading it back: files only, no pickle.

``save(detector, directory)`` writes ``directory/detector.json`` and one ``<attribute>.npy`` per fitted
array; ``load(directory)`` makes the detector again with ``create(name, **params)`` and sets its fitted
state, so the loaded detector scores **bit for bit** as the saved one did (on the same device).

``detector.json``::

    {"format": "oodviz-detector", "version": 1, "name": "mahalanobis", "oodviz": "<version>",
     "params": {...constructor parameters but the model...},
     "state": {"<attribute>_": <entry>, ...}}

Each fitted attribute (a name ending in ``_``) is one entry, by its kind:

- ``{"kind": "value", "value": v}``: a number, string, bool, None, or a list/dict of them (JSON keeps a
  float's every bit: Python writes the shortest repr that reads back to the same double);
- ``{"kind": "tensor" | "array", "file": "<attribute>.npy", "dtype", "shape", "sha256"}``: a torch
  tensor (saved from the CPU; ``bfloat16`` as its ``int16`` bits) or a numpy array, read back with
  ``np.load(allow_pickle=False)`` and checked against the dtype, shape and SHA-256 recorded;
  ``save(..., copy_files=True)`` copies a memory map so (a bank in a temporary directory): it is mapped
  again from the copy (``"memory_map": true``), and a string attribute naming the original file (knn's
  ``bank_path_``) is made to name the copy;
- ``{"kind": "file", "path", "dtype", "shape", "offset", "size", "sha256"}``: a read-only memory map kept
  by reference, not copied (knn's bank: the feature store's ``features.npy``). Loading maps the same
  file again after checking that its size and SHA-256 are those recorded: a bank that changed or is
  gone is refused, never searched.

Loading also checks the arrays against each other: their axes as the detector declares them
(``fitted_shapes``: arrays sharing a letter, D or C, share its size), so an array replaced and re-hashed
with another shape is refused, naming its file and field, not a traceback when scored.

A constructor parameter that is not JSON (the ``model`` of the detectors that run the classifier
again) is not saved: pass it to ``load(directory, model=...)``. Anything else a detector keeps that is
none of the above makes ``save`` raise, naming the attribute: a new detector with another kind of state
must store it as tensors and plain values.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

import oodviz
from oodviz.files import write_atomic

FORMAT = "oodviz-detector"
VERSION = 1
MANIFEST = "detector.json"
#: constructor parameters that are objects, not settings: never saved, given to :func:`load` instead
OBJECT_PARAMS = ("model",)
_HASH_BLOCK = 16 * 2**20


class DetectorFileError(ValueError):
    """A saved detector that cannot be loaded as saved: missing, damaged, foreign or changed files."""


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _is_plain(value) -> bool:
    """Whether JSON writes ``value`` and reads back an equal value of the same type."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return True  # NaN and infinities too (Python's json writes and reads them)
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def saved_params(detector) -> dict:
    """The constructor parameters ``save`` writes: all but :data:`OBJECT_PARAMS`, each a plain JSON value."""
    params = {k: v for k, v in detector.get_params().items() if k not in OBJECT_PARAMS}
    for key, value in params.items():
        if not _is_plain(value):
            raise ValueError(
                f"{detector.name}: parameter {key}={value!r} ({type(value).__name__}) cannot be saved as JSON; "
                "parameters must be numbers, strings, booleans, None or lists of them"
            )
    return params


def fitted_state(detector) -> dict:
    """The detector's fitted attributes (public names ending in ``_``)."""
    return {k: v for k, v in vars(detector).items() if k.endswith("_") and not k.startswith("_")}


def referenced_files(detector) -> list[Path]:
    """The files a saved ``detector`` would reference instead of copying (its read-only memory maps)."""
    return [Path(v.filename) for v in fitted_state(detector).values() if _is_file_backed(v)]


def _is_file_backed(value) -> bool:
    return isinstance(value, np.memmap) and value.filename is not None and value.mode == "r"


def _array_entry(directory: Path, key: str, array: np.ndarray, kind: str, dtype: str) -> dict:
    path = directory / f"{key}.npy"
    with open(path, "wb") as file:
        np.save(file, array, allow_pickle=False)  # a transposed (Fortran-order) array stays so: same matmul bits
    return {"kind": kind, "file": path.name, "dtype": dtype, "shape": list(array.shape), "sha256": file_sha256(path)}


def _state_entry(detector, directory: Path, key: str, value, copy_files: bool) -> dict:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor  # numpy has no bfloat16
        return _array_entry(directory, key, bits.numpy(), "tensor", dtype)
    if isinstance(value, np.ndarray):
        if _is_file_backed(value) and not copy_files:
            path = Path(value.filename).resolve()
            return {
                "kind": "file",
                "path": str(path),
                "dtype": value.dtype.str,
                "shape": list(value.shape),
                "offset": int(value.offset),
                "size": path.stat().st_size,
                "sha256": file_sha256(path),
            }
        if value.dtype.hasobject:
            raise ValueError(f"{detector.name}: fitted attribute {key} is an object array; it cannot be saved")
        entry = _array_entry(directory, key, np.asarray(value), "array", value.dtype.str)
        if _is_file_backed(value):  # copied: mapped again from the copy, and paths naming it follow
            entry.update(memory_map=True, copied_from=str(Path(value.filename).resolve()))
        return entry
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        value = value.item()
    if _is_plain(value):
        return {"kind": "value", "value": value}
    raise ValueError(
        f"{detector.name}: fitted attribute {key} is a {type(value).__name__}, which cannot be saved; keep fitted "
        "state as tensors, numpy arrays, numbers, strings or lists of them (oodviz.detectors.persist)"
    )


def save(detector, directory, copy_files: bool = False) -> Path:
    """Write ``detector`` (fitted or not) to ``directory`` (created; files of an earlier save there are
    replaced) and return the manifest's path. ``copy_files=True`` writes memory-mapped state (knn's bank)
    as ``.npy`` files too, for a bank that will not outlive the detector (a temporary directory)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        key: _state_entry(detector, directory, key, value, copy_files) for key, value in fitted_state(detector).items()
    }
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "name": detector.name,
        "oodviz": oodviz.__version__,
        "params": saved_params(detector),
        "state": state,
    }
    path = directory / MANIFEST
    write_atomic(path, json.dumps(manifest, indent=1, allow_nan=True))
    return path


def read_manifest(directory) -> dict:
    """The checked ``detector.json`` of a saved detector; :class:`DetectorFileError` saying what is wrong."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DetectorFileError(f"{path} does not exist: not a saved detector directory (Detector.save(directory))")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DetectorFileError(f"{path} is not valid JSON ({error}); save the detector again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DetectorFileError(f'{path} is not an oodviz detector file (no "format": {FORMAT!r})')
    if manifest.get("version") != VERSION:
        raise DetectorFileError(
            f"{path} has format version {manifest.get('version')!r}; this oodviz reads version {VERSION}: "
            "save the detector again with this version"
        )
    if not isinstance(manifest.get("params"), dict) or not isinstance(manifest.get("state"), dict):
        raise DetectorFileError(f'{path} lacks its "params" or "state" object; save the detector again')
    return manifest


def _load_array(directory: Path, key: str, entry: dict) -> np.ndarray:
    name = entry.get("file")
    if not isinstance(name, str) or Path(name).name != name:  # a bare file name inside the directory
        raise DetectorFileError(f"{directory / MANIFEST}: state {key} names no file of this directory ({name!r})")
    path = directory / name
    if not path.is_file():
        raise DetectorFileError(f"{path} (fitted state {key}) is missing; save the detector again")
    if file_sha256(path) != entry.get("sha256"):
        raise DetectorFileError(f"{path} (fitted state {key}) changed since it was saved (SHA-256 differs)")
    try:
        array = np.load(path, allow_pickle=False, mmap_mode="r" if entry.get("memory_map") else None)
    except ValueError as error:
        raise DetectorFileError(f"{path} (fitted state {key}) is not a plain .npy array: {error}") from None
    if list(array.shape) != entry.get("shape"):
        raise DetectorFileError(f"{path}: shape {list(array.shape)}, but {entry.get('shape')} was saved")
    return array


def _load_file(directory: Path, key: str, entry: dict) -> np.memmap:
    path = Path(str(entry.get("path")))
    what = f"{directory / MANIFEST}: fitted state {key} references {path}"
    if not path.is_file():
        raise DetectorFileError(f"{what}, which is gone; the run's feature store was removed: run again")
    if path.stat().st_size != entry.get("size") or file_sha256(path) != entry.get("sha256"):
        raise DetectorFileError(f"{what}, which changed since the detector was saved (size or SHA-256): run again")
    shape, offset = entry.get("shape"), entry.get("offset")
    try:
        dtype = np.dtype(entry.get("dtype"))
    except TypeError:
        dtype = None
    whole = [offset, *shape] if isinstance(shape, list) else [None]
    if dtype is None or dtype.hasobject or not all(type(n) is int and n >= 0 for n in whole):
        raise DetectorFileError(
            f"{what} with dtype {entry.get('dtype')!r}, shape {shape!r} and offset {offset!r}: not a plain dtype, "
            "sizes and offset that are integers >= 0; the detector file was changed: run again"
        )
    if offset + dtype.itemsize * int(np.prod(shape)) > path.stat().st_size:
        raise DetectorFileError(
            f"{what} as {shape} {dtype} from byte {offset}, past the end of its {path.stat().st_size} bytes; the "
            "detector file was changed: run again"
        )
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape))


def _state_value(directory: Path, key: str, entry) -> object:
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind == "value":
        return entry.get("value")
    if kind == "file":
        return _load_file(directory, key, entry)
    if kind == "array":
        return _load_array(directory, key, entry)
    if kind == "tensor":
        array = _load_array(directory, key, entry)
        dtype = getattr(torch, str(entry.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise DetectorFileError(f"{directory / MANIFEST}: state {key} has an unknown dtype {entry.get('dtype')!r}")
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor
    raise DetectorFileError(f"{directory / MANIFEST}: state {key} has an unknown kind {kind!r}")


def restore_state(detector, directory: Path, state: dict):
    """``detector`` (made from the saved name and parameters) with the fitted ``state`` of ``detector.json`` set on
    it, checked entry by entry and then together (:func:`_check_shapes`); returns it. What
    :func:`oodviz.detectors.load` does after making the detector."""
    moved = {  # a copied memory map's old path -> its copy
        entry["copied_from"]: str((directory / entry["file"]).resolve())
        for entry in state.values()
        if isinstance(entry, dict) and entry.get("copied_from")
    }
    for key, entry in state.items():
        if not key.endswith("_"):
            raise DetectorFileError(f"{directory / MANIFEST}: {key!r} is not a fitted attribute (name ending in _)")
        value = _state_value(directory, key, entry)
        setattr(detector, key, moved.get(value, value) if isinstance(value, str) else value)
    _check_shapes(detector, directory, state)
    return detector


def _check_shapes(detector, directory: Path, state: dict) -> None:
    """Refuse (:class:`DetectorFileError`, naming the files and the fields) fitted arrays whose shapes disagree
    with the detector's :attr:`~oodviz.detectors.base.Detector.fitted_shapes`: a number of axes other than
    declared, or one axis letter (D features, C classes, ...) of two sizes. Each file's hash and recorded shape
    may match a tampered array; the arrays together must still describe one detector."""

    def where(key: str) -> str:
        entry = state[key]
        return f"{directory / entry['file'] if 'file' in entry else entry.get('path')} (fitted state {key})"

    seen: dict[str, tuple[int, str]] = {}  # axis letter -> its size, the field that gave it
    for key, letters in type(detector).fitted_shapes.items():
        shape = getattr(getattr(detector, key, None), "shape", None)
        if shape is None or key not in state:
            continue
        if len(shape) != len(letters):
            raise DetectorFileError(
                f"{where(key)}: shape {list(shape)}, but {detector.name}'s {key} has {len(letters)} axes "
                f"({' x '.join(letters)}); the detector file was changed: save the detector again"
            )
        for letter, size in zip(letters, shape):
            size_seen, field = seen.setdefault(letter, (size, key))
            if size != size_seen:
                raise DetectorFileError(
                    f"{where(key)}: shape {list(shape)} has {letter} = {size}, but {where(field)} has "
                    f"{letter} = {size_seen}; the detector file was changed: save the detector again"
                )
