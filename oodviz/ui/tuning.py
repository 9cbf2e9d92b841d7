"""What tuning on validation data chose (:mod:`oodviz.pipeline.tuning`), and the warning when a validation set is also
a test set; the tables come from :func:`tuning_table` and :func:`grid_table` (no streamlit in them)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from oodviz.config.run import RunConfig
from oodviz.config.tuning import validation_warnings
from oodviz.config.validation import ConfigError


def tuning_table(detectors: dict) -> pd.DataFrame:
    """One row per tuned detector of ``detectors.json``: the parameters chosen, their validation AUROC, the grid
    size and the validation sets (empty when nothing was tuned; parts a damaged file lacks are left blank)."""
    rows = []
    for name, entry in (detectors if isinstance(detectors, dict) else {}).items():
        tuning = entry.get("tuning") if isinstance(entry, dict) else None
        if not isinstance(tuning, dict):
            continue
        chosen, validation = _table(tuning.get("chosen")), _table(tuning.get("validation"))
        rows.append(
            {
                "detector": name,
                "chosen": ", ".join(f"{k}={v}" for k, v in chosen.items()) if chosen else "none (every point failed)",
                "validation AUROC": tuning.get("auroc"),
                "points tried": len(_points(tuning)),
                "validation sets": f"{validation.get('id', '?')} vs {validation.get('ood', '?')}",
            }
        )
    return pd.DataFrame(rows)


def grid_table(tuning: dict) -> pd.DataFrame:
    """Every grid point of one detector's tuning record: its parameters, validation AUROC or error, and the choice."""
    return pd.DataFrame(
        [
            {
                **_table(row.get("params")),
                "validation AUROC": row.get("auroc"),
                "error": row.get("error", ""),
                "chosen": row.get("params") == tuning.get("chosen"),
            }
            for row in _points(tuning)
        ]
    )


def _table(value) -> dict:
    return value if isinstance(value, dict) else {}


def _points(tuning: dict) -> list[dict]:
    results = tuning.get("results")
    return [row for row in results if isinstance(row, dict)] if isinstance(results, list) else []


def config_warnings(config: dict) -> list[str]:
    """:func:`~oodviz.pipeline.tuning.validation_warnings` of a run's saved config (none for one that no longer reads)."""
    try:
        return validation_warnings(RunConfig.from_dict(config))
    except (ConfigError, TypeError, AttributeError):
        return []


def validation_warning(results) -> None:
    """A warning above the results when a validation set is also a test (or fit) set: said once, here, by the
    metrics it is about (the run's warning events drop it, :func:`without_validation_warnings`)."""
    for warning in config_warnings(results.config):
        st.warning(f"Tuning: {warning}.")


def without_validation_warnings(messages: list[str], config: dict) -> list[str]:
    """A run's warning ``messages`` less those :func:`validation_warning` shows above its results (the worker
    warns the same, :func:`oodviz.pipeline.tuning.tune_detectors`)."""
    shown = set(config_warnings(config))
    return [message for message in messages if message not in shown]


def tuning_panel(results) -> None:
    """The parameters tuning chose per detector, and each grid's results in an expander."""
    table = tuning_table(results.detectors)
    if table.empty:
        return
    st.markdown("**Tuned on validation data** (each detector's parameters chosen by validation AUROC, OOD positive)")
    st.dataframe(table, hide_index=True, width="stretch")
    for name, chosen in zip(table["detector"], table["chosen"]):
        with st.expander(f"{name}: {chosen} (every grid point)"):
            st.dataframe(grid_table(results.detectors[name]["tuning"]), hide_index=True, width="stretch")
