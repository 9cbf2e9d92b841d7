"""RunConfig checks before work: files, field types, dataset and detector params, the model's layers and
classes, the data-dependent limits (check_sizes), and class names of image folders against the model's."""

import codecs
import json

import numpy as np
import pytest
from helpers import make_problem
from PIL import Image

from oodviz.config.run import ConfigError, DatasetChoice, DetectorChoice, RunConfig
from oodviz.config.validation import check_sizes
from oodviz.data import class_mismatch, dataset_param_problems, load_dataset
from oodviz.detectors import create
from oodviz.models import architecture_layer_names, backbone_classes, load_backbone


def small_config(**changes) -> RunConfig:
    return RunConfig(device="cpu", ood=[DatasetChoice("digits-heldout")], detectors=[DetectorChoice("msp")], **changes)


# ---- files ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bom, encoding",
    [
        (codecs.BOM_UTF8, "utf-8"),
        (codecs.BOM_UTF16_LE, "utf-16-le"),
        (codecs.BOM_UTF16_BE, "utf-16-be"),
        (codecs.BOM_UTF32_LE, "utf-32-le"),
        (codecs.BOM_UTF32_BE, "utf-32-be"),
    ],
)
def test_a_config_with_a_byte_order_mark_loads_as_the_same_config(tmp_path, bom, encoding):
    config = small_config(data_root="donn\u00e9es/\u65e5\u672c", seed=7)
    path = tmp_path / "run.json"
    path.write_bytes(bom + json.dumps(config.to_dict()).encode(encoding))
    assert RunConfig.load(path) == config
    toml = tmp_path / "run.toml"
    toml.write_bytes(bom + 'data_root = "donn\u00e9es"\nbatch_size = 64\n'.encode(encoding))
    assert RunConfig.load(toml) == RunConfig(data_root="donn\u00e9es", batch_size=64)


def test_nesting_up_to_the_limit_loads_and_deeper_is_refused(tmp_path):
    # the top table, ood, ood[0] and its params are 4 levels; a list 28 deep as params.size reaches 32
    def config(depth):
        return '{"ood": [{"name": "noise-gaussian", "params": {"size": ' + "[" * depth + "]" * depth + "}}]}"

    (tmp_path / "ok.json").write_text(config(28))
    assert (
        RunConfig.load(tmp_path / "ok.json").ood[0].params["size"] == json.loads(config(28))["ood"][0]["params"]["size"]
    )
    (tmp_path / "deep.json").write_text(config(29))
    with pytest.raises(ConfigError, match="more than 32 levels deep"):
        RunConfig.load(tmp_path / "deep.json")


def test_a_json_key_given_twice_in_one_table_is_refused_with_its_line(tmp_path):
    """JSON readers keep a repeated key's last value silently (TOML refuses it): a config refuses it, naming the
    file, the key and the lines; the same key in two different tables is no repetition."""
    path = tmp_path / "run.json"
    path.write_text(
        '{\n  "ood": [{"name": "digits-heldout"}, {"name": "noise-uniform"}],\n'
        '  "detectors": [{"name": "knn",\n    "params": {"k": 5, "k\\u0020": 1,\n      "k": 50}}],\n'
        '  "batch_size": 64\n}\n'
    )
    with pytest.raises(ConfigError) as caught:
        RunConfig.load(path)
    assert caught.value.problems == [
        f'{path}, line 5: the key "k" is given a second time in one table (first on line 4); give each setting once'
    ]
    path.write_text('{"device": "cpu", "batch_size": 64,\n\n"device": "cuda"}')
    with pytest.raises(ConfigError, match='line 3: the key "device" is given a second time'):
        RunConfig.load(path)


