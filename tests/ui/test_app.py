"""The app's page logic with Streamlit's AppTest: form to config, reattach from the URL, results pages, the run list.
The moves between pages: :mod:`app_nav`; each page's own features: test_pages.py."""

import base64
import json
import shutil

import numpy as np
import pandas as pd
import pytest
from app_nav import APP, on_page
from helpers import brute_force_threshold
from streamlit.testing.v1 import AppTest

from oodviz.config.run import DetectorChoice, RunConfig, preset
from oodviz.ui.form import FOLDER_PRESET, FormValues, config_from_form, form_values_from_config
from oodviz.ui.history import runs_table_key


def test_the_default_form_is_the_default_run_config():
    assert config_from_form(FormValues()) == RunConfig()
    assert config_from_form(FormValues()).problems() == []


def test_form_choices_become_the_config():
    values = FormValues(
        backbone="resnet18",
        weights="random",
        layers=[" layer3 "],
        id_preset="cifar10 (torchvision files)",
        ood=["svhn", "noise-uniform"],
        ood_folder="/data/my-ood",
        detectors=["knn", "vim"],
        detector_params={"knn": {"k": 7}, "msp": {}},
        device="cpu",
        batch_size=64,
        precision="bf16",
        fit_subsample=5000,
        test_subsample=0,
        ood_subsample=300,
        download=True,
    )
    config = config_from_form(values)
    assert (config.backbone, config.weights, config.layer, config.precision, config.batch_size) == (
        "resnet18",
        "random",
        "layer3",
        "bf16",
        64,
    )
    assert (config.id_fit.name, config.id_fit.params, config.id_fit.subsample) == ("cifar10", {"split": "train"}, 5000)
    assert (config.id_test.params, config.id_test.subsample) == ({"split": "test"}, None)
    assert [(d.name, d.params, d.subsample) for d in config.ood] == [
        ("svhn", {"split": "test"}, 300),
        ("noise-uniform", {"size": 32}, 300),
        ("folder", {"path": "/data/my-ood"}, 300),
    ]  # generated sets come at the ID images' size: 32 x 32 for CIFAR-10
    assert config.ood[2].group == "far"
    assert config.detectors == [DetectorChoice("knn", {"k": 7}), DetectorChoice("vim", {})]
    assert config.download is True
    folders = config_from_form(FormValues(id_preset=FOLDER_PRESET, fit_folder="/a", test_folder="/b"))
    assert (folders.id_fit.params, folders.id_test.params) == ({"path": "/a"}, {"path": "/b"})


@pytest.mark.parametrize("name", ["digits", "fashion-mnist", "custom"])
def test_a_run_config_becomes_the_form_that_makes_it_again(name):
    """ "New run from this one" fills the New run page's form with the run's choices: form -> config must give the
    run's config back."""
    if name == "custom":
        config = config_from_form(
            FormValues(
                backbone="resnet18",
                weights="random",
                layers=["layer3"],
                id_preset=FOLDER_PRESET,
                fit_folder="/a",
                test_folder="/b",
                ood=["svhn"],
                ood_folder="/c",
                detectors=["knn", "vim"],
                detector_params={"knn": {"k": 7}},
                device="cpu",
                batch_size=64,
                precision="bf16",
                fit_subsample=500,
                ood_subsample=30,
                download=True,
            )
        )
    else:
        config = preset(name)
    values = form_values_from_config(config)
    assert config_from_form(values) == config
    assert values.id_preset == {
        "digits": "digits (bundled, 8x8)",
        "fashion-mnist": "Fashion-MNIST, 8 classes",
    }.get(name, FOLDER_PRESET)


@pytest.fixture(scope="module")
def runs_root(default_run, tmp_path_factory):
    """A runs root holding one finished default run, made by the CLI (a copy: these tests add runs)."""
    root = tmp_path_factory.mktemp("runs")
    shutil.copytree(default_run.path, root / "r1")
    return root


@pytest.fixture
def app(runs_root, monkeypatch):
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(runs_root))
    return AppTest.from_file(APP, default_timeout=60)


def test_the_landing_page_offers_the_default_and_the_runs_page_lists_past_runs(app, runs_root):
    app.run()
    assert not app.exception
    assert [b.label for b in app.button if b.label == "Run the default"]
    assert [m for m in app.multiselect if m.label == "Detectors"][0].value == [d.name for d in RunConfig().detectors]
    from oodviz.detectors import available

    intro = app.markdown[0].value  # the default's detectors counted, not "every detector" (20 of 34 run)
    assert f"with the {len(RunConfig().detectors)} detectors of the CNN defaults (of the {len(available())}" in intro
    on_page(app, "runs")
    assert not app.exception
    runs = app.dataframe[0].value
    assert list(runs["run"]) == ["r1"] and runs["state"].iloc[0] == "done"
    metrics = pd.read_csv(runs_root / "r1" / "metrics.csv")
    per_dataset = metrics[~metrics.ood_dataset.str.endswith(" (mean)")]  # the six OOD sets, not the group means
    mean_auroc = {name: rows.auroc.sum() / 6 for name, rows in per_dataset.groupby("detector")}
    best = max(mean_auroc, key=mean_auroc.get)
    assert runs["best detector"].iloc[0] == best
    assert runs["mean AUROC"].iloc[0] == pytest.approx(mean_auroc[best])


