"""The New run page's form: its validation data, tuning switch and layers (issue 17) and its checks (issue 14 point
1), with Streamlit's AppTest on an empty runs root: what reaches the submitted config, errors under their fields, the
default detector list that follows the backbone's family; every field reruns the page, so what the form offers and
says follows the fields as they are, before any Start or Estimate (issue 26)."""

from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

import oodviz.ui.new_run
from oodviz.config.defaults import default_detector_params
from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
from oodviz.data import load_dataset
from oodviz.results.tables import ood_datasets_of
from oodviz.runs.jobs import QueueFull
from oodviz.ui.form import FormValues, config_from_form, form_problems, form_values_from_config
from oodviz.ui.form_tuning import HELD_OUT, VALIDATION_FOLDER

APP = str(Path(__file__).resolve().parents[2] / "app.py")
#: the bundled ID fit set of the default form (digits 0-7 of scikit-learn's training part)
DIGITS_FIT = len(load_dataset("digits-train"))


@pytest.fixture
def submitted(tmp_path, monkeypatch, app_subprocesses_in_process):
    """The configs Start submits (recorded, not queued); the app's runs root is empty; the estimate before a start
    in this process (``app_subprocesses_in_process``)."""
    configs = []

    def submit(config, root, nproc_per_node=1):
        configs.append(config)
        raise QueueFull("test: recorded, not queued")

    monkeypatch.setattr(oodviz.ui.new_run, "submit", submit)
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(tmp_path / "runs"))
    return configs


@pytest.fixture
def app(submitted):
    app = AppTest.from_file(APP, default_timeout=120)
    app.run()
    assert not app.exception
    return app


def widget(app, kind: str, label: str):
    (found,) = [w for w in getattr(app.main, kind) if w.label.startswith(label)]
    return found


def click(app, label: str) -> None:
    widget(app, "button", label).click().run()
    assert not app.exception


def test_validation_data_grids_and_layers_reach_the_submitted_config(app, submitted):
    widget(app, "checkbox", "Tune parameters on validation data").check()
    widget(app, "selectbox", "ID validation").select(HELD_OUT)
    widget(app, "number_input", "Held-out ID images").set_value(200)
    widget(app, "multiselect", "OOD datasets").set_value(["digits-heldout", "noise-uniform"])
    widget(app, "selectbox", "OOD validation set").select("digits-rotated")
    widget(app, "multiselect", "Layers").set_value(["features.3", "penultimate"])
    widget(app, "multiselect", "Detectors").set_value(["energy", "mahalanobis", "msp"])
    # each default grid, editable: energy's
    assert widget(app, "text_input", "mahalanobis grid").value == "normalize: false, true"
    energy = widget(app, "text_input", "energy grid")
    assert energy.value == "temperature: 0.5, 1, 2, 5, 10"
    energy.input("temperature: 1, 2")
    click(app, "Start run")
    (config,) = submitted
    assert config.id_val == DatasetChoice("digits-train", subsample=200, subsample_mode="last")
    # the fit takes the images before the held-out ones: disjoint
    assert (config.id_fit.subsample, config.id_fit.subsample_mode) == (DIGITS_FIT - 200, "first")
    assert config.ood_val == DatasetChoice("digits-rotated")
    assert (config.layer, config.layers) == (None, ["features.3", "penultimate"])
    # energy's grid as edited, mahalanobis' default grid (None); msp has nothing to tune
    assert config.detectors == [
        DetectorChoice("energy", grid={"temperature": [1.0, 2.0]}),
        DetectorChoice("mahalanobis"),
        DetectorChoice("msp"),
    ]
    assert config.problems() == [] and not [w for w in app.main.warning if "validation" in w.value]
    # the run's page fills the form with its choices: the form gives the same config back
    again = form_values_from_config(config)
    assert (again.tune, again.id_val, again.id_val_images, again.ood_val) == (True, HELD_OUT, 200, "digits-rotated")
    assert config_from_form(again) == config


