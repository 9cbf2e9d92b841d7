"""A run over several layers (``RunConfig.layers``): validation, extraction, detector columns, combined Mahalanobis.

``layers = ["features.0", "features.3", "penultimate"]`` extracts every split once, hooking every layer in
the same forward pass (:func:`oodviz.engine.layers.extract_layers_or_reuse`): one feature store per layer,
the same rows in each. ``"penultimate"`` names the head's input (the default features). The first layer's
store is the split's main store (its logits, labels, predictions and row order are every layer's).

What the run scores (:func:`detector_columns`):

- a detector that reads features: once per layer, column ``"<name>@<layer>"`` (:mod:`oodviz.results.layers`);
  one that needs the classifier's head only at ``"penultimate"`` (the head maps no other layer to logits);
- a detector that reads only the logits, or runs the model itself (the run's backbone, ``layer`` unset):
  once, under its plain name;
- with ``mahalanobis`` at two or more layers: ``"mahalanobis@combined"``, the sum of the per-layer scores
  standardised on held-out ID images (``id_val``) when the run has them, else on the ID fit split (in-sample)
  (:func:`combine_layers`, :func:`oodviz.results.layers.combine_standardised`).

``meta.json["layers"]`` records the layers, each layer's store per split and the detectors left out at a
layer. Per-layer detectors are saved like the others (``detectors/<detector>@<layer>/``, knn referencing its
layer's ID fit store as its bank) with each layer's backbone identity (``detectors/layers.json``), so that
``oodviz score`` extracts the layers it needs in one pass and scores every column, the combined one included
(:mod:`oodviz.pipeline.scoring`).
"""

from __future__ import annotations

from oodviz.columns import COMBINED, COMBINED_DETECTOR, PENULTIMATE, layer_column
from oodviz.config.layers import COMBINE_STAGE, headless_skips
from oodviz.config.splits import feature_store_root, store_key_params
from oodviz.engine.layers import extract_layers_or_reuse
from oodviz.pipeline.job import SCORE_BATCH
from oodviz.results.layers import combine_standardised, depth_order

#: what the multi-layer Mahalanobis records in ``detectors.json`` (``{split}``: the split it standardises on)
COMBINED_FORMULA = "sum over layers l of (s_l(x) - mean_l) / std_l; mean_l, std_l (ddof=0) of s_l on the {split} split"
#: what each standardisation split is, for ``detectors.json``
STANDARDISED_ON = {
    "id_val": "held-out: the ID validation images, which no detector was fitted on",
    "id_fit": "in-sample: the ID fit images the per-layer detectors were fitted on (no id_val in the run)",
}


def layer_views(job) -> dict:
    """Layer name -> a view of the run's model (:meth:`~oodviz.models.Backbone.with_layer`) with its features, for
    every layer of the run (:func:`backbone_views`); made once per run and kept in ``job.layer_views`` (each view
    finds its feature size with a probe forward)."""
    if job.layer_views is None:
        job.layer_views = backbone_views(job.backbone, job.config.layers, job.config.pooling_at)
    return job.layer_views


def backbone_views(backbone, layers: list[str], pooling_at) -> dict:
    """Layer name -> a view of ``backbone``'s model with that layer's features, pooled by ``pooling_at(layer)``
    (:meth:`oodviz.config.run.RunConfig.pooling_at`)."""
    return {
        layer: backbone.with_layer(None if layer == PENULTIMATE else layer, pooling=pooling_at(layer))
        for layer in layers
    }


def extract_layers_split(job, split: str, choice, stage):
    """The stores of ``split`` at every layer, extracted in one pass or reused (``job.layer_stores[split]``);
    returns the first layer's, the split's main store. ValueError when the layers' stores disagree on the rows."""

    stores = extract_layers_or_reuse(
        layer_views(job),
        job.datasets[split],
        feature_store_root(job.run),
        key_params=store_key_params(job.config, choice),
        feature_dtype=job.config.feature_dtype,
        **job.model_pass_options(stage),
    )
    return keep_layer_stores(job, split, stores)


