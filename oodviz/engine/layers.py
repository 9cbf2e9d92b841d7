"""Several feature layers in one forward pass: one feature store per layer, the same rows in each.

::

    views = {"features.0": backbone.with_layer("features.0"), "penultimate": backbone}
    stores = extract_layers_or_reuse(views, dataset, "features/", {"split": "val"}, device="cuda")
    stores["features.0"].features   # [N, 16]; stores["penultimate"].features: [N, 64]

Each view (a :class:`~oodviz.models.Backbone` of the same model, :meth:`~oodviz.models.Backbone.with_layer`)
keeps its own store key (:func:`~oodviz.engine.store.store_key` of the view), so a layer's store is the
one a single-layer extraction of that layer would write and read: a multi-layer run reuses the stores of
single-layer runs and the other way round. The layers whose store is missing (or damaged) are extracted
together: :class:`LayerFanout` hooks all of them, one forward gives their features side by side
``[B, D_1 + ... + D_L]``, and :class:`LayerWriters` hands each layer its columns, so every store gets
the rows in the same order, with the same logits, labels, predictions and source indices. The loop
(batching, OOM back-off, cancel, all-or-nothing) is :func:`~oodviz.engine.extract`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import torch
from torch import Tensor

from oodviz.engine.extraction import check_verify, extract, trusted_store
from oodviz.engine.store import FeatureStore, StoreWriter, key_spec, store_key


class LayerFanout:
    """The views of one model (``views[i].model`` is the same object) as one backbone for
    :func:`~oodviz.engine.extract`: ``features_and_logits(x) -> (features [B, D_1 + ... + D_L], logits [B, C])``,
    each view's features (pooled its own way) in the order of ``views``, from one forward pass.
    ``name``, ``model``, ``transform``, ``input_shape`` and ``weights_id`` are the first view's; ``layer``
    names every layer (``"a+b"``); ``head`` is ``None`` (each layer's store gets its own, :class:`LayerWriters`)."""

    head = None

    def __init__(self, views: Sequence):
        if not views:
            raise ValueError("LayerFanout needs at least one view")
        if any(view.model is not views[0].model for view in views):
            raise ValueError("the views of a LayerFanout must share one model (Backbone.with_layer)")
        self.views = list(views)
        first = self.views[0]
        self.name, self.model, self.transform = first.name, first.model, first.transform
        self.input_shape, self.weights_id = first.input_shape, first.weights_id
        self.layer = "+".join(str(view.layer) for view in self.views)

    def features_and_logits(self, x: Tensor, grad: bool = False) -> tuple[Tensor, Tensor]:
        with ExitStack() as hooks:
            captured = [hooks.enter_context(view.capture()) for view in self.views[1:]]
            first, logits = self.views[0].features_and_logits(x, grad=grad)
        rest = [view.captured_features(c) for view, c in zip(self.views[1:], captured, strict=True)]
        return torch.cat([first, *rest], dim=1), logits


class LayerWriters:
    """A :class:`~oodviz.engine.store.StoreWriter` per layer behind one writer's interface, for
    :func:`~oodviz.engine.extract`'s ``make_writer``: :meth:`append` gives layer ``i`` its columns
    ``[sum(D_<i), sum(D_<=i))`` of the fan-out's features and every layer the same logits, labels,
    predictions and indices; :meth:`commit` writes each store with its own ``key_spec``, layer and head (the
    rest of ``meta.json``, timings and ``counts`` of non-finite rows included, is the pass's, over every layer).

    :param layers: per layer, in the fan-out's order: ``(key, D, key_spec, head or None)``
    The other parameters are ``make_writer``'s (the fan-out's key is not used: each layer has its own).
    """

    def __init__(
        self, layers: list[tuple], root, capacity: int, feature_dim: int, num_classes: int, feature_dtype: str
    ):
        if sum(dim for _, dim, _, _ in layers) != feature_dim:
            raise ValueError(f"the layers' feature sizes do not add up to the fan-out's D={feature_dim}")
        self.layers = layers
        self.writers: list[StoreWriter] = []
        self.stores: list[FeatureStore] = []
        try:
            for key, dim, _, _ in layers:
                self.writers.append(StoreWriter(root, key, capacity, dim, num_classes, feature_dtype))
        except BaseException:
            self.abort()
            raise

    @property
    def rows(self) -> int:
        return self.writers[0].rows

    def append(self, features, logits, labels, indices, predictions=None) -> None:
        start = 0
        for writer, (_, dim, _, _) in zip(self.writers, self.layers, strict=True):
            writer.append(features[:, start : start + dim], logits, labels, indices, predictions)
            start += dim

    def commit(self, meta: dict | None = None, head=None, sync: bool = True) -> FeatureStore:
        """Commit every layer's store (``head`` is ignored: each layer has its own); returns the first,
        the others are in :attr:`stores`. A layer whose commit fails leaves the committed ones in place
        (each is a complete store) and aborts the rest."""
        meta = dict(meta or {})
        try:
            for writer, (_, _, spec, layer_head) in zip(self.writers, self.layers, strict=True):
                backbone = {**meta.get("backbone", {}), **{k: spec["backbone"].get(k) for k in ("layer", "pooling")}}
                layer_meta = {**meta, "key_spec": spec, "backbone": backbone, "params": spec["params"]}
                self.stores.append(writer.commit(layer_meta, head=layer_head, sync=sync))
        finally:
            self.abort()
        return self.stores[0]

    def abort(self) -> None:
        """Remove every uncommitted store's temporary directory (no-op for committed ones)."""
        for writer in self.writers:
            writer.abort()


def _cpu_head(view):
    head = view.head
    return None if head is None else tuple(t.detach().float().cpu() for t in head)


def extract_layers_or_reuse(
    views: dict,
    dataset,
    store_root,
    key_params: dict | None = None,
    *,
    feature_dtype: str = "float32",
    precision: str = "fp32",
    verify: str = "cheap",
    progress=None,
    **options,
) -> dict[str, FeatureStore]:
    """The feature store of each view of ``views`` (layer name -> Backbone view of one model), reused when
    a trusted one exists (:func:`~oodviz.engine.extraction.trusted_store`), else extracted in one forward
    pass with every other missing layer. Returns layer name -> store, in the order of ``views``; a store
    extracted now has ``reused = False`` and the ``reuse_warning`` of a damaged one it replaced.
    ``options``: the other keyword arguments of :func:`~oodviz.engine.extract` (device, batch_size, ...)."""
    check_verify(verify)
    keys = {
        layer: store_key(view, dataset, key_params, feature_dtype=feature_dtype, precision=precision)
        for layer, view in views.items()
    }
    stores, warnings = {}, {}
    for layer, key in keys.items():
        stores[layer], warnings[layer] = trusted_store(store_root, key, verify)
    missing = [layer for layer in views if stores[layer] is None]
    for layer in views:
        if stores[layer] is not None:
            stores[layer].reused = True
    if missing:
        layers = [
            (
                keys[layer],
                views[layer].feature_dim,
                key_spec(views[layer], dataset, key_params, feature_dtype=feature_dtype, precision=precision),
                _cpu_head(views[layer]),
            )
            for layer in missing
        ]
        made: list[LayerWriters] = []

        def make_writer(root, _key, capacity, feature_dim, num_classes, dtype):
            made.append(LayerWriters(layers, root, capacity, feature_dim, num_classes, dtype))
            return made[-1]

        fanout = LayerFanout([views[layer] for layer in missing])
        extract(
            fanout,
            dataset,
            store_root,
            key_params,
            feature_dtype=feature_dtype,
            precision=precision,
            progress=progress,
            make_writer=make_writer,
            **options,
        )
        for layer, store in zip(missing, made[-1].stores, strict=True):
            store.reuse_warning = warnings[layer]
            stores[layer] = store
    elif progress is not None:
        n = next(iter(stores.values())).n
        progress(n, n, {"stage": "reused", "items_per_s": 0.0, "written": n, "elapsed_s": 0.0})
    return stores
