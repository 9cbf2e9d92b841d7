"""One-line facts about a run for lists and comparisons: what it ran, how it ended, how well."""

from __future__ import annotations

from oodviz.results import best_detector, read_table
from oodviz.runs.rundir import RunDir


def title(config: dict) -> str:
    """``"digits-cnn on digits-train vs 6 OOD sets, 12 detectors"``."""
    return (
        f"{config.get('backbone')} on {config.get('id_fit', {}).get('name')} vs {len(config.get('ood', []))} OOD sets, "
        f"{len(config.get('detectors', []))} detectors"
    )


def summarise(run: RunDir) -> dict:
    """``run_id, state, title, created, error``, and for finished runs ``best_detector`` with the best
    mean AUROC over the OOD datasets (``best_auroc``) and its mean FPR95 (:func:`oodviz.results.best_detector`)."""
    status = run.read_status()
    summary = {
        "run_id": run.run_id,
        "state": status.get("state"),
        "stage": status.get("stage"),
        "created": status.get("created"),
        "error": status.get("error"),
        "title": title(run.read_config()),
        "best_detector": None,
        "best_auroc": None,
        "best_fpr95": None,
    }
    metrics = read_table(run.path / "metrics.csv")
    if metrics is not None and len(metrics):
        summary.update(best_detector(metrics))
    return summary
