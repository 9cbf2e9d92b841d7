"""The form's validation data (tuning, :mod:`oodviz.pipeline.tuning`) and layers (:mod:`oodviz.pipeline.layers`) as
RunConfig settings, and back (no streamlit here: unit-testable).

- ID validation (``FormValues.id_val``): :data:`NO_VALIDATION`; :data:`HELD_OUT`, the last
  ``id_val_images`` images of the ID fit set (``subsample_mode="last"``), the fit then takes the images before
  them (``"first"``, at most ``fit_size - id_val_images``: disjoint); or :data:`VALIDATION_FOLDER`, an image
  folder of ID images.
- OOD validation (``FormValues.ood_val``): :data:`NO_VALIDATION` or one of the OOD sets the form offers, with
  the same parameters as a test set of that name (so the form can say when it is also a test set).
- ``tune``: the switch; off, the run names no validation data and tunes nothing. On, each chosen detector
  tries its default grid (:func:`oodviz.pipeline.tuning.detector_grid`) less the parameters set in the form.
- Layers (``FormValues.layers``): none or ``["penultimate"]`` = the default layer; one name = ``layer``;
  several = ``layers``, a run over several layers.
"""

from __future__ import annotations

from oodviz.columns import PENULTIMATE
from oodviz.config.catalog import backbone_layers, backbone_names, default_grid, detector_names, param_fields
from oodviz.config.run import DatasetChoice
from oodviz.config.tuning import detector_grid

NO_VALIDATION = "none"
HELD_OUT = "part of the ID fit set"
VALIDATION_FOLDER = "an image folder"
ID_VALIDATION_CHOICES = (NO_VALIDATION, HELD_OUT, VALIDATION_FOLDER)


def layer_settings(layers: list[str]) -> tuple[str | None, list[str]]:
    """``(RunConfig.layer, RunConfig.layers)`` for the layers chosen in the form."""
    names = [name.strip() for name in layers]
    if len(names) > 1:
        return None, names
    if not names or names[0] == PENULTIMATE:
        return None, []
    return names[0], []


def form_layers(config) -> list[str]:
    """The form's layers for ``config`` (the inverse of :func:`layer_settings`)."""
    return list(config.layers) if config.layers else [config.layer or PENULTIMATE]


def layer_options(backbone: str, chosen: list[str]) -> list[str]:
    """The layers the form offers for ``backbone``: ``"penultimate"`` and the model's modules
    (:func:`oodviz.models.architecture_layer_names`, the names the config is checked against), then any
    ``chosen`` name that is not one of them (a run's config, shown so that its check can say what is wrong).
    A user's own model file offers only ``"penultimate"`` (no hooks can be attached to it)."""

    names = backbone_layers(backbone) if backbone in backbone_names() else []
    offered = [PENULTIMATE, *names]
    return offered + [name for name in chosen if name not in offered]


def validation_choices(values, fit: DatasetChoice, ood_choice) -> tuple[DatasetChoice | None, DatasetChoice | None]:
    """``(id_val, ood_val)`` of the form ``values`` (None when the switch is off or the field is
    :data:`NO_VALIDATION`); sets ``fit``'s subsample to leave the held-out images out. ``ood_choice(name)`` is
    the form's DatasetChoice of an OOD set of that name."""
    if not values.tune:
        return None, None
    id_val = None
    if values.id_val == HELD_OUT:
        held = int(values.id_val_images)
        id_val = DatasetChoice(fit.name, dict(fit.params), subsample=held if held > 0 else None, subsample_mode="last")
        fit.subsample_mode = "first"
        if values.fit_size and 0 < held < values.fit_size:
            fit.subsample = min(fit.subsample or values.fit_size, values.fit_size - held)
    elif values.id_val == VALIDATION_FOLDER:
        id_val = DatasetChoice("folder", {"path": values.id_val_folder.strip()})
    ood_val = None if values.ood_val == NO_VALIDATION else ood_choice(values.ood_val)
    return id_val, ood_val