def test_reattaching_from_the_url_shows_the_runs_results(app, runs_root):
    app.query_params["run"] = "r1"
    app.run()
    assert not app.exception
    assert any("r1" in c.value and "done" in c.value for c in app.caption)
    assert [t.label for t in app.tabs][:4] == ["Metrics", "Score histograms", "ROC / PR", "Failure cases"]
    metrics = pd.read_csv(runs_root / "r1" / "metrics.csv")
    shown = app.dataframe[0].value  # the near/far means, one row per detector
    assert list(shown["detector"]) == list(metrics.detector.unique())
    mahalanobis_near = metrics[
        (metrics.detector == "mahalanobis") & (metrics.ood_dataset == "near (mean)")
    ].auroc.item()
    assert shown.set_index("detector").loc["mahalanobis", "AUROC near"] == pytest.approx(mahalanobis_near)
    assert app.session_state["results-tab"] == "Metrics"
    assert not other_tabs_drawn(app)  # the header's threshold is drawn, nothing of the other tabs


def other_tabs_drawn(app) -> list[str]:
    """What the score histograms and failure cases tabs draw, found on the page (nothing while another tab is open)."""
    return [m.label for m in app.metric if m.label.startswith("Misses")] + [
        c.value for c in app.caption if c.value.startswith("At threshold ")
    ]


def shown_threshold_tab(app, tab):
    app.session_state["results-tab"] = tab
    return app.run()


def opened(app, run, **view):
    """Open ``run`` with the URL the app gives it (``?run=``), or a link with ``view``'s parameters too."""
    app.query_params.clear()
    app.query_params.update(run=run, **view)
    return app.run()


def test_the_shared_detectors_explanation_is_drawn_once_opened(app):
    """ "What it does" beside the detector above the tabs (a popover) draws nothing while closed (it imports the
    detector classes, torch modules); opened, it shows the formula the detector's module declares."""
    from oodviz.detectors import describe
    from oodviz.detectors.teaching import formula_clauses

    def formulas(app):  # the panel's inline KaTeX: "$clause,$" lines, the last without its comma
        return [m.value for m in app.markdown if m.value.startswith("$")]

    app.query_params["run"] = "r1"
    app.run()
    shown_threshold_tab(app, "Score histograms")
    [detector_box] = [s for s in app.selectbox if s.label.startswith("Detector")]
    assert not formulas(app) and not [m for m in app.markdown if m.value.startswith(f"**{detector_box.value}**:")]
    app.session_state[f"teaching-{detector_box.value}"] = True
    app.run()
    assert not app.exception
    assert [m for m in app.markdown if m.value.startswith(f"**{detector_box.value}**:")]  # the popover's panel
    [shown] = formulas(app)
    clauses = [line.strip().strip("$").removesuffix(",") for line in shown.split("  \n")]
    assert clauses == formula_clauses(describe(detector_box.value)["formula"])


def test_one_threshold_and_detector_shared_by_the_tabs_per_set_by_default(app, runs_root):
    """The threshold starts at 95% recall of every OOD set (the lowest of the per-set thresholds), can be
    switched to the pooled one, and the histogram and the failure cases tabs share it and the detector."""
    app.query_params["run"] = "r1"
    app.run()
    shown_threshold_tab(app, "Score histograms")
    assert not app.exception
    [detector_box] = [s for s in app.selectbox if s.label.startswith("Detector")]
    scores = pd.read_parquet(runs_root / "r1" / "scores.parquet")
    ood = scores[scores.split == "ood"]

    def per_set(detector):
        return {name: brute_force_threshold(rows[detector]) for name, rows in ood.groupby("dataset")}

    detector = detector_box.value
    assert app.slider[0].value == pytest.approx(min(per_set(detector).values()))
    hardest = min(per_set(detector), key=per_set(detector).get)  # the set that decides "every OOD set"
    id_scores = scores.loc[scores.split == "id_test", detector].to_numpy()
    flagged = (id_scores >= per_set(detector)[hardest]).mean()
    [note] = [c.value for c in app.caption if "is decided by" in c.value]
    assert f"**{hardest}**" in note and f"there {flagged:.1%} of the ID test images are flagged" in note
    missed = [m for m in app.metric if m.label.startswith("Misses")][0].value
    every = min(per_set(detector).values())
    assert missed.startswith(f"{int((ood[detector] < every).sum()):,} (")
    [basis] = [s for s in app.selectbox if s.label == "Start the threshold at"]
    basis.select("95% of all OOD sets pooled").run()
    assert app.slider[0].value == pytest.approx(brute_force_threshold(ood[detector]))
    assert not [c for c in app.caption if "is decided by" in c.value]  # only for "every OOD set"
    [s for s in app.selectbox if s.label.startswith("Detector")][0].select("energy").run()
    [basis] = [s for s in app.selectbox if s.label == "Start the threshold at"]
    basis.select("digits-heldout").run()
    assert app.slider[0].value == pytest.approx(per_set("energy")["digits-heldout"])
    app.slider[0].set_value(app.slider[0].value + 1.0).run()
    moved = app.slider[0].value
    shown_threshold_tab(app, "Failure cases")
    assert not app.exception
    assert [s for s in app.selectbox if s.label.startswith("Detector")][0].value == "energy"
    assert app.slider[0].value == pytest.approx(moved)
    assert any(f"At threshold {moved:.4g}" in c.value for c in app.caption)
    shown_threshold_tab(app, "Metrics")
    shown_threshold_tab(app, "Score histograms")  # kept while a tab without the threshold was open
    assert [s for s in app.selectbox if s.label.startswith("Detector")][0].value == "energy"
    assert app.slider[0].value == pytest.approx(moved)


