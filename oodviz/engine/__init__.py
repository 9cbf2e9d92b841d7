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
    from oodviz.engine.batched import PRECISIONS as PRECISIONS
    from oodviz.engine.batched import BatchedPass as BatchedPass
    from oodviz.engine.batched import Cancelled as Cancelled
    from oodviz.engine.batched import CudaContextLost as CudaContextLost
    from oodviz.engine.batched import is_out_of_memory as is_out_of_memory
    from oodviz.engine.extraction import extract as extract
    from oodviz.engine.extraction import extract_or_reuse as extract_or_reuse
    from oodviz.engine.inputs import InputScores as InputScores
    from oodviz.engine.inputs import score_inputs as score_inputs
    from oodviz.engine.loading import AUTO_WORKERS as AUTO_WORKERS
    from oodviz.engine.store import FEATURE_DTYPES as FEATURE_DTYPES
    from oodviz.engine.store import STORE_FORMAT as STORE_FORMAT
    from oodviz.engine.store import STORES_DIRNAME as STORES_DIRNAME
    from oodviz.engine.store import VERIFY_LEVELS as VERIFY_LEVELS
    from oodviz.engine.store import DeviceSplit as DeviceSplit
    from oodviz.engine.store import DiskFullError as DiskFullError
    from oodviz.engine.store import FeatureStore as FeatureStore
    from oodviz.engine.store import StoreBatches as StoreBatches
    from oodviz.engine.store import StoreError as StoreError
    from oodviz.engine.store import StoreWriter as StoreWriter
    from oodviz.engine.store import check_free_space as check_free_space
    from oodviz.engine.store import check_stores as check_stores
    from oodviz.engine.store import clean_stale_tmp as clean_stale_tmp
    from oodviz.engine.store import describe_transform as describe_transform
    from oodviz.engine.store import find_store as find_store
    from oodviz.engine.store import key_spec as key_spec
    from oodviz.engine.store import list_stores as list_stores
    from oodviz.engine.store import open_store as open_store
    from oodviz.engine.store import remove_store as remove_store
    from oodviz.engine.store import store_key as store_key
    from oodviz.engine.store import store_users as store_users
    from oodviz.engine.store import stores_used_only_by as stores_used_only_by

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


__all__ = sorted(name for names in _SOURCES.values() for name in names)
