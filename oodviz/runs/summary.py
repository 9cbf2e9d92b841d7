"""One-line facts about a run for lists and comparisons: what it ran, how it ended, how well."""

from __future__ import annotations

import pandas as pd

from oodviz.runs.rundir import RunDir


def title(config: dict) -> str:
    """``"digits-cnn on digits-train vs 6 OOD sets, 12 detectors"``."""
    return (
        f"{config.get('backbone')} on {config.get('id_fit', {}).get('name')} vs {len(config.get('ood', []))} OOD sets, "
        f"{len(config.get('detectors', []))} detectors"
    )


def read_metrics(run: RunDir) -> pd.DataFrame | None:
    path = run.path / "metrics.csv"
    return pd.read_csv(path) if path.exists() else None


def summarise(run: RunDir) -> dict:
    """``run_id, state, title, created, error``, and for finished runs ``best_detector`` with the best
    mean AUROC over the OOD datasets (``best_auroc``) and its mean FPR95."""
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
    metrics = read_metrics(run)
    if metrics is not None and len(metrics):
        summary.update(best_detector(metrics))
    return summary


def best_detector(metrics: pd.DataFrame) -> dict:
    """``best_detector`` with the highest AUROC averaged over the OOD datasets, its ``best_auroc`` and ``best_fpr95``."""
    per_dataset = metrics[~metrics.ood_dataset.str.endswith("(mean)")]
    means = per_dataset.groupby("detector")[["auroc", "fpr95"]].mean()
    best = means.auroc.idxmax()
    return {"best_detector": best, "best_auroc": float(means.auroc[best]), "best_fpr95": float(means.fpr95[best])}
