"""timm and Hugging Face backbones (oodviz.models.hub) and token pooling, on small random models made here.

The features oodviz stores must be the ones the model's own head reads: timm's
``forward_head(forward_features(x), pre_logits=True)``, the Hugging Face ViT's class token after its final norm;
the logits the model's own, and the head (W, b) must map the features to them. Nothing is downloaded.
"""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from oodviz.models import (
    architecture_layer_names,
    available_backbones,
    estimate_memory,
    load_backbone,
    pool_features,
    wrap_model,
)
from oodviz.models.architectures import backbone_family
from oodviz.models.hub_names import TIMM_LISTED

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

#: A two-block ViT on 32 x 32 images: 4 patches of 16 x 16, D = 48, 5 classes.
TINY_VIT = {"img_size": 32, "depth": 2, "embed_dim": 48, "num_heads": 2, "num_classes": 5}


def _close(a, b, tol=1e-5):
    return torch.allclose(a, b, rtol=tol, atol=tol * (1 + float(b.abs().max())))


def _inputs(backbone, n=3):
    return torch.randn((n, *backbone.input_shape), generator=torch.Generator().manual_seed(0))


def _check_head_and_logits(backbone, x, features, logits):
    with torch.no_grad():
        own = backbone.model(x)
    own = getattr(own, "logits", own)
    weight, bias = backbone.head
    assert _close(logits, own)
    assert _close(features @ weight.T + bias, logits)


@pytest.fixture(scope="module")
def vit():
    """A class-token timm ViT (global_pool='token': its head reads the class token)."""
    return load_backbone("timm:vit_tiny_patch16_224", weights="random", model_args=TINY_VIT)


def test_timm_vit_features_are_its_own_pre_logits_and_its_head_gives_its_logits(vit):
    x = _inputs(vit)
    features, logits = vit.features_and_logits(x)
    with torch.no_grad():
        pre_logits = vit.model.forward_head(vit.model.forward_features(x), pre_logits=True)
    assert vit.input_shape == (3, 32, 32) and vit.feature_dim == 48 and vit.num_classes == 5
    assert _close(features, pre_logits)
    _check_head_and_logits(vit, x, features, logits)
    # its token layers: the class token first; the last norm's class token is the head's input
    assert vit.tokens.prefix == 1 and vit.tokens.head_pooling == "cls"
    assert "blocks.0" in vit.tokens.layers and "patch_embed" not in vit.tokens.layers
    norm = vit.with_layer("norm")
    assert norm.pooling == "cls" and _close(norm.features_and_logits(x)[0], pre_logits)
    with torch.no_grad():
        block = vit.model.blocks[0](vit.model._pos_embed(vit.model.patch_embed(x)))
    assert _close(vit.with_layer("blocks.0", pooling="mean").features_and_logits(x)[0], block[:, 1:].mean(1))
    assert vit.with_layer("blocks.0", pooling="avg").feature_dim == 48
    assert vit.with_layer("patch_embed.proj").pooling == "avg"  # a feature map: its default stays avg


def test_timm_mean_pooled_vit_leaves_its_class_and_register_tokens_out():
    args = {**TINY_VIT, "reg_tokens": 2, "global_pool": "avg", "fc_norm": False}
    backbone = load_backbone("timm:vit_tiny_patch16_224", weights="random", model_args=args)
    assert backbone.tokens.prefix == 3 and backbone.tokens.head_pooling == "mean"
    x = _inputs(backbone)
    with torch.no_grad():
        tokens = backbone.model.forward_features(x)
        pre_logits = backbone.model.forward_head(tokens, pre_logits=True)
    assert tokens.shape[1] == 3 + 4
    norm = backbone.with_layer("norm")
    assert norm.pooling == "mean" and _close(norm.features_and_logits(x)[0], pre_logits)
    assert _close(pre_logits, tokens[:, 3:].mean(1))
    features, logits = backbone.features_and_logits(x)
    assert _close(features, pre_logits)
    _check_head_and_logits(backbone, x, features, logits)


