"""The results view in the URL: the tab, detector and threshold a link opens (no streamlit here: unit-testable).

A link to a run's results carries ``run`` and, where the view differs from the run's defaults:

- ``tab``: the open tab, its label as a slug (``score-histograms``, ``roc-pr``; any spelling that slugs the same);
- ``detector``: the detector shared by the tabs (default: the best by mean AUROC);
- ``basis``: where the threshold starts, ``every`` (95% of every OOD set, the default), ``pooled`` or the name of
  one OOD set (``set:<name>`` also, and always for a set named like a keyword);
- ``threshold``: the threshold when it was moved off the basis' own, written exactly (``repr`` of the float).

:func:`view_params` writes them; :func:`read_view` reads a URL's back and checks each against the run, so that a
value the run does not have (a tab, a detector, a set, a threshold that is not a finite number inside the
slider's range) is dropped with a note and the run's default shown in its place, never applied. A threshold
belongs to the detector and basis it was chosen on: when the link's detector or basis is dropped, so is it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: The query parameters of the results view (``run`` and ``token`` are the page's own)
VIEW_PARAMS = ("tab", "detector", "basis", "threshold")
#: The threshold bases the page offers besides one OOD set's 95% (its selectbox's options, as shown)
EVERY_SET = "95% of every OOD set"
POOLED = "95% of all OOD sets pooled"
BASIS_WORDS = {EVERY_SET: "every", POOLED: "pooled"}
SET_PREFIX = "set:"
#: A threshold as a link writes it: a decimal number, optionally with an exponent (no nan, inf, ``1_0``, hex)
NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
SHOWN_CHARS = 40


@dataclass(frozen=True)
class View:
    """What the results page shows: the open tab (its label), the shared detector, the threshold basis (as the
    page's selectbox holds it: :data:`EVERY_SET`, :data:`POOLED` or an OOD set's name) and the threshold
    (``None``: the basis' own)."""

    tab: str
    detector: str
    basis: str = EVERY_SET
    threshold: float | None = None


def tab_slug(label: str) -> str:
    """A tab's name in the URL: lower case, each run of other characters than letters and digits one ``-``
    ("ROC / PR" -> ``roc-pr``, "Which layer?" -> ``which-layer``)."""
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def basis_param(basis: str) -> str:
    """``basis`` in the URL: ``every``, ``pooled``, or the set's name (``set:<name>`` where the name alone would
    read as a keyword or as this prefix)."""
    if basis in BASIS_WORDS:
        return BASIS_WORDS[basis]
    if basis in BASIS_WORDS.values() or basis.startswith(SET_PREFIX):
        return SET_PREFIX + basis
    return basis


def view_params(view: View, defaults: View) -> dict[str, str]:
    """The query parameters that make a link open ``view``: only those that differ from ``defaults`` (the run's
    own view), so that a run opened and not changed keeps its short ``?run=`` URL. The threshold is written
    exactly: the link opens the same number, not a rounding of it."""
    params = {}
    if view.tab != defaults.tab:
        params["tab"] = tab_slug(view.tab)
    if view.detector != defaults.detector:
        params["detector"] = view.detector
    if view.basis != defaults.basis:
        params["basis"] = basis_param(view.basis)
    if view.threshold is not None:
        params["threshold"] = repr(float(view.threshold))
    return params


def shown(value: str) -> str:
    """A value from the URL quoted for a note in the page: at most :data:`SHOWN_CHARS` characters, with Markdown's
    (and Streamlit's ``:red[...]``) punctuation escaped, so that a crafted link draws no link or formatting."""
    cut = value if len(value) <= SHOWN_CHARS else value[:SHOWN_CHARS] + "…"
    return "'" + re.sub(r"([\\`*_{}\[\]()<>#|~$:!+\-.&])", r"\\\1", cut) + "'"


def read_view(
    params: Mapping[str, str],
    tabs: list[str],
    detectors: list[str],
    sets: list[str],
    defaults: View,
    threshold_range: Callable[[str, str], tuple[float, float]],
) -> tuple[View, list[str]]:
    """The view a URL's ``params`` ask for on a run with these ``tabs`` (labels), ``detectors`` and OOD ``sets``,
    and a note for each value dropped (Markdown, values quoted by :func:`shown`). A parameter absent or empty, or
    dropped, takes the run's default (``defaults``). ``threshold_range(detector, basis)`` is the (low, high) a
    threshold may take there (the slider's range); a threshold outside it is dropped, as is one whose detector or
    basis the link named but the run does not have (it was chosen for that)."""
    given = {name: str(params[name]).strip() for name in VIEW_PARAMS if str(params.get(name) or "").strip()}
    notes: list[str] = []
    tab = defaults.tab
    if "tab" in given:
        slugs = {tab_slug(label): label for label in tabs}
        tab = slugs.get(tab_slug(given["tab"]), tab)
        if tab_slug(given["tab"]) not in slugs:
            notes.append(f"tab {shown(given['tab'])} (this run has no such tab)")
    detector, detector_ok = defaults.detector, True
    if "detector" in given:
        detector_ok = given["detector"] in detectors
        if detector_ok:
            detector = given["detector"]
        else:
            notes.append(f"detector {shown(given['detector'])} (not a detector of this run)")
    basis, basis_ok = defaults.basis, True
    if "basis" in given:
        basis_ok, basis = _basis(given["basis"], sets, defaults.basis)
        if not basis_ok:
            notes.append(f"basis {shown(given['basis'])} (not every, pooled or an OOD set of this run)")
    threshold = None
    if "threshold" in given:
        text = given["threshold"]
        if not NUMBER.fullmatch(text) or abs(float(text)) == float("inf"):
            notes.append(f"threshold {shown(text)} (not a number)")
        elif not (detector_ok and basis_ok):
            dropped = "detector" if not detector_ok else "basis"
            notes.append(f"threshold {shown(text)} (it was chosen for the {dropped} dropped)")
        else:
            low, high = threshold_range(detector, basis)
            if low <= float(text) <= high:
                threshold = float(text)
            else:
                notes.append(f"threshold {shown(text)} (outside this detector's range, {low:.4g} to {high:.4g})")
    return View(tab, detector, basis, threshold), notes


def _basis(value: str, sets: list[str], default: str) -> tuple[bool, str]:
    words = {word: basis for basis, word in BASIS_WORDS.items()}
    if value in words:
        return True, words[value]
    name = value.removeprefix(SET_PREFIX) if value.startswith(SET_PREFIX) else value
    return (True, name) if name in sets else (False, default)
