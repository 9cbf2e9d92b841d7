"""The app's pages with Streamlit's AppTest: the Runs page's search and filters and its moves to the Run and Compare
pages, the Compare page from its URL, the Detectors page, the old single-page link, and the estimate's table."""

import json
import shutil

import pandas as pd
import pytest
from app_nav import APP, on_page, widget
from streamlit.testing.v1 import AppTest

from oodviz.runs.rundir import RunDir
from oodviz.ui.history import RUNS_COLUMNS, filtered, runs_table_key, tags_of, write_label

# --- the Runs page: search and filters -------------------------------------------------------------------------


def row(run: str, **values) -> dict:
    """One row of the run list (:func:`oodviz.ui.history.runs_table`), blank but for ``values``."""
    return {**dict.fromkeys(RUNS_COLUMNS, ""), "mean AUROC": None, "mean FPR95": None, "run": run, **values}


def test_tags_are_the_hash_words_of_a_runs_name_and_notes_once_in_lower_case():
    assert tags_of({"name": "baseline #CIFAR", "notes": "see #cifar again, #ViT-b_16 and # alone; a#b too"}) == [
        "cifar",
        "vit-b_16",
        "b",
    ]
    assert tags_of({"name": "", "notes": ""}) == []


def test_each_filter_of_the_run_list_keeps_only_the_matching_rows():
    table = pd.DataFrame(
        [
            row("r1", name="first", state="done", backbone="digits-cnn", **{"ID data": "digits-test"}, tags="a, b"),
            row("r2", state="failed (2 detector(s) failed)", backbone="resnet18", **{"ID data": "cifar10"}, tags="b"),
            row("r3", state="running", backbone="digits-cnn", **{"ID data": "openood cifar10"}, notes="Retried KNN"),
            row("r4", state="failed", backbone="resnet18", **{"ID data": "cifar10"}, **{"best detector": "vim"}),
        ],
        columns=RUNS_COLUMNS,
    )

    def kept(search="", states=(), backbones=(), data=(), tags=()):
        return list(filtered(table, search, list(states), list(backbones), list(data), list(tags)).run)

    assert kept() == ["r1", "r2", "r3", "r4"]  # no filter: every row
    assert kept(search="  knn ") == ["r3"]  # the notes, case-insensitive, the spaces around cut
    assert kept(search="FIRST") == ["r1"] and kept(search="vim") == ["r4"] and kept(search="r2") == ["r2"]
    assert kept(states=["failed"]) == ["r2", "r4"]  # its first word: detectors failing still make it failed
    assert kept(states=["done", "running"]) == ["r1", "r3"]
    assert kept(backbones=["resnet18"]) == ["r2", "r4"]
    assert kept(data=["cifar10"]) == ["r2", "r4"]  # not "openood cifar10"
    assert kept(tags=["b"]) == ["r1", "r2"] and kept(tags=["a", "b"]) == ["r1"] and kept(tags=["c"]) == []
    assert kept(states=["failed"], backbones=["resnet18"], tags=["b"]) == ["r2"]  # every filter at once


@pytest.fixture(scope="module")
def runs_root(default_run, tmp_path_factory):
    """Four runs, copies of the finished default run: ``r1`` as it is; ``r-cifar`` another backbone and ID data, named
    with a tag; ``r-failed`` failed, with a tag in its notes; ``r-notes`` with notes only."""
    root = tmp_path_factory.mktemp("runs")
    for name in ("r1", "r-cifar", "r-failed", "r-notes"):
        shutil.copytree(default_run.path, root / name)
    config = json.loads((root / "r-cifar" / "config.json").read_text())
    config["backbone"], config["id_test"]["name"] = "resnet18", "cifar10"
    (root / "r-cifar" / "config.json").write_text(json.dumps(config))
    write_label(root / "r-cifar", "big model #Baseline", "")
    (root / "r-failed" / "metrics.csv").unlink()
    RunDir(root / "r-failed").write_status(state="failed", error="ValueError: bad")
    write_label(root / "r-failed", "", "ran out of memory #baseline #oom")
    write_label(root / "r-notes", "", "the Keeper")
    return root