def test_timm_checkpoint_takes_its_class_count_and_reproduces_the_model(tmp_path):
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**TINY_VIT, "num_classes": 7}).eval()
    path = tmp_path / "vit.pt"
    torch.save({"state_dict": model.state_dict()}, path)
    args = {k: v for k, v in TINY_VIT.items() if k != "num_classes"}
    backbone = load_backbone("timm:vit_tiny_patch16_224", checkpoint=path, model_args=args, layer="blocks.1")
    assert backbone.num_classes == 7 and backbone.pooling == "cls" and backbone.head is None
    assert backbone.weights_id.startswith("sha256:") and backbone.weights_id.endswith(json.dumps(args, sort_keys=True))
    x = _inputs(backbone)
    with torch.no_grad():
        tokens = model.blocks(model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x)))))
        own = model(x)
    features, logits = backbone.features_and_logits(x)
    assert _close(features, tokens[:, 0]) and _close(logits, own)
    estimate = estimate_memory(backbone.with_layer("blocks.1", pooling="none"), {"train": 1000})
    assert estimate["raw_feature_shape"] == (5, 48) and estimate["feature_dim"] == 5 * 48
    warning = estimate.warn_if_over(1000)
    # pooled as the model's own head reads its tokens, or by the others that apply to a token layer
    assert "leaving pooling unset, the model's own: 'cls' (the class token), gives D=48 instead of 240" in warning
    assert "so do 'avg', 'max' and 'mean' (of the patch tokens)" in warning


def test_timm_pretrained_weights_without_a_local_file_are_refused_with_how_to_give_one():
    with pytest.raises(FileNotFoundError, match="does not download") as refused:
        load_backbone("timm:vit_tiny_patch16_224", model_args=TINY_VIT)
    message = str(refused.value)
    assert "checkpoint='vit_tiny_patch16_224.pt'" in message and "pretrained=True" in message
    assert "weights='random'" in message
    with pytest.raises(ValueError, match="did you mean 'timm:vit_tiny_patch16_224'"):
        load_backbone("timm:vit_tiny_patch16_22", weights="random")
    with pytest.raises(ImportError, match=r"oodviz\[timm\]"):
        from oodviz.models.hub import _require

        _require("no_such_package_for_oodviz", "timm")


def test_cls_and_mean_are_refused_where_there_is_no_class_token(vit):
    with pytest.raises(ValueError, match="layer 'patch_embed' gives 4 tokens but not the model's token sequence"):
        vit.with_layer("patch_embed", pooling="cls")
    with pytest.raises(ValueError, match="this layer gives .* a feature map: use pooling='avg' or 'max'"):
        vit.with_layer("patch_embed.proj", pooling="mean")
    tokens = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    assert torch.equal(pool_features(tokens, "cls"), tokens[:, 0])
    assert torch.equal(pool_features(tokens, "mean", prefix_tokens=2), tokens[:, 2:].mean(1))
    with pytest.raises(ValueError, match="leaves no patch tokens"):
        pool_features(tokens, "mean", prefix_tokens=5)


def test_cls_and_mean_need_a_model_whose_token_layout_is_known():
    # a model of one's own whose layer "1" gives a sequence [B, 8, 4]: oodviz cannot tell which is a class token
    model = nn.Sequential(nn.Conv2d(3, 8, 16, 16), nn.Flatten(2), nn.Flatten(1), nn.Linear(32, 3))
    backbone = wrap_model(model, lambda image: torch.zeros(3, 32, 32), head="3", input_shape=(3, 32, 32))
    assert backbone.tokens is None and backbone.with_layer("1").pooling == "avg"
    with pytest.raises(ValueError, match="needs to know where the class and patch tokens are"):
        backbone.with_layer("1", pooling="cls")