def form_validation(config) -> dict:
    """The form's validation fields for ``config`` (the inverse of :func:`validation_choices` for the configs the
    form makes): ``tune``, ``id_val``, ``id_val_images``, ``id_val_folder``, ``ood_val``."""
    fields = {"tune": config.id_val is not None or config.ood_val is not None}
    fields["ood_val"] = config.ood_val.name if config.ood_val is not None else NO_VALIDATION
    val = config.id_val
    if val is None:
        fields["id_val"] = NO_VALIDATION
    elif val.name == "folder":
        fields.update(id_val=VALIDATION_FOLDER, id_val_folder=val.params.get("path", ""))
    else:
        fields.update(id_val=HELD_OUT, id_val_images=val.subsample or 0)
    return fields


def held_out_problems(values) -> list[str]:
    """What is wrong with the held-out ID validation images of ``values`` (the config's checks cannot see the
    ID fit set's size): none to hold out, or not fewer than the set has, or the set could not be counted."""
    if not (values.tune and values.id_val == HELD_OUT):
        return []
    held = int(values.id_val_images)
    if held <= 0:
        return ["hold out at least one image of the ID fit set to validate on"]
    if not values.fit_size:
        return ["the ID fit set could not be counted, so no images can be held out of it; choose a folder"]
    if held >= values.fit_size:
        return [
            f"hold out fewer than the {values.fit_size:,} images of the ID fit set (the detectors are fitted on the "
            "rest)"
        ]
    return []


def _value_text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value).lower() if isinstance(value, bool) else str(value)


def grid_text(grid: dict) -> str:
    """``{"temperature": [0.5, 1.0]}`` -> ``"temperature: 0.5, 1"``: a grid as the form shows and edits it."""
    return "; ".join(f"{key}: {', '.join(_value_text(v) for v in values)}" for key, values in grid.items())


def parse_grid(detector: str, text: str) -> tuple[dict, list[str]]:
    """The grid typed as ``"parameter: value, value; parameter: value"`` for ``detector`` (blank: ``{}``, no
    tuning), and what cannot be read: each value as its parameter's kind (:func:`oodviz.ui.form.param_fields`);
    the config's own checks (:func:`oodviz.pipeline.tuning.tuning_problems`) judge the parameters and values."""

    kinds = {field.name: field.kind for field in param_fields(detector)}
    grid, problems = {}, []
    for part in (piece.strip() for piece in text.split(";")):
        if not part:
            continue
        key, colon, values = (item.strip() for item in part.partition(":"))
        if not colon:
            problems.append(f"{detector} grid: write parameter: value, value (got {part[:40]!r})")
            continue
        grid[key] = []
        for value in (item.strip() for item in values.split(",")):
            try:
                grid[key].append(_typed(kinds.get(key, "choice"), value))
            except ValueError:
                problems.append(f"{detector} grid: {key} takes {kinds[key]} values, got {value[:40]!r}")
    return grid, problems


def _typed(kind: str, text: str):
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "bool":
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    return text


def grid_of(values, name: str) -> dict | None:
    """``DetectorChoice.grid`` of detector ``name`` in the form ``values``: None (the default grid) unless the run
    tunes and its grid was edited (``detector_grids``), read with :func:`parse_grid`."""
    typed = values.detector_grids.get(name)
    return None if typed is None or not values.tune else parse_grid(name, typed)[0]


def tuned_grids(config) -> dict[str, dict]:
    """Detector -> the grid it tries in ``config`` (:func:`oodviz.pipeline.tuning.detector_grid`, with the default grids
    of :mod:`oodviz.config.catalog`: no torch import), for each known detector; ``{}`` for one with nothing to tune."""

    known = detector_names()
    return {choice.name: detector_grid(choice, default_grid) for choice in config.detectors if choice.name in known}