def test_bad_validation_fields_show_every_error_under_its_field_and_submit_nothing(app, submitted):
    """Errors under their fields, all at once, no run; an OOD validation set that is also a test set is warned
    under its field (a warning: such a run may start)."""
    widget(app, "checkbox", "Tune parameters on validation data").check()
    widget(app, "selectbox", "ID validation").select(HELD_OUT)
    widget(app, "number_input", "Held-out ID images").set_value(DIGITS_FIT)  # nothing left to fit on
    widget(app, "selectbox", "OOD validation set").select("noise-uniform")  # one of the default test sets
    widget(app, "text_input", "energy grid").input("temperature: 1, hot")
    widget(app, "multiselect", "Detectors").set_value(["energy"])
    click(app, "Start run")
    assert submitted == []
    errors = [e.value for e in app.main.error]
    assert errors == [
        f"hold out fewer than the {DIGITS_FIT:,} images of the ID fit set (the detectors are fitted on the rest)",
        "energy grid: temperature takes float values, got 'hot'",
        "Fix first: 2 problem(s), shown under their fields.",
    ]
    (warning,) = [w.value for w in app.main.warning if "validation" in w.value]
    assert warning.startswith("the OOD validation set noise-uniform is also the OOD test set noise-uniform (same")
    # each message right under its field: nothing but captions drawn between them
    shown = [(node.type, getattr(node, "label", None) or str(getattr(node, "value", ""))) for node in app.main]
    for field, message in (
        ("Held-out ID images", errors[0]),
        ("OOD validation set", warning),
        ("energy grid", errors[1]),
    ):
        at = next(i for i, (kind, text) in enumerate(shown) if text.startswith(field) and kind != "subheader")
        following = [text for kind, text in shown[at + 1 :] if kind not in ("caption", "empty")]
        assert following[0] == message


def test_the_default_detector_list_follows_the_backbone_family_until_edited(app):
    detectors = widget(app, "multiselect", "Detectors")
    assert detectors.value == list(default_detector_params("digits-cnn"))
    widget(app, "selectbox", "Backbone").select("vit_b_16").run()
    assert not app.exception
    transformer = list(default_detector_params("vit_b_16"))
    assert widget(app, "multiselect", "Detectors").value == transformer
    assert "ash" not in transformer and "gradnorm" not in transformer
    assert widget(app, "checkbox", "mahalanobis: normalize").value is True  # MDS++ on a transformer
    assert any("ViT-B RMDS++ 81.71" in c.value for c in app.main.caption)
    assert "encoder.layers.encoder_layer_11" in widget(app, "multiselect", "Layers").options
    widget(app, "selectbox", "Backbone").select("resnet18").run()
    assert widget(app, "multiselect", "Detectors").value == list(default_detector_params("resnet18"))
    assert widget(app, "checkbox", "mahalanobis: normalize").value is False
    assert any("SCALE 81.36/96.53" in c.value for c in app.main.caption)
    # a list the user chose stays when the backbone changes
    widget(app, "multiselect", "Detectors").set_value(["msp", "energy"])
    widget(app, "checkbox", "Tune parameters on validation data").check()  # a problem: checked, not estimated
    click(app, "Estimate memory")
    widget(app, "selectbox", "Backbone").select("swin_t").run()
    assert widget(app, "multiselect", "Detectors").value == ["msp", "energy"]


# ---- the form follows its fields as they are, before any Start or Estimate (issue 26) ----------------------------


def parameter_section(app):
    """The expander of the chosen detectors' parameters, and the detectors whose parameters it offers (each field's
    label starts with its detector's name)."""
    (section,) = [e for e in app.main.expander if e.label.startswith("Parameters of the ")]
    fields = [w for kind in ("number_input", "selectbox", "checkbox") for w in getattr(section, kind)]
    return section, {field.label.split(": ")[0] for field in fields}


