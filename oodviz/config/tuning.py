"""What a run tunes: the validation splits, each detector's grid, and what is wrong with them (checked before any
work). How tuning runs (fit per grid point, AUROC on the validation splits, the choice) is the stage
:mod:`oodviz.pipeline.tuning`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from oodviz import detectors
from oodviz.config.layers import detector_columns
from oodviz.params import param_problems, shown
from oodviz.problems import Problem, detector_problem

if TYPE_CHECKING:
    from oodviz.config.run import DetectorChoice, RunConfig

#: The most grid points one detector may try (each is a fit and two validation scorings).
MAX_GRID_POINTS = 64
#: The splits a tuning run adds: ``(split, config attribute, loaded as OOD)``.
VALIDATION_SPLITS = (("id_val", "id_val", False), ("ood_val", "ood_val", True))


def tunes(config: RunConfig) -> bool:
    """Whether ``config`` tunes its detectors: it names both validation splits."""
    return config.id_val is not None and config.ood_val is not None


def validation_splits(config: RunConfig) -> list[tuple]:
    """``(split, dataset choice, loaded as OOD)`` of the validation splits of ``config`` (none unless it tunes)."""
    return [(split, getattr(config, key), as_ood) for split, key, as_ood in VALIDATION_SPLITS] if tunes(config) else []


def detector_grid(choice: DetectorChoice, default_grid: Callable[[str], Mapping] | None = None) -> dict[str, list]:
    """The values ``choice`` tries per parameter: its ``grid``, or (None) its detector's default grid less the
    parameters its ``params`` fix. ``default_grid(name)``: the detector class's ``default_grid`` unless given (the
    app's form passes :func:`oodviz.config.catalog.default_grid`, the same grids read without importing torch)."""
    if choice.grid is not None:
        return {key: list(values) for key, values in choice.grid.items()}
    if default_grid is None:
        default = detectors.detector_class(choice.name).default_grid
    else:
        default = default_grid(choice.name)
    return {key: list(values) for key, values in default.items() if key not in choice.params}


def grid_points(grid: Mapping[str, list]) -> list[dict]:
    """Every combination of ``grid``'s values, as parameter tables, the last parameter varying fastest."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def _same_data(a, b) -> bool:
    return a.name == b.name and a.params == b.params


def validation_warnings(config: RunConfig) -> list[str]:
    """What makes the choice or the test metrics of a tuning run unsound: the OOD validation set is a test OOD set
    (same dataset and parameters), the ID validation set may share images with the ID fit set (same dataset and
    parameters, unless one takes the ``"first"`` and the other the ``"last"`` items), or it is the ID test set."""
    if not tunes(config):
        return []
    found = []
    for choice in config.ood:  # named as the results name an OOD set (OOD names are unique in a config)
        if _same_data(choice, config.ood_val):
            found.append(
                f"the OOD validation set {config.ood_val.result_name} is also the OOD test set {choice.result_name} (same dataset and "
                "parameters): its parameters were chosen on the data they are tested on, so its test metrics are "
                "optimistic; choose an OOD validation set that is not a test set (another dataset, or other params "
                "such as a seed)"
            )
    fit, val = config.id_fit, config.id_val
    if _same_data(val, fit) and {fit.subsample_mode, val.subsample_mode} != {"first", "last"}:
        found.append(
            f"the ID validation set {val.name} may share images with the ID fit set: detectors are validated on "
            "what they were fitted on (knn with k=1 looks perfect); take disjoint parts, e.g. subsample_mode "
            '"first" for id_fit and "last" for id_val, or another dataset'
        )
    if _same_data(config.id_val, config.id_test):
        found.append(
            f"the ID validation set {config.id_val.name} is the ID test set: the test metrics are optimistic; "
            "validate on held-out ID images that are not in the test set"
        )
    return found


# -- checks ---------------------------------------------------------------------------------------
def tuning_problems(config: RunConfig, detectors_checked: bool = True) -> list[Problem]:
    """Every problem with ``config``'s validation splits and grids (``detectors_checked``: the detector list
    itself is well-formed, so its grids can be read), each message naming the fix."""
    found = []
    if (config.id_val is None) != (config.ood_val is None):
        missing = "ood_val" if config.ood_val is None else "id_val"
        message = (
            f"tuning needs both id_val (held-out ID images) and ood_val (an OOD set that is not a test set); "
            f"set {missing} too, or neither"
        )
        found.append(Problem(message, missing))
    if not detectors_checked:
        return found

    for i, choice in enumerate(config.detectors):
        if getattr(choice, "name", None) in detectors.available() and isinstance(getattr(choice, "params", None), dict):
            named = f"detectors[{i}] ({choice.name})"
            for message in _grid_problems(choice, named, tunes(config)):
                found.append(detector_problem(message, named, f"detectors[{i}].grid", choice.name))
    return found


def _grid_problems(choice: DetectorChoice, where: str, tuning: bool) -> list[str]:
    """What is wrong with one detector's grid: its shape, its parameters, its values, its size."""

    grid = choice.grid
    if grid is None or grid == {}:
        return []
    if not isinstance(grid, Mapping):
        return [
            f"{where}: grid must be a table {{parameter = [values]}} (or unset for the default grid), got {shown(grid)}"
        ]
    if not tuning:
        return [f"{where}: a grid needs validation data: set id_val and ood_val, or remove the grid"]
    found = []
    cls = detectors.detector_class(choice.name)
    tunable = [name for name in cls.param_names() if name not in ("model", "bank_dir")]
    for key, values in grid.items():
        if key not in tunable:
            found.append(
                f"{where}: grid names {key!r}, which is not a parameter to tune; "
                f"its parameters: {', '.join(tunable) or 'none'}"
            )
        elif key in choice.params:
            found.append(f"{where}: {key} is set in params and in grid; remove it from one of them")
        elif not isinstance(values, (list, tuple)) or not values:
            found.append(
                f"{where}: grid.{key} must be a non-empty list of values, "
                f"e.g. [{shown(getattr(cls(), key))}], got {shown(values)}"
            )
        elif len({shown(v) for v in values}) < len(values):
            found.append(f"{where}: grid.{key} lists a value twice; list each value once")
        else:
            for j, value in enumerate(values):
                found += _value_problems(choice, key, value, f"{where}: grid.{key}[{j}]")
    if not found and (n := len(grid_points(grid))) > MAX_GRID_POINTS:
        found.append(f"{where}: the grid has {n} combinations, more than {MAX_GRID_POINTS}; shorten its lists")
    return found


def _value_problems(choice: DetectorChoice, key: str, value, where: str) -> list[str]:

    found = param_problems(detectors.detector_class(choice.name), {key: value}, where, skip=("model",), signs=False)
    if found:
        return found
    try:
        detectors.create(choice.name, **{**choice.params, key: value})
    except (ValueError, TypeError) as error:
        return [f"{where}: {error}"]
    return []


def tuned_columns(config: RunConfig) -> list[tuple]:
    """``(result column, DetectorChoice, layer or None, grid)`` of every column a tuning run tunes, in fit order:
    each detector with a grid, at each layer it is scored at (:func:`oodviz.pipeline.layers.detector_columns`; one
    column per detector in a single-layer run)."""

    if not tunes(config):
        return []
    columns = [(column, choice, layer, detector_grid(choice)) for column, choice, layer in detector_columns(config)]
    return [column for column in columns if column[3]]
