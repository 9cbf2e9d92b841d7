"""The Runs page: every run (with the names, notes and tags users gave), filtered and sorted; open, compare, delete.

A run's name and notes live in its directory, ``label.json`` (``{"name", "notes"}``); the run keeps its id,
so its URL (``?run=<id>``) keeps working whatever it is called.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import pandas as pd
import streamlit as st

from oodviz import engine
from oodviz.files import read_json_object, write_atomic
from oodviz.results.summary import summarise
from oodviz.runs.jobs import delete_run, list_runs
from oodviz.runs.rundir import RunDir
from oodviz.ui.access import PathRefused, run_path, shown_message
from oodviz.ui.navigation import open_compare, open_run, page, runs_root

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


def label_editor(run: RunDir, place) -> None:
    """Name and annotate a run (shown in the run list; a ``#word`` tags it), in a popover in ``place``; its id and
    URL stay the same."""
    label = read_label(run.path)
    with place.popover("Name and notes", width="stretch", help="Name the run and note what it was for; #word tags it."):
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


def run_choices(root: Path) -> list[str]:
    """The ids of the runs under ``root`` a page may offer, newest first: the direct children of the runs root (a link
    leading out of it is not a run of this app, never read)."""
    ids = []
    for run in list_runs(root):
        try:
            run_path(root, run.run_id)
        except PathRefused:
            continue
        ids.append(run.run_id)
    return ids


def run_label(run_id: str) -> str:
    """How a picker names a run of :func:`~oodviz.ui.navigation.runs_root`: its id, and the name a user gave it (an id
    from the URL that is no run name of the runs root, ``../x``, is shown as it is: nothing outside is read)."""
    try:
        name = read_label(run_path(runs_root(), run_id))["name"]
    except PathRefused:
        return run_id
    return f"{run_id} · {name}" if name else run_id


def tags_of(label: dict) -> list[str]:
    """The tags of a run: each ``#word`` of its name and notes, lower case, once, in order."""
    return list(dict.fromkeys(tag.lower() for tag in TAG.findall(f"{label['name']} {label['notes']}")))


def runs_table(root: Path) -> pd.DataFrame:
    """One row per run, read-only (:func:`oodviz.results.summary.summarise`): a damaged run's state says what is wrong;
    its backbone, ID data and tags (:func:`tags_of`) to filter by, and its notes to search."""
    rows = []
    for run_id in run_choices(root):
        run = RunDir(Path(root) / run_id)
        s = summarise(run)
        state = s["error"] if s["state"] == "damaged" else str(s["state"])
        if s["failed_detectors"]:
            state += f" ({len(s['failed_detectors'])} detector(s) failed)"
        label = read_label(run.path)
        rows.append(
            {
                "run": s["run_id"],
                "name": label["name"],
                "state": state,
                "best detector": s["best_detector"] or "",
                "mean AUROC": s["best_auroc"],
                "mean FPR95": s["best_fpr95"],
                "backbone": s["backbone"],
                "ID data": s["id_data"],
                "tags": ", ".join(tags_of(label)),
                "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(s["created"])) if s["created"] else "",
                "what": s["title"],  # last: the longest, the figures stay in view at 1000 px
                "notes": label["notes"],
            }
        )
    return pd.DataFrame(rows, columns=RUNS_COLUMNS)


#: the run list's columns (the notes are searched, not shown)
RUNS_COLUMNS = [
    "run",
    "name",
    "state",
    "best detector",
    "mean AUROC",
    "mean FPR95",
    "backbone",
    "ID data",
    "tags",
    "created",
    "what",
    "notes",
]
#: a tag: ``#`` and a word (letters, digits, ``_``, ``-``)
TAG = re.compile(r"#([\w-]+)")


def runs_table_key(run_ids: list[str]) -> str:
    """The run list's widget key: a new one when the rows shown change (runs come or go, a filter), so a selection
    never points at other rows."""
    return "runs-table-" + hashlib.sha1("\n".join(run_ids).encode()).hexdigest()[:12]


def filtered(
    table: pd.DataFrame, search: str, states: list[str], backbones: list[str], data: list[str], tags: list[str]
):
    """The rows of the run list that match: ``search`` (case-insensitive) in the run id, name, notes, best detector or
    description; a state among ``states`` (its first word: "failed (2 detector(s) failed)" is failed), a backbone
    among ``backbones``, ID data among ``data``, every tag of ``tags``; an empty filter keeps every row."""
    keep = pd.Series(True, index=table.index)
    if search.strip():
        text = table[["run", "name", "notes", "best detector", "what"]].astype(str).agg(" ".join, axis=1)
        keep &= text.str.contains(search.strip(), case=False, regex=False)
    if states:
        keep &= table.state.str.split().str[0].isin(states)
    if backbones:
        keep &= table.backbone.isin(backbones)
    if data:
        keep &= table["ID data"].isin(data)
    for tag in tags:
        keep &= table.tags.str.split(", ").apply(lambda found, tag=tag: tag in found)
    return table[keep]


def runs_page() -> None:
    """The Runs page: every run under the runs root, filtered by a search, state, backbone, ID data and tags, sorted
    by any column (its heading); open one, compare two, or delete (asked first)."""
    st.title("Runs")
    root = runs_root()
    table = runs_table(root)
    if table.empty:
        st.caption("No runs yet.")
        st.page_link(page("new"), label="Start one on the New run page")
        return
    search = st.text_input(
        "Search", placeholder="run id, name, notes, detector, data…", help="Case-insensitive, anywhere in the text."
    )
    f1, f2, f3, f4 = st.columns(4)
    states = f1.multiselect("State", sorted(set(table.state.str.split().str[0])))
    backbones = f2.multiselect("Backbone", sorted(set(table.backbone) - {""}))
    data = f3.multiselect("ID data", sorted(set(table["ID data"]) - {""}))
    tags = f4.multiselect(
        "Tags",
        sorted({tag for found in table.tags for tag in found.split(", ") if tag}),
        help="Write #word in a run's name or notes (Name and notes, on its Run page) to tag it.",
    )
    shown = filtered(table, search, states, backbones, data, tags).reset_index(drop=True)
    st.caption(
        f"{len(shown)} of {len(table)} run(s). Click a column's heading to sort by it; select rows to open, compare "
        "or delete them."
    )
    chosen = st.dataframe(
        shown.drop(columns="notes").style.format({"mean AUROC": "{:.3f}", "mean FPR95": "{:.3f}"}, na_rep="—"),
        hide_index=True,
        width="stretch",
        on_select="rerun",
        selection_mode="multi-row",
        key=runs_table_key(list(shown.run)),
    )
    picked = [shown.iloc[i]["run"] for i in chosen.selection.rows if i < len(shown)]
    c1, c2, c3 = st.columns(3)
    if c1.button("Open", disabled=len(picked) != 1, width="stretch"):
        open_run(picked[0])
    if c2.button("Compare", disabled=len(picked) != 2, width="stretch", help="Select two runs to compare them."):
        open_compare(*picked)
    with c3:  # the button first: in line with Open and Compare, its option under it
        delete = st.button("Delete", disabled=not picked, width="stretch")
        remove_stores = st.checkbox(
            "with their feature stores",
            help="Also remove the extracted features that no other run uses (a later run extracts them again).",
            key="delete-stores",
        )
        if delete:
            st.session_state[CONFIRM] = picked
    confirm_delete(root, picked, remove_stores)


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
