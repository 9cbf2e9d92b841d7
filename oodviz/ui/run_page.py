"""The Run page (``/run?run=<id>``): one run — live while it runs (:mod:`oodviz.ui.watch`), its results once finished
(:mod:`oodviz.ui.results`). A header picks the run; under it the run's state, name, warnings, and for a failed run its
error with the fixes it names."""

from __future__ import annotations

import streamlit as st

from oodviz.config.plan import run_headline
from oodviz.config.run import RunConfig
from oodviz.files import read_json_object
from oodviz.problems import Fix, fixes_from
from oodviz.runs.jobs import refresh
from oodviz.runs.rundir import FINAL_STATES, RunDir
from oodviz.ui.access import PathRefused, run_path, show_server_details, shown_message
from oodviz.ui.fixes import fix_buttons
from oodviz.ui.form import FormValues, form_fixes, form_values_from_config
from oodviz.ui.history import label_editor, read_label, run_choices, run_label
from oodviz.ui.navigation import open_new_run, open_run, runs_root
from oodviz.ui.results import results_page
from oodviz.ui.tuning import without_validation_warnings
from oodviz.ui.watch import job_panel


def run_warnings(run: RunDir, limit: int = 8) -> list[str]:
    """The run's warning events (a class mismatch, a re-extracted store, failed detectors), each once, the
    last ``limit`` of them."""
    messages = [e["message"] for e in run.read_events() if e.get("event") == "warning" and e.get("message")]
    return list(dict.fromkeys(messages))[-limit:]


def run_fixes(run: RunDir) -> list[Fix]:
    """The fixes the run's warnings carry (the pre-flight's, for a run started over the limits), each once."""
    found = [fix for e in run.read_events() if e.get("event") == "warning" for fix in fixes_from(e.get("fixes"))]
    return list(dict.fromkeys(found))


def current_run(asked: str | None) -> RunDir | None:
    """The run named in the URL, or None after saying why it cannot be shown (a name outside the runs root, a run
    that is not there)."""
    if asked is None:
        return None
    try:
        path = run_path(runs_root(), asked)
    except PathRefused as refusal:
        st.error(f"The run in the URL cannot be opened: {refusal}.")
        return None
    if not (path / "config.json").exists():
        where = f" under {runs_root().resolve()}" if show_server_details() else ""
        st.error(f"There is no run {path.name!r}{where}; it may have been deleted.")
        return None
    return RunDir(path)


def run_header(asked: str | None) -> None:
    """The run picker (a change opens that run from its own default view), the run's name and notes, and "New run from
    this one"."""
    ids = run_choices(runs_root())
    options = ids if asked is None or asked in ids else [asked, *ids]
    pick, name, again = st.columns([5, 2, 2], vertical_alignment="bottom")  # both buttons' labels whole at 1000 px
    chosen = pick.selectbox(
        "Run",
        options,
        index=options.index(asked) if asked in options else None,
        format_func=run_label,
        placeholder="Choose a run" if ids else "No runs yet: start one on the New run page",
        key=f"run-picker-{asked}",
    )
    if chosen is not None and chosen != asked:
        open_run(chosen)
    if asked in ids:
        label_editor(RunDir(runs_root() / asked), name)
    if again.button(
        "New run from this one",
        disabled=asked not in ids,
        width="stretch",
        help="The New run page with this run's choices, to change some and run again (a new run; this one is kept).",
    ):
        open_new_run(asked)


def run_page() -> None:
    asked = st.query_params.get("run")
    run_header(asked)
    run = current_run(asked)
    if run is None:
        if asked is None:
            st.caption("Choose a run above, or open one from the Runs page.")
        return
    status = refresh(run)
    state = status.get("state")
    where = f" · {run.path.resolve()}" if show_server_details() else ""
    config, config_problem = read_json_object(run.config_path)
    if state == "damaged" or config_problem:
        damage = status.get("error") if state == "damaged" else f"damaged: {config_problem}"
        st.error(f"This run cannot be shown: {shown_message(str(damage))}. Delete it on the Runs page.")
        return
    if state not in FINAL_STATES:
        st.caption(f"Run `{run.run_id}`{where}")
        job_panel(run)  # it shows the live state itself
        return
    name = read_label(run.path)["name"]
    st.caption(f"Run `{run.run_id}`{' · ' + name if name else ''} · {state}{where}")
    try:
        ran_config = RunConfig.load(run.config_path)
        ran = form_values_from_config(ran_config)
        st.markdown(f"**{run_headline(ran_config, paths=show_server_details())}**")
    except (ValueError, OSError):  # a config this version cannot read: the rest of the page still shows
        ran = None
    for message in without_validation_warnings(run_warnings(run), config):  # those: above the results
        st.warning(shown_message(message))
    if state == "failed":
        failed(run, status, ran)
    elif state == "cancelled":
        why = f" ({status['error']})" if status.get("error") else ""
        st.warning(f"The run was cancelled{why}. Finished parts are kept below where there are any.")
    results_page(run)


def failed(run: RunDir, status: dict, ran: FormValues | None) -> None:
    """A failed run's error, and the fixes it names as buttons that open the New run page filled with the run's
    choices and the fix."""
    error = status.get("error") or "no error was recorded (was the worker killed?)"
    st.error(f"The run failed: {shown_message(str(error))}")
    fixes = [*fixes_from(status.get("fixes")), *run_fixes(run)]
    base = ran if ran is not None else FormValues()
    st.info(
        "To retry: New run from this one holds its choices. Change what the error names and press Start run "
        "(a new run; this one is kept)."
        + (" Or start from its choices with a fix the error names:" if form_fixes(fixes, base) else "")
    )
    fix_buttons(fixes, base, st, "Retry with: ", "retry-fix", from_run=run.run_id)
    if status.get("detail") and show_server_details():
        with st.expander("Details"):
            st.code(status["detail"])