def test_timm_cnn_layers_channels_last_inside_convnext_blocks():
    # conv_mlp=False: the MLP of convnext_tiny and larger, linear layers on channels-last maps
    args = {"depths": (1, 1, 1, 1), "dims": (8, 16, 32, 64), "num_classes": 3, "conv_mlp": False}
    convnext = load_backbone("timm:convnext_atto", weights="random", model_args=args, input_shape=(3, 64, 64))
    assert convnext.tokens is None and backbone_family("timm:convnext_atto") == "cnn"
    # ConvNeXt blocks work on [B, H, W, C] between their norm and their MLP, [B, C, H, W] outside
    inside = convnext.with_layer("stages.1.blocks.0.mlp.act")
    assert inside.feature_shape().layout == "nhwc" and inside.feature_dim == 4 * 16
    assert convnext.with_layer("stages.1.blocks.0.mlp.drop2").feature_shape().layout == "nhwc"
    for outside in ("stages.1.blocks.0", "stages.1.blocks.0.drop_path", "stages.1.blocks.0.conv_dw"):
        assert convnext.with_layer(outside).feature_shape().layout == "nchw", outside
    x = _inputs(convnext)
    features, logits = convnext.features_and_logits(x)
    with torch.no_grad():
        pre_logits = convnext.model.forward_head(convnext.model.forward_features(x), pre_logits=True)
    assert _close(features, pre_logits)
    _check_head_and_logits(convnext, x, features, logits)


def test_timm_models_are_listed_and_their_layers_offered():
    assert available_backbones()[-len(TIMM_LISTED) :] == list(TIMM_LISTED)
    assert backbone_family("timm:vit_base_patch16_224") == "transformer"
    assert backbone_family("timm:swin_tiny_patch4_window7_224") == "transformer"
    assert backbone_family("timm:regnety_160") == "cnn"
    names = architecture_layer_names("timm:vit_base_patch16_224")
    assert "blocks.11" in names and "head" in names and "norm" in names


# ----------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A 2-layer ViT (D = 32, 4 patches of 16 x 16 on 32 x 32 images, 3 classes) and its image processor, saved."""
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=16,
        num_labels=3,
        id2label={0: "cat", 1: "dog", 2: "fox"},
        label2id={"cat": 0, "dog": 1, "fox": 2},
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("hf-vit")
    transformers.ViTForImageClassification(config).save_pretrained(directory)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(directory)
    return directory


def test_hf_vit_features_are_its_class_token_and_its_head_gives_its_logits(hf_dir):
    backbone = load_backbone(f"hf:{hf_dir}")
    assert backbone.input_shape == (3, 32, 32) and backbone.classes == ["cat", "dog", "fox"]
    assert backbone.tokens.prefix == 1 and backbone.tokens.head_pooling == "cls"
    x = _inputs(backbone)
    features, logits = backbone.features_and_logits(x)
    with torch.no_grad():
        sequence = backbone.model.vit(x).last_hidden_state  # after the final layer norm
        hidden = backbone.model(x, output_hidden_states=True).hidden_states
    assert _close(features, sequence[:, 0])
    _check_head_and_logits(backbone, x, features, logits)
    last_norm = backbone.with_layer("vit.layernorm")
    assert last_norm.pooling == "cls" and _close(last_norm.features_and_logits(x)[0], sequence[:, 0])
    block = backbone.with_layer("vit.layers.0", pooling="mean")
    assert _close(block.features_and_logits(x)[0], hidden[1][:, 1:].mean(1))
    assert "vit.layers.1" in architecture_layer_names(f"hf:{hf_dir}")
    assert backbone_family(f"hf:{hf_dir}") == "transformer"


def test_hf_preprocessing_is_the_image_processors(hf_dir):
    backbone = load_backbone(f"hf:{hf_dir}")
    processor = transformers.AutoImageProcessor.from_pretrained(hf_dir, local_files_only=True)
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    expected = processor(images=image, return_tensors="pt")["pixel_values"][0]
    assert _close(backbone.transform(image), expected)
    assert backbone.transform(Image.new("L", (50, 70))).shape == (3, 32, 32)