def test_each_run_keeps_its_own_detector_and_threshold(app, runs_root):
    """A detector and threshold chosen on one run do not carry into the next run opened (its tables and galleries
    used the old run's threshold while the caption described the new run's): that run starts from its own
    defaults, and the first run, opened again, shows what was chosen on it."""
    second = runs_root / "r-second"
    shutil.copytree(runs_root / "r1", second)
    try:
        app.query_params["run"] = "r1"
        app.run()
        shown_threshold_tab(app, "Score histograms")

        def detector():
            return [s for s in app.selectbox if s.label.startswith("Detector")][0]

        default_detector, default_threshold = detector().value, app.slider[0].value
        assert default_detector != "energy"
        detector().select("energy").run()
        app.slider[0].set_value(app.slider[0].value + 1.0).run()
        moved = app.slider[0].value
        assert app.query_params["detector"] == "energy"  # r1's view is in the URL
        opened(app, "r-second")  # as the app opens a run: the URL without the view of the run shown before
        assert not app.exception
        assert app.session_state["results-tab"] == "Metrics"  # r-second's own first tab, not r1's histograms
        assert not other_tabs_drawn(app)
        shown_threshold_tab(app, "Score histograms")
        assert detector().value == default_detector and app.slider[0].value == pytest.approx(default_threshold)
        assert not any(f"At threshold {moved:.4g}" in c.value for c in app.caption)
        assert app.query_params == {"run": "r-second", "tab": "score-histograms"}
        opened(app, "r1")  # r1 again, in the same session: what was chosen on it, tab too
        assert detector().value == "energy" and app.slider[0].value == pytest.approx(moved)
        assert app.query_params["threshold"] == repr(moved)
    finally:
        shutil.rmtree(second)


def shared_box(app, label):
    """The selectbox above the tabs whose label starts with ``label`` ("Detector", "Start the threshold at")."""
    [box] = [s for s in app.selectbox if s.label.startswith(label)]
    return box


def link_notes(app) -> list[str]:
    return [i.value for i in app.info if i.value.startswith("Not applied from the link")]


def test_a_link_opens_the_view_it_names_and_the_url_follows_the_view(app, runs_root):
    """A link with the tab, detector, threshold basis and threshold opens that view, the threshold to the last bit;
    each change of the view is written to the URL (only what differs from the run's defaults), and the URL, opened
    in a new session (a reload, a shared link), shows the same view again."""
    scores = pd.read_parquet(runs_root / "r1" / "scores.parquet")
    held_out = scores.loc[scores.dataset == "digits-heldout", "energy"]
    chosen = brute_force_threshold(held_out) + 0.123456789  # off the basis' own, not on the slider's steps
    link = {"tab": "failure-cases", "detector": "energy", "basis": "digits-heldout", "threshold": repr(chosen)}
    opened(app, "r1", **link)
    assert not app.exception and not link_notes(app)
    assert app.session_state["results-tab"] == "Failure cases"
    assert shared_box(app, "Detector").value == "energy"
    assert shared_box(app, "Start the threshold at").value == "digits-heldout"
    assert app.slider[0].value == chosen
    assert any(f"At threshold {chosen:.4g}" in c.value for c in app.caption)
    assert app.query_params == {"run": "r1", **link}  # the link stays as it was
    shared_box(app, "Start the threshold at").select("95% of all OOD sets pooled").run()
    pooled = brute_force_threshold(scores.loc[scores.split == "ood", "energy"])
    assert app.slider[0].value == pytest.approx(pooled)
    assert app.query_params == {"run": "r1", "tab": "failure-cases", "detector": "energy", "basis": "pooled"}
    moved = (app.slider[0].value + app.slider[0].max) / 2
    app.slider[0].set_value(moved).run()
    app.session_state["results-tab"] = "Score histograms"
    app.run()
    assert not app.exception
    url = dict(app.query_params)
    assert url == {
        "run": "r1",
        "tab": "score-histograms",
        "detector": "energy",
        "basis": "pooled",
        "threshold": repr(moved),
    }
    reloaded = AppTest.from_file(APP, default_timeout=60)
    reloaded.query_params.update(url)
    reloaded.run()
    assert not reloaded.exception and not link_notes(reloaded)
    assert reloaded.session_state["results-tab"] == "Score histograms"
    assert shared_box(reloaded, "Detector").value == "energy"
    assert shared_box(reloaded, "Start the threshold at").value == "95% of all OOD sets pooled"
    assert reloaded.slider[0].value == moved
    assert dict(reloaded.query_params) == url
    [b for b in reloaded.button if b.label == "New run from this one"][0].click()
    reloaded.run()  # leaving the run leaves its view
    assert dict(reloaded.query_params) == {"from": "r1"}


