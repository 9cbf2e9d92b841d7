"""The results view in the URL (oodviz.ui.view_url): written only where it differs from the run's defaults, read back
exactly, and every value the run does not have dropped with a note, never applied."""

import math

import pytest

from oodviz.ui.view_url import EVERY_SET, POOLED, View, basis_param, read_view, shown, tab_slug, view_params

TABS = ["Metrics", "Score histograms", "ROC / PR", "Failure cases", "Risk–coverage", "Which layer?", "Run details"]
DETECTORS = ["msp", "energy", "mahalanobis@penultimate"]
SETS = ["digits-heldout", "noise-uniform", "every", "set:odd"]
DEFAULTS = View("Metrics", "msp")


def ranges(detector, basis):
    """A threshold range per detector (the basis plays no part here)."""
    return {"msp": (0.0, 1.0), "energy": (-12.5, -1.0), "mahalanobis@penultimate": (3.0, 900.0)}[detector]


def read(**params):
    return read_view(params, TABS, DETECTORS, SETS, DEFAULTS, ranges)


def test_tab_slugs_are_short_distinct_and_url_safe():
    slugs = [tab_slug(t) for t in TABS]
    assert slugs == [
        "metrics",
        "score-histograms",
        "roc-pr",
        "failure-cases",
        "risk-coverage",
        "which-layer",
        "run-details",
    ]
    from oodviz.ui.results import RESULT_TABS

    every = [tab_slug(label) for label, _ in RESULT_TABS]
    assert len(set(every)) == len(every) and all(s.replace("-", "").isalnum() for s in every)


def test_a_run_opened_and_not_changed_has_no_view_parameters():
    assert view_params(DEFAULTS, DEFAULTS) == {}
    assert read() == (DEFAULTS, [])


@pytest.mark.parametrize(
    "view",
    [
        View("Score histograms", "energy", "digits-heldout", -3.25),
        View("ROC / PR", "mahalanobis@penultimate", POOLED),
        View("Failure cases", "msp", EVERY_SET, 0.1 + 0.2),  # 0.30000000000000004: kept to the last bit
        View("Which layer?", "msp", "every"),  # an OOD set named like the keyword: set:every
        View("Metrics", "energy", "set:odd", -1.0000000000000002),
        View("Run details", "msp", EVERY_SET, 1.0),  # a threshold at the top of the range
    ],
)
def test_a_view_written_to_the_url_reads_back_the_same(view):
    params = view_params(view, DEFAULTS)
    assert all(isinstance(v, str) for v in params.values())
    assert read(**params) == (view, [])


def test_only_what_differs_from_the_defaults_is_written():
    assert view_params(View("Score histograms", "msp"), DEFAULTS) == {"tab": "score-histograms"}
    assert view_params(View("Metrics", "energy", POOLED), DEFAULTS) == {"detector": "energy", "basis": "pooled"}
    assert view_params(View("Metrics", "msp", "digits-heldout", 0.5), DEFAULTS) == {
        "basis": "digits-heldout",
        "threshold": "0.5",
    }
    assert basis_param("every") == "set:every" and basis_param("set:odd") == "set:set:odd"
    assert basis_param(EVERY_SET) == "every" and basis_param("noise-uniform") == "noise-uniform"


def test_a_tab_may_be_named_by_its_label_or_any_spelling_of_its_slug():
    for spelling in ("Score histograms", "SCORE-HISTOGRAMS", "score_histograms", " score histograms "):
        assert read(tab=spelling) == (View("Score histograms", "msp"), [])
    assert read(tab="roc/pr")[0].tab == "ROC / PR"


def test_a_set_basis_may_be_named_with_the_prefix():
    assert read(basis="set:digits-heldout")[0].basis == "digits-heldout"
    assert read(basis="every")[0].basis == EVERY_SET  # the keyword, not the set named "every"
    assert read(basis="set:every")[0].basis == "every"


@pytest.mark.parametrize(
    ("params", "view", "note"),
    [
        ({"tab": "probe-images"}, DEFAULTS, "tab 'probe\\-images' (this run has no such tab)"),
        ({"detector": "knn"}, DEFAULTS, "detector 'knn' (not a detector of this run)"),
        ({"basis": "svhn"}, DEFAULTS, "basis 'svhn' (not every, pooled or an OOD set of this run)"),
        ({"threshold": "abc"}, DEFAULTS, "threshold 'abc' (not a number)"),
        ({"threshold": "nan"}, DEFAULTS, "threshold 'nan' (not a number)"),
        ({"threshold": "inf"}, DEFAULTS, "threshold 'inf' (not a number)"),
        ({"threshold": "1e999"}, DEFAULTS, "threshold '1e999' (not a number)"),
        ({"threshold": "0x1p-2"}, DEFAULTS, "threshold '0x1p\\-2' (not a number)"),
        ({"threshold": "1_0"}, DEFAULTS, "threshold '1\\_0' (not a number)"),
        ({"threshold": "1.5"}, DEFAULTS, "threshold '1\\.5' (outside this detector's range, 0 to 1)"),
        ({"threshold": "-0.001"}, DEFAULTS, "threshold '\\-0\\.001' (outside this detector's range, 0 to 1)"),
        (
            {"detector": "energy", "threshold": "0.5"},  # msp's range, not energy's
            View("Metrics", "energy"),
            "threshold '0\\.5' (outside this detector's range, -12.5 to -1)",
        ),
        (
            {"detector": "knn", "threshold": "0.5"},  # in msp's range, but chosen for knn: not applied to msp
            DEFAULTS,
            "threshold '0\\.5' (it was chosen for the detector dropped)",
        ),
        (
            {"basis": "svhn", "threshold": "0.5"},
            DEFAULTS,
            "threshold '0\\.5' (it was chosen for the basis dropped)",
        ),
    ],
)
def test_a_value_the_run_does_not_have_is_dropped_with_a_note(params, view, note):
    shown_view, notes = read(**params)
    assert shown_view == view and note in notes


def test_the_rest_of_a_link_applies_when_one_value_is_dropped():
    view, notes = read(tab="failure-cases", detector="energy", basis="nowhere", threshold="-2")
    assert view == View("Failure cases", "energy", EVERY_SET) and len(notes) == 2
    view, notes = read(tab="no-such-tab", detector="energy", threshold="-2")
    assert view == View("Metrics", "energy", EVERY_SET, -2.0) and len(notes) == 1


def test_empty_parameters_are_absent_and_others_are_ignored():
    assert read(tab="", detector=" ", token="secret", run="r1") == (DEFAULTS, [])


def test_a_value_in_a_note_draws_no_markdown_and_is_cut():
    crafted = "[click](https://example.org) **bold** :red[x] $x$ <b>" + "y" * 100
    note = shown(crafted)
    for raw in ("[click]", "](", "**", ":red[", "$x$", "<b>"):
        assert raw not in note
    assert note.endswith("…'") and len(note) < 2 * 40 + 10


def test_the_threshold_read_is_the_float_written():
    for value in (math.pi, -1e-300, 123456789.123456789, 5e-324):
        params = view_params(View("Metrics", "msp", EVERY_SET, value), DEFAULTS)
        view, _ = read_view(params, TABS, DETECTORS, SETS, DEFAULTS, lambda d, b: (-1e308, 1e308))
        assert view.threshold == value