def test_from_dict_refuses_what_is_not_a_table_of_settings():
    with pytest.raises(ConfigError, match=r"a run config is a table of settings, got \[1, 2\]"):
        RunConfig.from_dict([1, 2])
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_dict({"id_fit": None, "detectors": {"knn": {}}, "ood": [3]})
    assert caught.value.problems == [
        "id_fit must be a dataset name or a table with a 'name', got null",
        "ood[0] must be a dataset name or a table with a 'name', got 3",
        'detectors must be a list of names or tables, got {"knn": {}}',
    ]


# ---- fields and parameters ------------------------------------------------------------------


def test_the_default_config_and_the_presets_have_no_problems():
    from oodviz.config.run import PRESETS

    for make in PRESETS.values():
        assert make().problems() == []


def test_a_detector_listed_twice_is_refused_since_both_would_write_one_result_column():
    config = small_config()
    config.detectors = [DetectorChoice("knn", {"k": 5}), DetectorChoice("msp"), DetectorChoice("knn", {"k": 50})]
    assert config.problems() == ["detector 'knn' is listed twice: keep one (to compare its parameters, give it a grid)"]
    config.detectors = config.detectors[:2]
    assert config.problems() == []


def test_a_config_built_in_code_is_type_checked_like_a_file():
    config = small_config(batch_size=2.0, seed=False, memory_budget_gb=float("inf"), checkpoint="a\0b", pooling=5)
    config.ood.append(DatasetChoice("noise-uniform", {"n": 10.5, "noise_seed": -1}, subsample=True))
    assert config.problems() == [
        "pooling must be a string or a table or null, got 5",
        "batch_size must be an integer, got 2.0",
        "seed must be an integer, got false",
        "memory_budget_gb must be a finite number, got Infinity",
        "checkpoint file a\x00b does not exist",
        "ood[1].subsample must be an integer or null, got true",
        "ood[1] (noise-uniform): n must be an integer, got 10.5",
        "ood[1] (noise-uniform): noise_seed must be >= 0, got -1",
    ]


def test_dataset_params_are_checked_against_the_loaders_signature():
    assert dataset_param_problems("photo-patches", {"size": [28, 28], "window": "big", "n": 0}) == [
        "Dataset 'photo-patches': size must be an integer, got [28, 28]",
        "Dataset 'photo-patches': window must be an integer or null, got \"big\"",
        "Dataset 'photo-patches': n must be positive, got 0",
    ]
    assert dataset_param_problems("folder", {"path": 5, "mode": True}) == [
        "Dataset 'folder': path must be a string or null, got 5",
        "Dataset 'folder': mode must be a string or null, got true",
    ]
    assert dataset_param_problems("noise-gaussian", {"size": [28, 28], "n": 3}) == []  # size: an int or (h, w)
    with pytest.raises(ValueError, match="n must be positive, got -5"):
        load_dataset("noise-gaussian", n=-5)
    with pytest.raises(ValueError, match="download must be True or False, got 'no'"):
        load_dataset("noise-gaussian", download="no")


def test_detector_params_are_type_checked_and_finite():
    config = small_config()
    config.detectors = [
        DetectorChoice("knn", {"k": True}),
        DetectorChoice("energy", {"temperature": float("nan")}),
        DetectorChoice("react", {"percentile": "90"}),
        DetectorChoice("vim", {"dim": 3}),
    ]
    assert config.problems() == [
        "detectors[0] (knn): k must be an integer, got true",
        "detectors[1] (energy): temperature must be a finite number, got NaN",
        'detectors[2] (react): percentile must be a number, got "90"',
    ]


# ---- the model ------------------------------------------------------------------------------


def test_layer_names_and_classes_are_those_of_the_loaded_model():
    for name in ("digits-cnn", "resnet18"):
        loaded = load_backbone(name, weights="random")
        assert architecture_layer_names(name) == loaded.layer_names()
        assert backbone_classes(name, "random") == loaded.classes
    assert backbone_classes("digits-cnn") == load_backbone("digits-cnn").classes
    assert backbone_classes("resnet18", checkpoint="model.pt") is None
    assert backbone_classes("torchscript", checkpoint="model.pt") is None