@pytest.fixture
def app(runs_root, monkeypatch):
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(runs_root))
    return AppTest.from_file(APP, default_timeout=60)


def shown_runs(app) -> list[str]:
    return sorted(app.dataframe[0].value.run)


def test_the_runs_page_searches_and_filters_its_rows(app):
    on_page(app, "runs")
    assert not app.exception
    assert shown_runs(app) == ["r-cifar", "r-failed", "r-notes", "r1"]
    table = app.dataframe[0].value.set_index("run")
    assert (table.loc["r-cifar", "backbone"], table.loc["r-cifar", "ID data"]) == ("resnet18", "cifar10")
    assert table.loc["r-failed", "tags"] == "baseline, oom" and table.loc["r-cifar", "tags"] == "baseline"
    assert "notes" not in table.columns  # searched, not shown
    assert widget(app.multiselect, "State").options == ["done", "failed"]
    assert widget(app.multiselect, "Backbone").options == ["digits-cnn", "resnet18"]
    assert widget(app.multiselect, "ID data").options == ["cifar10", "digits-test"]
    assert widget(app.multiselect, "Tags").options == ["baseline", "oom"]
    widget(app.text_input, "Search").input("keeper").run()  # in the notes only
    assert shown_runs(app) == ["r-notes"] and any(c.value.startswith("1 of 4 run(s).") for c in app.caption)
    widget(app.text_input, "Search").input("").run()
    for label, chosen, expected in (
        ("State", ["failed"], ["r-failed"]),
        ("Backbone", ["resnet18"], ["r-cifar"]),
        ("ID data", ["digits-test"], ["r-failed", "r-notes", "r1"]),
        ("Tags", ["baseline"], ["r-cifar", "r-failed"]),
        ("Tags", ["baseline", "oom"], ["r-failed"]),
    ):
        widget(app.multiselect, label).set_value(chosen).run()
        assert not app.exception
        assert shown_runs(app) == expected, (label, chosen)
        widget(app.multiselect, label).set_value([]).run()
    widget(app.multiselect, "Tags").set_value(["baseline"]).run()
    widget(app.multiselect, "State").set_value(["done"]).run()
    assert shown_runs(app) == ["r-cifar"]  # the filters together


def select_rows(app, run_ids: list[str]):
    """Select the rows of ``run_ids`` in the Runs page's table, in that order."""
    listed = list(app.dataframe[0].value.run)
    rows = [listed.index(run_id) for run_id in run_ids]
    app.session_state[runs_table_key(listed)] = {"selection": {"rows": rows, "columns": [], "cells": []}}
    return app.run()


def test_open_shows_the_run_on_its_page_and_compare_the_two_runs_on_the_compare_page(app):
    on_page(app, "runs")
    assert widget(app.button, "Open").disabled and widget(app.button, "Compare").disabled
    select_rows(app, ["r-notes"])
    assert not widget(app.button, "Open").disabled and widget(app.button, "Compare").disabled
    widget(app.button, "Open").click().run()
    assert not app.exception
    assert dict(app.query_params) == {"run": "r-notes"}
    assert widget(app.selectbox, "Run").value == "r-notes" and app.tabs  # the Run page, the run's results
    on_page(app, "runs")
    select_rows(app, ["r-cifar", "r1"])
    assert widget(app.button, "Open").disabled
    widget(app.button, "Compare").click().run()
    assert not app.exception
    assert dict(app.query_params) == {"a": "r-cifar", "b": "r1"}
    assert [t.value for t in app.title] == ["Compare"]
    assert (widget(app.selectbox, "Run A").value, widget(app.selectbox, "Run B").value) == ("r-cifar", "r1")
    assert any(m.value == "**Compare r-cifar (A) with r1 (B)**" for m in app.markdown)


