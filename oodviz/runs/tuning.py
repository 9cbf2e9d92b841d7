"""Tuning detectors on validation data: each detector's parameters chosen by AUROC on held-out ID images
against an OOD validation set, before the detectors are fitted for the test sets.

A run tunes when its config names both validation splits, ``id_val`` (held-out ID images, not the ID test
set) and ``ood_val`` (an OOD set that is not one of the test sets). Each detector then tries every point of its
grid (``DetectorChoice.grid``: ``{parameter: [values]}``, every combination, the parameters the fit uses varying
slowest; None = the detector's ``default_grid`` less the parameters fixed in ``params``; ``{}`` = no tuning).
In a run over several layers a detector that reads features is tuned at each layer it is scored at, on that
layer's stores: ``<detector>@<layer>`` gets its own choice (:func:`tuned_columns`).

- the validation splits are extracted once, like every split (their feature stores are reused by later runs);
- per grid point the detector is fitted on the ID fit split's store and scores the two validation stores
  (model-based detectors, such as odin, rerun the model on the validation images); a point that changes only
  parameters the fit does not use (every parameter of a detector with no fit, such as energy; knn's ``k``,
  ash's and scale's percentile: the detector's ``score_params``) rescores the fitted detector instead;
- AUROC (OOD positive, :func:`oodviz.metrics.ood_metrics`) on ``id_val`` vs ``ood_val`` ranks the points;
  the first of the best is chosen (ties go to the earlier grid point).

``tune_detectors`` is the pipeline's stage (``tune <column>``, one per result column with a grid: the detector's
name, or ``<detector>@<layer>``); what it tried and chose lands in ``detectors.json`` under each column's
``"tuning"``: ``grid``, ``results`` (``params`` and ``auroc``, or ``error``, per point), ``fits`` (how many fits it
took), ``chosen`` and its ``auroc``, the ``validation`` sets and (several layers) the ``layer``. The fit stage
then fits the chosen parameters. :func:`validation_warnings` says when a validation set is also a test set (the
worker warns, the app shows it). :func:`tuning_problems` checks a config's grids before any work.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from oodviz.params import param_problems, shown

if TYPE_CHECKING:
    from oodviz.runs.config import DetectorChoice, RunConfig
    from oodviz.runs.pipeline import Job

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
    app's form passes :func:`oodviz.catalog.default_grid`, the same grids read without importing torch)."""
    if choice.grid is not None:
        return {key: list(values) for key, values in choice.grid.items()}
    if default_grid is None:
        from oodviz.detectors import detector_class

        default = detector_class(choice.name).default_grid
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
                f"the OOD validation set {choice.name} is also the OOD test set {choice.name} (same dataset and "
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
def tuning_problems(config: RunConfig, detectors_checked: bool = True) -> list[str]:
    """Every problem with ``config``'s validation splits and grids (``detectors_checked``: the detector list
    itself is well-formed, so its grids can be read), each message naming the fix."""
    found = []
    if (config.id_val is None) != (config.ood_val is None):
        missing = "ood_val" if config.ood_val is None else "id_val"
        found.append(
            f"tuning needs both id_val (held-out ID images) and ood_val (an OOD set that is not a test set); "
            f"set {missing} too, or neither"
        )
    if not detectors_checked:
        return found
    from oodviz.detectors import available

    for i, choice in enumerate(config.detectors):
        if getattr(choice, "name", None) in available() and isinstance(getattr(choice, "params", None), dict):
            found += _grid_problems(choice, f"detectors[{i}] ({choice.name})", tunes(config))
    return found


def _grid_problems(choice: DetectorChoice, where: str, tuning: bool) -> list[str]:
    """What is wrong with one detector's grid: its shape, its parameters, its values, its size."""
    from oodviz.detectors import create, detector_class

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
    cls = detector_class(choice.name)
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
                found += _value_problems(choice, key, value, f"{where}: grid.{key}[{j}]", create)
    if not found and (n := len(grid_points(grid))) > MAX_GRID_POINTS:
        found.append(f"{where}: the grid has {n} combinations, more than {MAX_GRID_POINTS}; shorten its lists")
    return found


def _value_problems(choice: DetectorChoice, key: str, value, where: str, create) -> list[str]:
    from oodviz.detectors import detector_class

    found = param_problems(detector_class(choice.name), {key: value}, where, skip=("model",), signs=False)
    if found:
        return found
    try:
        create(choice.name, **{**choice.params, key: value})
    except (ValueError, TypeError) as error:
        return [f"{where}: {error}"]
    return []


# -- the stage ------------------------------------------------------------------------------------
def tune_detectors(job: Job, fit_features=None, auroc_of=None) -> None:
    """One stage per result column with a grid (``tune <column>``, :func:`tuned_columns`) when the run tunes:
    :func:`tune_detector` at the column's layer, recorded in ``job.tuning[column]``; a warning per
    :func:`validation_warnings`, and when every point of a grid failed. ``fit_features`` and ``auroc_of``: as
    :func:`tune_detector` takes them (a sharded run passes its own)."""
    if not tunes(job.config):
        return
    for warning in validation_warnings(job.config):
        job.reporter.warn(warning)
    for column, choice, layer, grid in tuned_columns(job.config):
        with job.reporter.stage(f"tune {column}") as stage:
            record = tune_detector(job, choice, grid, stage, fit_features, auroc_of, layer)
            job.tuning[column] = record
            if "chosen" in record:
                stage.note(f"{column}: {record['chosen']} (validation AUROC {record['auroc']:.4f})")
            else:
                job.reporter.warn(
                    f"{column}: every grid point failed on the validation data (first: "
                    f"{record['results'][0]['error']}); it is fitted with its configured parameters"
                )


