"""The names of a run's result columns: a detector, or a detector at a layer (``"mahalanobis@features.3"``).

A run with ``layers = ["features.0", "features.3", "penultimate"]`` scores every detector that reads features once
per layer (:func:`reads_features`); its score column (``scores.parquet``) and its ``detector`` in ``metrics.csv`` /
``per_class.csv`` are ``"<detector>@<layer>"`` (:func:`layer_column`). Detectors that read only the logits, or run
the model themselves, are the same at every layer and keep their plain name; so does every detector of a
single-layer run. :func:`split_column` gives back ``(detector, layer or None)``: the one parser of that syntax.
"""

from __future__ import annotations

#: separates a detector from its layer in a result column: ``"mahalanobis@features.3"``
LAYER_SEP = "@"
#: the name of the penultimate features (the head's input) in ``RunConfig.layers``
PENULTIMATE = "penultimate"
#: the "layer" of a score combined over every layer (:func:`combine_standardised`)
COMBINED = "combined"
#: the detector whose per-layer scores a multi-layer run combines (:func:`combine_standardised`)
COMBINED_DETECTOR = "mahalanobis"


def layer_column(detector: str, layer: str) -> str:
    """The result column of ``detector`` at ``layer``: ``"<detector>@<layer>"``."""
    return f"{detector}{LAYER_SEP}{layer}"


def split_column(column: str) -> tuple[str, str | None]:
    """``(detector, layer)`` of a result column; ``layer`` is ``None`` for a plain detector name."""
    detector, sep, layer = column.partition(LAYER_SEP)
    return (detector, layer) if sep else (column, None)


def reads_features(detector_class) -> bool:
    """Whether a detector class reads the features (so a multi-layer run scores it once per layer):
    ``"features"`` among the batch fields it declares (:meth:`~oodviz.detectors.base.Detector.fields_to_read`);
    model-based detectors run the model themselves and are scored once."""
    return not detector_class.needs_model and "features" in detector_class.fields_to_read(fitting=True)