def test_only_the_chosen_detectors_parameters_are_offered_and_a_new_choice_offers_its_own_at_once(app, submitted):
    """Not a field for each of the detectors oodviz has: those of the chosen ones, and a detector added to the list
    brings its fields on that rerun, with nothing pressed; a value typed stays while the list changes, and reaches
    the run."""
    widget(app, "multiselect", "Detectors").set_value(["msp", "knn"]).run()
    section, offered = parameter_section(app)
    assert section.label == "Parameters of the 2 chosen detector(s)" and offered == {"knn"}  # msp has none
    assert [w.label for w in section.number_input if w.label.startswith("knn: ")][0] == "knn: k"
    widget(app, "number_input", "knn: k").set_value(7)
    widget(app, "multiselect", "Detectors").set_value(["msp", "knn", "odin"]).run()
    assert not app.exception and not app.main.error
    section, offered = parameter_section(app)
    assert section.label == "Parameters of the 3 chosen detector(s)" and offered == {"knn", "odin"}
    assert widget(app, "number_input", "knn: k").value == 7
    assert not [w for w in app.main.number_input if w.label.startswith(("react: ", "ash: ", "scale: "))]
    widget(app, "multiselect", "Detectors").set_value(["msp", "knn"]).run()
    assert parameter_section(app)[1] == {"knn"}
    click(app, "Start run")
    (config,) = submitted
    assert config.detectors == [DetectorChoice("msp"), DetectorChoice("knn", {"k": 7})]


def held_out(app) -> tuple[str, int]:
    """The held-out count's label and value."""
    field = widget(app, "number_input", "Held-out ID images")
    return field.label, field.value


def write_folder(root: Path, per_class: dict[str, int]) -> Path:
    """An image folder: ``per_class[c]`` 8x8 PNGs under ``root/c``."""
    from PIL import Image

    for name, count in per_class.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            Image.new("L", (8, 8), color=i * 10 % 256).save(root / name / f"{i}.png")
    return root


