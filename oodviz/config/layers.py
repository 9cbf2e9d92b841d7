"""The result columns a config asks for: each detector once, or once per layer in a run over several layers
(``RunConfig.layers``), and what is wrong with its layers. The run's stages over layers are
:mod:`oodviz.pipeline.layers`; the column names, :mod:`oodviz.columns`.
"""

from __future__ import annotations

from oodviz import detectors, models
from oodviz.columns import COMBINED_DETECTOR, PENULTIMATE, layer_column, reads_features

#: the stage of :func:`oodviz.pipeline.layers.combine_layers`
COMBINE_STAGE = f"combine {COMBINED_DETECTOR} over layers"


def layers_problems(config, model_known: bool) -> list[str]:
    """What is wrong with ``config.layers`` (names, duplicates, and ``layer`` set beside it); the names are
    checked against the model's layers when ``model_known`` (the backbone is valid)."""

    found = []
    bad = [name for name in config.layers if not isinstance(name, str) or not name]
    if bad:
        return [f"layers must be a list of layer names (or {PENULTIMATE!r}), got {bad!r}"]
    for name in sorted({n for n in config.layers if config.layers.count(n) > 1}):
        found.append(f"layers lists {name!r} twice")
    if config.layer is not None:
        found.append(
            f"set layer or layers, not both: put {config.layer!r} in layers (layers = [...] compares several layers)"
        )
    if not model_known:
        return found
    if config.backbone in models.USER_MODEL_NAMES:
        return [*found, f"layers are not supported for {config.backbone} models (hooks cannot be attached to them)"]
    names = models.architecture_layer_names(config.backbone, config.model_args or None)
    for name in config.layers:
        if name != PENULTIMATE and name not in names:
            note = f"{PENULTIMATE!r} names the head's input."
            found.append("layers: " + models.unknown_layer_message(config.backbone, name, names, note))
    return found


def detector_columns(config) -> list[tuple[str, object, str | None]]:
    """``(result column, DetectorChoice, layer or None)`` of every detector the run fits, in config order
    (per layer in ``config.layers`` order); ``layer`` is ``None`` for a detector scored on the main store."""

    if not config.layers:
        return [(choice.name, choice, None) for choice in config.detectors]
    columns = []
    for choice in config.detectors:
        kind = detectors.detector_class(choice.name)
        if not reads_features(kind):
            columns.append((choice.name, choice, None))
            continue
        for layer in config.layers:
            if layer == PENULTIMATE or not kind.needs_head:
                columns.append((layer_column(choice.name, layer), choice, layer))
    return columns


def headless_skips(config) -> dict[str, list[str]]:
    """Detector -> the layers it is left out at: it needs the head, which maps only the penultimate features."""
    scored = {column for column, _, _ in detector_columns(config)}
    skips = {
        choice.name: [layer for layer in config.layers if layer_column(choice.name, layer) not in scored]
        for choice in config.detectors
        if choice.name not in scored
    }
    return {name: layers for name, layers in skips.items() if layers}


def combines_layers(config) -> bool:
    """Whether the run plans ``mahalanobis@combined``: mahalanobis at two or more layers (:func:`oodviz.pipeline.layers.combine_layers`)."""
    columns = [column for column, choice, _ in detector_columns(config) if choice.name == COMBINED_DETECTOR]
    return len(config.layers) > 1 and len(columns) > 1
