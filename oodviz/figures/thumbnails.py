"""Thumbnails of a run's samples: each scores row's image, re-read from its dataset.

The datasets are re-opened with the run config's parameters (never downloading) and kept in a
process-wide LRU cache (:data:`DATASET_CACHE_SIZE` datasets, shared by the app's sessions), so a
gallery of a dozen images does not re-open a dataset each time.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import pandas as pd
from PIL import Image, ImageDraw

from oodviz.results.tables import ID_SPLIT, Results

_DATASET_CACHE: OrderedDict = OrderedDict()
_DATASET_CACHE_LOCK = threading.Lock()  # Streamlit serves sessions from threads
DATASET_CACHE_SIZE = 16
PLACEHOLDER_GREY = (160, 160, 160)
LETTERBOX = (255, 255, 255)


def _config_dict(results_or_config) -> dict:
    if isinstance(results_or_config, Results):
        return results_or_config.config or {}
    if hasattr(results_or_config, "to_dict"):
        return results_or_config.to_dict()
    return dict(results_or_config or {})


def _choice_for(config: dict, split: str, dataset: str) -> tuple[dict | None, bool]:
    """The dataset entry of the run config for a scores row and whether it was loaded as OOD."""

    def result_name(choice: dict) -> str | None:  # as DatasetChoice.result_name
        return choice.get("title") or choice.get("name")

    if split == ID_SPLIT:
        choice = config.get("id_test")
        return (choice if choice and result_name(choice) == dataset else None), False
    for choice in config.get("ood", []) or []:
        if result_name(choice) == dataset:
            return choice, True
    return None, True


def _cache_key(config: dict, choice: dict, as_ood: bool) -> tuple:
    return (
        choice.get("name"),
        json.dumps(choice.get("params") or {}, sort_keys=True, default=str),
        str(config.get("data_root", "data")),
        choice.get("subsample"),
        choice.get("subsample_mode", "first"),
        int(config.get("seed", 0)),
        bool(as_ood),
    )


def _open_dataset(key: tuple):
    """The dataset for a cache key (module-level LRU of :data:`DATASET_CACHE_SIZE` datasets).

    Opened with ``download=False`` (a thumbnail never fetches files). Failures are not cached.
    """
    with _DATASET_CACHE_LOCK:
        if key in _DATASET_CACHE:
            _DATASET_CACHE.move_to_end(key)
            return _DATASET_CACHE[key]
    from oodviz.data import load_dataset

    name, params, root, subsample, mode, seed, as_ood = key
    ds = load_dataset(
        name,
        root=root,
        download=False,
        subsample=subsample,
        subsample_mode=mode,
        seed=seed,
        as_ood=as_ood,
        **json.loads(params),
    )
    with _DATASET_CACHE_LOCK:
        _DATASET_CACHE[key] = ds
        while len(_DATASET_CACHE) > DATASET_CACHE_SIZE:
            _DATASET_CACHE.popitem(last=False)
    return ds


def prefetch_datasets(results_or_config) -> threading.Thread | None:
    """Open the run's ID test set and OOD sets into the LRU in a background (daemon) thread, so that the first
    gallery does not wait for them (opening Fashion-MNIST's took seconds); None when all are open already. A
    dataset that cannot be opened is left to :func:`thumbnails` (its placeholder)."""
    config = _config_dict(results_or_config)
    choices = [(config.get("id_test"), False)] + [(choice, True) for choice in config.get("ood", []) or []]
    keys = [_cache_key(config, choice, as_ood) for choice, as_ood in choices if choice and choice.get("name")]
    with _DATASET_CACHE_LOCK:
        missing = [key for key in keys if key not in _DATASET_CACHE]
    if not missing:
        return None

    def open_each() -> None:
        for key in missing:
            try:
                _open_dataset(key)
            except Exception:  # the gallery shows "missing" for it
                continue

    thread = threading.Thread(target=open_each, name="oodviz-thumbnail-prefetch", daemon=True)
    thread.start()
    return thread


def clear_dataset_cache() -> None:
    """Forget the datasets :func:`thumbnails` opened (e.g. after files changed on disk)."""
    with _DATASET_CACHE_LOCK:
        _DATASET_CACHE.clear()


def placeholder(size: int = 64, text: str = "missing") -> Image.Image:
    """A grey ``size`` x ``size`` RGB image with ``text`` in the middle; ``info["oodviz"] == text``."""
    image = Image.new("RGB", (size, size), PLACEHOLDER_GREY)
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.textbbox((0, 0), text)
    draw.text(((size - (right - left)) / 2 - left, (size - (bottom - top)) / 2 - top), text, fill=(255, 255, 255))
    image.info["oodviz"] = text
    return image


def fit_image(image: Image.Image, size: int = 64) -> Image.Image:
    """``image`` as an RGB ``size`` x ``size`` thumbnail, aspect ratio kept (white letterbox).

    Images smaller than ``size`` are enlarged with NEAREST (8x8 digits stay crisp pixel blocks;
    an 8x8 image becomes exact 8x8-pixel blocks at size 64); larger ones are reduced with a
    smoothing (LANCZOS) filter.
    """
    image = image.convert("RGB")
    w, h = image.size
    scale = size / max(w, h)
    new = (max(1, round(w * scale)), max(1, round(h * scale)))
    if new != (w, h):
        image = image.resize(new, Image.Resampling.NEAREST if scale > 1 else Image.Resampling.LANCZOS)
    if new == (size, size):
        image.info["oodviz"] = "ok"
        return image
    canvas = Image.new("RGB", (size, size), LETTERBOX)
    canvas.paste(image, ((size - new[0]) // 2, (size - new[1]) // 2))
    canvas.info["oodviz"] = "ok"
    return canvas


def thumbnails(results_or_config, rows: pd.DataFrame, size: int = 64) -> list[Image.Image]:
    """One RGB ``size`` x ``size`` image per row of ``rows`` (e.g. a :func:`oodviz.results.analysis.failure_cases` table).

    ``results_or_config``: :class:`oodviz.results.tables.Results`, a RunConfig or its dict. Each row's dataset is
    re-opened with the run config's parameters (the ``id_test`` entry for split ``id_test``, the
    OOD entry of the same name for split ``ood``; same root, subsampling and seed, but never
    downloading) and cached in a module-level LRU. The row's ``index`` is the sample's *source
    index* (what the engine stores); its position in the dataset is found in
    ``ds.source_indices``.

    Never raises for a sample that cannot be shown: a dataset that cannot be opened any more
    (files moved, unknown name) or a source index it no longer has gives a grey placeholder with
    the text ``"missing"``; an image file that cannot be decoded gives ``"unreadable"``. Each
    image's ``info["oodviz"]`` says which (``"ok"``, ``"missing"``, ``"unreadable"``).
    """
    config = _config_dict(results_or_config)
    images: list[Image.Image] = []
    failed: dict[tuple, bool] = {}  # within one call, try a broken dataset once
    for split, dataset, index in zip(rows["split"], rows["dataset"], rows["index"]):
        choice, as_ood = _choice_for(config, str(split), str(dataset))
        if choice is None:
            images.append(placeholder(size, "missing"))
            continue
        key = _cache_key(config, choice, as_ood)
        if key in failed:
            images.append(placeholder(size, "missing"))
            continue
        try:
            ds = _open_dataset(key)
        except Exception:
            failed[key] = True
            images.append(placeholder(size, "missing"))
            continue
        source_indices = np.asarray(ds.source_indices)
        index = int(index)
        position = int(np.searchsorted(source_indices, index))  # subsample_indices are ascending
        if position >= len(source_indices) or source_indices[position] != index:
            hits = np.flatnonzero(source_indices == index)  # a source with unsorted indices
            if not hits.size:
                images.append(placeholder(size, "missing"))
                continue
            position = int(hits[0])
        try:
            item = ds[position]
        except Exception:
            images.append(placeholder(size, "missing"))
            continue
        if item is None or not isinstance(item[0], Image.Image):
            images.append(placeholder(size, "unreadable"))
            continue
        images.append(fit_image(item[0], size))
    return images
