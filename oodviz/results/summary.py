"""One-line facts about a run for lists and comparisons: what it ran, how it ended, how well."""

from __future__ import annotations

from oodviz.files import read_json_object
from oodviz.results.leaderboard import run_benchmark
from oodviz.results.tables import best_detector, read_result_table, scores_file_problem
from oodviz.runs.jobs import refresh
from oodviz.runs.rundir import DAMAGED, STATES, RunDir


def title(config: dict) -> str:
    """``"digits-cnn on digits-train vs 6 OOD sets, 12 detectors"`` (an OpenOOD benchmark's run: ``on OpenOOD v1.5
    cifar10``); parts the config lacks are left out."""
    id_fit = config.get("id_fit")
    fit_name = id_fit.get("name") if isinstance(id_fit, dict) else None
    if benchmark := run_benchmark(config):
        fit_name = f"OpenOOD v1.5 {benchmark}"
    ood, detectors = config.get("ood"), config.get("detectors")
    parts = [str(config.get("backbone", "?")), f"on {fit_name}" if fit_name else ""]
    if isinstance(ood, list):
        parts.append(f"vs {len(ood)} OOD sets,")
    if isinstance(detectors, list):
        parts.append(f"{len(detectors)} detectors")
    return " ".join(p for p in parts if p).rstrip(",")


def id_data(config: dict) -> str:
    """The ID data of a run's config as a run list names it: its ID test set (an OpenOOD v1.5 benchmark's run,
    :func:`~oodviz.results.leaderboard.run_benchmark`: ``openood <benchmark>``); "" when the config names none."""
    if benchmark := run_benchmark(config):
        return f"openood {benchmark}"
    test = config.get("id_test")
    return str(test.get("name", "")) if isinstance(test, dict) else ""


def summarise(run: RunDir) -> dict:
    """``run_id, state, stage, title, backbone, id_data, created, error, failed_detectors``, and for finished runs
    ``best_detector`` with the best mean AUROC over the OOD datasets (``best_auroc``) and its mean FPR95
    (:func:`oodviz.results.tables.best_detector`). Read-only and never raises: the state of a run whose files
    cannot be read (a ``done`` run's ``metrics.csv`` or ``scores.parquet`` included) is ``"damaged"`` and ``error``
    says ``"damaged: <what>"``."""
    status = refresh(run)
    config, problem = read_json_object(run.config_path)
    summary = {
        "run_id": run.run_id,
        "state": status.get("state"),
        "stage": status.get("stage"),
        "created": status.get("created") if isinstance(status.get("created"), int | float) else None,
        "error": status.get("error"),
        "failed_detectors": status.get("failed_detectors") or [],
        "title": title(config),
        "backbone": str(config.get("backbone", "")),
        "id_data": id_data(config),
        "best_detector": None,
        "best_auroc": None,
        "best_fpr95": None,
    }
    if problem is None and summary["state"] not in (*STATES, DAMAGED):
        problem = "status.json has no known state"
    if problem is None and summary["state"] == "done" and (scores := scores_file_problem(run.path)) is not None:
        problem = f"scores.parquet {scores}"  # what the run page, report and score read
    if problem is None and summary["state"] == "done":
        metrics = read_result_table(run.path, "metrics.csv")
        try:
            summary.update(best_detector(metrics))
        except (AttributeError, KeyError, TypeError, ValueError):  # None, garbage or no rows: not a result table
            problem = "metrics.csv is missing or not a metrics table"
    if problem is not None and summary["state"] != DAMAGED:
        summary.update(state=DAMAGED, error=f"damaged: {problem}")
    return summary