def test_the_held_out_count_follows_the_id_data_fields_as_they_are_edited(app, submitted, tmp_path):
    """The label of the held-out count names the size of the ID fit set the fields name now: the bundled digits',
    none for image folders until tuning reads a folder, then that folder's, another folder's once its path is
    edited, the digits' again; nothing pressed. Its value, a fifth of that set, follows too until a count is typed;
    a count typed stays (a label that changed made a new field, back at the suggestion)."""
    fit = write_folder(tmp_path / "fit", {"a": 3, "b": 7})
    other = write_folder(tmp_path / "other", {"a": 5, "b": 9, "c": 1})
    assert held_out(app) == (f"Held-out ID images (of the {DIGITS_FIT:,} ID fit images)", DIGITS_FIT // 5)
    widget(app, "selectbox", "In-distribution").select("image folders (your own)").run()
    assert held_out(app) == ("Held-out ID images (of the ID fit images)", 0)  # a folder is counted when tuning
    widget(app, "checkbox", "Tune parameters on validation data").check().run()
    assert held_out(app) == ("Held-out ID images (of the ID fit images)", 0)  # no folder yet
    widget(app, "text_input", "ID fit folder").input(str(fit)).run()
    assert held_out(app) == ("Held-out ID images (of the 10 ID fit images)", 2)
    widget(app, "text_input", "ID fit folder").input(str(other)).run()
    assert held_out(app) == ("Held-out ID images (of the 15 ID fit images)", 3)
    widget(app, "number_input", "Held-out ID images").set_value(4).run()
    widget(app, "text_input", "ID fit folder").input(str(fit)).run()
    assert held_out(app) == ("Held-out ID images (of the 10 ID fit images)", 4)
    widget(app, "selectbox", "In-distribution").select("digits (bundled, 8x8)").run()
    assert held_out(app) == (f"Held-out ID images (of the {DIGITS_FIT:,} ID fit images)", 4)
    assert not app.exception and not app.main.error and submitted == []


def detectors_caption_shown(app) -> str:
    (caption,) = [c.value for c in app.main.caption if "family" in c.value and "list" in c.value]
    return caption


def test_the_caption_under_the_detector_list_says_when_the_list_was_edited_and_when_it_is_the_default_again(app):
    from oodviz.config.catalog import detector_names
    from oodviz.config.defaults import defaults_reason

    default = list(default_detector_params("digits-cnn"))
    assert detectors_caption_shown(app).startswith(defaults_reason("digits-cnn"))
    widget(app, "multiselect", "Detectors").set_value(["msp", "energy"]).run()
    assert detectors_caption_shown(app) == (
        f"Your list: 2 of the {len(detector_names())} detectors. The digits-cnn family's default is {len(default)} "
        f"({', '.join(default)}); choose another backbone and this list stays as you made it."
    )
    widget(app, "multiselect", "Detectors").set_value(default).run()
    assert detectors_caption_shown(app).startswith(defaults_reason("digits-cnn"))
    assert not app.exception


def test_a_tuning_problem_goes_once_both_validation_fields_are_fixed_and_the_run_starts(app, submitted):
    """Tuning without validation data: Start says so under ID validation and starts nothing. A held-out count the
    fit set cannot spare: its problem instead. Both fields fixed (a count it can spare, an OOD validation set):
    Estimate shows no problem any more, and Start starts the run with them."""
    widget(app, "checkbox", "Tune parameters on validation data").check()
    widget(app, "multiselect", "Detectors").set_value(["energy"])
    click(app, "Start run")
    assert submitted == []
    assert [e.value for e in app.main.error] == [
        form_problems(FormValues(tune=True, fit_size=DIGITS_FIT))["id_val"][0],
        "Fix first: 1 problem(s), shown under their fields.",
    ]
    widget(app, "selectbox", "ID validation").select(HELD_OUT)
    widget(app, "number_input", "Held-out ID images").set_value(DIGITS_FIT)
    click(app, "Start run")
    assert submitted == []
    held_out, no_ood_val, count = [e.value for e in app.main.error]  # the first problem gone, two others instead
    assert held_out == (
        f"hold out fewer than the {DIGITS_FIT:,} images of the ID fit set (the detectors are fitted on the rest)"
    )
    assert no_ood_val.startswith("tuning needs both id") and no_ood_val.endswith("or neither")
    assert count == "Fix first: 2 problem(s), shown under their fields."
    widget(app, "number_input", "Held-out ID images").set_value(100)
    widget(app, "selectbox", "OOD validation set").select("digits-rotated")
    click(app, "Estimate memory")
    assert [e.value for e in app.main.error] == [] and submitted == []
    assert "Fits this machine's free disk, RAM and GPU memory." in [s.value for s in app.main.success]
    click(app, "Start run")
    assert [e.value for e in app.main.error] == ["test: recorded, not queued"]  # the fixture's submit, nothing else
    (config,) = submitted
    assert config.id_val == DatasetChoice("digits-train", subsample=100, subsample_mode="last")
    assert config.ood_val == DatasetChoice("digits-rotated") and config.problems() == []


def test_form_problems_of_the_validation_fields(tmp_path):
    """Checked without a browser: each problem keyed by its field."""
    (tmp_path / "empty").mkdir()
    tuned = FormValues(tune=True, fit_size=DIGITS_FIT)
    assert form_problems(tuned)["id_val"] == [
        "tuning needs validation data: set 'ID validation' above to 'part of the ID fit set' (how many: the number "
        "above) or 'an image folder', and choose an 'OOD validation set' below"
    ]
    problems = form_problems(FormValues(tune=True, id_val=VALIDATION_FOLDER, id_val_folder=str(tmp_path / "empty")))
    assert problems["id_val_folder"][0].startswith(f"No images found under {tmp_path / 'empty'}")
    assert problems["ood_val"][0].endswith("set ood_val too, or neither")
    assert form_problems(FormValues(tune=True, id_val=HELD_OUT, id_val_images=0, ood_val="digits-rotated"))[
        "id_val"
    ] == ["hold out at least one image of the ID fit set to validate on"]
    bad_layer = form_problems(FormValues(layers=["features.3", "no-such-layer"]))
    assert list(bad_layer) == ["layers"] and "no-such-layer" in bad_layer["layers"][0]
    assert (
        form_problems(
            FormValues(tune=True, id_val=HELD_OUT, id_val_images=50, ood_val="digits-rotated", fit_size=DIGITS_FIT)
        )
        == {}
    )


def test_edited_grids_are_read_as_their_parameters_kinds_and_checked_like_a_configs():
    tuned = FormValues(
        tune=True,
        id_val=HELD_OUT,
        id_val_images=50,
        ood_val="digits-rotated",
        fit_size=DIGITS_FIT,
        detectors=["knn", "mahalanobis", "energy"],
        detector_grids={"knn": "k: 1, 5", "mahalanobis": "normalize: true", "energy": ""},
    )
    grids = {d.name: d.grid for d in config_from_form(tuned).detectors}
    assert grids == {"knn": {"k": [1, 5]}, "mahalanobis": {"normalize": [True]}, "energy": {}}  # blank: no tuning
    assert all(type(k) is int for k in grids["knn"]["k"]) and form_problems(tuned) == {}
    assert form_values_from_config(config_from_form(tuned)).detector_grids == {
        "knn": "k: 1, 5",
        "mahalanobis": "normalize: true",
        "energy": "",
    }
    bad = FormValues(**{**tuned.__dict__, "detector_grids": {"knn": "k: 1, 5; nope: 3", "mahalanobis": "true"}})
    problems = form_problems(bad)
    assert list(problems) == ["grids"]
    unknown, unread = problems["grids"]  # the config's check, then what could not be read
    assert unknown.startswith("knn: grid names 'nope', which is not a parameter to tune")  # not the config's index
    assert unread == "mahalanobis grid: write parameter: value, value (got 'true')"
    untuned = FormValues(**{**tuned.__dict__, "tune": False})  # an edited grid without tuning is not used
    assert [d.grid for d in config_from_form(untuned).detectors] == [None, None, None]


def test_the_fewer_layers_fix_drops_the_widest_layer_and_the_estimate_then_fits(app, submitted, monkeypatch):
    """Three digits-cnn layers over a disk that holds two of them: the pre-flight's "fewer layers" fix is a button
    that takes exactly the widest layer out of Layers and estimates again, which then fits. The estimate runs
    in this process (the app runs it in a subprocess) against that disk; the stores written out from the formula,
    N x (D x 4 + C x 4 + 24) bytes per split (D: avg-pooled, one per channel), plus the head room the pre-flight
    asks for (margin_for)."""
    import json

    import oodviz.pipeline.preflight
    from oodviz.config.run import RunConfig
    from oodviz.engine.store.space import margin_for
    from oodviz.models.digits import DigitsCNN
    from oodviz.pipeline.probe import estimate_for_config

    model = DigitsCNN()
    dims = {"features.0": model.features[0].out_channels, "features.3": model.features[2].out_channels}
    dims["penultimate"] = model.fc.in_features
    assert max(dims, key=dims.get) == "penultimate"
    n = sum(len(load_dataset(name)) for name in ("digits-train", "digits-test", "digits-heldout"))
    store = {layer: n * (d * 4 + model.fc.out_features * 4 + 24) for layer, d in dims.items()}
    two = store["features.0"] + store["features.3"]
    disk = two + margin_for(two) + store["penultimate"] // 2  # the two narrow layers with head room, half the widest
    limits = oodviz.pipeline.preflight.machine_limits

    def with_small_disk(root, device, cap=None):
        return {**limits(root, device, cap), "disk": disk}

    monkeypatch.setattr(oodviz.pipeline.preflight, "machine_limits", with_small_disk)
    monkeypatch.setattr(
        oodviz.ui.new_run,
        "memory_estimate",
        lambda config, root: estimate_for_config(RunConfig.from_dict(json.loads(config)), root),
    )
    widget(app, "multiselect", "Layers").set_value(list(dims))
    widget(app, "multiselect", "OOD datasets").set_value(["digits-heldout"])
    widget(app, "multiselect", "Detectors").set_value(["msp", "mahalanobis"])
    click(app, "Estimate memory")
    # the verdict first, then the needs (the one over its limit first, marked), then the fix as a button
    (verdict,) = [e.value for e in app.main.error]
    assert verdict.startswith("Does not fit this machine: feature stores, 3 layers (") and " of disk, " in verdict
    assert f"penultimate: D={dims['penultimate']}, " in verdict
    (needs,) = [frame.value for frame in app.main.dataframe]
    assert needs[""].tolist().count("OVER") == 1 and needs.iloc[0][""] == "OVER"
    assert needs.iloc[0]["what"].startswith("feature stores, 3 layers")
    ((made,),) = [[c.value for c in app.main.code]]  # "How the estimate was made"
    assert "feature stores" in made
    assert widget(app, "button", "Start run").disabled
    fixes = [b.label for b in app.main.button if b.label.startswith("Fix: ")]
    assert "Fix: Leave out layer penultimate (the widest)" in fixes and not [f for f in fixes if "features." in f]
    click(app, "Fix: Leave out layer penultimate (the widest)")
    assert widget(app, "multiselect", "Layers").value == ["features.0", "features.3"]
    assert any(s.value.startswith("Applied: Leave out layer penultimate") for s in app.main.success)
    assert "Fits this machine's free disk, RAM and GPU memory." in [s.value for s in app.main.success]
    assert not widget(app, "button", "Start run").disabled and not app.main.error and not app.main.warning
    click(app, "Start run")
    assert [config.layers for config in submitted] == [["features.0", "features.3"]]


def test_a_runs_page_says_once_that_its_ood_validation_set_is_a_test_set(default_run_copy, monkeypatch):
    """The worker's warning event and the results page say the same: the page shows it once, above the results
    (with "Tuning:"), not again in the run's warnings."""
    from oodviz.config.run import RunConfig
    from oodviz.config.tuning import validation_warnings
    from oodviz.pipeline.reporter import Reporter
    from oodviz.runs.rundir import RunDir

    config = RunConfig.load(default_run_copy / "config.json")
    config.id_fit.subsample_mode = "first"  # the fit's first images, validation its last: only the OOD set overlaps
    config.id_val = DatasetChoice("digits-train", subsample=50, subsample_mode="last")
    config.ood_val = config.ood[0]
    config.save(default_run_copy / "config.json")
    (warning,) = validation_warnings(config)
    Reporter(RunDir(default_run_copy)).warn(warning)  # as the worker's tuning stage does
    Reporter(RunDir(default_run_copy)).warn("another warning")
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(default_run_copy.parent))
    page = AppTest.from_file(APP, default_timeout=120)
    page.query_params["run"] = default_run_copy.name
    page.run()
    assert not page.exception
    shown = [w.value for w in page.main.warning]
    ood_name = config.ood[0].name  # as the results name the set, not its place in the config
    assert [w for w in shown if f"is also the OOD test set {ood_name} " in w] == [f"Tuning: {warning}."]
    assert ood_name == ood_datasets_of(pd.read_parquet(default_run_copy / "scores.parquet"))[0]  # the results' name
    assert "ood[" not in warning
    assert "another warning" in shown


