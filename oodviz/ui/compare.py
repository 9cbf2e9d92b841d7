"""The Compare page (``/compare?a=<id>&b=<id>``): two runs side by side — a warning first when their data differ, the
settings they differ in, a per-detector scatter of mean AUROC and the table of differences, matched per layer and
detector, with every detector that could not be matched named and why."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import streamlit as st

from oodviz.figures import plots
from oodviz.results.analysis import compare_runs, unmatched_detectors
from oodviz.results.tables import load_results
from oodviz.ui.history import run_choices, run_label
from oodviz.ui.navigation import runs_root, url_widget_key, url_written_key


def flat(config: dict, prefix: str = "") -> dict[str, str]:
    """A config as ``{"id_test.name": "digits-test", "detectors": "msp, knn(k=5)", ...}`` for a difference table."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if key == "detectors" and isinstance(value, list):
            out[name] = ", ".join(
                d.get("name", "?")
                + (f"({', '.join(f'{k}={v}' for k, v in d['params'].items())})" if d.get("params") else "")
                for d in value
                if isinstance(d, dict)
            )
        elif key == "ood" and isinstance(value, list):
            out[name] = ", ".join(
                json.dumps(d, sort_keys=True) if d.get("params") else d.get("name", "?") for d in value
            )
        elif isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        elif name == "pooling" and value is None:  # unset: what the model's head reads (RunConfig.pooling)
            out[name] = "model's own"
        else:
            out[name] = "" if value is None else str(value)
    return out


def config_difference(a: dict, b: dict) -> pd.DataFrame:
    """The settings two configs differ in: ``setting, run A, run B``."""
    fa, fb = flat(a or {}), flat(b or {})
    keys = [k for k in dict.fromkeys([*fa, *fb]) if fa.get(k, "") != fb.get(k, "")]
    return pd.DataFrame(
        {"setting": keys, "run A": [fa.get(k, "") for k in keys], "run B": [fb.get(k, "") for k in keys]}
    )


def data_mismatch(a: dict, b: dict) -> str | None:
    """What makes two runs' metrics not comparable: another ID test set, or other OOD sets; None when same."""
    fa, fb = flat(a or {}), flat(b or {})
    differs = [k for k in ("id_test.name", "id_test.params.split", "id_test.subsample") if fa.get(k) != fb.get(k)]
    said = []
    if differs:
        said.append(f"the ID test set differs ({fa.get('id_test.name')} vs {fb.get('id_test.name')})")
    if fa.get("ood") != fb.get("ood"):
        said.append("the OOD sets differ (only the sets both have are compared)")
    return "; ".join(said) or None


#: :func:`oodviz.results.analysis.compare_runs`'s columns as the comparison table shows them
COMPARE_HEADINGS = {
    "ood_dataset": "OOD dataset",
    "auroc_a": "AUROC A",
    "auroc_b": "AUROC B",
    "auroc_delta": "AUROC B − A",
    "fpr95_a": "FPR95 A",
    "fpr95_b": "FPR95 B",
    "fpr95_delta": "FPR95 B − A",
}


def better_b(gain: float) -> str:
    """The text colour of a difference in run B's favour (``gain > 0``: green) or against it (red); none at 0
    (as shown, three decimals) or NaN."""
    if pd.isna(gain) or round(gain, 3) == 0:
        return ""
    return "color: #1b5e20" if gain > 0 else "color: #b71c1c"


def unmatched_note(a, b) -> None:
    """Names each detector of either run that the comparison could not match, and why
    (:func:`oodviz.results.analysis.unmatched_detectors`): nothing a run computed leaves the comparison unsaid."""

    unmatched = unmatched_detectors(a, b)
    if unmatched:
        st.caption(
            "Not compared, no counterpart in the other run: "
            + "; ".join(f"{u['detector']} (run {u['run']}: {u['why']})" for u in unmatched)
        )


def compare(root: Path, a_id: str, b_id: str) -> None:
    """Two runs side by side: a warning first when their data differ, the config difference, a per-detector
    scatter of mean AUROC (run A vs run B, over the OOD sets both have) and the table of deltas."""

    a, b = (load_results(root / r) for r in (a_id, b_id))
    if a.metrics is None or b.metrics is None:
        st.caption("Both runs need results to compare.")
        return
    st.markdown(f"**Compare {a_id} (A) with {b_id} (B)**")
    mismatch = data_mismatch(a.config, b.config)
    if mismatch:
        st.warning(f"These runs are on different data: {mismatch}. Their numbers are not comparable one to one.")
    diff = config_difference(a.config, b.config)
    if diff.empty:
        st.caption("Same config: differences come from randomness or the software version.")
    else:
        st.table(diff.set_index("setting"))  # wrapped, not cut: a setting's value can be a long list
    table = compare_runs(a, b)
    per_set = table[~table.ood_dataset.str.endswith(" (mean)")]
    if per_set.empty:
        st.info("The runs share no (detector, OOD set) pair: nothing to compare.")
        unmatched_note(a, b)
        return
    means = per_set.groupby("detector", sort=False)[["auroc_a", "auroc_b"]].mean()
    sets = sorted(per_set.ood_dataset.unique())
    st.plotly_chart(
        plots.compare_scatter(means, f"Mean AUROC over {len(sets)} shared OOD set(s)", a_id, b_id),
        width="stretch",
    )
    shown = per_set.rename(columns=COMPARE_HEADINGS)
    st.dataframe(
        shown.style.format(precision=3)
        .map(better_b, subset=["AUROC B − A"])
        .map(lambda delta: better_b(-delta), subset=["FPR95 B − A"]),
        hide_index=True,
        width="stretch",
    )
    st.caption("B − A: green where run B is better (a higher AUROC, a lower FPR95), red where it is worse.")
    unmatched_note(a, b)


def compare_page() -> None:
    """Two pickers (run A, run B; their ids in the URL, so a link reopens the comparison) and :func:`compare`."""
    st.title("Compare")
    ids = run_choices(runs_root())
    if len(ids) < 2:
        st.caption("Comparing needs two runs: start another on the New run page.")
        return
    picked = []
    for column, name, fallback in zip(st.columns(2), ("a", "b"), ids[1::-1]):
        asked = st.query_params.get(name)
        if asked is not None and asked not in ids:
            column.warning(f"There is no run {asked!r} here; it may have been deleted.")
        key = url_widget_key(f"compare-{name}", asked, ids, fallback)
        chosen = column.selectbox(f"Run {name.upper()}", ids, format_func=run_label, key=key)
        if st.query_params.get(name) != chosen:
            st.query_params[name] = chosen
        st.session_state[url_written_key(key)] = chosen
        picked.append(chosen)
    if picked[0] == picked[1]:
        st.info("Choose two different runs.")
        return
    compare(runs_root(), *picked)
