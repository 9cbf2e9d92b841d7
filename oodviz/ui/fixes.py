"""The estimate beside Start, and the fixes a message names as one-click changes of the form.

The last estimate is kept in the session with the form values it was made for: while the form still holds
those values and the estimate is over the machine's limits, Start is disabled (unless "Run anyway" is
ticked) and the fixes the pre-flight names (:class:`~oodviz.problems.Fix` objects, :func:`~oodviz.ui.form.form_fixes`) are buttons under it.
A fix, or a failed run's "retry with" button, fills the New run page's form: the fixed values are kept in the session
for the run that page starts from (``?from=<id>``, or none) and the form draws them as its defaults; the next rerun
estimates them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pandas as pd
import streamlit as st

from oodviz.models import format_bytes
from oodviz.pipeline.probe import ProbeAnswer
from oodviz.problems import Fix
from oodviz.ui.access import shown_message
from oodviz.ui.form import FormFix, FormValues, form_fixes
from oodviz.ui.navigation import open_new_run

#: session keys: the last estimate, the form filled by a fix, "estimate on the next rerun", the checkbox
PREFLIGHT = "preflight"
PREFILL = "form-prefill"
ESTIMATE_NEXT = "estimate-next"
RUN_ANYWAY = "run-anyway"


def form_key(values: FormValues) -> str:
    """The form's values as one string (what an estimate was made for)."""
    return json.dumps(asdict(values), sort_keys=True, default=str)


def from_run() -> str | None:
    """The run the New run page starts from (``?from=<id>``), or None."""
    return st.query_params.get("from")