def tuned_columns(config: RunConfig) -> list[tuple]:
    """``(result column, DetectorChoice, layer or None, grid)`` of every column a tuning run tunes, in fit order:
    each detector with a grid, at each layer it is scored at (:func:`oodviz.runs.layers.detector_columns`; one
    column per detector in a single-layer run)."""
    from oodviz.runs.layers import detector_columns

    if not tunes(config):
        return []
    columns = [(column, choice, layer, detector_grid(choice)) for column, choice, layer in detector_columns(config)]
    return [column for column in columns if column[3]]


def tune_detector(
    job: Job,
    choice: DetectorChoice,
    grid: dict[str, list],
    stage,
    fit_features=None,
    auroc_of=None,
    layer: str | None = None,
) -> dict:
    """Fit and score every point of ``grid`` (on top of ``choice.params``) on the stores of ``layer`` (None: the
    run's main ones); the ``detectors.json`` record.

    ``fit_features(job, detector, stage, layer)`` fits a feature-based detector (default: on the whole ID fit
    store, :func:`~oodviz.runs.pipeline.fit_on_store`); ``auroc_of(job, detector, stage, layer=layer)`` is the
    AUROC of a fitted one on the validation splits (default :func:`validation_auroc`). A sharded run passes its own
    (:mod:`oodviz.runs.sharded`), which give every rank the same AUROC or raise the same error on every rank.

    Parameters that only change the score (all of them for a detector with no fit; else the detector's
    ``score_params``) vary fastest, and a point that differs from the previous one only in those rescores the
    fitted detector (:meth:`~oodviz.detectors.Detector.set_params`) instead of fitting again; ``fits`` counts
    the fits."""
    from oodviz.detectors import detector_class
    from oodviz.engine import Cancelled
    from oodviz.runs.config import DetectorChoice
    from oodviz.runs.pipeline import fitted_detector

    auroc_of = validation_auroc if auroc_of is None else auroc_of
    cls = detector_class(choice.name)
    rescored = set(grid) if not cls.needs_fit else set(cls.score_params)
    grid = {key: grid[key] for key in sorted(grid, key=lambda key: key in rescored)}  # stable: refit keys first
    results, detector, fitted_for, fits = [], None, None, 0
    points = grid_points(grid)
    for done, point in enumerate(points, start=1):
        refit = {key: value for key, value in point.items() if key not in rescored}
        try:
            if detector is None or refit != fitted_for:
                detector = None  # a failed fit leaves nothing to rescore
                point_choice = DetectorChoice(choice.name, {**choice.params, **point})
                detector = fitted_detector(job, point_choice, stage, layer, fit_features)
                fitted_for, fits = refit, fits + 1
            else:
                detector.set_params(**{key: point[key] for key in rescored})
            results.append({"params": point, "auroc": auroc_of(job, detector, stage, layer=layer)})
        except Cancelled:
            raise
        except Exception as error:  # one grid point failing (k above the fit rows, NaN scores) is one row
            results.append({"params": point, "error": f"{type(error).__name__}: {error}"})
        stage.progress(done, len(points), {})
    config = job.config
    record = {
        "grid": grid,
        "results": results,
        "metric": "auroc",
        "fits": fits,
        "validation": {"id": config.id_val.name, "ood": config.ood_val.name},
    }
    if layer is not None:
        record["layer"] = layer
    scored = [row for row in results if "auroc" in row]
    if scored:
        best = max(scored, key=lambda row: row["auroc"])  # max keeps the first of equal values
        record.update(chosen=best["params"], auroc=best["auroc"])
    return record


def validation_auroc(job: Job, detector, stage, layer: str | None = None) -> float:
    """AUROC (OOD positive) of a fitted detector's scores on ``id_val`` against ``ood_val`` (at ``layer``)."""
    from oodviz.metrics import ood_metrics

    id_scores, ood_scores = (validation_scores(job, detector, split, stage, layer) for split, _, _ in VALIDATION_SPLITS)
    return float(ood_metrics(id_scores, ood_scores)["auroc"])


def validation_scores(job: Job, detector, split: str, stage, layer: str | None = None):
    """Scores ``[N]`` of a fitted detector on a validation split (its store at ``layer``, None: the main one; or
    its images for a model-based one)."""
    from oodviz.runs.model_passes import score_with_model
    from oodviz.runs.pipeline import SCORE_BATCH, finite_scores

    if detector.needs_model:
        values = score_with_model(job, detector, split, stage)
    else:
        fields = detector.fields_to_read(fitting=False)
        batches = job.store_of(split, layer).batches(SCORE_BATCH, device=job.device, include=fields)
        values = detector.score(batches, device=job.device).numpy()
    return finite_scores(detector, detector.name, split, values)


def tuned_choice(job: Job, choice: DetectorChoice, column: str | None = None) -> DetectorChoice:
    """``choice`` with the parameters tuning chose for its result ``column`` (None: the detector's name; itself
    when it was not tuned)."""
    from oodviz.runs.config import DetectorChoice

    chosen = job.tuning.get(column or choice.name, {}).get("chosen")
    return DetectorChoice(choice.name, {**choice.params, **chosen}, choice.grid) if chosen else choice
