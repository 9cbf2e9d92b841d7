"""The form's catalog (:mod:`oodviz.catalog`) is what the code declares: the file equals :func:`build`, and the
form's readers give what the detector classes, the model registry and the dataset registry give."""

from __future__ import annotations

import json

import pytest

from oodviz import catalog
from oodviz.detectors import available, detector_class
from oodviz.models import architecture_layer_names, available_backbones
from oodviz.models.architectures import backbone_family
from oodviz.runs.config import DetectorChoice, RunConfig
from oodviz.runs.defaults import FAMILY_CHANGES, default_detector_params
from oodviz.runs.tuning import detector_grid
from oodviz.ui.form import declared_param_fields, param_fields
from oodviz.ui.form_tuning import layer_options, tuned_grids


def test_the_catalog_file_is_what_the_code_declares():
    # regenerate with `python -m oodviz.catalog` when this fails
    assert catalog.catalog() == json.loads(json.dumps(catalog.build()))


@pytest.mark.parametrize("name", available())
def test_the_forms_parameter_fields_are_the_constructors(name):
    read, declared = param_fields(name), declared_param_fields(name)
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
