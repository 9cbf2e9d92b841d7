"""Every detector declares what it teaches (formula, paper, what it reads, when it fails) in its own module."""

import re

import pytest

from oodviz.detectors import Teaching, available, describe, detector_class, registry
from oodviz.detectors.mahalanobis import Mahalanobis
from oodviz.detectors.teaching import formula_clauses


@pytest.mark.parametrize("name", available())
def test_every_registered_detector_describes_itself(name):
    cls = detector_class(name)
    info = describe(name)
    assert info["name"] == name and info["summary"] == cls.summary and info["paper"] == cls.paper
    assert "teaching" in vars(cls), f"{cls.__module__}.{cls.__name__} must declare its own teaching"
    formula = info["formula"]
    assert formula.startswith("s(x) = ")  # the OOD score, higher = more OOD
    depth = 0
    for char in formula.replace(r"\{", "").replace(r"\}", ""):
        depth += {"{": 1, "}": -1}.get(char, 0)
        assert depth >= 0, formula
    assert depth == 0, f"unbalanced braces in {formula}"
    assert re.search(r"\*[^*]+\*, .*\b(19|20)\d\d$", info["citation"]), info[
        "citation"
    ]  # "Authors, *Title*, Venue Year"
    assert info["reads"] and "\n" not in info["fails_when"] and len(info["fails_when"]) <= 130
    if info["needs_model"]:
        assert "the model" in info["reads"]


def test_the_texts_are_the_modules_own():
    """Different detectors, different words: no copy of another detector's teaching."""
    described = [describe(name) for name in available()]
    for key in ("formula", "fails_when"):  # (several logit-only detectors read the same thing)
        values = [d[key] for d in described]
        assert len(set(values)) == len(values), key
    assert describe("rmd")["formula"] != describe("mahalanobis")["formula"]


def test_a_detector_without_its_own_teaching_is_named(monkeypatch):
    class Undocumented(Mahalanobis):  # inherits Mahalanobis's teaching, which does not describe it
        name = "undocumented"

    monkeypatch.setitem(registry._REGISTRY, "undocumented", Undocumented)
    with pytest.raises(ValueError, match=r"'undocumented' .*declares no teaching = Teaching\(formula=..."):
        describe("undocumented")


def test_teaching_refuses_empty_or_multi_line_texts():
    with pytest.raises(ValueError, match="Teaching.citation must be a non-empty string"):
        Teaching(formula="s(x) = x", citation=" ", reads="x", fails_when="never")
    with pytest.raises(ValueError, match="one line"):
        Teaching(formula="s(x) = x", citation="A, *T*, V 2020", reads="x", fails_when="a\nb")


def test_a_formula_splits_into_its_top_level_clauses():
    """One line each in the narrow panel: the score, then its definitions; a ``,\\quad`` inside braces stays."""
    assert formula_clauses(r"s(x) = -\max_k p_k,\quad p = \operatorname{softmax}(z),\quad T = 1") == [
        r"s(x) = -\max_k p_k",
        r"p = \operatorname{softmax}(z)",
        "T = 1",
    ]
    assert formula_clauses(r"s(x) = \min_k d_k") == [r"s(x) = \min_k d_k"]
    assert formula_clauses(r"s(x) = f_{a,\quad b} + \{c\},\quad e = 1") == [r"s(x) = f_{a,\quad b} + \{c\}", "e = 1"]
    for name in available():  # every clause of every formula: balanced braces, the score first
        clauses = formula_clauses(describe(name)["formula"])
        assert clauses[0].startswith("s(x) = ") and all(clause.count("{") == clause.count("}") for clause in clauses)
