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
- AUROC (OOD positive, :func:`oodviz.results.metrics.ood_metrics`) on ``id_val`` vs ``ood_val`` ranks the points;
  the first of the best is chosen (ties go to the earlier grid point).

``tune_detectors`` is the pipeline's stage (``tune <column>``, one per result column with a grid: the detector's
name, or ``<detector>@<layer>``); what it tried and chose lands in ``detectors.json`` under each column's
``"tuning"``: ``grid``, ``results`` (``params`` and ``auroc``, or ``error``, per point), ``fits`` (how many fits it
took), ``chosen`` and its ``auroc``, the ``validation`` sets and (several layers) the ``layer``. The fit stage
then fits the chosen parameters. :func:`validation_warnings` says when a validation set is also a test set (the
worker warns, the app shows it). :func:`tuning_problems` checks a config's grids before any work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oodviz.config.run import DetectorChoice
from oodviz.config.tuning import VALIDATION_SPLITS, grid_points, tuned_columns, tunes, validation_warnings
from oodviz.detectors import detector_class
from oodviz.engine import Cancelled
from oodviz.pipeline.job import SCORE_BATCH, finite_scores, fitted_detector
from oodviz.pipeline.model_passes import score_with_model
from oodviz.results.metrics import ood_metrics

if TYPE_CHECKING:
    from oodviz.pipeline.job import Job


# -- the stage ------------------------------------------------------------------------------------
def tune_detectors(job: Job, fit_features=None, auroc_of=None) -> None:
    """One stage per result column with a grid (``tune <column>``, :func:`tuned_columns`) when the run tunes:
    :func:`tune_detector` at the column's layer, recorded in ``job.tuning[column]``; a warning per
    :func:`validation_warnings`, and when every point of a grid failed. ``fit_features`` and ``auroc_of``: as
    :func:`tune_detector` takes them (a sharded run passes its own).

    Reads ``config``, ``stores``, ``layer_stores``, ``datasets`` (model-based detectors); writes ``tuning``."""
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
    store, :func:`~oodviz.pipeline.stages.fit_on_store`); ``auroc_of(job, detector, stage, layer=layer)`` is the
    AUROC of a fitted one on the validation splits (default :func:`validation_auroc`). A sharded run passes its own
    (:mod:`oodviz.pipeline.sharded`), which give every rank the same AUROC or raise the same error on every rank.

    Parameters that only change the score (all of them for a detector with no fit; else the detector's
    ``score_params``) vary fastest, and a point that differs from the previous one only in those rescores the
    fitted detector (:meth:`~oodviz.detectors.Detector.set_params`) instead of fitting again; ``fits`` counts
    the fits."""

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

    id_scores, ood_scores = (validation_scores(job, detector, split, stage, layer) for split, _, _ in VALIDATION_SPLITS)
    return float(ood_metrics(id_scores, ood_scores)["auroc"])


def validation_scores(job: Job, detector, split: str, stage, layer: str | None = None):
    """Scores ``[N]`` of a fitted detector on a validation split (its store at ``layer``, None: the main one; or
    its images for a model-based one)."""

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

    chosen = job.tuning.get(column or choice.name, {}).get("chosen")
    return DetectorChoice(choice.name, {**choice.params, **chosen}, choice.grid) if chosen else choice