def store_estimate(
    values: FormValues, answer: ProbeAnswer | None = None, error: str = "", classifier_problem: str | None = None
) -> None:
    """Keep the estimate of ``values``: the probe's answer (its description and needs; the pre-flight refusal and
    fixes, or None when it fits), what is wrong with the model's classes against the ID labels (None: nothing found,
    :mod:`oodviz.pipeline.classifier_check`), or why it failed."""
    st.session_state[PREFLIGHT] = {
        "form": form_key(values),
        "description": answer.description if answer else "",
        "refusal": answer.refusal if answer else None,
        "needs": list(answer.needs) if answer else [],
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
    """The form a fix filled for the New run page as its URL has it (starting from the same run, or none), or None."""
    entry = st.session_state.get(PREFILL)
    return entry["values"] if entry and entry["from"] == from_run() else None


def apply_fix(fix: FormFix, run_id: str | None) -> None:
    """Open the New run page starting from run ``run_id`` (None: the defaults), its form filled with ``fix``
    applied, estimated there."""
    st.session_state[PREFILL] = {"from": run_id, "values": fix.values, "label": fix.label}
    st.session_state[ESTIMATE_NEXT] = True
    open_new_run(run_id)


def fix_buttons(
    fixes: list[Fix], values: FormValues, place, prefix: str, key: str, from_run: str | None = None
) -> None:
    """One button per fix of ``fixes`` that the form ``values`` can make (:func:`~oodviz.ui.form.form_fixes`), each
    ``prefix + label``; a click opens the New run page (starting from run ``from_run``) with the fix's change applied
    onto ``values``. A fix ``values`` already has is not offered again."""
    for i, fix in enumerate(form_fixes(fixes, values)):
        change = {k: v for k, v in asdict(fix.values).items() if getattr(values, k) != v}
        if not change:
            continue
        if place.button(prefix + fix.label, key=f"{key}-{i}", width="stretch", wrap=True):  # long labels wrap
            apply_fix(FormFix(fix.label, replace(values, **change)), from_run)


#: the needs table's rows in sight at once (the rest scroll; those over their limit come first)
NEEDS_ROWS_SHOWN = 8
#: the style of a need over its limit in the needs table (dark text: legible in the dark theme too)
OVER_STYLE = "background-color: #ffcdd2; color: #b71c1c"


def resource_name(resource: str) -> str:
    """A need's resource as the estimate names it: disk, RAM, GPU."""
    return resource if resource == "disk" else resource.upper()


def needs_table(needs: list[dict]) -> pd.DataFrame:
    """The pre-flight's needs (:meth:`~oodviz.pipeline.preflight.Need.to_dict`) as the estimate's table: those over
    their limit first, then in the pre-flight's order; sizes in B/KiB/MiB/GiB, what each need is last."""
    rows = sorted(needs, key=lambda need: not need["over"])
    return pd.DataFrame(
        {
            "": ["OVER" if need["over"] else "fits" for need in rows],
            "resource": [resource_name(need["resource"]) for need in rows],
            "needed": [format_bytes(need["needed"]) for need in rows],
            "available": [format_bytes(need["available"]) for need in rows],
            "what": [need["what"] for need in rows],  # last: the longest, the figures stay in sight
        }
    )


def verdict(entry: dict) -> str:
    """One line on the estimate: what is over its limit, or that the run fits."""
    over = [need for need in entry["needs"] if need["over"]]
    if not over and not entry["refusal"]:
        return "Fits this machine's free disk, RAM and GPU memory."
    said = "; ".join(
        f"{need['what']}: {format_bytes(need['needed'])} of {resource_name(need['resource'])}, "
        f"{format_bytes(need['available'])} available"
        for need in over
    )
    return f"Does not fit this machine: {said or 'see the needs below'}."


def estimate_panel(values: FormValues, place) -> None:
    """Beside Start, in ``place``: the fix just applied, then the estimate of the form's values — the verdict first,
    the needs as a table with the rows over their limit first and red, the fixes as buttons and the "Run anyway"
    checkbox, and the estimate's details folded."""
    filled = st.session_state.get(PREFILL)
    if filled and filled["from"] == from_run():
        # the form as first drawn from the fix's values: it completes what they leave to it (a failed run's config
        # has no count of the ID fit images, nor the held-out images it suggests from it), so not equal to them
        drawn = filled.setdefault("drawn", form_key(values))
        if drawn == form_key(values):
            place.success(f"Applied: {filled['label']}. Press Start run to run it (a new run).")
    entry = last_estimate(values)
    if entry is None:
        place.caption("Estimate memory (or Start run) measures what this run needs against this machine.")
        return
    if entry["error"]:
        place.error(f"Could not estimate the run's needs: {shown_message(str(entry['error']))}")
        return
    classifier_problem = entry.get("classifier_problem")
    if entry["refusal"]:
        place.error(verdict(entry))
    else:
        place.success(verdict(entry))
    if entry.get("refused_start") and refused(values) and not st.session_state.get(RUN_ANYWAY):
        why = " and ".join(
            reason
            for reason, found in (
                ("the run is over this machine's limits", entry["refusal"]),
                ("the model's classes do not look like the ID labels", classifier_problem),
            )
            if found
        )
        place.error(f"Not started: {why}. Fix the form, or tick Run anyway.")
    if classifier_problem:
        place.warning(classifier_problem)
    if entry["needs"]:
        table = needs_table(entry["needs"])
        place.dataframe(
            table.style.apply(lambda row: [OVER_STYLE if row[""] == "OVER" else ""] * len(row), axis=1),
            hide_index=True,
            width="stretch",
            height=min(38 + 35 * len(table), 38 + 35 * NEEDS_ROWS_SHOWN),
        )
    fixes = entry.get("fixes", [])
    if entry["refusal"] and fixes:  # each fix said whole; those the form can make are buttons under it
        place.warning("To make it fit:\n" + "\n".join(f"- {fix.text}" for fix in fixes))
        fix_buttons(fixes, values, place, "Fix: ", "preflight-fix", from_run())
    with place.expander("How the estimate was made"):
        st.code(entry["description"].strip(), language=None, wrap_lines=True)
    if refused(values):
        place.checkbox(
            "Run anyway",
            key=RUN_ANYWAY,
            help="Start is off while the estimate is over the free disk, RAM or GPU memory, or the model's classes "
            "do not look like the ID labels; tick this to start regardless (over the limits the run may fail or "
            "slow the machine down; with other classes its accuracy, AURC and per-class tables mean nothing, and "
            "say so).",
        )