@pytest.mark.parametrize(
    ("link", "said"),
    [
        (
            {"tab": "nowhere", "detector": "knn2", "basis": "svhn", "threshold": "0.5"},
            [
                "tab 'nowhere' (this run has no such tab)",
                "detector 'knn2' (not a detector of this run)",
                "basis 'svhn' (not every, pooled or an OOD set of this run)",
                "threshold '0\\.5' (it was chosen for the detector dropped)",
            ],
        ),
        ({"tab": "score-histograms", "detector": "energy", "threshold": "abc"}, ["threshold 'abc' (not a number)"]),
        ({"tab": "score-histograms", "detector": "energy", "threshold": "1e9"}, ["threshold '1e9' (outside"]),
        ({"tab": "which-layer"}, ["tab 'which\\-layer' (this run has no such tab)"]),  # a one-layer run
    ],
)
def test_values_in_a_link_the_run_does_not_have_are_dropped_with_a_note(app, runs_root, link, said):
    """Each value the run does not have is named in one note and the run's default shown in its place (a threshold
    chosen for a detector or basis dropped is dropped too: it would be a wrong number on another detector); the
    rest of the link applies, and the URL keeps only what was applied."""
    opened(app, "r1", **link)
    assert not app.exception
    [note] = link_notes(app)
    assert all(part in note for part in said), note
    applied = {k: v for k, v in link.items() if not any(f"{k} '" in part for part in said)}
    assert dict(app.query_params) == {"run": "r1", **applied}
    if applied.get("tab") != "score-histograms":
        assert app.session_state["results-tab"] == "Metrics" and not other_tabs_drawn(app)
        return
    scores = pd.read_parquet(runs_root / "r1" / "scores.parquet")
    ood = scores[scores.split == "ood"]
    every = min(brute_force_threshold(rows["energy"]) for _, rows in ood.groupby("dataset"))
    assert shared_box(app, "Detector").value == "energy" and app.slider[0].value == pytest.approx(every)
    missed = [m for m in app.metric if m.label.startswith("Misses")][0].value
    assert missed.startswith(f"{int((ood['energy'] < every).sum()):,} (")  # the counts at that threshold
    app.run()  # the note said once: the URL now holds what is shown
    assert not link_notes(app)


def test_new_run_from_a_run_shows_its_choices_in_the_form(app, runs_root):
    """The Run page's "New run from this one" opens the New run page (``?from=<id>``) with the run's choices in the
    form; the link itself does the same in a new session."""
    other = runs_root / "r-other"
    shutil.copytree(runs_root / "r1", other)
    config = RunConfig.load(other / "config.json")
    config.detectors, config.batch_size = [DetectorChoice("msp"), DetectorChoice("knn", {"k": 5})], 32
    config.save(other / "config.json")
    try:
        app.query_params["run"] = "r-other"
        app.run()
        assert not app.exception and not [b for b in app.button if b.label == "Start run"]
        [b for b in app.button if b.label == "New run from this one"][0].click().run()
        assert not app.exception
        assert dict(app.query_params) == {"from": "r-other"}
        for shown in (app, on_page(AppTest.from_file(APP, default_timeout=60), "new", **{"from": "r-other"})):
            assert [t.value for t in shown.title] == ["New run"] and [b for b in shown.button if b.label == "Start run"]
            assert [m for m in shown.multiselect if m.label == "Detectors"][0].value == ["msp", "knn"]
            assert [n for n in shown.number_input if n.label == "knn: k"][0].value == 5
            assert [n for n in shown.number_input if n.label == "Batch size"][0].value == 32
            assert any("Starting from the choices of run `r-other`" in c.value for c in shown.caption)
    finally:
        shutil.rmtree(other)


def test_an_unknown_run_in_the_url_is_a_clear_message(app):
    app.query_params["run"] = "no-such-run"
    app.run()
    assert not app.exception
    assert any("There is no run 'no-such-run'" in e.value for e in app.error)


def test_a_failed_run_shows_a_readable_error_with_details_folded(app, runs_root):
    failed = runs_root / "r-failed"
    shutil.copytree(runs_root / "r1", failed)
    (failed / "metrics.csv").unlink()
    from oodviz.runs.rundir import RunDir

    RunDir(failed).write_status(
        state="failed", error="ValueError: vim: dim=64 must be between 1 and D-1", detail="Traceback ..."
    )
    app.query_params["run"] = "r-failed"
    app.run()
    assert not app.exception
    assert any("The run failed: ValueError: vim: dim=64" in e.value for e in app.error)
    assert any(x.label == "Details" for x in app.expander)
    shutil.rmtree(failed)


def test_a_failed_run_offers_the_fixes_its_error_names_and_a_click_fills_the_form(app, runs_root):
    """A run the OOM killer ended carries the smaller-batch fix in its status (as the supervisor records it):
    "Retry with" opens the New run page from that run (``?from=<id>``), its form filled with the run's choices and a
    quarter of its batch size, estimates it, and starts nothing. The button comes from the fix's kind and value: the
    error's words play no part."""
    from oodviz.problems import smaller_batch
    from oodviz.runs.rundir import RunDir

    failed = runs_root / "r-oom"
    shutil.copytree(runs_root / "r1", failed)
    (failed / "metrics.csv").unlink()
    RunDir(failed).write_status(
        state="failed",
        error="(any words: the fix is data)",
        fixes=[smaller_batch(256, "killed by the OOM killer").to_dict()],
    )
    before = sorted(p.name for p in runs_root.iterdir())
    app.query_params["run"] = "r-oom"
    app.run()
    retry = [b for b in app.button if b.label.startswith("Retry with: ")]
    assert [b.label for b in retry] == ["Retry with: Batch size 256 → 64"]
    retry[0].click().run()
    assert not app.exception
    assert dict(app.query_params) == {"from": "r-oom"} and [t.value for t in app.title] == ["New run"]
    app = on_page(app, "new", **{"from": "r-oom"})  # AppTest stays on the page the app opened
    assert [n for n in app.number_input if n.label == "Batch size"][0].value == 64
    detectors = [m for m in app.multiselect if m.label == "Detectors"][0].value
    assert detectors == [d.name for d in RunConfig.load(failed / "config.json").detectors]
    assert any(s.value.startswith("Applied: Batch size 256 → 64") for s in app.success)
    assert any(s.value.startswith("Fits this machine's") for s in app.success)  # estimated at once
    assert not [b for b in app.button if b.label.startswith(("Retry with: ", "Fix: "))]  # nothing left to offer
    assert sorted(p.name for p in runs_root.iterdir()) == before
    shutil.rmtree(failed)