def test_a_layer_is_checked_against_the_architecture():
    assert small_config(backbone="resnet18", weights="random", layer="layer3.1.conv2").problems() == []
    problems = small_config(backbone="digits-cnn", layer="features.9").problems()
    assert len(problems) == 1 and problems[0].startswith("digits-cnn has no layer 'features.9'")
    top = ", ".join(n for n in architecture_layer_names("digits-cnn") if "." not in n)
    # nothing close: a full stop, then the top-level layers, as one sentence each
    assert small_config(backbone="digits-cnn", layer="zzz").problems() == [
        f"digits-cnn has no layer 'zzz'. Its top-level layers: {top}."
    ]
    problems = small_config(backbone="torchscript", checkpoint=__file__, layer="fc").problems()
    assert problems == [
        "layer='fc' is not supported for torchscript models (hooks cannot be attached to them); leave layer unset, "
        "or load a state dict of a built-in architecture"
    ]


# ---- pooling: the model's own by default ------------------------------------------------------


def test_pooling_unset_is_the_models_own_and_round_trips_through_json_and_toml(tmp_path):
    """The default is None (null in JSON, absent in TOML, which has no null): each layer takes what the model's head
    reads (load_backbone resolves it); a name or a table round-trips as it was; a table's unnamed layer is None."""
    config = small_config()
    assert config.pooling is None and config.pooling_at(None) is None and config.to_dict()["pooling"] is None
    config.save(tmp_path / "run.json")
    assert json.loads((tmp_path / "run.json").read_text())["pooling"] is None
    assert RunConfig.load(tmp_path / "run.json") == config
    (tmp_path / "run.toml").write_text('backbone = "digits-cnn"\nlayers = ["features.0", "features.3"]\n')
    assert RunConfig.load(tmp_path / "run.toml").pooling is None
    (tmp_path / "table.toml").write_text('layers = ["features.0", "features.3"]\npooling = { "features.3" = "max" }\n')
    table = RunConfig.load(tmp_path / "table.toml")
    assert (table.pooling_at("features.0"), table.pooling_at("features.3")) == (None, "max")
    assert table.pooling_at(None) is None  # the main layer, features.0: not named
    for pooling in (None, "avg", {"features.3": "max"}, {"features.0": "none", "features.3": None}):
        again = RunConfig.from_dict(
            json.loads(json.dumps(small_config(layers=["features.0", "features.3"], pooling=pooling).to_dict()))
        )
        assert again.pooling == pooling and again.problems() == []


def test_a_saved_runs_avg_pooling_loads_and_means_avg(tmp_path):
    """Runs saved before the default changed wrote ``"pooling": "avg"``: they load unchanged and pool with avg, also
    on a transformer's token layer (whose default is now its class token)."""
    saved = small_config(backbone="vit_b_16", weights="random", layer="encoder.layers.encoder_layer_5").to_dict()
    saved["pooling"] = "avg"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    config = RunConfig.load(tmp_path / "config.json")
    assert config.pooling == "avg" and config.pooling_at(None) == "avg" and config.problems() == []