def test_hf_random_weights_and_refusals(hf_dir, tmp_path):
    random = load_backbone(f"hf:{hf_dir}", weights="random")
    assert random.weights_id.startswith("random:hf:") and random.num_classes == 3
    with pytest.raises(FileNotFoundError, match="not a saved Hugging Face model"):
        load_backbone(f"hf:{tmp_path}")
    with pytest.raises(ValueError, match="takes its weights from the directory"):
        load_backbone(f"hf:{hf_dir}", checkpoint=hf_dir / "config.json")
    bare = tmp_path / "bare"
    transformers.ViTForImageClassification.from_pretrained(hf_dir, local_files_only=True).save_pretrained(bare)
    with pytest.raises(FileNotFoundError, match="no preprocessor_config.json"):
        load_backbone(f"hf:{bare}")


def test_hf_swin_has_no_class_token_and_its_head_reads_the_tokens_mean(tmp_path):
    config = transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=4, num_labels=3
    )
    torch.manual_seed(0)
    transformers.SwinForImageClassification(config).save_pretrained(tmp_path)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    backbone = load_backbone(f"hf:{tmp_path}")
    assert backbone.tokens.prefix == 0 and backbone.tokens.head_pooling == "mean" and backbone.classes is None
    x = _inputs(backbone)
    features, logits = backbone.features_and_logits(x)
    with torch.no_grad():
        pooled = backbone.model.swin(x).pooler_output
    assert _close(features, pooled)
    _check_head_and_logits(backbone, x, features, logits)
    last_norm = backbone.with_layer("swin.layernorm")
    assert last_norm.pooling == "mean" and _close(last_norm.features_and_logits(x)[0], pooled)


# ----------------------------------------------------------------------------- through the engine


class _Images:
    """``ds[i] -> (PIL image, label, source_index)``: ``n`` seeded random 40 x 40 images, labels ``i % classes``."""

    def __init__(self, n, name, seed, classes):
        rng = np.random.default_rng(seed)
        self.images = [Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)) for _ in range(n)]
        self.name = name
        self.classes = [str(c) for c in range(classes)]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], i % len(self.classes), i


@pytest.mark.parametrize("source, layer", [("timm", None), ("timm", "blocks.1"), ("hf", None), ("hf", "vit.layers.0")])
def test_features_go_through_the_store_to_mahalanobis_vim_and_energy(vit, hf_dir, source, layer, tmp_path):
    from oodviz.detectors import create
    from oodviz.engine import extract

    loaded = vit if source == "timm" else load_backbone(f"hf:{hf_dir}")
    backbone = loaded if layer is None else loaded.with_layer(layer)
    fit, test = (_Images(n, name, seed, loaded.num_classes) for n, name, seed in ((40, "fit", 0), (12, "test", 1)))
    stores = {ds.name: extract(backbone, ds, tmp_path, {"layer": layer}, batch_size=16) for ds in (fit, test)}
    x = torch.stack([backbone.transform(image) for image in test.images])
    features, logits = backbone.features_and_logits(x)
    assert _close(torch.from_numpy(np.array(stores["test"].features)), features)
    assert _close(torch.from_numpy(np.array(stores["test"].logits)), logits)
    head = stores["fit"].head
    assert (head is None) == (layer is not None)
    for name, params in (("mahalanobis", {}), ("vim", {"dim": 8}), ("energy", {})):
        if name == "vim" and head is None:
            continue  # vim needs the head, which a block's features do not feed
        detector = create(name, **params).fit(stores["fit"].batches(), head=head)
        scores = detector.score(stores["test"].batches())
        assert scores.shape == (12,) and torch.isfinite(scores).all(), name