def test_the_parameter_editor_sets_choices_booleans_and_numbers(
    app, runs_root, monkeypatch, app_subprocesses_in_process
):
    """Non-numeric detector parameters are edited as what they are (a choice, a checkbox); only the values
    changed from the detector's defaults go into the config."""
    import oodviz.ui.new_run
    from oodviz.runs.jobs import QueueFull

    submitted = []

    def submit(config, root, nproc_per_node=1):
        submitted.append(config)
        raise QueueFull("test: recorded, not queued")

    monkeypatch.setattr(oodviz.ui.new_run, "submit", submit)
    app.run()
    [box for box in app.selectbox if box.label == "ash: variant"][0].set_value("p")
    assert [box.options for box in app.selectbox if box.label == "knn: backend"] == [
        ["exact", "faiss-flat", "faiss-ivf"]
    ]
    [box for box in app.checkbox if box.label == "mahalanobis: normalize"][0].check()
    [n for n in app.number_input if n.label == "energy: temperature"][0].set_value(2.5)
    assert [n.value for n in app.number_input if n.label == "vim: dim"] == [None]  # blank: automatic
    [b for b in app.button if b.label == "Start run"][0].click().run()
    assert not app.exception
    (config,) = submitted
    params = {d.name: d.params for d in config.detectors if d.params}
    assert params == {"ash": {"variant": "p"}, "mahalanobis": {"normalize": True}, "energy": {"temperature": 2.5}}


def test_a_finished_runs_warnings_are_shown_above_its_results(app, runs_root):
    """A class mismatch, a re-extracted store or failed detectors are said on the run's page, once each."""
    warned = runs_root / "r-warned"
    shutil.copytree(runs_root / "r1", warned)
    mismatch = "ID folder classes cat, dog are not the model's classes: accuracy and per-class tables are meaningless"
    with open(warned / "events.jsonl", "a") as events:
        for message in (mismatch, "id_fit: store re-extracted", mismatch):
            events.write(json.dumps({"event": "warning", "message": message}) + "\n")
    app.query_params["run"] = "r-warned"
    app.run()
    assert not app.exception
    shown = [w.value for w in app.warning]
    assert shown.count(mismatch) == 1 and "id_fit: store re-extracted" in shown
    assert [t.label for t in app.tabs][0] == "Metrics"


def test_form_problems_are_keyed_by_the_field_they_are_about(tmp_path):
    """Every problem at once, each under its field: the folders' own checks and the config's."""
    from oodviz.ui.form import form_problems

    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "empty").mkdir()
    values = FormValues(
        id_preset=FOLDER_PRESET,
        fit_folder=str(tmp_path / "missing"),
        test_folder=str(tmp_path / "a-file"),
        ood_folder=str(tmp_path / "empty"),
        layers=["no-such-layer"],
        detectors=[],
        batch_size=0,
    )
    problems = form_problems(values)
    assert set(problems) == {"fit_folder", "test_folder", "ood_folder", "layers", "detectors", "batch_size"}
    assert problems["fit_folder"] == [f"Image folder {tmp_path / 'missing'} does not exist"]
    assert "is a file, not a directory" in problems["test_folder"][0]
    assert problems["ood_folder"][0].startswith(f"No images found under {tmp_path / 'empty'}")
    assert problems["detectors"] == ["choose at least one detector"]
    assert "no-such-layer" in problems["layers"][0] and "batch_size" in problems["batch_size"][0]
    assert form_problems(FormValues()) == {}


def test_start_with_a_bad_form_shows_every_error_and_creates_no_run(app, runs_root):
    app.run()
    before = sorted(p.name for p in runs_root.iterdir())
    [box for box in app.selectbox if box.label == "In-distribution"][0].select(FOLDER_PRESET).run()
    [t for t in app.text_input if t.label.startswith("ID fit folder")][0].input("/no/such/folder")
    [m for m in app.multiselect if m.label == "Detectors"][0].set_value([])
    [b for b in app.button if b.label == "Start run"][0].click().run()
    assert not app.exception
    errors = [e.value for e in app.error]
    assert errors == [
        "Image folder /no/such/folder does not exist",
        'The "folder" dataset needs path=\\<a directory of images\\>',  # escaped: shown as typed, not as HTML
        "choose at least one detector",
        "Fix first: 3 problem(s), shown under their fields.",
    ]
    assert sorted(p.name for p in runs_root.iterdir()) == before and "run" not in app.query_params


def test_a_bad_detector_parameter_is_said_once_under_the_detector_parameters(app, runs_root):
    """A parameter a detector refuses: its message, with the detector's name once, in the slot under "Parameters of
    the 2 chosen detector(s)" (below the Detectors list and its caption); no run is created."""
    from oodviz.ui.form import form_problems

    values = FormValues(detectors=["react", "knn"], detector_params={"react": {"percentile": 150}, "knn": {"k": -5}})
    assert form_problems(values) == {
        "detector_params": [
            "react: percentile is in percent and must satisfy 0 <= percentile <= 100, got 150",
            "knn: k must be a positive integer, got -5",
        ]
    }
    [problem] = RunConfig(detectors=[DetectorChoice("energy", {"temperature": "x"})]).problems()
    assert (problem.field, problem.detail) == ("detectors[0]", 'energy: temperature must be a number, got "x"')
    app.run()
    before = sorted(p.name for p in runs_root.iterdir())
    [m for m in app.multiselect if m.label == "Detectors"][0].set_value(["react", "energy"]).run()
    [n for n in app.number_input if n.label == "react: percentile"][0].set_value(150.0)
    [b for b in app.button if b.label == "Start run"][0].click().run()
    assert not app.exception
    said = "react: percentile is in percent and must satisfy 0 \\<= percentile \\<= 100, got 150"  # as typed
    assert [e.value for e in app.error] == [said, "Fix first: 1 problem(s), shown under their fields."]
    assert next_sibling(app.main, "Parameters of the 2 chosen detector(s)").value == said
    assert sorted(p.name for p in runs_root.iterdir()) == before and "run" not in app.query_params


