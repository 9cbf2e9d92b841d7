"""The form's catalog (:mod:`oodviz.config.catalog`) is built from the code that declares it, in a process of its
own, once per version of the code; the form's readers give what the detector classes, the model registry and the
dataset registry give."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import write_idx

from oodviz.config import catalog
from oodviz.config.catalog import param_fields
from oodviz.config.defaults import FAMILY_CHANGES, default_detector_params
from oodviz.config.run import DetectorChoice, RunConfig
from oodviz.config.tuning import detector_grid
from oodviz.data import load_dataset
from oodviz.detectors import available, detector_class
from oodviz.models import architecture_layer_names, available_backbones
from oodviz.models.architectures import backbone_family
from oodviz.params import editable_fields
from oodviz.ui.form_tuning import layer_options, tuned_grids

SPLITS = ("train", "test")


def test_the_catalog_is_built_from_the_code_in_a_process_of_its_own(tmp_path):
    """A fresh cache: the first reader builds it in a child process (torch stays out of the reader), a second
    reader reads the same file without building it again."""
    env = {**os.environ, catalog.CACHE_DIR_VARIABLE: str(tmp_path)}
    code = (
        "import sys, json\nfrom oodviz.config.catalog import catalog, catalog_path\n"
        "names = catalog()['detectors']\n"
        "print(json.dumps([str(catalog_path()), names, 'torch' in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    path, names, torch_imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert not torch_imported and names == available()
    assert Path(path).parent == tmp_path and json.loads(Path(path).read_text()) == json.loads(
        json.dumps(catalog.build())
    )
    built = Path(path).stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert json.loads(again.stdout.strip().splitlines()[-1])[0] == path and Path(path).stat().st_mtime_ns == built


def test_a_changed_source_file_names_another_catalog(tmp_path):
    package = tmp_path / "oodviz"
    shutil.copytree(catalog.PACKAGE_ROOT, package, ignore=shutil.ignore_patterns("__pycache__", "katex", "weights"))
    key = catalog.source_key(package)
    assert key == catalog.source_key(catalog.PACKAGE_ROOT)  # the same sources: the same catalog
    detector = package / "detectors" / "knn.py"
    detector.write_text(detector.read_text().replace("k: int = 50", "k: int = 51"))
    assert catalog.source_key(package) != key


@pytest.mark.parametrize("name", available())
def test_the_forms_parameter_fields_are_the_constructors(name):
    read, declared = param_fields(name), editable_fields(detector_class(name))
    assert read == declared
    assert [type(f.default) for f in read] == [type(f.default) for f in declared]


def test_default_detectors_and_grids_are_the_classes():
    for backbone in [*available_backbones(), "torchscript", " ViT_B_16 ", "no-such-model"]:
        family = backbone_family(backbone)
        assert catalog.backbone_family(backbone) == family
        changes = FAMILY_CHANGES[family]
        expected = {
            name: changes["params"].get(name, {})
            for name in available()
            if detector_class(name).in_defaults and name not in changes["leave_out"]
        }
        assert default_detector_params(backbone) == expected
    config = RunConfig(detectors=[DetectorChoice(name, {"temperature": 2.0}) for name in available()])
    by_class = {choice.name: detector_grid(choice) for choice in config.detectors}
    assert tuned_grids(config) == by_class
    assert by_class["odin"] == {
        k: list(v) for k, v in detector_class("odin").default_grid.items() if k != "temperature"
    }


def test_the_forms_layers_are_the_architectures():
    for backbone in available_backbones():
        assert layer_options(backbone, ["penultimate"]) == ["penultimate", *architecture_layer_names(backbone)]
    assert layer_options("torchscript", ["penultimate", "x"]) == ["penultimate", "x"]


def test_the_forms_pooling_defaults_are_the_loaded_models():
    """What the form says "model's own" gives a layer is what the loaded backbone resolves ``pooling=None`` to: the
    class token on ViT-B/16's encoder blocks, avg on its patch embedding and on a CNN's maps; no token layers for the
    CNNs and Swin (whose stages are maps)."""
    from oodviz.models import architecture_token_layout, load_backbone

    for name in available_backbones():
        layout = architecture_token_layout(name)
        expected = None if layout is None else {"head_pooling": layout.head_pooling, "layers": list(layout.layers)}
        assert catalog.catalog()["backbones"][name]["tokens"] == expected, name
    assert (
        catalog.catalog()["backbones"]["resnet18"]["tokens"]
        is None
        is catalog.catalog()["backbones"]["swin_t"]["tokens"]
    )
    vit = load_backbone("vit_b_16", weights="random")
    for layer in ("encoder.layers.encoder_layer_3", "encoder.ln", "conv_proj"):
        assert catalog.layer_default_pooling("vit_b_16", layer) == vit.with_layer(layer).default_pooling, layer
    assert catalog.layer_default_pooling("vit_b_16", "encoder.layers.encoder_layer_3") == "cls"
    assert catalog.layer_default_pooling("resnet18", "layer3") == "avg"
    assert catalog.layer_default_pooling("timm:not_listed", "blocks.1") is None


def _fake_mnist(folder, gz: bool, sizes=(("train", 23), ("t10k", 11))) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in sizes:
        write_idx(folder / f"{prefix}-images-idx3-ubyte", np.zeros((n, 28, 28), np.uint8), gz)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", (np.arange(n) * 7 % 10).astype(np.uint8), gz)


def loaded_size(name: str, params: dict, root) -> int | None:
    """What the sidebar counted before the catalog: the set loaded (None when it cannot be)."""
    try:
        return len(load_dataset(name, root=str(root), **params))
    except Exception:
        return None


@pytest.mark.parametrize("gz", [False, True])
def test_the_known_split_sizes_are_the_loaded_sets(tmp_path, gz, monkeypatch):
    monkeypatch.setitem(catalog.catalog()["system_dirs"], "fashion-mnist", str(tmp_path / "no-system-copy"))
    for name in catalog.BUNDLED_SPLITS:
        assert catalog.known_split_size(name, {}, str(tmp_path)) == loaded_size(name, {}, tmp_path)
    for folder in catalog.mnist_folders().values():
        _fake_mnist(tmp_path / folder / "raw", gz)
    cases = [(name, {"split": split}) for name in [*catalog.mnist_folders(), "fashion-mnist-id"] for split in SPLITS]
    for name, params in cases:
        expected = loaded_size(name, params, tmp_path)
        assert expected in (23, 11, 19, 9) and catalog.known_split_size(name, params, str(tmp_path)) == expected
    # what it cannot read cheaply is left to loading: other sets, other parameters, missing files
    empty = tmp_path / "empty"
    for name, params in [("mnist", {"split": "train"}), ("cifar10", {"split": "train"}), ("mnist", {})]:
        assert catalog.known_split_size(name, params, str(empty)) is None
    (tmp_path / "KMNIST" / "raw" / "t10k-images-idx3-ubyte").unlink(missing_ok=True)
    (tmp_path / "KMNIST" / "raw" / "t10k-images-idx3-ubyte.gz").unlink(missing_ok=True)
    assert catalog.known_split_size("kmnist", {"split": "train"}, str(tmp_path)) is None


@pytest.mark.skipif(
    catalog.known_split_size("fashion-mnist-id", {"split": "train"}, "/nonexistent") is None,
    reason="Debian's dataset-fashion-mnist is not installed",
)
def test_fashion_mnist_from_the_system_copy_counts_as_loaded(tmp_path):
    for name in ("fashion-mnist-id", "fashion-mnist"):
        params = {"split": "train"}
        assert catalog.known_split_size(name, params, str(tmp_path / name)) == loaded_size(
            name, params, tmp_path / name
        )