def _saved_hf_vit(directory, num_labels: int):
    """A 2-layer Hugging Face ViT on 32 x 32 images with ``num_labels`` unnamed classes and its image processor,
    saved in ``directory``."""
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=16,
        num_labels=num_labels,
    )
    torch.manual_seed(0)
    transformers.ViTForImageClassification(config).save_pretrained(directory)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("hub", ["timm", "hf"])
def test_a_small_vit_runs_end_to_end_with_mahalanobis_vim_and_energy(hub, tmp_path):
    """A config naming ``timm:...`` (with ``model_args``) or ``hf:<directory>`` (saved here): checked against the
    model's own layers, run by ``oodviz run`` (hf) and by ``oodviz.run`` from Python (timm); the stores hold the
    class token, the feature the ViT's head reads (``pooling="cls"``), equal to the model's own features, and every
    detector scores every OOD set. The random models do not know the digits' classes: the pre-flight refuses them
    until forced."""
    import oodviz
    from oodviz.cli import main
    from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
    from oodviz.engine import open_store

    if hub == "timm":
        model = {
            "backbone": "timm:vit_tiny_patch16_224",
            "weights": "random",
            "model_args": {**TINY_VIT, "num_classes": 8},
        }
    else:
        model = {"backbone": f"hf:{_saved_hf_vit(tmp_path / 'hf-vit', 8)}"}  # the digits' 8 ID classes
    config = RunConfig(
        **model,
        pooling="cls",
        id_fit=DatasetChoice("digits-train", subsample=120),
        id_test=DatasetChoice("digits-test", subsample=60),
        ood=[DatasetChoice("noise-gaussian", {"n": 40})],
        detectors=[DetectorChoice("mahalanobis"), DetectorChoice("vim", {"dim": 16}), DetectorChoice("energy")],
        device="cpu",
    )
    assert RunConfig(**{**vars(config), "layer": "no.such.block"}).problems()[0].field == "layer"
    out = tmp_path / "runs" / "vit"
    if hub == "timm":
        results = oodviz.run(config, out=out, progress=False)
    else:
        path = tmp_path / "config.json"
        config.save(path)
        assert main(["run", str(path), "--out", str(out), "--force"]) == 0
        results = oodviz.load_results(out)
    assert results.status["state"] == "done"
    scored = set(zip(results.metrics.detector, results.metrics.ood_dataset))
    assert {(name, "noise-gaussian") for name in ("mahalanobis", "vim", "energy")} <= scored
    meta = json.loads((results.path / "meta.json").read_text())
    store = open_store(tmp_path / "runs" / ".features", meta["splits"]["id_test"]["store"])
    backbone = config.load_backbone()
    assert store.feature_dim == backbone.feature_dim == (48 if hub == "timm" else 32)
    images = [backbone.transform(image) for image in _split_images(config.id_test, store.indices[:4])]
    features, _ = backbone.features_and_logits(torch.stack(images))
    assert _close(torch.as_tensor(np.asarray(store.features[:4])).float(), features, tol=1e-4)


def _split_images(choice, indices):
    """The images of a dataset choice at a store's source ``indices`` (rows of the whole dataset)."""
    from oodviz.data import load_dataset

    dataset = load_dataset(choice.name)
    return [dataset[int(i)][0] for i in indices]