def next_sibling(block, label: str):
    """The element drawn right after the one labelled ``label`` in its container (AppTest's element tree)."""
    children = list(getattr(block, "children", {}).values())
    for i, child in enumerate(children):
        if getattr(child, "label", None) == label:
            return children[i + 1]
        found = next_sibling(child, label)
        if found is not None:
            return found
    return None


def test_the_live_panel_reads_the_event_log_incrementally_and_keeps_a_bounded_memory_series(tmp_path):
    from oodviz.ui.live import EventTail

    log = tmp_path / "events.jsonl"
    rows = [{"time": 100.0 + i, "stage": "extract id_fit", "event": "progress", "done": i, "total": 999,
             "cpu_rss": 1000 + i} for i in range(1000)]  # fmt: skip
    text = "".join(json.dumps(r) + "\n" for r in rows)
    tail = EventTail(log, max_points=50)
    log.write_text(text[:5000] + '{"time": 1')  # a line still being written waits for the next poll
    first = tail.poll()
    assert first == text[:5000].rfind("\n") + 1 and tail.offset == first
    log.write_text(text)
    assert tail.poll() == len(text.encode()) - first  # only the new bytes are read
    assert tail.poll() == 0  # nothing new: nothing read
    assert tail.latest == rows[-1] and tail.started == 100.0
    times = [m["time"] for m in tail.memory]
    assert len(times) <= 101 and times[0] == 100.0 and times[-1] == 1099.0  # bounded, spans the whole run
    gaps = np.diff(times[:-1])  # the last one is the newest sample, shown whatever the stride
    assert len(times) > 50 and gaps.min() == gaps.max()  # decimated evenly, not truncated
    with log.open("a") as out:
        out.write(json.dumps({"stage": "extract id_fit", "event": "end", "wall_s": 3.0, "peak_cpu_rss": 5}) + "\n")
        for message in ("a", "b", "a"):
            out.write(json.dumps({"event": "warning", "message": message}) + "\n")
    tail.poll()
    assert list(tail.ended) == ["extract id_fit"] and list(tail.warnings) == ["b", "a"]


def test_stage_k_of_n_the_run_fraction_and_its_eta(default_run):
    from oodviz.config.plan import planned_stages
    from oodviz.ui.live import EventTail, hms, run_eta_s, stage_position

    plan = planned_stages(RunConfig.load(default_run.path / "config.json"))
    ends = [json.loads(line) for line in (default_run.path / "events.jsonl").read_text().splitlines()]
    assert plan == [e["stage"] for e in ends if e.get("event") == "end"]  # the stages the worker really ran
    assert (
        len(plan) == 2 + 8 + 20 + 7 * 2 + 2
    )  # load x2, extract 8 splits, fit 20, score 7 splits (+odin), save, metrics
    tail = EventTail(default_run.path / "events.jsonl")
    tail.poll()
    assert stage_position(plan, tail.ended, None, None) == (len(plan), 1.0)
    half = dict(list(tail.ended.items())[:9])
    progress = {"stage": plan[9], "done": 25, "total": 100}
    k, fraction = stage_position(plan, half, plan[9], progress)
    assert (k, fraction) == (10, pytest.approx(9.25 / len(plan)))
    assert run_eta_s(30.0, 0.25) == pytest.approx(90.0) and run_eta_s(0.0, 0.0) is None
    assert (hms(59.6), hms(3725), hms(0)) == ("1:00", "1:02:05", "0:00")


def test_runs_can_be_named_and_annotated_and_the_url_keeps_working(app, runs_root):
    from oodviz.ui.history import read_label, write_label

    named = runs_root / "r-named"
    shutil.copytree(runs_root / "r1", named)
    write_label(named, "  first   try ", "notes\nline 2")
    assert read_label(named) == {"name": "first try", "notes": "notes\nline 2"}
    assert json.loads((named / "label.json").read_text())["name"] == "first try"
    with pytest.raises(ValueError, match="at most 80 characters"):
        write_label(named, "x" * 81, "")
    on_page(app, "runs")
    runs = app.dataframe[0].value.set_index("run")
    assert runs.loc["r-named", "name"] == "first try" and runs.loc["r1", "name"] == ""
    on_page(app, "run", run="r-named")
    assert not app.exception and any("first try" in c.value for c in app.caption)
    assert any(m.value.startswith("**digits-cnn · ID digits-test · OOD digits-heldout") for m in app.markdown)
    # the header's "Name and notes": renaming keeps the run's id and URL, and tags it
    [name] = [t for t in app.text_input if t.label == "Name"]
    name.input("baseline #resnet")
    [b for b in app.button if b.label == "Save"][0].click().run()
    assert not app.exception and read_label(named)["name"] == "baseline #resnet"
    assert app.query_params["run"] == "r-named"
    on_page(app, "runs")
    assert app.dataframe[0].value.set_index("run").loc["r-named", "tags"] == "resnet"
    shutil.rmtree(named)


