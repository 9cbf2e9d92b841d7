"""The form's OpenOOD v1.5 presets (issue 28): an ID choice per benchmark that runs its lists from the data root as
``oodviz bench`` does (:func:`oodviz.pipeline.openood.benchmark_config`), the protocol switch, the round trip of a
benchmark run's config, and what the form says before Start (the fields a preset does not use, the data root's
problems under the data root)."""

from dataclasses import replace
from pathlib import Path

import pytest
from helpers import checkpoint, write_cifar10_root
from streamlit.testing.v1 import AppTest

import oodviz.ui.new_run
from oodviz import models
from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
from oodviz.pipeline.openood import benchmark_config
from oodviz.runs.jobs import QueueFull
from oodviz.ui.form import (
    OPENOOD_BACKBONES,
    OPENOOD_PRESETS,
    FormValues,
    config_from_form,
    form_problems,
    form_values_from_config,
    openood_warnings,
)
from oodviz.ui.form_tuning import HELD_OUT, NO_VALIDATION

APP = str(Path(__file__).resolve().parents[2] / "app.py")
CIFAR10 = "OpenOOD v1.5 cifar10"


def preset_values(**changes) -> FormValues:
    """The form with the cifar10 preset, its network and a checkpoint, the OOD list cleared."""
    values = FormValues(
        backbone="openood-resnet18-32x32",
        id_preset=CIFAR10,
        checkpoint="/ckpt/s0/best.ckpt",
        data_root="/data/openood",
        ood=[],
        detectors=["msp", "energy"],
    )
    return replace(values, **changes)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """A complete small cifar10 data root in OpenOOD's layout and a checkpoint of its network."""
    tmp = tmp_path_factory.mktemp("openood-form")
    write_cifar10_root(tmp / "openood")
    return tmp / "openood", checkpoint(tmp / "s0.ckpt", 0)


def test_one_preset_per_benchmark_each_naming_its_network():
    assert list(OPENOOD_PRESETS.values()) == list(models.OPENOOD_BENCHMARKS)
    assert OPENOOD_BACKBONES == {name: net.backbone for name, net in models.OPENOOD_NETWORKS.items()}


def test_a_preset_runs_the_benchmarks_lists_as_oodviz_bench_does():
    config = config_from_form(preset_values(fit_subsample=500, ood_subsample=50, protocol="openood"))
    bench = benchmark_config("cifar10", "/data/openood", "/ckpt/s0/best.ckpt")
    assert config.id_fit == replace(bench.id_fit, subsample=500) and config.id_test == bench.id_test
    assert config.ood == [replace(choice, subsample=50) for choice in bench.ood]
    assert [(c.result_name, c.group) for c in config.ood] == [
        ("cifar100", "near"),
        ("tin", "near"),
        ("mnist", "far"),
        ("svhn", "far"),
        ("texture", "far"),
        ("places365", "far"),
    ]
    assert config.preprocessing == "openood:cifar10" and (config.id_val, config.ood_val) == (None, None)
    # the form's own choices: backbone, checkpoint, detectors, protocol (ash's OpenOOD variant written in)
    assert (config.backbone, config.checkpoint, config.data_root) == (
        "openood-resnet18-32x32",
        "/ckpt/s0/best.ckpt",
        "/data/openood",
    )
    assert config.protocol == "openood" and config.detectors == [DetectorChoice("msp"), DetectorChoice("energy")]
    # tuning: OpenOOD's validation lists
    tuned = config_from_form(preset_values(tune=True))
    assert tuned.id_val == DatasetChoice("openood", {"benchmark": "cifar10", "split": "id_val"}, title="cifar10")
    assert tuned.ood_val == DatasetChoice("openood", {"benchmark": "cifar10", "split": "ood_val"}, title="tin")
    # the OOD list and the extra folder are not used: form_problems asks for them empty
    assert config_from_form(preset_values(ood=["svhn"], ood_folder="/x")).ood == bench.ood
    # another preset: no preprocessing of OpenOOD's, the protocol as chosen
    plain = config_from_form(FormValues(protocol="openood"))
    assert plain.preprocessing is None and plain.protocol == "openood"
    assert config_from_form(FormValues()) == RunConfig()


@pytest.mark.parametrize("benchmark", list(OPENOOD_PRESETS.values()))
def test_a_bench_runs_config_becomes_the_form_that_makes_it_again(benchmark):
    """A run of ``oodviz bench`` opened from the run list: the form shows it, and makes the same config."""
    config = benchmark_config(
        benchmark, "/data/openood", "/ckpt/best.ckpt", tune=True, device="cpu", batch_size=64, protocol="openood"
    )
    values = form_values_from_config(config)
    assert values.id_preset == f"OpenOOD v1.5 {benchmark}" and values.protocol == "openood"
    assert (values.ood, values.tune, values.id_val, values.ood_val) == ([], True, NO_VALIDATION, NO_VALIDATION)
    assert config_from_form(values) == config
    untuned = benchmark_config(benchmark, "/data/openood", None, weights="random", detectors=["msp", "ash"])
    untuned.id_fit.subsample = 200
    assert config_from_form(form_values_from_config(untuned)) == untuned