def test_the_fewer_layers_fix_is_offered_only_for_a_layer_the_form_has_beside_others():
    """From a refusal or a failed run's warning (a run started anyway): the widest layer out, the others kept in
    order; nothing for a form with that layer alone, or without it."""
    from oodviz.problems import Fix
    from oodviz.ui.form import form_fixes

    said = [Fix("drop_layer", "fewer layers: the widest is features.3 (D=32)", "features.3")]
    three = FormValues(layers=["features.0", "features.3", "penultimate"])
    ((label, fixed),) = [(fix.label, fix.values) for fix in form_fixes(said, three)]
    assert (label, fixed.layers) == ("Leave out layer features.3 (the widest)", ["features.0", "penultimate"])
    assert fixed == FormValues(layers=["features.0", "penultimate"])  # nothing else changed
    assert form_fixes(said, FormValues(layers=["features.3"])) == []
    assert form_fixes(said, FormValues(layers=["features.0", "penultimate"])) == []


def test_rewording_every_config_problem_keeps_each_under_its_field(monkeypatch):
    """A translation hook: every problem of the config rewritten; the form still places each under the same field,
    as it reads the problem's field, never its words."""
    from oodviz.problems import Problem
    from oodviz.ui.form import form_problems

    values = FormValues(
        detectors=["react", "knn"],
        detector_params={"react": {"percentile": 150}},
        batch_size=0,
        pooling="nope",
        device="cuda:7",
    )
    original = form_problems(values)
    assert {"detector_params", "batch_size", "pooling", "device"} <= set(original)
    problems = RunConfig.problems

    def reworded(config):
        return [Problem(f"«{i}»", p.field, f"«{i}»") for i, p in enumerate(problems(config))]

    monkeypatch.setattr(RunConfig, "problems", reworded)
    translated = form_problems(values)
    assert {field: len(said) for field, said in translated.items()} == {
        field: len(said) for field, said in original.items()
    }
    assert all(message.startswith("«") for said in translated.values() for message in said)


