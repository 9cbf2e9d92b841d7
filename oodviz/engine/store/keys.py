"""Store keys: what determines a split's content, hashed into the name of its directory.

``key`` is a shortened sha256 of a canonical JSON of everything that determines the content
(:func:`key_spec`, :func:`store_key`). A directory whose name carries :data:`TMP_MARK` or
:data:`OLD_MARK` is a split being written or being replaced, and is never opened as a store
(:func:`check_key`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import torch

#: Bumped when the layout changes; part of every key, so old stores are never misread.
#: 2: ``meta.json["files"]`` holds a checksum of every array file (stores of format 1 had none and
#: are extracted again rather than trusted unverified).
STORE_FORMAT = 2
#: Hex digits of sha256 kept in a key (80 bits).
KEY_LENGTH = 20
#: What ``features.npy`` can hold (logits are always float32).
FEATURE_DTYPES = ("float32", "float16")
#: The arrays of a split, one ``<name>.npy`` each, ``N`` rows.
ARRAYS = ("features", "logits", "labels", "predictions", "indices")
#: Marks the directory of a split being written (``<key>.tmp-<pid>-<start>-<random>``) and of one being
#: replaced or removed (``<key>.old-...``); ``<start>`` is the writer process's start time in ms.
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class StoreError(ValueError):
    """A directory that is not a complete, readable feature store."""


def check_feature_dtype(feature_dtype: str) -> str:
    """``feature_dtype`` when it is one of :data:`FEATURE_DTYPES`, else a ValueError naming them."""
    if feature_dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature_dtype must be one of {FEATURE_DTYPES}, got {feature_dtype!r}")
    return feature_dtype


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

    Read off the backbone: ``name``, ``weights_id``, ``layer`` and ``pooling`` when it has them (a
    :class:`~oodviz.models.Backbone`'s ``pooling`` is the resolved name: a run's unset pooling and the name it resolves
    to, e.g. ``"avg"`` on a CNN's map or ``"cls"`` on a ViT's block, key the same store), and the transform's description (:func:`describe_transform`) unless ``key_params`` has a
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


def check_key(key: str) -> str:
    """``key`` when it names a finished store's directory; a ValueError (a :class:`StoreError` for a
    temporary or replaced one) otherwise."""
    key = str(key)
    if not key or key in (".", "..") or "/" in key or "\\" in key or os.sep in key:
        raise ValueError(f"store key must be a plain directory name (letters, digits, '-', '_'), got {key!r}")
    if TMP_MARK in key or OLD_MARK in key:
        raise StoreError(
            f"{key!r} is an unfinished or replaced store (its name contains {TMP_MARK!r} or {OLD_MARK!r}) and is never "
            "opened; extract again, and remove leftovers with oodviz.engine.clean_stale_tmp(root)"
        )
    return key
