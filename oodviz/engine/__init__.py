"""Extraction and the on-disk feature store: run a backbone once, fit and score many detectors.

- :func:`extract` / :func:`extract_or_reuse`: batched extraction of features, logits, labels,
  predictions and source indices into a store, bounded host memory, OOM back-off, no device
  side effects (:mod:`oodviz.engine.extraction`).
- :class:`FeatureStore` / :func:`open_store`: one split on disk, ``store.batches()`` streams it as
  :class:`oodviz.Batch` chunks for ``detector.fit`` / ``score`` (:mod:`oodviz.engine.store`).
- :func:`store_key` / :func:`key_spec`: the content key of a split.
- Trust and housekeeping: :meth:`FeatureStore.verify` (checksums), :func:`check_free_space` /
  :class:`DiskFullError`, :func:`clean_stale_tmp`, :func:`remove_store`, :func:`stores_used_only_by`.
- :func:`score_inputs`: for detectors that run the model again (odin, mcd), the dataset's model
  inputs streamed through a scoring function on the device, in store order (:mod:`oodviz.engine.inputs`).
- :class:`BatchedPass`: what both share, one batched pass of a dataset through the model on a
  device: DataLoader, model placement, OOM back-off, progress, :class:`Cancelled`
  (:mod:`oodviz.engine.batched`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oodviz.lazy import lazy_attributes

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time each name is imported on first use
    from oodviz.engine.batched import PRECISIONS, BatchedPass, Cancelled, CudaContextLost, is_out_of_memory
    from oodviz.engine.extraction import extract, extract_or_reuse
    from oodviz.engine.inputs import InputScores, score_inputs
    from oodviz.engine.loading import AUTO_WORKERS
    from oodviz.engine.store import (
        FEATURE_DTYPES,
        STORE_FORMAT,
        STORES_DIRNAME,
        VERIFY_LEVELS,
        DeviceSplit,
        DiskFullError,
        FeatureStore,
        StoreBatches,
        StoreError,
        StoreWriter,
        check_free_space,
        check_stores,
        clean_stale_tmp,
        describe_transform,
        find_store,
        key_spec,
        list_stores,
        open_store,
        remove_store,
        store_key,
        store_users,
        stores_used_only_by,
    )

#: Each public name and the submodule that defines it, imported on first use: the store's constants and the torch-free
#: layers that name them (the run config, the app's catalog) do not load torch with this package.
_SOURCES = {
    "batched": ("BatchedPass", "Cancelled", "CudaContextLost", "PRECISIONS", "is_out_of_memory"),
    "extraction": ("extract", "extract_or_reuse"),
    "loading": ("AUTO_WORKERS",),
    "inputs": ("InputScores", "score_inputs"),
    "store": (
        "DeviceSplit",
        "DiskFullError",
        "FEATURE_DTYPES",
        "FeatureStore",
        "STORES_DIRNAME",
        "STORE_FORMAT",
        "StoreBatches",
        "StoreError",
        "StoreWriter",
        "VERIFY_LEVELS",
        "check_free_space",
        "check_stores",
        "clean_stale_tmp",
        "describe_transform",
        "find_store",
        "key_spec",
        "list_stores",
        "open_store",
        "remove_store",
        "store_key",
        "store_users",
        "stores_used_only_by",
    ),
}
__getattr__ = lazy_attributes(__name__, _SOURCES, globals())


__all__ = [
    "AUTO_WORKERS",
    "BatchedPass",
    "Cancelled",
    "CudaContextLost",
    "DeviceSplit",
    "DiskFullError",
    "FEATURE_DTYPES",
    "FeatureStore",
    "InputScores",
    "PRECISIONS",
    "STORES_DIRNAME",
    "STORE_FORMAT",
    "StoreBatches",
    "StoreError",
    "StoreWriter",
    "VERIFY_LEVELS",
    "check_free_space",
    "check_stores",
    "clean_stale_tmp",
    "describe_transform",
    "extract",
    "extract_or_reuse",
    "find_store",
    "is_out_of_memory",
    "key_spec",
    "list_stores",
    "open_store",
    "remove_store",
    "score_inputs",
    "store_key",
    "store_users",
    "stores_used_only_by",
]