# ---- pooling: one field per layer, the model's own by default ---------------------------------------------------


def test_each_layer_gets_a_pooling_field_with_the_choices_that_apply():
    """Penultimate (the head's input, already pooled) has none, except for a TorchScript file (its output may be a
    map); a CNN's layer offers the model's own (avg) and avg, max, none; a ViT's token layer also cls and mean, its
    own being the class token; a layer whose kind the catalog does not know (a typed timm name) offers all."""
    from oodviz.ui.form import pooled_layers, pooling_label, pooling_options

    assert pooled_layers("digits-cnn", ["penultimate", "features.3"]) == ["features.3"]
    assert pooled_layers("torchscript", ["penultimate"]) == ["penultimate"]
    cnn = pooling_options("digits-cnn", "features.3")
    assert cnn == ([None, "avg", "max", "none"], "avg") and pooling_label(None, "avg") == "model's own (avg)"
    assert pooling_options("torchscript", "penultimate") == ([None, "avg", "max", "none"], "avg")
    assert pooling_options("vit_b_16", "encoder.layers.encoder_layer_5") == (
        [None, "avg", "max", "cls", "mean", "none"],
        "cls",
    )
    assert pooling_options("vit_b_16", "conv_proj") == ([None, "avg", "max", "none"], "avg")  # before the class token
    assert pooling_options("timm:vit_not_in_the_catalog", "blocks.3") == (
        [None, "avg", "max", "cls", "mean", "none"],
        None,
    )
    assert pooling_label(None, None) == "model's own" and pooling_label("mean", "cls") == "mean (of the patch tokens)"