def test_the_moves_between_pages_keep_the_access_token_in_the_url(app, monkeypatch):
    """Serving others, the token stays in the URL of the page a button opens (a link to it still opens the app)."""
    from oodviz.ui.access import AccessPolicy

    for key, value in AccessPolicy(token="t0ken", serve_others=True, data_dirs=()).to_env().items():
        monkeypatch.setenv(key, value)
    on_page(app, "runs", token="t0ken")
    select_rows(app, ["r1"])
    widget(app.button, "Open").click().run()
    assert not app.exception and dict(app.query_params) == {"token": "t0ken", "run": "r1"}
    on_page(app, "run", token="t0ken", run="r1")
    widget(app.button, "New run from this one").click().run()
    assert not app.exception and dict(app.query_params) == {"token": "t0ken", "from": "r1"}


# --- the Compare page from its URL ---------------------------------------------------------------------------------


def compared(app) -> list[str]:
    return [m.value for m in app.markdown if m.value.startswith("**Compare ")]


def test_the_compare_page_shows_the_two_runs_of_its_url(app):
    on_page(app, "compare", a="r1", b="r-cifar")
    assert not app.exception
    assert (widget(app.selectbox, "Run A").value, widget(app.selectbox, "Run B").value) == ("r1", "r-cifar")
    assert widget(app.selectbox, "Run B").format_func("r-cifar") == "r-cifar · big model #Baseline"
    assert compared(app) == ["**Compare r1 (A) with r-cifar (B)**"]
    assert any("different data: the ID test set differs (digits-test vs cifar10)" in w.value for w in app.warning)
    diff = [t.value for t in app.table if t.value.index.name == "setting"][0]
    assert diff.loc["backbone"].tolist() == ["digits-cnn", "resnet18"]
    assert dict(app.query_params) == {"a": "r1", "b": "r-cifar"}
    widget(app.selectbox, "Run B").select("r-notes").run()  # the choice goes into the URL
    assert not app.exception
    assert dict(app.query_params) == {"a": "r1", "b": "r-notes"} and compared(app) == [
        "**Compare r1 (A) with r-notes (B)**"
    ]


def test_a_deleted_run_in_the_compare_url_is_said_and_the_page_still_compares(app):
    on_page(app, "compare", a="gone", b="r1")
    assert not app.exception
    assert [w.value for w in app.warning if "There is no run" in w.value] == [
        "There is no run 'gone' here; it may have been deleted."
    ]
    a = widget(app.selectbox, "Run A").value
    assert a in ("r1", "r-cifar", "r-failed", "r-notes") and a != "r1"  # another run, not the one asked for B
    assert widget(app.selectbox, "Run B").value == "r1"
    assert dict(app.query_params) == {"a": a, "b": "r1"}  # the URL names runs that are there
    widget(app.selectbox, "Run A").select("r-notes").run()
    assert not app.exception and compared(app) == ["**Compare r-notes (A) with r1 (B)**"]
    assert not [w for w in app.warning if "There is no run" in w.value]
    on_page(app, "compare", a="r1", b="r1")
    assert any(i.value == "Choose two different runs." for i in app.info) and not compared(app)


# --- the Detectors page --------------------------------------------------------------------------------------------


def test_the_detectors_page_explains_the_detector_of_its_url_and_writes_a_choice_into_it(app):
    from oodviz.detectors import describe

    on_page(app, "detectors", detector="odin")
    assert not app.exception
    assert widget(app.selectbox, "Detector").value == "odin"
    assert any(m.value == f"**odin**: {describe('odin')['summary']}" for m in app.markdown)
    assert any(c.value == f"Fails when: {describe('odin')['fails_when']}" for c in app.caption)
    widget(app.selectbox, "Detector").select("knn").run()
    assert not app.exception
    assert dict(app.query_params) == {"detector": "knn"}
    assert any(m.value.startswith("**knn**: ") for m in app.markdown)
    assert not any(m.value.startswith("**odin**") for m in app.markdown)


