"""The app: choose in the sidebar, watch a run, analyse it; past runs and comparisons.

The run id lives in the URL (``?run=<id>``), and with it the view of its results (``tab``, ``detector``, ``basis``,
``threshold``: :mod:`oodviz.ui.view_url`): a reload, another tab or a link comes back to the same view.
The UI only turns choices into a RunConfig and draws runs; everything else is in ``oodviz``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from pathlib import Path

import streamlit as st

from oodviz.config.catalog import detector_names
from oodviz.config.plan import run_headline
from oodviz.config.run import ConfigError, RunConfig, preset
from oodviz.files import read_json_object
from oodviz.problems import Fix, fixes_from
from oodviz.runs.jobs import QueueFull, refresh, submit
from oodviz.runs.rundir import FINAL_STATES, RunDir
from oodviz.runs.telemetry import device_facts
from oodviz.ui.access import AccessPolicy, PathRefused, run_path, show_server_details, shown_message
from oodviz.ui.fixes import (
    ESTIMATE_NEXT,
    RUN_ANYWAY,
    fix_buttons,
    prefilled,
    refuse_start,
    refused,
    store_estimate,
)
from oodviz.ui.form import (
    FormValues,
    config_from_form,
    form_fixes,
    form_problems,
    form_values_from_config,
    processes_of,
)
from oodviz.ui.history import label_editor, past_runs, read_label
from oodviz.ui.results import results_page
from oodviz.ui.sidebar import memory_estimate, render_form
from oodviz.ui.tuning import without_validation_warnings
from oodviz.ui.view_url import VIEW_PARAMS
from oodviz.ui.watch import job_panel


def runs_root() -> Path:
    """Where runs live: ``$OODVIZ_RUNS_ROOT``, default ``./runs`` (shared with ``oodviz run``)."""
    return Path(os.environ.get("OODVIZ_RUNS_ROOT", "runs"))


def open_run(run_id: str | None) -> None:
    """Show run ``run_id`` (None: the run list): the URL names it, without the view of the run shown before
    (its tab, detector and threshold: the run opened starts from its own)."""
    for name in VIEW_PARAMS:
        st.query_params.pop(name, None)
    if run_id:
        st.query_params["run"] = run_id
    else:
        st.query_params.pop("run", None)


def url_run_path() -> Path | None:
    """The directory of the run named in the URL (it may not exist), or None. Raises PathRefused for a
    name that is not a direct child of the runs root (``..``, a path, a link leading outside)."""
    run_id = st.query_params.get("run")
    return run_path(runs_root(), run_id) if run_id else None


def current_run() -> RunDir | None:
    try:
        path = url_run_path()
    except PathRefused as refusal:
        st.error(f"The run in the URL cannot be opened: {refusal}.")
        return None
    if path is None:
        return None
    if not (path / "config.json").exists():
        where = f" under {runs_root().resolve()}" if show_server_details() else ""
        st.error(f"There is no run {path.name!r}{where}; it may have been deleted.")
        return None
    return RunDir(path)


def confined_config(config: RunConfig) -> RunConfig | None:
    """``config`` with its typed paths confined to the allowed data directories, or None after saying
    in the sidebar which were refused (see :meth:`AccessPolicy.confine_config`)."""
    try:
        return AccessPolicy.from_env().confine_config(config)
    except PathRefused as refusal:
        st.sidebar.error(f"Not allowed on this server: {refusal}")
        return None


def plain(text: str) -> str:
    """``text`` shown as typed in Streamlit's markdown: a path's ``_a_`` stays, not in italics."""
    return re.sub(r"([\\`*_{}\[\]<>#|~$])", r"\\\1", text)


def handle_form(values: FormValues, action: str | None, slots: dict) -> None:
    """On Estimate or Start (or after a fix filled the form): check the whole form first
    (:func:`form_problems`) and show every problem under its field; only a form without problems is estimated
    (kept beside Start, :mod:`oodviz.ui.fixes`), and started when it fits or "Run anyway" is ticked (nothing is
    created before)."""
    if action is None and st.session_state.pop(ESTIMATE_NEXT, False):
        action = "estimate"
    if action is None:
        return
    problems = form_problems(values, AccessPolicy.from_env())
    for name, messages in problems.items():
        slots[name].error("\n\n".join(plain(m) for m in messages))
    if problems:
        count = sum(len(m) for m in problems.values())
        if "form" not in problems:
            slots["form"].error(f"Fix first: {count} problem(s), shown under their fields above.")
        return
    config = AccessPolicy.from_env().confine_config(config_from_form(values))
    try:
        answer = memory_estimate(json.dumps(config.to_dict()), str(runs_root()))
    except ConfigError as error:  # the pre-flight's refusal (an unreadable checkpoint, knn's k above the fit rows)
        store_estimate(values, error=str(error))
        if action == "start":  # as a refusal of submit(): nothing is started
            slots["form"].error(str(error))
            return
    except Exception as error:  # a missing dataset or weight file: say what, keep the app running
        store_estimate(values, error=str(error))
    else:
        store_estimate(values, answer, classifier_problem=answer.estimate.get("classifier_problem"))
    if action == "start":
        if not refused(values) or st.session_state.get(RUN_ANYWAY):
            gpus = sum(f["device"].startswith("cuda") for f in device_facts())
            start_run(config, slots["form"], processes=processes_of(values, gpus))
            return
        refuse_start()
    st.rerun()  # the sidebar draws the estimate beside Start, and Start off when over the limits


def start_run(config: RunConfig, place=st, processes: int = 1) -> None:
    """Submit ``config`` (on ``processes`` processes: "all N GPUs") and open its page; a refusal (an invalid
    config, a full queue) is shown in ``place``."""
    try:
        run = submit(config, runs_root(), nproc_per_node=processes)
    except (ConfigError, QueueFull) as error:
        place.error(str(error))
        return
    open_run(run.run_id)
    st.rerun()


def landing(values: FormValues) -> None:
    chosen, known = len(RunConfig().detectors), len(detector_names())
    st.markdown(
        "Which inputs would your classifier wrongly trust, and which out-of-distribution detector catches them? "
        "Choose a model, data and detectors in the sidebar — or start with the bundled offline default: "
        "**digits-cnn** on scikit-learn's 8x8 digits (classes 0–7) against held-out digits 8 and 9, inverted and "
        f"rotated digits, photo patches and noise, with the {chosen} detectors of the CNN defaults (of the {known} "
        "oodviz has; the sidebar's Detectors list holds the others). **Fashion-MNIST** runs **fashion-cnn** on the "
        "real 28x28 Fashion-MNIST (8 classes) against its held-out Shirt and Ankle boot, inverted and rotated images, "
        "digits, photo patches and noise; it reads Debian's `dataset-fashion-mnist`, the files in the sidebar's data "
        "root, or downloads them where the sidebar allows downloads."
    )
    buttons = st.container(horizontal=True)  # each button as wide as its label: none is cut
    if buttons.button("Run the default", type="primary"):
        start_run(config_from_form(FormValues()))
    if buttons.button("Run Fashion-MNIST"):
        config = preset("fashion-mnist")
        config.data_root, config.download = values.data_root.strip() or "data", bool(values.download)
        config = confined_config(config)
        if config is None:
            return
        start_run(config)


def run_warnings(run: RunDir, limit: int = 8) -> list[str]:
    """The run's warning events (a class mismatch, a re-extracted store, failed detectors), each once, the
    last ``limit`` of them."""
    messages = [e["message"] for e in run.read_events() if e.get("event") == "warning" and e.get("message")]
    return list(dict.fromkeys(messages))[-limit:]


def run_fixes(run: RunDir) -> list[Fix]:
    """The fixes the run's warnings carry (the pre-flight's, for a run started over the limits), each once."""
    found = [fix for e in run.read_events() if e.get("event") == "warning" for fix in fixes_from(e.get("fixes"))]
    return list(dict.fromkeys(found))


def run_page(run: RunDir, values: FormValues) -> None:

    status = refresh(run)
    state = status.get("state")
    where = f" · {run.path.resolve()}" if show_server_details() else ""
    config, config_problem = read_json_object(run.config_path)
    if state == "damaged" or config_problem:
        damage = status.get("error") if state == "damaged" else f"damaged: {config_problem}"
        st.error(f"This run cannot be shown: {shown_message(str(damage))}. Delete it from Past runs (All runs).")
        return
    if state not in FINAL_STATES:
        st.caption(f"Run `{run.run_id}`{where}")
        job_panel(run)  # it shows the live state itself
        return
    name = read_label(run.path)["name"]
    st.caption(f"Run `{run.run_id}`{' · ' + name if name else ''} · {state}{where}")
    try:
        st.markdown(f"**{run_headline(RunConfig.load(run.config_path), paths=show_server_details())}**")
    except (ValueError, OSError):  # a config this version cannot read: the rest of the page still shows
        pass
    label_editor(run)
    for message in without_validation_warnings(run_warnings(run), config):  # those: above the results
        st.warning(shown_message(message))
    if state == "failed":
        error = status.get("error") or "no error was recorded (was the worker killed?)"
        st.error(f"The run failed: {shown_message(str(error))}")
        fixes = [*fixes_from(status.get("fixes")), *run_fixes(run)]
        try:
            ran = form_values_from_config(RunConfig.load(run.config_path))
        except (ValueError, OSError):  # a config this version cannot read: the fixes apply to the form as it is
            ran = values
        st.info(
            "To retry: the sidebar holds this run's choices. Change what the error names and press Start run "
            "(a new run; this one is kept)."
            + (" Or fill the form with a fix the error names:" if form_fixes(fixes, ran) else "")
        )
        fix_buttons(fixes, values, st, "Retry with: ", "retry-fix", base=ran)
        if status.get("detail") and show_server_details():
            with st.expander("Details"):
                st.code(status["detail"])
    elif state == "cancelled":
        why = f" ({status['error']})" if status.get("error") else ""
        st.warning(f"The run was cancelled{why}. Finished parts are kept below where there are any.")
    results_page(run)


TOKEN_KEY = "access-token"


def access_granted(policy: AccessPolicy) -> bool:
    """Whether this browser session may use the app: always without a token; else once it has given the
    token, in the URL (``?token=``) or in the prompt drawn here (kept in the session)."""
    if policy.token_ok(st.session_state.get(TOKEN_KEY)):
        return True
    given = st.query_params.get("token")
    if given is not None and policy.token_ok(given):
        st.session_state[TOKEN_KEY] = given
        return True
    st.title("oodviz")
    st.info("This oodviz server needs its access token: the one printed where `oodviz app` was started.")
    with st.form("access-token-form"):
        typed = st.text_input("Access token", type="password")
        entered = st.form_submit_button("Open the app")
    if entered and policy.token_ok(typed):
        st.session_state[TOKEN_KEY] = typed
        st.rerun()
    if entered or given is not None:
        st.error("That is not this server's access token.")
    return False


#: At a 1000 px window: narrower side margins (the first eight result tabs fit on one line), result tabs that
#: wrap rather than scroll out of sight, and sidebar chips in a smaller font, so no name is cut.
PAGE_STYLE = """<style>
[data-testid="stMainBlockContainer"] { padding-left: 1.5rem; padding-right: 1.5rem; }
[role="tablist"] { flex-wrap: wrap; column-gap: 0.5rem; }
[data-testid="stMultiSelectTagsContainer"] span { font-size: 0.75rem; }
</style>"""


def main() -> None:
    st.set_page_config(page_title="oodviz", page_icon="🔍", layout="wide")
    st.html(PAGE_STYLE)
    if not access_granted(AccessPolicy.from_env()):
        return
    try:
        page()
    except Exception as error:  # st.rerun/st.stop are BaseExceptions and pass through
        if not show_server_details():  # the details go to the server's log, not to another person's page
            traceback.print_exc(file=sys.stderr)
            st.error("Something went wrong. The app is still running; finished runs are kept.")
            return
        st.error(
            f"Something went wrong: {type(error).__name__}: {error}. The app is still running; finished runs are kept."
        )
        with st.expander("Details"):
            st.exception(error)


def form_defaults() -> FormValues:
    """The sidebar's starting values: those a fix filled in on this page, else those of the run in the URL (to
    rerun it with changes), else the default."""
    filled = prefilled()
    if filled is not None:
        return filled
    try:
        path = url_run_path()
    except PathRefused:  # the run page says so
        path = None
    if path is not None and (path / "config.json").exists():
        try:
            return form_values_from_config(RunConfig.load(path / "config.json"))
        except (ValueError, OSError):  # an unreadable config: the run page says so
            pass
    return FormValues()


def page() -> None:
    values, action, slots = render_form(form_defaults())
    header, home = st.columns([4, 1], vertical_alignment="bottom")
    header.title("oodviz")
    if home.button("All runs", width="stretch"):
        open_run(None)
        st.rerun()
    handle_form(values, action, slots)
    run = current_run()
    if run is not None:
        run_page(run, values)
        return
    landing(values)
    st.subheader("Past runs")
    past_runs(runs_root(), open_run)