def test_the_pooling_fields_make_the_configs_pooling_and_a_table_round_trips():
    """All fields at the model's own: pooling unset; one layer: its field's name; several: a table of the fields that
    name one. A config's table (or name) comes back from the form as it was; each field shows the config's pooling
    of its layer."""
    from oodviz.ui.form import pooling_from_fields, pooling_of

    layers = ["features.0", "features.3", "penultimate"]
    assert pooling_from_fields(layers, {"features.0": None, "features.3": None}) is None
    assert pooling_from_fields(["features.3"], {"features.3": "max"}) == "max"
    assert pooling_from_fields(layers, {"features.0": None, "features.3": "max"}) == {"features.3": "max"}
    for pooling in (None, "none", {"features.3": "max"}, {"features.0": "none", "features.3": "avg"}):
        config = RunConfig(layers=layers, pooling=pooling, detectors=[DetectorChoice("msp")])
        values = form_values_from_config(config)
        assert config_from_form(values) == config and config.problems() == []
        fields = {layer: pooling_of(values.pooling, layer) for layer in ("features.0", "features.3")}
        if isinstance(pooling, dict):  # what the form's fields give back: the same table
            assert pooling_from_fields(layers, fields) == pooling
    # a saved run's "avg" over several layers comes back as a table that means the same for each layer
    avg = form_values_from_config(RunConfig(layers=layers, pooling="avg"))
    made = RunConfig(
        layers=layers, pooling=pooling_from_fields(layers, {k: pooling_of(avg.pooling, k) for k in layers[:2]})
    )
    assert made.pooling == {"features.0": "avg", "features.3": "avg"}
    assert [made.pooling_at(layer) for layer in layers[:2]] == ["avg", "avg"]