def test_cls_and_mean_are_refused_where_the_layer_holds_no_token_sequence():
    """Checked before any work, from the architecture built on the meta device: a CNN's layer, a ViT's patch
    embedding (before the class token is added); each table entry's problem about ``pooling[<layer>]`` (the form puts it
    under that layer's field). The ViT's encoder blocks take them; the penultimate features (the head's input, already
    pooled) are left as they are by any pooling."""
    cnn = small_config(backbone="resnet18", weights="random", layers=["layer3", "layer4"], pooling={"layer3": "cls"})
    (problem,) = cnn.problems()
    assert problem.field == "pooling[layer3]"
    assert problem.startswith("pooling 'cls' of layer3 reads the class token of a transformer's token sequence; ")
    assert "use 'avg' or 'max', or leave it unset (the model's own: avg)" in problem
    block, patches = "encoder.layers.encoder_layer_5", "conv_proj"
    vit = {"backbone": "vit_b_16", "weights": "random"}
    assert small_config(**vit, layers=[block, "penultimate"], pooling="mean").problems() == []
    assert (
        small_config(**vit, layers=[block, "penultimate"], pooling={block: "mean", "penultimate": "cls"}).problems()
        == []
    )
    (problem,) = small_config(**vit, layer=patches, pooling="cls").problems()
    assert problem.field == "pooling" and f"but {patches} does not give vit_b_16's token sequence" in problem
    assert (
        small_config(**vit, layer=patches).problems() == []
        and small_config(**vit, layer=patches, pooling="max").problems() == []
    )
    assert [p.field for p in small_config(pooling={"features.0": "avg"}).problems()] == ["pooling[features.0]"]


# ---- limits known once the data is loaded ---------------------------------------------------


def test_check_sizes_agrees_with_the_detectors_own_limits():
    problem = make_problem(n_classes=3, dim=12, n_fit=40)
    config = small_config()
    config.detectors = [DetectorChoice("knn", {"k": 41}), DetectorChoice("vim", {"dim": 12}), DetectorChoice("fdbd")]
    assert check_sizes(config, n_fit_rows=40, feature_dim=12, num_classes=3) == [
        "detectors[0] (knn): k=41 is more than the 40 rows of the ID fit set; choose k <= 40 or fit on more data",
        "detectors[1] (vim): dim=12 must be between 1 and D-1 = 11 for the D=12 features of this model "
        "and layer; choose a dim in that range",
    ]
    for name, params in (("knn", {"k": 41}), ("vim", {"dim": 12})):
        with pytest.raises(ValueError):
            create(name, **params).fit(problem.fit_batches(), head=problem.head).score(
                problem.batches(problem.eval_x)[0]
            )
    config.detectors = [DetectorChoice("knn", {"k": 40}), DetectorChoice("vim", {"dim": 11}), DetectorChoice("vim")]
    assert check_sizes(config, n_fit_rows=40, feature_dim=12, num_classes=3) == []
    for name, params in (("knn", {"k": 40}), ("vim", {"dim": 11})):
        scores = (
            create(name, **params)
            .fit(problem.fit_batches(), head=problem.head)
            .score(problem.batches(problem.eval_x)[0])
        )
        assert np.isfinite(np.asarray(scores)).all()
    config.detectors = [DetectorChoice("fdbd"), DetectorChoice("vim")]
    assert check_sizes(config, n_fit_rows=40, feature_dim=1, num_classes=1) == [
        "detectors[0] (fdbd): needs a model with at least 2 classes, this one has 1; leave out fdbd",
        "detectors[1] (vim): dim=0 must be between 1 and D-1 = 0 for the D=1 features of this model "
        "and layer; choose a dim in that range",
    ]


# ---- class names of an image folder against the model's --------------------------------------


def test_class_mismatch_names_the_folders_that_are_not_model_classes():
    assert class_mismatch(["0", "1", "2"], [str(d) for d in range(8)]) is None
    assert class_mismatch(["Cat", "dog"], ["cat", "dog"]) is None  # case does not matter
    assert class_mismatch(["cat", "dog"], None) is None
    assert class_mismatch([], ["cat"]) is None
    text = class_mismatch(["cat", "dog", "zebra"], ["tench", "goldfish", "dog"])
    assert text.startswith("2 of the 3 ID classes are not classes of the model: 'cat', 'zebra'. ")
    assert "Accuracy and the per-class tables" in text and "meaningless" in text and 'class_map = "model"' in text
    text = class_mismatch(["dog", "tench"], ["tench", "goldfish", "dog"])
    assert text.startswith("the ID classes are classes of the model but at other indices")
    imagenet = backbone_classes("resnet18")
    assert "'kitten'" in class_mismatch(["kitten", "goldfish"], imagenet)