# --- the link of the single-page app ---------------------------------------------------------------------------


def test_an_old_link_to_a_run_opens_the_run_page_with_its_view(app):
    """``/?run=<id>&tab=...`` (the one page of earlier versions) opens the Run page, its view kept: the URL keeps
    every parameter, and no New run form is drawn."""
    app.query_params.update(run="r1", tab="score-histograms", detector="energy", basis="pooled")
    app.run()
    assert not app.exception
    assert dict(app.query_params) == {"run": "r1", "tab": "score-histograms", "detector": "energy", "basis": "pooled"}
    assert widget(app.selectbox, "Run").value == "r1"
    assert app.session_state["results-tab"] == "Score histograms"
    assert widget(app.selectbox, "Detector").value == "energy"
    assert widget(app.selectbox, "Start the threshold at").value == "95% of all OOD sets pooled"
    assert not [b for b in app.button if b.label in ("Start run", "Run the default")]
    assert "New run" not in [t.value for t in app.title]


def test_the_run_picker_opens_another_run_from_its_own_view(app):
    on_page(app, "run", run="r1", tab="score-histograms")
    assert app.session_state["results-tab"] == "Score histograms"
    widget(app.selectbox, "Run").select("r-notes").run()
    assert not app.exception
    assert dict(app.query_params) == {"run": "r-notes"}
    assert any(c.value.startswith("Run `r-notes`") for c in app.caption)


# --- the estimate's table and verdict ------------------------------------------------------------------------------


def need(resource: str, what: str, needed: int, available: int) -> dict:
    """A need as :meth:`oodviz.pipeline.preflight.Need.to_dict` writes it."""
    return {"resource": resource, "what": what, "needed": needed, "available": available, "kind": "fit",
            "over": needed > available}  # fmt: skip


GIB = 2**30
NEEDS = [
    need("disk", "feature stores", 2 * GIB, 100 * GIB),
    need("ram", "batch of extraction", 40 * GIB, 16 * GIB),
    need("gpu", "batch of extraction", GIB, 80 * GIB),
    need("ram", "fit of knn", 20 * GIB, 16 * GIB),
]


def test_the_needs_table_puts_the_needs_over_their_limit_first():
    from oodviz.ui.fixes import needs_table

    table = needs_table(NEEDS)
    assert list(table.columns) == ["", "resource", "needed", "available", "what"]
    assert table.to_dict("records") == [
        {"": "OVER", "resource": "RAM", "what": "batch of extraction", "needed": "40 GiB", "available": "16 GiB"},
        {"": "OVER", "resource": "RAM", "what": "fit of knn", "needed": "20 GiB", "available": "16 GiB"},
        {"": "fits", "resource": "disk", "what": "feature stores", "needed": "2 GiB", "available": "100 GiB"},
        {"": "fits", "resource": "GPU", "what": "batch of extraction", "needed": "1 GiB", "available": "80 GiB"},
    ]  # over first, then in the pre-flight's order
    assert needs_table([]).empty


def test_the_verdict_says_what_is_over_its_limit_or_that_the_run_fits():
    from oodviz.ui.fixes import verdict

    assert verdict({"needs": NEEDS, "refusal": "over"}) == (
        "Does not fit this machine: batch of extraction: 40 GiB of RAM, 16 GiB available; "
        "fit of knn: 20 GiB of RAM, 16 GiB available."
    )
    fits = [n for n in NEEDS if not n["over"]]
    assert verdict({"needs": fits, "refusal": None}) == "Fits this machine's free disk, RAM and GPU memory."
    assert verdict({"needs": [], "refusal": "over"}) == "Does not fit this machine: see the needs below."