def test_a_pooling_problem_goes_under_its_layers_field_and_the_unpooled_fix_keeps_the_others():
    from oodviz.problems import Fix
    from oodviz.ui.form import form_fixes

    values = FormValues(backbone="resnet18", weights="random", layers=["layer3", "layer4"], pooling={"layer3": "cls"})
    problems = form_problems(values)
    assert list(problems) == ["pooling[layer3]"]
    assert problems["pooling[layer3]"][0].startswith("pooling 'cls' of layer3 reads the class token")
    single = FormValues(backbone="resnet18", weights="random", layers=["layer3"], pooling="mean")
    assert list(form_problems(single)) == ["pooling"]  # one layer: one field, "Pooling"
    assert list(form_problems(replace(single, pooling={"layer3": "mean"}))) == ["pooling"]
    unpooled = FormValues(layers=["features.0", "features.3"], pooling={"features.0": "none", "features.3": "max"})
    ((label, fixed),) = [(f.label, f.values) for f in form_fixes([Fix("pooling", "pool", None)], unpooled)]
    assert label == "Pool the features (the model's own pooling)" and fixed.pooling == {"features.3": "max"}


def test_the_form_offers_a_pooling_per_layer_and_the_run_gets_the_table(app, submitted):
    """Two layers picked: each gets its field ("Pooling of <layer>", the model's own first, no cls or mean on a CNN's
    maps) and penultimate a caption; the run started gets the table of the fields that name a pooling. A run's
    table, drawn again, shows in the fields as it was."""
    assert not [box for box in app.main.selectbox if box.label.startswith("Pooling")]  # penultimate alone
    assert any(c.value.startswith("penultimate: the classifier head's input") for c in app.main.caption)
    widget(app, "multiselect", "Layers").set_value(["features.0", "features.3", "penultimate"]).run()
    fields = [box for box in app.main.selectbox if box.label.startswith("Pooling")]
    assert [box.label for box in fields] == ["Pooling of features.0", "Pooling of features.3"]
    assert all(
        box.value is None and box.options == ["model's own (avg)", "avg", "max", "none (flattened)"] for box in fields
    )
    widget(app, "selectbox", "Pooling of features.3").set_value("max")
    widget(app, "multiselect", "Detectors").set_value(["msp"])
    click(app, "Start run")
    (config,) = submitted
    assert config.layers == ["features.0", "features.3", "penultimate"] and config.pooling == {"features.3": "max"}
    assert config_from_form(form_values_from_config(config)) == config


def test_a_runs_pooling_table_fills_the_fields_and_its_problem_shows_under_its_layer(submitted, tmp_path):
    """The form drawn from a run's config on the New run page (``?from=<id>``; a table, one entry a pooling that does not apply to a CNN's layer: shown
    as it was): each field shows its layer's entry; Estimate puts the refusal under that layer's field."""
    config = RunConfig(layers=["features.0", "features.3"], pooling={"features.0": "cls", "features.3": "none"})
    (tmp_path / "runs" / "pooled").mkdir(parents=True)
    config.save(tmp_path / "runs" / "pooled" / "config.json")
    app = AppTest.from_file(APP, default_timeout=120)
    app.query_params["from"] = "pooled"
    app.run()
    assert not app.exception
    assert widget(app, "selectbox", "Pooling of features.0").value == "cls"
    assert widget(app, "selectbox", "Pooling of features.3").value == "none"
    click(app, "Estimate memory")
    shown = [(node.type, getattr(node, "label", None) or str(getattr(node, "value", ""))) for node in app.main]
    at = next(i for i, (_, text) in enumerate(shown) if text == "Pooling of features.0")
    following = [text for kind, text in shown[at + 1 :] if kind not in ("caption", "empty")]
    assert following[0].startswith("pooling 'cls' of features.0 reads the class token")


def test_comparing_a_run_saved_with_avg_and_one_with_pooling_unset_says_which_is_which():
    from oodviz.ui.compare import config_difference

    old, new = RunConfig(pooling="avg").to_dict(), RunConfig().to_dict()
    assert config_difference(old, new).values.tolist() == [["pooling", "avg", "model's own"]]
    table = RunConfig(layers=["features.0", "features.3"], pooling={"features.3": "max"}).to_dict()
    assert config_difference(new, table).set_index("setting").loc["pooling.features.3"].tolist() == ["", "max"]
