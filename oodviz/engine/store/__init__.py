"""The on-disk feature store: one directory per extracted split, read through memory maps.

Layout of a split, ``<root>/<key>/``::

    features.npy      [N, D]  float32 (or float16)   penultimate features
    logits.npy        [N, C]  float32                 classifier outputs
    labels.npy        [N]     int64                   class index, -1 = OOD
    predictions.npy   [N]     int64                   argmax of logits (first maximum on ties)
    indices.npy       [N]     int64                   source index of each row in the dataset
    head_weight.npy   [C, D]  float32  (optional)     final linear layer, when the backbone has one
    head_bias.npy     [C]     float32  (optional)
    meta.json                                         what, how, how many, how long; "files": the
                                                      checksum, size and mtime of every .npy above

One module per concern:

- :mod:`~oodviz.engine.store.keys`: ``key`` is a shortened sha256 of a canonical JSON of everything
  that determines the content (:func:`key_spec`, :func:`store_key`).
- :mod:`~oodviz.engine.store.writer`: :class:`StoreWriter` writes a split under
  ``<key>.tmp-<pid>-<start>-<random>`` and renames it to ``<key>`` only when every row and
  ``meta.json`` (with ``"complete": true``) are on disk, so a killed extraction never leaves a
  directory a later run would trust. Memory stays bounded by one batch.
- :mod:`~oodviz.engine.store.integrity`: a blake2b checksum of every array file, computed as it is
  written and recorded in ``meta.json["files"]``; :meth:`FeatureStore.verify` checks it (cheaply
  by size and mtime, or fully).
- :mod:`~oodviz.engine.store.space`: :func:`check_free_space` before extraction, :class:`DiskFullError`
  when a write finds the disk full (the temporary directory removed).
- :mod:`~oodviz.engine.store.manage`: :func:`clean_stale_tmp` removes leftovers whose writer (pid and
  start time) is gone; :func:`remove_store`; :func:`store_users` and :func:`stores_used_only_by` say
  which runs (``meta["splits"][split]["store"]``) use which store.
- :mod:`~oodviz.engine.store.reader`: :class:`FeatureStore` maps the arrays with
  ``np.load(mmap_mode="r")``; :func:`open_store`, :func:`find_store`, :func:`list_stores`.
- :mod:`~oodviz.engine.store.batches`: :meth:`FeatureStore.batches` streams a split as
  :class:`oodviz.Batch` chunks that every detector consumes directly, re-iterable for two-pass
  fits, optionally straight onto a GPU; :class:`DeviceSplit` holds a whole split on a device.
"""

from oodviz.engine.store.batches import BATCH_FIELDS, DeviceSplit, StoreBatches
from oodviz.engine.store.integrity import VERIFY_LEVELS
from oodviz.engine.store.keys import (
    ARRAYS,
    FEATURE_DTYPES,
    KEY_LENGTH,
    STORE_FORMAT,
    StoreError,
    canonical_json,
    check_feature_dtype,
    describe_transform,
    key_spec,
    store_key,
)
from oodviz.engine.store.manage import (
    STORES_DIRNAME,
    check_stores,
    clean_stale_tmp,
    remove_store,
    run_store_keys,
    store_users,
    stores_used_only_by,
)
from oodviz.engine.store.reader import FeatureStore, find_store, list_stores, open_store
from oodviz.engine.store.space import DiskFullError, check_free_space, free_bytes
from oodviz.engine.store.writer import StoreWriter

__all__ = [
    "ARRAYS",
    "BATCH_FIELDS",
    "FEATURE_DTYPES",
    "KEY_LENGTH",
    "STORES_DIRNAME",
    "STORE_FORMAT",
    "VERIFY_LEVELS",
    "DeviceSplit",
    "DiskFullError",
    "FeatureStore",
    "StoreBatches",
    "StoreError",
    "StoreWriter",
    "canonical_json",
    "check_feature_dtype",
    "check_free_space",
    "check_stores",
    "clean_stale_tmp",
    "describe_transform",
    "find_store",
    "free_bytes",
    "key_spec",
    "list_stores",
    "open_store",
    "remove_store",
    "run_store_keys",
    "store_key",
    "store_users",
    "stores_used_only_by",
]