def test_the_fields_a_preset_does_not_use_are_asked_empty(data_root):
    root, ckpt = data_root
    ready = preset_values(data_root=str(root), checkpoint=ckpt)
    assert form_problems(ready) == {}
    problems = form_problems(replace(ready, ood=["svhn"], ood_folder="/some/folder"))
    assert problems["ood"] == [
        "OpenOOD v1.5 cifar10 runs its benchmark's own OOD sets (near cifar100, tin; far mnist, svhn, texture, "
        "places365), the sets its leaderboard averages over: clear this list (these sets would not run)"
    ]
    assert problems["ood_folder"][0].endswith("clear this field") and set(problems) == {"ood", "ood_folder"}
    tuned = form_problems(replace(ready, tune=True, id_val=HELD_OUT, id_val_images=0, ood_val="svhn"))
    assert set(tuned) == {"id_val", "ood_val"}  # not "hold out at least one image": the preset names its own
    assert tuned["id_val"] == [
        "OpenOOD v1.5 cifar10 tunes on OpenOOD's validation lists of the benchmark (ID: id_val; OOD: ood_val): set "
        "ID validation to 'none'"
    ]
    assert form_problems(replace(ready, tune=True)) == {}  # OpenOOD's lists, both there


def test_a_missing_data_root_list_or_image_is_the_data_roots_problem(data_root, tmp_path):
    root, ckpt = data_root
    missing = form_problems(preset_values(data_root=str(tmp_path / "nowhere"), checkpoint=ckpt))
    assert list(missing) == ["data_root"]
    (message,) = missing["data_root"]
    assert message.startswith("OpenOOD benchmark cifar10: no list folder benchmark_imglist/cifar10/ under data root")
    assert "--datasets cifar-10" in message
    # one image gone, one list gone: each set says what to fetch
    broken = tmp_path / "broken"
    write_cifar10_root(broken)
    (broken / "images_classic" / "svhn" / "test" / "svhn_3.png").unlink()
    (broken / "benchmark_imglist" / "cifar10" / "test_tin.txt").unlink()
    said = form_problems(preset_values(data_root=str(broken), checkpoint=ckpt))["data_root"]
    assert [m.split(":")[0] for m in said] == ["cifar10 near/tin", "cifar10 far/svhn"]
    assert "images_classic/svhn/test/svhn_3.png" in said[1] and "--datasets svhn" in said[1]
    # tuning reads the validation lists too
    (broken / "benchmark_imglist" / "cifar10" / "val_tin.txt").unlink()
    assert "cifar10 ood_val" in " ".join(form_problems(preset_values(data_root=str(broken), tune=True))["data_root"])


def test_a_backbone_other_than_the_benchmarks_network_is_warned_not_refused(data_root):
    root, ckpt = data_root
    assert openood_warnings(preset_values()) == []
    assert openood_warnings(preset_values(backbone="resnet18")) == [
        "The cifar10 leaderboard's figures are of openood-resnet18-32x32 (OpenOOD's checkpoints): with resnet18 the "
        "comparison is of another network"
    ]
    imagenet = preset_values(id_preset="OpenOOD v1.5 imagenet", backbone="vit_b_16")
    assert openood_warnings(imagenet) == []  # on the leaderboard too: compared with its own rows
    assert openood_warnings(FormValues()) == []


@pytest.fixture
def submitted(tmp_path, monkeypatch, app_subprocesses_in_process):
    """The configs Start submits (recorded, not queued); the estimate in this process."""
    configs = []

    def submit(config, root, nproc_per_node=1):
        configs.append(config)
        raise QueueFull("test: recorded, not queued")

    monkeypatch.setattr(oodviz.ui.new_run, "submit", submit)
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(tmp_path / "runs"))
    return configs


def widget(app, kind: str, label: str):
    (found,) = [w for w in getattr(app.main, kind) if w.label.startswith(label)]
    return found


def test_start_with_the_preset_submits_the_benchmarks_run(data_root, submitted):
    root, ckpt = data_root
    app = AppTest.from_file(APP, default_timeout=180)
    app.run()
    widget(app, "selectbox", "Backbone").select("openood-resnet18-32x32").run()
    widget(app, "selectbox", "In-distribution").select(CIFAR10)
    widget(app, "text_input", "Checkpoint file").input(ckpt)
    widget(app, "text_input", "Data root").input(str(root))
    widget(app, "multiselect", "Detectors").set_value(["msp", "energy"])
    widget(app, "radio", "Protocol").set_value("openood")
    widget(app, "button", "Start run").click().run()  # the default OOD list is still chosen
    assert not app.exception and not submitted
    assert "runs its benchmark's own OOD sets" in " ".join(e.value for e in app.main.error)
    widget(app, "multiselect", "OOD datasets").set_value([])
    widget(app, "number_input", "ID fit").set_value(20)
    widget(app, "button", "Start run").click().run()
    # a random network on random images: the classifier check refuses it, rightly (as oodviz bench without --force)
    assert not submitted and "the model's classes do not look like the ID labels" in app.main.error[0].value
    widget(app, "checkbox", "Run anyway").check().run()
    widget(app, "button", "Start run").click().run()
    assert not app.exception
    (config,) = submitted
    expected = benchmark_config("cifar10", str(root), ckpt, detectors=["msp", "energy"], protocol="openood")
    expected.id_fit.subsample = 20
    assert config.to_dict() == {**expected.to_dict(), "data_root": config.data_root}
    assert Path(config.data_root).resolve() == root.resolve()
