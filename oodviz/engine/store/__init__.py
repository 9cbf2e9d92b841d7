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

One module per concern:

- :mod:`~oodviz.engine.store.keys`: ``key`` is a shortened sha256 of a canonical JSON of everything
  that determines the content (:func:`key_spec`, :func:`store_key`).
- :mod:`~oodviz.engine.store.writer`: :class:`StoreWriter` writes a split under
  ``<key>.tmp-<pid>-<random>`` and renames it to ``<key>`` only when every row and ``meta.json``
  (with ``"complete": true``) are on disk, so a killed extraction never leaves a directory a later
  run would trust; :func:`clean_stale_tmp` removes leftovers. Memory stays bounded by one batch.
- :mod:`~oodviz.engine.store.reader`: :class:`FeatureStore` maps the arrays with
  ``np.load(mmap_mode="r")``; :func:`open_store`, :func:`find_store`, :func:`list_stores`.
- :mod:`~oodviz.engine.store.batches`: :meth:`FeatureStore.batches` streams a split as
  :class:`oodviz.Batch` chunks that every detector consumes directly, re-iterable for two-pass
  fits, optionally straight onto a GPU; :class:`DeviceSplit` holds a whole split on a device.
"""

from oodviz.engine.store.batches import BATCH_FIELDS, DeviceSplit, StoreBatches
from oodviz.engine.store.keys import (
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
from oodviz.engine.store.reader import FeatureStore, find_store, list_stores, open_store
from oodviz.engine.store.writer import ARRAYS, StoreWriter, clean_stale_tmp

__all__ = [
    "ARRAYS",
    "BATCH_FIELDS",
    "FEATURE_DTYPES",
    "KEY_LENGTH",
    "STORE_FORMAT",
    "DeviceSplit",
    "FeatureStore",
    "StoreBatches",
    "StoreError",
    "StoreWriter",
    "canonical_json",
    "check_feature_dtype",
    "clean_stale_tmp",
    "describe_transform",
    "find_store",
    "key_spec",
    "list_stores",
    "open_store",
    "store_key",
]
