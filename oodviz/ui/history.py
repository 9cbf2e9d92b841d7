"""Past runs: the list (with the names users gave), delete with confirmation, and comparing two runs.

A run's name and notes live in its directory, ``label.json`` (``{"name", "notes"}``); the run keeps its id,
so its URL (``?run=<id>``) keeps working whatever it is called.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import streamlit as st

from oodviz import engine
from oodviz.figures import plots
from oodviz.files import read_json_object, write_atomic
from oodviz.results.analysis import compare_runs, unmatched_detectors
from oodviz.results.summary import summarise
from oodviz.results.tables import load_results
from oodviz.runs.jobs import delete_run, list_runs
from oodviz.runs.rundir import RunDir
from oodviz.ui.access import PathRefused, run_path, shown_message

LABEL_FILE = "label.json"
NAME_MAX = 80
NOTES_MAX = 2000
CONFIRM = "confirm-delete"


def read_label(path: Path) -> dict:
    """``{"name", "notes"}`` of the run at ``path`` (empty strings when it has none, or a damaged file)."""
    data, _ = read_json_object(Path(path) / LABEL_FILE)
    data = data if isinstance(data, dict) else {}
    return {key: str(data.get(key) or "") for key in ("name", "notes")}


def write_label(path: Path, name: str, notes: str) -> None:
    """Save a run's name (one line, at most :data:`NAME_MAX` characters) and notes; ValueError when too long."""
    name, notes = " ".join(name.split()), notes.strip()
    if len(name) > NAME_MAX or len(notes) > NOTES_MAX:
        raise ValueError(f"a name has at most {NAME_MAX} characters and notes at most {NOTES_MAX}; shorten them")
    write_atomic(Path(path) / LABEL_FILE, json.dumps({"name": name, "notes": notes}).encode())


def label_editor(run: RunDir) -> None:
    """Name and annotate a run (shown in the run list); its id and URL stay the same."""
    label = read_label(run.path)
    with st.expander(f"Name and notes{': ' + label['name'] if label['name'] else ''}"):
        with st.form(f"label-{run.run_id}", border=False):
            name = st.text_input("Name", label["name"], max_chars=NAME_MAX)
            notes = st.text_area("Notes", label["notes"], max_chars=NOTES_MAX, height=80)
            if st.form_submit_button("Save"):
                try:
                    write_label(run.path, name, notes)
                except (ValueError, OSError) as error:
                    st.error(f"Not saved: {shown_message(str(error))}")
                else:
                    st.rerun()


def runs_table(root: Path) -> pd.DataFrame:
    """One row per run, read-only (:func:`oodviz.results.summary.summarise`): a damaged run's state says what is wrong."""
    rows = []
    for run in list_runs(root):
        try:
            run_path(root, run.run_id)
        except PathRefused:  # a link leading out of the runs root: not a run of this app, never read
            continue
        s = summarise(run)
        state = s["error"] if s["state"] == "damaged" else str(s["state"])
        if s["failed_detectors"]:
            state += f" ({len(s['failed_detectors'])} detector(s) failed)"
        rows.append(
            {
                "run": s["run_id"],
                "name": read_label(run.path)["name"],
                "state": state,
                "best detector": s["best_detector"] or "",
                "mean AUROC": s["best_auroc"],
                "mean FPR95": s["best_fpr95"],
                "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(s["created"])) if s["created"] else "",
                "what": s["title"],  # last: the longest, the figures stay in view at 1000 px
            }
        )
    return pd.DataFrame(rows)


def runs_table_key(run_ids: list[str]) -> str:
    """The run list's widget key: a new one when runs come or go, so a selection never points at other rows."""
    return "runs-table-" + hashlib.sha1("\n".join(run_ids).encode()).hexdigest()[:12]


def past_runs(root: Path, open_run: Callable[[str | None], None]) -> None:
    table = runs_table(root)
    if table.empty:
        st.caption("No runs yet.")
        return
    chosen = st.dataframe(
        table.style.format({"mean AUROC": "{:.3f}", "mean FPR95": "{:.3f}"}, na_rep="—"),
        hide_index=True,
        width="stretch",
        on_select="rerun",
        selection_mode="multi-row",
        key=runs_table_key(list(table.run)),
    )
    picked = [table.iloc[i]["run"] for i in chosen.selection.rows if i < len(table)]
    c1, c2, c3 = st.columns(3)
    if c1.button("Open", disabled=len(picked) != 1):
        open_run(picked[0])
        st.rerun()
    with c3:
        remove_stores = st.checkbox(
            "with their feature stores",
            help="Also remove the extracted features that no other run uses (a later run extracts them again).",
            key="delete-stores",
        )
        if st.button("Delete", disabled=not picked):
            st.session_state[CONFIRM] = picked
    confirm_delete(root, picked, remove_stores)
    if len(picked) == 2:
        compare(root, *picked)
    else:
        c2.caption("Select two runs to compare them.")


def confirm_delete(root: Path, picked: list[str], remove_stores: bool) -> None:
    """Ask before deleting the runs the Delete button named (while they are still the ones selected)."""
    pending = st.session_state.get(CONFIRM)
    if not pending:
        return
    if pending != picked:  # the selection changed: that request is void
        st.session_state.pop(CONFIRM)
        return
    what = " and their unused feature stores" if remove_stores else ""
    st.warning(f"Delete {len(pending)} run(s){what}: {', '.join(pending)}? This cannot be undone.")
    yes, no, _ = st.columns([1, 1, 3])
    if yes.button("Yes, delete", type="primary"):
        st.session_state.pop(CONFIRM)
        delete_runs(root, pending, remove_stores)
        st.rerun()
    if no.button("Keep them"):
        st.session_state.pop(CONFIRM)
        st.rerun()


def delete_runs(root: Path, run_ids: list[str], remove_stores: bool) -> None:
    """Delete runs (their processes first); with ``remove_stores``, also the feature stores no other run uses."""

    for run_id in run_ids:
        run = RunDir(root / run_id)
        unused = engine.stores_used_only_by(run.path, root) if remove_stores else []  # before the run is gone
        delete_run(run)
        for store in unused:
            try:
                engine.remove_store(store.parent, store.name)
            except FileNotFoundError:  # removed meanwhile by another session
                pass


# -- compare --------------------------------------------------------------------------------------
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
        st.dataframe(diff, hide_index=True, width="stretch")
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