def test_a_run_over_two_vit_layers_pools_each_as_its_table_says(tmp_path):
    """``pooling = {"blocks.0": "mean", "penultimate": "cls"}``: the first block's store holds the mean of its patch
    tokens, the penultimate store the class token the head reads, each equal to the model's view pooled so."""
    import oodviz
    from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
    from oodviz.engine import open_store

    pooling = {"blocks.0": "mean", "penultimate": "cls"}
    config = RunConfig(
        backbone="timm:vit_tiny_patch16_224",
        weights="random",
        model_args={**TINY_VIT, "num_classes": 8},
        layers=["blocks.0", "penultimate"],
        pooling=pooling,
        id_fit=DatasetChoice("digits-train", subsample=80),
        id_test=DatasetChoice("digits-test", subsample=40),
        ood=[DatasetChoice("noise-gaussian", {"n": 20})],
        detectors=[DetectorChoice("mahalanobis"), DetectorChoice("energy")],
        device="cpu",
    )
    results = oodviz.run(config, out=tmp_path / "runs" / "two", progress=False)
    assert {"mahalanobis@blocks.0", "mahalanobis@penultimate"} <= set(results.metrics.detector)
    layers = json.loads((results.path / "meta.json").read_text())["layers"]
    backbone = config.load_backbone()
    for layer, how in pooling.items():
        store = open_store(tmp_path / "runs" / ".features", layers["stores"][layer]["id_test"])
        view = backbone.with_layer(None if layer == "penultimate" else layer, pooling=how)
        images = [backbone.transform(image) for image in _split_images(config.id_test, store.indices[:3])]
        features, _ = view.features_and_logits(torch.stack(images))
        assert _close(torch.as_tensor(np.asarray(store.features[:3])).float(), features, tol=1e-4), layer


# ----------------------------------------------------------------------------- a run's default pooling


@pytest.mark.parametrize("hub", ["timm", "hf"])
def test_a_runs_intermediate_block_is_its_class_token_by_default_and_avg_when_asked(hub, hf_dir):
    """A run config that leaves ``pooling`` unset: its intermediate encoder block's features are the block's class
    token (what the ViT's head reads of its last block); a table asks avg of another block, the mean over every token,
    class token included. The views are made as the worker makes them (``backbone_views`` with
    ``RunConfig.pooling_at``), and their stores keyed by the resolved name: unset and "cls" share one, "avg" has its
    own. The meta-device layout the config check and the form read is the loaded model's."""
    from oodviz.config.run import RunConfig
    from oodviz.engine import store_key
    from oodviz.models import architecture_token_layout
    from oodviz.pipeline.layers import backbone_views

    if hub == "timm":
        model = {"backbone": "timm:vit_tiny_patch16_224", "weights": "random", "model_args": TINY_VIT}
        first, second = "blocks.0", "blocks.1"
    else:
        model = {"backbone": f"hf:{hf_dir}"}
        first, second = "vit.layers.0", "vit.layers.1"
    config = RunConfig(**model, layers=[first, second, "penultimate"], pooling={second: "avg"})
    assert config.pooling_at(first) is None and config.problems() == []
    backbone = config.load_backbone()
    assert architecture_token_layout(config.backbone, config.model_args) == backbone.tokens
    views = backbone_views(backbone, config.layers, config.pooling_at)
    assert [views[layer].pooling for layer in config.layers] == ["cls", "avg", "avg"]
    x = _inputs(backbone)
    with torch.no_grad():
        if hub == "timm":
            tokens = backbone.model.patch_drop(backbone.model._pos_embed(backbone.model.patch_embed(x)))
            outputs = [backbone.model.blocks[0](backbone.model.norm_pre(tokens))]
            outputs.append(backbone.model.blocks[1](outputs[0]))
        else:
            outputs = backbone.model(x, output_hidden_states=True).hidden_states[1:3]
    assert _close(views[first].features_and_logits(x)[0], outputs[0][:, 0])  # the class token
    assert _close(views[second].features_and_logits(x)[0], outputs[1].mean(1))  # avg over all tokens
    single = RunConfig(**model, layer=first).load_backbone()  # one layer, pooling unset
    assert single.pooling == "cls" and _close(single.features_and_logits(x)[0], outputs[0][:, 0])
    data = _Images(4, "keys", 0, backbone.num_classes)
    keys = {how: store_key(backbone.with_layer(first, pooling=how), data, {}) for how in (None, "cls", "avg")}
    assert keys[None] == keys["cls"] != keys["avg"]