def keep_layer_stores(job, split: str, stores: dict):
    """Keep ``stores`` (layer -> store of ``split``, in ``config.layers`` order) as ``job.layer_stores[split]``,
    warning of each damaged store replaced; returns the first layer's, the split's main store. ValueError when
    the layers' stores disagree on the rows. (A sharded run opens its stores its own way, :mod:`oodviz.pipeline.sharded`.)"""
    first = next(iter(stores.values()))
    for layer, store in stores.items():
        if store.reuse_warning and store is not first:  # the first's is the split's, warned by extract_splits
            job.reporter.warn(f"{split} at {layer}: {store.reuse_warning}")
        if store.n != first.n or not (store.indices == first.indices).all():
            raise ValueError(
                f"{split}: the store of layer {layer!r} ({store.key}) has other rows than that of "
                f"{job.config.layers[0]!r} ({first.key}); delete one of them and run again"
            )
    job.layer_stores[split] = stores
    return first


def record_layers(job) -> None:
    """``meta.json["layers"]``: the layers, their store per split, the detectors left out at a layer (warned), and
    ``depth_order``, the layers from shallow to deep in the model (:func:`oodviz.results.layers.depth_order`; ``None``
    when the backbone has no module names to place them by)."""
    skipped = headless_skips(job.config)
    for name, layers in skipped.items():
        job.reporter.warn(f"{name} needs the classifier's head, so it is scored at {PENULTIMATE!r} only, not {layers}")
    job.meta["layers"] = {
        "layers": list(job.config.layers),
        "stores": {
            layer: {split: stores[layer].key for split, stores in job.layer_stores.items()}
            for layer in job.config.layers
        },
        "skipped_needs_head": skipped,
        "depth_order": depth_order(job.config.layers, job.backbone.layer_names()),
    }


def combine_layers(job) -> None:
    """Stage ``combine mahalanobis over layers``: when ``mahalanobis`` scored two or more layers, the column
    ``"mahalanobis@combined"`` of every scored split (:func:`oodviz.results.layers.combine_standardised`). Each layer's
    scores are standardised by their mean and standard deviation on ``id_val`` when the run has it (held-out ID
    images: the scale the layer's scores have on unseen ID data), else on the ID fit split (in-sample: the
    detectors were fitted on it, so its scores are smaller than on unseen ID data, and a layer that overfits more
    weighs more). The layers, the split (``standardised_on`` and its ``reference``), the means and standard
    deviations and the formula go into ``detectors.json``. Nothing to do in a single-layer run.

    Reads ``config``, ``fitted``, ``frames``, ``layer_stores``; writes a column into each of ``frames`` and
    ``detector_log["mahalanobis@combined"]``."""

    parts = {
        layer: layer_column(COMBINED_DETECTOR, layer)
        for layer in job.config.layers
        if layer_column(COMBINED_DETECTOR, layer) in job.fitted
    }
    if len(parts) < 2:
        return
    name = layer_column(COMBINED_DETECTOR, COMBINED)
    split = "id_val" if "id_val" in job.layer_stores else "id_fit"
    with (
        job.reporter.stage(COMBINE_STAGE) as stage,
        job.detector_may_fail(name, "combine the layers", stage),
    ):
        reference = {}
        for done, (layer, column) in enumerate(parts.items(), start=1):
            detector = job.fitted[column]
            batches = job.store_of(split, layer).batches(
                SCORE_BATCH, device=job.device, include=detector.fields_to_read(fitting=False)
            )
            reference[layer] = detector.score(batches, device=job.device).numpy()
            stage.progress(done, len(parts), {})
        for frame in job.frames:
            frame[name], stats = combine_standardised(
                {layer: frame[column].to_numpy() for layer, column in parts.items()}, reference
            )
        job.detector_log[name] = {
            "layers": list(parts),
            "standardised_on": split,
            "reference": STANDARDISED_ON[split],
            "stats": stats,
            "formula": COMBINED_FORMULA.format(split=split),
        }