@pytest.fixture
def animal_folder(tmp_path):
    """Class folders Dog (2 images), cat (1), goldfish (1): labels 0, 1, 2 by sorted name."""
    rng = np.random.default_rng(0)
    for folder, count in (("Dog", 2), ("cat", 1), ("goldfish", 1)):
        (tmp_path / "images" / folder).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).save(
                tmp_path / "images" / folder / f"{i}.png"
            )
    return tmp_path / "images"


def test_class_map_model_labels_each_folder_with_its_model_class_index(animal_folder):
    model_classes = ["goldfish", "cat", "tench", "dog"]
    plain = load_dataset("folder", path=str(animal_folder))
    assert plain.classes == ["Dog", "cat", "goldfish"] and plain.labels.tolist() == [0, 0, 1, 2]
    mapped = load_dataset("folder", path=str(animal_folder), class_map="model", model_classes=model_classes)
    assert mapped.classes == model_classes
    expected = [model_classes.index(mapped.item_name(i).split("/")[-2].lower()) for i in range(len(mapped))]
    assert expected == [3, 3, 1, 0]
    assert mapped.labels.tolist() == expected
    assert [mapped[i][1] for i in range(len(mapped))] == expected
    assert [mapped[i][0].tobytes() for i in range(4)] == [plain[i][0].tobytes() for i in range(4)]
    assert class_mismatch(mapped.classes, model_classes) is None


def test_class_map_model_refuses_folders_that_are_not_model_classes(animal_folder):
    with pytest.raises(ValueError, match=r"folder\(s\) 'Dog' are not classes of the model"):
        load_dataset("folder", path=str(animal_folder), class_map="model", model_classes=["cat", "goldfish"])
    with pytest.raises(ValueError, match='class_map="model" needs a model with class names'):
        load_dataset("folder", path=str(animal_folder), class_map="model")
    with pytest.raises(ValueError, match='class_map must be "model" or unset'):
        load_dataset("folder", path=str(animal_folder), class_map="models")


def test_a_config_asks_for_class_map_model_only_with_a_model_that_has_class_names(animal_folder):
    folder = DatasetChoice("folder", {"path": str(animal_folder), "class_map": "model"})
    assert small_config(backbone="resnet18", weights="random", id_fit=folder, id_test=folder).problems() == []
    problems = small_config(backbone="resnet18", checkpoint=__file__, id_fit=folder, id_test=folder).problems()
    assert problems == [
        'id_fit: class_map="model" needs a model with class names; resnet18 with a checkpoint has none, so leave '
        "class_map unset",
        'id_test: class_map="model" needs a model with class names; resnet18 with a checkpoint has none, so leave '
        "class_map unset",
    ]


def test_the_openood_protocol_gives_each_detector_openoods_parameters_under_its_own():
    from oodviz import detectors

    config = RunConfig(
        protocol="openood", detectors=[DetectorChoice("ash"), DetectorChoice("msp"), DetectorChoice("react")]
    )
    assert [c.params for c in config.detectors] == [{"variant": "b"}, {}, {}]  # OpenOOD's ASH is ASH-B
    assert detectors.create("ash", **config.detectors[0].params).variant == "b"
    mine = RunConfig(protocol="openood", detectors=[DetectorChoice("ash", {"variant": "p", "percentile": 80.0})])
    assert mine.detectors[0].params == {"variant": "p", "percentile": 80.0}  # what the config says wins
    # recorded in the config, and loading it again changes nothing
    again = RunConfig.from_dict(mine.to_dict())
    assert again == mine and again.protocol == "openood"
    paper = RunConfig(detectors=[DetectorChoice("ash")])
    assert paper.protocol == "paper" and paper.detectors[0].params == {}
    assert RunConfig(protocol="OpenOOD").problems() == ["protocol must be one of paper, openood, got 'OpenOOD'"]
