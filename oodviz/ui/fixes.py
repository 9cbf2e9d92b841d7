"""The estimate beside Start, and the fixes a message names as one-click changes of the form.

The last estimate is kept in the session with the form values it was made for: while the form still holds
those values and the estimate is over the machine's limits, Start is disabled (unless "Run anyway" is
ticked) and the fixes the pre-flight names (:class:`~oodviz.problems.Fix` objects, :func:`~oodviz.ui.form.form_fixes`) are buttons under it.
A fix, or a failed run's "retry with" button, fills the form: the fixed values are kept in the session for
the page they were made on (the run in the URL, or none) and the sidebar draws them as its defaults; the
next rerun estimates them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import streamlit as st

from oodviz.pipeline.probe import ProbeAnswer
from oodviz.problems import Fix
from oodviz.ui.access import shown_message
from oodviz.ui.form import FormFix, FormValues, form_fixes

#: session keys: the last estimate, the form filled by a fix, "estimate on the next rerun", the checkbox
PREFLIGHT = "preflight"
PREFILL = "form-prefill"
ESTIMATE_NEXT = "estimate-next"
RUN_ANYWAY = "run-anyway"


def form_key(values: FormValues) -> str:
    """The form's values as one string (what an estimate was made for)."""
    return json.dumps(asdict(values), sort_keys=True, default=str)


def url_run() -> str | None:
    return st.query_params.get("run")


def store_estimate(
    values: FormValues, answer: ProbeAnswer | None = None, error: str = "", classifier_problem: str | None = None
) -> None:
    """Keep the estimate of ``values``: the probe's answer (its description; the pre-flight refusal, its table and
    fixes, or None when it fits), what is wrong with the model's classes against the ID labels (None: nothing found,
    :mod:`oodviz.pipeline.classifier_check`), or why it failed."""
    st.session_state[PREFLIGHT] = {
        "form": form_key(values),
        "description": answer.description if answer else "",
        "refusal": answer.refusal if answer else None,
        "table": answer.table if answer else "",
        "fixes": list(answer.fixes) if answer else [],
        "error": error,
        "classifier_problem": classifier_problem,
    }


def refuse_start() -> None:
    """Remember that Start was pressed and refused (said in the panel until the form changes)."""
    st.session_state[PREFLIGHT]["refused_start"] = True


def last_estimate(values: FormValues) -> dict | None:
    """The kept estimate when it was made for ``values``, else None."""
    entry = st.session_state.get(PREFLIGHT)
    return entry if entry and entry["form"] == form_key(values) else None


def refused(values: FormValues) -> bool:
    """The estimate of ``values`` refuses the run: over the machine's limits, or a model whose classes are not the ID
    labels."""
    entry = last_estimate(values)
    return bool(entry and (entry["refusal"] or entry.get("classifier_problem")))


def start_blocked(values: FormValues) -> bool:
    """Start is off: the estimate of these values refuses the run and "Run anyway" is not ticked."""
    return refused(values) and not st.session_state.get(RUN_ANYWAY)


def prefilled() -> FormValues | None:
    """The form a fix filled for the page in the URL, or None."""
    entry = st.session_state.get(PREFILL)
    return entry["values"] if entry and entry["run"] == url_run() else None


def apply_fix(fix: FormFix) -> None:
    """Fill the form with ``fix`` applied, estimate it on the rerun."""
    st.session_state[PREFILL] = {"run": url_run(), "values": fix.values, "label": fix.label}
    st.session_state[ESTIMATE_NEXT] = True
    st.rerun()


def fix_buttons(
    fixes: list[Fix], values: FormValues, place, prefix: str, key: str, base: FormValues | None = None
) -> None:
    """One button per fix of ``fixes`` that the form ``base`` (default: ``values``) can make
    (:func:`~oodviz.ui.form.form_fixes`), each ``prefix + label``; a click applies the fix's change onto ``values``
    (the form as it is). A fix ``values`` already has is not offered again."""
    base = values if base is None else base
    for i, fix in enumerate(form_fixes(fixes, base)):
        change = {k: v for k, v in asdict(fix.values).items() if getattr(base, k) != v}
        if all(getattr(values, k) == v for k, v in change.items()):
            continue
        if place.button(prefix + fix.label, key=f"{key}-{i}", width="stretch", wrap=True):  # long labels wrap
            apply_fix(FormFix(fix.label, replace(values, **change)))


def estimate_panel(values: FormValues) -> None:
    """Under Start: the fix just applied, and the estimate of the form's values with, over the limits, the
    refusal, the fixes as buttons and the "Run anyway" checkbox."""
    filled = st.session_state.get(PREFILL)
    if filled and filled["run"] == url_run() and form_key(filled["values"]) == form_key(values):
        st.sidebar.success(f"Applied: {filled['label']}. Press Start run to run it (a new run).")
    entry = last_estimate(values)
    if entry is None:
        return
    if entry["error"]:
        st.sidebar.error(f"Could not estimate the run's needs: {shown_message(str(entry['error']))}")
        return
    st.sidebar.markdown("**Estimated needs**")
    table, fixes = entry.get("table", ""), entry.get("fixes", [])
    # the refusal's table of needs beside the estimate (once: a run over several layers has it there already),
    # lines wrapped: nothing cut in the sidebar
    described = entry["description"] if table in entry["description"] else f"{entry['description']}\n\n{table}"
    st.sidebar.code(described.strip(), language=None, wrap_lines=True)
    classifier_problem = entry.get("classifier_problem")
    if not entry["refusal"]:
        st.sidebar.caption("Fits this machine's free disk, RAM and GPU memory.")
    if not refused(values):
        return
    if entry.get("refused_start") and not st.session_state.get(RUN_ANYWAY):
        why = " and ".join(
            reason
            for reason, found in (
                ("the run is over this machine's limits", entry["refusal"]),
                ("the model's classes do not look like the ID labels", classifier_problem),
            )
            if found
        )
        st.sidebar.error(f"Not started: {why}. Fix the form, or tick Run anyway.")
    if classifier_problem:
        st.sidebar.warning(classifier_problem)
    if entry["refusal"]:
        st.sidebar.warning(
            "This run does not fit on this machine (the needs marked OVER above)."
            + ("\n\nTo make it fit:\n" + "\n".join(f"- {fix.text}" for fix in fixes) if fixes else "")
        )
        fix_buttons(fixes, values, st.sidebar, "Fix: ", "preflight-fix")
    st.sidebar.checkbox(
        "Run anyway",
        key=RUN_ANYWAY,
        help="Start is off while the estimate is over the free disk, RAM or GPU memory, or the model's classes do "
        "not look like the ID labels; tick this to start regardless (over the limits the run may fail or slow the "
        "machine down; with other classes its accuracy, AURC and per-class tables mean nothing, and say so).",
    )