def test_comparing_runs_on_other_data_says_so_and_shows_the_config_difference(runs_root):
    from oodviz.ui.compare import config_difference, data_mismatch

    a = RunConfig().to_dict()
    b = RunConfig(batch_size=32, ood=RunConfig().ood[:2]).to_dict()
    diff = config_difference(a, b).set_index("setting")
    assert diff.loc["batch_size"].tolist() == ["256", "32"] and "ood" in diff.index and len(diff) == 2
    assert data_mismatch(a, b) == "the OOD sets differ (only the sets both have are compared)"
    assert data_mismatch(a, a) is None
    fashion = preset("fashion-mnist").to_dict()
    assert data_mismatch(a, fashion).startswith("the ID test set differs (digits-test vs fashion-mnist-id)")


def test_compare_two_runs_in_the_app(app, runs_root):
    other = runs_root / "r-other-data"
    shutil.copytree(runs_root / "r1", other)
    config = RunConfig.load(other / "config.json")
    config.batch_size = 64
    config.ood = config.ood[:3]
    config.save(other / "config.json")
    kept_rows = pd.read_csv(other / "metrics.csv")
    kept_rows[kept_rows.ood_dataset.isin([c.name for c in config.ood])].to_csv(other / "metrics.csv", index=False)
    on_page(app, "runs")
    table = app.dataframe[0].value
    rows = [list(table.run).index(r) for r in ("r1", "r-other-data")]
    app.session_state[runs_table_key(list(table.run))] = {"selection": {"rows": rows, "columns": [], "cells": []}}
    app.run()
    [b for b in app.button if b.label == "Compare"][0].click().run()  # the Compare page, r1 as run A
    assert not app.exception
    assert dict(app.query_params) == {"a": "r1", "b": "r-other-data"}
    assert any("different data: the OOD sets differ" in w.value for w in app.warning)
    diff = [t.value for t in app.table if t.value.index.name == "setting"][0]
    assert diff.loc["batch_size", "run A"] == "256" and diff.loc["batch_size", "run B"] == "64"
    [scatter] = list(app.get("plotly_chart"))
    figure = json.loads(scatter.proto.spec)
    points = figure["data"][1]
    metrics = pd.read_csv(runs_root / "r1" / "metrics.csv")
    shared = metrics[metrics.ood_dataset.isin([c.name for c in config.ood])]
    expected = shared.groupby("detector", sort=False).auroc.mean()
    assert points["customdata"] == list(expected.index)  # every name in the hover; the text only where none overlap
    x = points["x"]  # plotly sends numpy arrays as typed base64 blobs
    x = np.frombuffer(base64.b64decode(x["bdata"]), dtype=x["dtype"]) if isinstance(x, dict) else np.asarray(x)
    np.testing.assert_allclose(x, expected.to_numpy())  # run A's mean AUROC over the three shared sets
    [deltas] = [d.value for d in app.dataframe if "AUROC B − A" in d.value.columns]
    assert list(deltas.columns[-6:]) == ["AUROC A", "AUROC B", "AUROC B − A", "FPR95 A", "FPR95 B", "FPR95 B − A"]
    assert set(deltas["OOD dataset"]) == {c.name for c in config.ood} and (deltas["AUROC B − A"] == 0).all()
    shutil.rmtree(other)


def test_a_difference_is_green_where_run_b_is_better_and_red_where_worse():
    from oodviz.ui.compare import better_b

    assert better_b(0.01) == "color: #1b5e20" and better_b(-0.01) == "color: #b71c1c"
    assert better_b(0.0004) == better_b(float("nan")) == ""  # 0.000 as shown; no value


def test_delete_asks_first(app, runs_root):
    doomed = runs_root / "r-doomed"
    shutil.copytree(runs_root / "r1", doomed)
    on_page(app, "runs")
    runs = list(app.dataframe[0].value.run)
    app.session_state[runs_table_key(runs)] = {
        "selection": {"rows": [runs.index("r-doomed")], "columns": [], "cells": []}
    }
    app.run()
    [b for b in app.button if b.label == "Delete"][0].click().run()
    assert any(w.value.startswith("Delete 1 run(s): r-doomed? This cannot be undone.") for w in app.warning)
    assert doomed.is_dir()  # not yet
    [b for b in app.button if b.label == "Keep them"][0].click().run()
    assert doomed.is_dir() and not [b for b in app.button if b.label == "Yes, delete"]
    [b for b in app.button if b.label == "Delete"][0].click().run()
    [b for b in app.button if b.label == "Yes, delete"][0].click().run()
    assert not app.exception and not doomed.exists()
    assert "r-doomed" not in list(app.dataframe[0].value.run)


def test_sizes_have_three_significant_digits_and_no_exponent():
    from oodviz.models import format_bytes

    cases = {0: "0 B", 999: "999 B", 1000: "0.977 KiB", 1536: "1.5 KiB", 1010 * 2**20: "0.986 GiB", 5 * 2**30: "5 GiB"}
    assert {n: format_bytes(n) for n in cases} == cases
    assert format_bytes(2**50) == "1 PiB"


def test_every_chart_of_the_default_run_stays_under_50_kib(default_run):
    """The owners' budget per chart: the histogram, ROC and PR with 7 OOD sets or all 20 detectors."""
    from oodviz.figures import plots
    from oodviz.results import analysis
    from oodviz.results.tables import detectors_of, ood_datasets_of
    from oodviz.ui.results import curve_points

    scores = pd.read_parquet(default_run.path / "scores.parquet")
    detectors, sets = detectors_of(scores), ood_datasets_of(scores)
    sizes = [
        len(plots.histogram_figure(analysis.score_histogram(scores, d), threshold=0.0).to_json()) for d in detectors
    ]
    for names, curve in (
        (sets, lambda name: analysis.curves(scores, "vim", name, max_points=curve_points(len(sets)))),
        (detectors, lambda name: analysis.curves(scores, name, sets[0], max_points=curve_points(len(detectors)))),
    ):
        curves = {name: curve(name) for name in names}
        sizes += [len(plots.roc_figure(curves).to_json()), len(plots.pr_figure(curves).to_json())]
    assert max(sizes) < 50 * 1024, sizes


def test_only_a_strict_best_is_marked_and_unrankable_aurc_columns_are_greyed():
    """Three decimals are shown: 1.000 and 1.000 tie at the top, whatever their fourth decimal, and mark nothing
    (eleven detectors at AURC 0.000 were all "best"); a value strictly better than every other as shown is marked,
    for a lower-is-better metric the lowest. An AURC or risk column resting on too few classifier errors is greyed
    and unmarked; the other columns are marked as ever."""
    from oodviz.ui.results import BEST, UNRANKED, best_marks, metric_marks

    auroc = pd.Series([0.99996, 0.99991, 0.5, float("nan")])
    assert list(best_marks(auroc, lower_is_better=False)) == ["", "", "", ""]
    assert list(best_marks(pd.Series([0.9, 0.95, 0.5]), lower_is_better=False)) == ["", BEST, ""]
    fpr = pd.Series([0.2004, 0.1996, 0.3])  # 0.200 and 0.200 as shown
    assert list(best_marks(fpr, lower_is_better=True)) == ["", "", ""]
    assert list(best_marks(pd.Series([0.2, 0.1, 0.3]), lower_is_better=True)) == ["", BEST, ""]
    assert list(best_marks(pd.Series([0.0, 0.0, 0.0]), lower_is_better=True)) == ["", "", ""]
    aurc = pd.Series([0.01, 0.02], name="AURC")
    assert list(metric_marks(aurc, ranked=False)) == [UNRANKED, UNRANKED]
    assert list(metric_marks(aurc, ranked=True)) == [BEST, ""]
    assert list(metric_marks(pd.Series([0.9, 0.8], name="AUROC near"), ranked=False)) == [BEST, ""]
    # AURC is printed to three significant digits (a rarely wrong classifier's 1.2e-4 is not 0.000): its best is
    # judged at that precision too
    small = pd.Series([0.000123, 0.000456, 0.0001234], name="AURC")
    assert list(metric_marks(small, ranked=True)) == ["", "", ""]  # 0.000123 twice: a tie
    assert list(metric_marks(small.iloc[:2], ranked=True)) == [BEST, ""]


def test_the_metrics_table_prints_aurc_and_risk_to_three_significant_digits(app, runs_root):
    """The default run's classifier errs on a handful of digits: its AURC is around 1e-4, which three decimals
    printed as 0.000 for every detector (a perfect score); the table prints it to three significant digits, the
    other metrics to three decimals."""
    import pyarrow as pa

    app.query_params["run"] = "r1"
    app.run()
    [table] = [d for d in app.dataframe if "AURC" in d.value.columns]
    shown = pa.ipc.open_stream(table.proto.arrow_data.styler.display_values).read_all().to_pandas()
    metrics = pd.read_csv(runs_root / "r1" / "metrics.csv").drop_duplicates("detector").set_index("detector")
    assert (metrics.aurc.between(1e-6, 5e-4)).any()  # the case the table got wrong
    for detector, aurc, auroc in zip(shown.detector, shown.AURC, shown["AUROC near"]):
        assert aurc == f"{metrics.aurc[detector]:.3g}" and float(aurc) > 0
        assert len(auroc.split(".")[1]) == 3


def test_aurc_and_risk_say_how_many_classifier_errors_they_rest_on(app, runs_root):
    """The metrics table's caption and the risk–coverage tab count the classifier's errors on the ID test set
    (counted here from scores.parquet); below 20 they say the columns cannot rank detectors."""
    from oodviz.results.tables import MIN_CLASSIFIER_ERRORS

    scores = pd.read_parquet(runs_root / "r1" / "scores.parquet")
    id_rows = scores[scores.split == "id_test"]
    errors, n = int((id_rows.prediction != id_rows.label).sum()), len(id_rows)
    said = f"rest on the classifier's {errors:,} errors among {n:,} ID test images"
    app.query_params["run"] = "r1"
    app.run()
    [caption] = [c.value for c in app.caption if said in c.value]
    assert errors < MIN_CLASSIFIER_ERRORS  # the bundled CNN: a handful of errors on the digits
    assert "too few to rank detectors by" in caption and "greyed and never highlighted" in caption
    shown_threshold_tab(app, "Risk–coverage")
    assert not app.exception
    assert any(said in c.value and "too few to rank detectors by" in c.value for c in app.caption)


def test_a_gallery_draws_each_line_of_six_images_in_a_row_of_its_own(app):
    """A caption that wraps lowers only its own line of images: each image alone in its column, six columns a row
    (one row of six columns stacking every sixth image let the lines drift apart)."""

    def children(node):
        kids = getattr(node, "children", None)
        return list(kids.values()) if isinstance(kids, dict) else []

    def blocks(node):
        for child in children(node):
            yield child
            yield from blocks(child)

    def images_in(column):
        return [c for c in children(column) if c.type == "image"]

    app.query_params["run"] = "r1"
    app.run()
    shown_threshold_tab(app, "Failure cases")
    assert not app.exception
    lines = [b for b in blocks(app.main) if any(c.type == "column" and images_in(c) for c in children(b))]
    assert len(lines) >= 4  # two galleries of 12 images: two lines each
    for line in lines:
        columns = [c for c in children(line) if c.type == "column"]
        assert len(columns) == 6 and all(len(images_in(c)) <= 1 for c in columns)
