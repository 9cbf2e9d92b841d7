"""The backbone registry (oodviz.models): bundled digits-cnn, torchvision archs, user models, memory."""

import importlib.util
import json
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from oodviz.models import (
    Backbone,
    DigitsTransform,
    available_backbones,
    backbone_info,
    digits_arrays,
    estimate_memory,
    feature_shape,
    load_backbone,
    pool_features,
    warn_if_over,
    wrap_model,
)
from oodviz.models.digits import DIGITS_METADATA, DIGITS_WEIGHTS, DigitsCNN, as_served, normalize_digits
from oodviz.models.hub_names import TIMM_LISTED

TORCHVISION = ["resnet18", "resnet50", "vit_b_16", "swin_t", "convnext_tiny", "efficientnet_b0", "mobilenet_v3_large"]
EXPECTED_D = {
    "resnet18": 512,
    "resnet50": 2048,
    "vit_b_16": 768,
    "swin_t": 768,
    "convnext_tiny": 768,
    "efficientnet_b0": 1280,
    "mobilenet_v3_large": 1280,
}


@pytest.fixture(scope="module")
def digits():
    return load_backbone("digits-cnn")


@pytest.fixture(scope="module")
def random_backbone():
    """``random_backbone(name)``: one random-weights backbone per architecture for the whole module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_backbone(name, weights="random")
        return cache[name]

    return get


@pytest.fixture(scope="module")
def resnet18(random_backbone):
    return random_backbone("resnet18")


def _close(a, b, tol=1e-4):
    return torch.allclose(a, b, rtol=tol, atol=tol * (1 + float(b.abs().max())))


def _digit_image(values: np.ndarray) -> Image.Image:
    """A digits array (0..16) as the greyscale image the data layer would make (ink bright)."""
    return Image.fromarray(np.uint8(np.round(values * 255 / 16)))


def test_registry_names():
    listed_timm = list(TIMM_LISTED) if importlib.util.find_spec("timm") else []
    openood = ["openood-resnet18-32x32", "openood-resnet18-224x224"]
    assert available_backbones() == ["digits-cnn", "fashion-cnn", *TORCHVISION, *openood, *listed_timm]
    for name in TORCHVISION:
        info = backbone_info(name)
        assert info["feature_dim"] == EXPECTED_D[name] and info["num_classes"] == 1000
        assert info["input_shape"] == (3, 224, 224) and info["weights_file"].endswith(".pth")
    assert backbone_info("digits-cnn")["weights_available"] is True
    with pytest.raises(ValueError, match="did you mean 'resnet18'"):
        load_backbone("resnet-18")


# ----------------------------------------------------------------------------- digits-cnn


def test_digits_splits_are_the_documented_ones():
    train, test, ood = digits_arrays("train"), digits_arrays("test"), digits_arrays("ood")
    assert (len(train.labels), len(test.labels), len(ood.labels)) == (1081, 362, 354)
    assert set(train.labels) == set(range(8)) and set(ood.labels) == {8, 9}
    assert not set(train.index) & set(test.index)
    assert train.images.shape[1:] == (8, 8) and train.images.max() == 16 and train.images.min() == 0
    # stratified: each class keeps ~25% of its samples in test
    counts = np.bincount(test.labels) / (np.bincount(test.labels) + np.bincount(train.labels))
    assert np.all(np.abs(counts - 0.25) < 0.01)


def test_digits_split_matches_the_data_layer():
    data = pytest.importorskip("oodviz.data")
    for ours, theirs in (("train", "train"), ("test", "test"), ("ood", "heldout")):
        mine = digits_arrays(ours)
        images, labels, index = data.digits_split(theirs)
        assert np.array_equal(mine.index, index) and np.array_equal(mine.labels, labels)
        assert np.array_equal(np.round(mine.images * 255 / 16).astype(np.uint8), images)  # the pixels served


def test_digits_cnn_reaches_recorded_accuracy_offline(digits):
    meta = json.loads(DIGITS_METADATA.read_text())
    assert meta["classes"] == [str(i) for i in range(8)] and meta["n_test"] == 362
    assert meta["test_accuracy"] >= 0.97
    assert DIGITS_WEIGHTS.stat().st_size < 200_000
    assert digits.weights_id == f"sha256:{meta['sha256']}"
    assert digits.classes == meta["classes"] and digits.num_classes == 8 and digits.feature_dim == 64

    # the app's path: uint8 greyscale PIL images -> transform -> model
    test = digits_arrays("test")
    x = torch.stack([digits.transform(_digit_image(im)) for im in test.images])
    assert x.shape == (362, 1, 8, 8)
    features, logits = digits.features_and_logits(x)
    correct = int((logits.argmax(1).numpy() == test.labels).sum())
    assert abs(correct - meta["test_correct"]) <= 1  # same weights, same pixels; allow float noise of one sample
    assert features.shape == (362, 64) and logits.shape == (362, 8)
    assert features.dtype == torch.float32 and (features >= 0).all()  # after ReLU + average pooling
    # the arrays path used by the training script gives the same inputs
    assert torch.allclose(x, normalize_digits(as_served(test.images)), atol=1e-6)


def test_digits_head_reproduces_logits(digits):
    x = normalize_digits(digits_arrays("ood").images[:50])
    features, logits = digits.features_and_logits(x)
    weight, bias = digits.head
    assert weight.shape == (8, 64) and bias.shape == (8,)
    assert _close(features @ weight.T + bias, logits, 1e-5)
    assert not logits.requires_grad  # extraction runs without autograd by default
    x = x[:2].clone().requires_grad_(True)
    _, logits = digits.features_and_logits(x, grad=True)  # ODIN-style input gradients
    logits.max(1).values.sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0


def test_digits_transform_takes_any_image():
    transform = DigitsTransform()
    test = digits_arrays("test")
    big = _digit_image(test.images[0]).resize((64, 48)).convert("RGBA")
    out = transform(big)
    assert out.shape == (1, 8, 8) and out.dtype == torch.float32 and torch.isfinite(out).all()
    exact = transform(_digit_image(test.images[0]))
    assert torch.allclose(exact, normalize_digits(test.images[0]), atol=0.01)
    blank = transform(Image.new("L", (8, 8)))
    assert torch.allclose(blank, normalize_digits(np.zeros((8, 8))))
    pickle.loads(pickle.dumps(transform))  # usable in DataLoader worker processes


# ----------------------------------------------------------------------------- torchvision


@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_random_head_reproduces_logits(name, random_backbone):
    rng_before = torch.random.get_rng_state()
    bb = random_backbone(name)
    assert torch.equal(rng_before, torch.random.get_rng_state())  # seeded init leaves the global RNG alone
    assert bb.weights_id.startswith("random:") and not bb.model.training
    x = bb.transform(Image.new("L", (50, 40), color=90)).unsqueeze(0)  # greyscale, odd size
    assert x.shape == (1, 3, 224, 224)
    assert torch.equal(
        pickle.loads(pickle.dumps(bb.transform))(Image.new("RGBA", (30, 30))), bb.transform(Image.new("RGB", (30, 30)))
    )
    x = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    if name != "vit_b_16":  # ViT needs 224 x 224; the others take a 64 x 64 input, much faster on a CPU
        x = torch.nn.functional.interpolate(x, size=(64, 64), mode="bilinear", antialias=True)
    features, logits = bb.features_and_logits(x)
    assert features.shape == (1, EXPECTED_D[name]) == (1, bb.feature_dim)
    assert logits.shape == (1, 1000) and bb.num_classes == 1000 and len(bb.classes) == 1000
    assert float(logits.std()) > 1e-3 and float(features.std()) > 1e-3  # random dry runs are not degenerate
    weight, bias = bb.head
    assert weight.shape == (1000, EXPECTED_D[name])
    assert _close(features @ weight.T + bias, logits)


@pytest.mark.kernels
def test_layer_hook_pooling_and_memory(resnet18):
    small = (3, 64, 64)  # probes (shape discovery) at 64 x 64 keep the test fast
    layer3 = load_backbone("resnet18", weights="random", layer="layer3", input_shape=small)
    assert layer3.model is not resnet18.model and layer3.weights_id == resnet18.weights_id
    assert layer3.feature_dim == 256 and layer3.head is None and layer3.source == "layer"
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    feats, logits = layer3.features_and_logits(x)
    _, reference_logits = resnet18.features_and_logits(x)
    assert feats.shape == (2, 256) and torch.equal(logits, reference_logits)
    assert list(resnet18.model._forward_hooks) == [] and list(resnet18.model.fc._forward_pre_hooks) == []

    maps = resnet18.model.layer3(
        resnet18.model.layer2(
            resnet18.model.layer1(
                resnet18.model.maxpool(resnet18.model.relu(resnet18.model.bn1(resnet18.model.conv1(x))))
            )
        )
    )
    assert _close(feats, maps.detach().mean(dim=(2, 3)))
    maxed = resnet18.with_layer("layer3", pooling="max")  # same model object, other feature layer
    assert maxed.model is resnet18.model and maxed.head is None and resnet18.head is not None
    assert _close(maxed.features_and_logits(x)[0], maps.detach().amax(dim=(2, 3)))

    # the model's own avgpool output is the penultimate feature vector
    avgpool = resnet18.with_layer("avgpool")
    assert _close(avgpool.features_and_logits(x)[0], resnet18.features_and_logits(x)[0])

    flat = resnet18.with_layer("layer3", pooling="none")
    shape = feature_shape(flat)
    assert shape.raw == (256, 14, 14) and shape.layout == "nchw" and shape.pooled_dim == 256
    assert flat.feature_dim == 256 * 14 * 14 == 50_176
    assert flat.estimate_feature_bytes(10) == 10 * 50_176 * 4
    estimate = estimate_memory(flat, {"train": 50_000, "test": 10_000})
    assert estimate["feature_dim"] == 50_176 and estimate["raw_feature_shape"] == (256, 14, 14)
    assert estimate["splits"]["train"]["features_bytes"] == 50_000 * 50_176 * 4
    assert estimate["splits"]["test"]["logits_bytes"] == 10_000 * 1000 * 4
    assert estimate["total_bytes"] == 60_000 * (50_176 * 4 + 1000 * 4 + 24)
    warning = estimate.warn_if_over(4 * 2**30)
    assert warning is not None and "50,000 x 50,176 features = 9.35 GiB" in warning
    # a feature map's own pooling is its average; the token poolings do not apply to it
    assert "leaving pooling unset, the model's own: 'avg', gives D=256 instead of 50,176 (256 x 14 x 14" in warning
    assert "so does 'max')" in warning and "'cls'" not in warning and "subsample" in warning
    assert warn_if_over(estimate, 20 * 2**30) is None
    pooled = estimate_memory(layer3, {"train": 50_000})
    assert pooled["features_bytes"] == 50_000 * 256 * 4 and pooled.warn_if_over(10**9) is None
    assert estimate_memory(layer3, {"train": 50_000}, feature_dtype="float16")["features_bytes"] == 50_000 * 256 * 2
    assert "pool the features" not in (pooled.warn_if_over(1000) or "")

    with pytest.raises(ValueError, match="did you mean 'layer3'"):
        resnet18.with_layer("layer_3")
    with pytest.raises(ValueError, match="pooling must be one of"):
        load_backbone("resnet18", weights="random", layer="layer3", pooling="median")
    with pytest.raises(ValueError, match="reads a transformer's token sequence .* use pooling='avg' or 'max'"):
        resnet18.with_layer("layer3", pooling="mean")
    assert resnet18.with_layer(None).head is not None


def test_channels_last_and_token_layers(random_backbone):
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    # Swin's stages are [B, H, W, C]: pooling is over H, W, and `norm` pooled is the penultimate vector
    penultimate = random_backbone("swin_t")
    swin = penultimate.with_layer("norm")
    assert swin.feature_shape().layout == "nhwc" and swin.feature_dim == 768
    assert swin.feature_shape().raw == (7, 7, 768)
    assert _close(swin.features_and_logits(x)[0], penultimate.features_and_logits(x)[0])
    # inside a ConvNeXt block the activations are channels-last too
    convnext = random_backbone("convnext_tiny").with_layer("features.1.0.block.3")
    assert convnext.feature_shape(x).raw == (16, 16, 384) and convnext.feature_dim == 384
    # ViT tokens [B, T, D] are averaged over T; unpooled they are the origin bug's T * D features
    tokens = torch.randn(2, 197, 768)
    assert pool_features(tokens, "avg").shape == (2, 768)
    assert torch.equal(pool_features(tokens, "max"), tokens.amax(1))
    assert pool_features(tokens, "none").shape == (2, 197 * 768)


def test_vit_b_16_token_layers_default_to_the_class_token_its_head_reads(random_backbone):
    penultimate = random_backbone("vit_b_16")
    assert penultimate.tokens.prefix == 1 and "encoder.layers.encoder_layer_0" in penultimate.tokens.layers
    assert "conv_proj" not in penultimate.tokens.layers  # the patch embedding: before the class token
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    encoder = penultimate.with_layer("encoder")
    assert encoder.pooling == "cls" and _close(encoder.features_and_logits(x)[0], penultimate.features_and_logits(x)[0])
    assert penultimate.with_layer("conv_proj").pooling == "avg"


def test_vit_unpooled_tokens_show_in_the_estimate(random_backbone):
    vit = random_backbone("vit_b_16").with_layer("encoder", pooling="none")
    shape = vit.feature_shape()
    assert shape.raw == (197, 768) and shape.layout == "tokens" and vit.feature_dim == 197 * 768
    warning = estimate_memory(vit, {"imagenet-val": 50_000}).warn_if_over(8 * 2**30)
    assert "50,000 x 151,296 features" in warning
    assert "leaving pooling unset, the model's own: 'cls' (the class token), gives D=768 instead of 151,296" in warning
    assert "so do 'avg', 'max' and 'mean' (of the patch tokens)" in warning


# ----------------------------------------------------------------------------- weights and checkpoints


def test_default_weights_without_cache_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(FileNotFoundError) as info:
        load_backbone("resnet18")  # default weights, allow_download=False: no network attempt
    message = str(info.value)
    assert "resnet18-f37072fd.pth" in message and str(tmp_path / "torch" / "hub" / "checkpoints") in message
    assert "weights='random'" in message
    assert backbone_info("resnet18")["weights_available"] is False


@pytest.mark.kernels
def test_default_weights_load_from_weights_dir(tmp_path, resnet18):
    torch.save(resnet18.model.state_dict(), tmp_path / "resnet18-f37072fd.pth")
    bb = load_backbone("resnet18", weights="default", weights_dir=tmp_path)
    assert bb.classes[0] == "tench" and bb.weights_id.startswith("sha256:")
    x = torch.randn(1, 3, 64, 64)
    assert torch.equal(bb.features_and_logits(x)[1], resnet18.features_and_logits(x)[1])
    with pytest.raises(ValueError, match="IMAGENET1K_V1"):
        load_backbone("resnet18", weights="IMAGENET1K_V9", weights_dir=tmp_path)


def test_checkpoint_round_trip_with_other_class_count(tmp_path):
    import torchvision

    torch.manual_seed(3)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    raw, wrapped = tmp_path / "raw.pt", tmp_path / "wrapped.pt"
    torch.save(model.state_dict(), raw)
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 3}, wrapped)
    for path in (raw, wrapped):
        bb = load_backbone("resnet18", checkpoint=path, classes=[f"c{i}" for i in range(10)])
        features, logits = bb.features_and_logits(x)
        assert bb.num_classes == 10 and bb.classes[9] == "c9" and torch.allclose(logits, expected, atol=1e-5)
        weight, bias = bb.head
        assert weight.shape == (10, 512) and _close(features @ weight.T + bias, logits)
        assert bb.weights_id.startswith("sha256:")
    assert (
        load_backbone("resnet18", checkpoint=raw).weights_id != load_backbone("resnet18", checkpoint=wrapped).weights_id
    )


def test_files_that_are_not_models_are_rejected(tmp_path, digits):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="could not be read as a state dict.*Expected a state dict of the resnet18"):
        load_backbone("resnet18", checkpoint=garbage)
    with pytest.raises(ValueError, match="is not a TorchScript file"):
        load_backbone("torchscript", checkpoint=garbage)

    other = tmp_path / "other.pt"
    torch.save({"epoch": 3, "lr": 0.1}, other)
    with pytest.raises(ValueError, match="holds a dict with keys 'epoch', 'lr'"):
        load_backbone("resnet18", checkpoint=other)
    listing = tmp_path / "list.pt"
    torch.save([1, 2, 3], listing)
    with pytest.raises(ValueError, match="holds a list"):
        load_backbone("resnet18", checkpoint=listing)

    # a valid state dict of another architecture: the mismatching keys are named
    digits_state = tmp_path / "digits.pt"
    torch.save(digits.model.state_dict(), digits_state)
    with pytest.raises(ValueError) as info:
        load_backbone("resnet18", checkpoint=digits_state)
    message = str(info.value)
    assert "not a state dict of the resnet18 architecture" in message
    assert "missing keys (e.g. conv1.weight" in message and "unexpected keys (e.g. features.0.weight" in message
    with pytest.raises(ValueError, match="looks like a state dict"):
        load_backbone("torchscript", checkpoint=digits_state)
    with pytest.raises(FileNotFoundError):
        load_backbone("resnet18", checkpoint=tmp_path / "missing.pt")


class _FeaturesAndLogits(nn.Module):
    """A user model whose forward returns (features, logits)."""

    def __init__(self, model: DigitsCNN):
        super().__init__()
        self.model = model

    def forward(self, x):
        features = self.model.flatten(self.model.avgpool(self.model.features(x)))
        return features, self.model.fc(features)


def test_torchscript_round_trip(tmp_path, digits):
    x = normalize_digits(digits_arrays("test").images[:20])
    expected_features, expected_logits = digits.features_and_logits(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.script(_FeaturesAndLogits(digits.model)).save(str(tmp_path / "pair.pt"))
        torch.jit.script(digits.model).save(str(tmp_path / "logits.pt"))

    pair = load_backbone("torchscript", checkpoint=tmp_path / "pair.pt", transform=DigitsTransform())
    assert pair.input_shape == (1, 8, 8) and pair.feature_dim == 64 and pair.num_classes == 8
    features, logits = pair.features_and_logits(x)
    assert torch.allclose(features, expected_features, atol=1e-6) and torch.allclose(logits, expected_logits, atol=1e-6)
    weight, bias = pair.head  # found and verified: the scripted fc maps features to logits
    assert torch.equal(weight, digits.head[0]) and torch.equal(bias, digits.head[1])

    only_logits = load_backbone("torchscript", checkpoint=tmp_path / "logits.pt", transform=DigitsTransform())
    features, logits = only_logits.features_and_logits(x)
    assert torch.allclose(logits, expected_logits, atol=1e-6) and torch.equal(features, logits)
    assert only_logits.head is None and only_logits.feature_dim == 8
    with pytest.raises(ValueError, match="is a TorchScript file"):
        load_backbone("digits-cnn", checkpoint=tmp_path / "pair.pt")
    with pytest.raises(ValueError, match="not supported for torchscript"):
        load_backbone("torchscript", checkpoint=tmp_path / "pair.pt", layer="model.fc")


def test_wrap_model_in_memory(digits):
    model = DigitsCNN().eval()
    bb = wrap_model(model, DigitsTransform(), head="fc", classes=list("abcdefgh"))
    assert isinstance(bb, Backbone) and bb.input_shape == (1, 8, 8) and bb.feature_dim == 64
    assert (
        bb.weights_id.startswith("sha256:")
        and bb.weights_id == wrap_model(model, DigitsTransform(), head="fc").weights_id
    )
    assert bb.weights_id != wrap_model(digits.model, DigitsTransform(), head="fc").weights_id
    x = torch.randn(4, 1, 8, 8)
    features, logits = bb.features_and_logits(x)
    assert _close(features @ bb.head[0].T + bb.head[1], logits, 1e-5)
    plain = wrap_model(lambda t: model(t), DigitsTransform())  # any callable
    assert plain.weights_id.startswith("uncached:") and torch.allclose(plain.features_and_logits(x)[1], logits)


def test_probes_leave_the_model_alone():
    model = DigitsCNN()
    model.features.append(nn.BatchNorm2d(64))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bb = wrap_model(model, DigitsTransform(), layer="features.6")
    assert bb.feature_dim == 64 and bb.feature_shape().raw == (64, 4, 4)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no BatchNorm update
    assert list(model.features[6]._forward_hooks) == []
    penultimate = wrap_model(model, DigitsTransform(), head="fc")
    assert (
        penultimate.feature_shape().raw == (64,) and estimate_memory(penultimate, {"a": 10})["features_bytes"] == 2560
    )
    assert pickle.loads(pickle.dumps(penultimate)).feature_dim == 64


def test_the_training_loop_is_deterministic_and_learns():
    """The loop behind the bundled weights: the same generator gives the same weights bit for bit,
    and it fits a separable problem; the augmentation sees every mini-batch."""
    from oodviz.models.training import train_classifier

    data = torch.Generator().manual_seed(1)
    y = torch.arange(200) % 2
    x = torch.randn(200, 4, generator=data) + 3 * y[:, None].float()
    seen = []

    def train():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        losses = []
        augment = lambda batch, g: seen.append(len(batch)) or batch  # noqa: E731
        train_classifier(
            model,
            x,
            y,
            epochs=5,
            batch_size=32,
            lr=0.1,
            weight_decay=0.0,
            augment=augment,
            generator=torch.Generator().manual_seed(0),
            on_epoch=lambda epoch, loss: losses.append(loss),
        )
        return model, losses

    (a, losses), (b, _) = train(), train()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert len(losses) == 5 and losses[-1] < losses[0] / 2
    assert float((a(x).argmax(1) == y).float().mean()) > 0.97
    assert sum(seen) == 2 * 5 * 200 and max(seen) == 32


# ---- device names ---------------------------------------------------------------------------

SPELLING = "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"


@pytest.mark.parametrize(
    "text", ["gpu", "CUDA", "Cpu", " cpu", "cuda:", "cuda:01", "cuda:-1", "cuda: 1", "mps", "", None, 0]
)
def test_device_names_outside_the_four_forms_are_refused_with_the_forms(text):
    from oodviz.config.run import RunConfig
    from oodviz.models import device_problem, parse_device

    with pytest.raises(ValueError, match=SPELLING) as refused:
        parse_device(text)
    assert str(refused.value).endswith(f"got {text!r}; 'auto' takes the GPU when there is one")
    assert device_problem(text) == str(refused.value)
    # The run config refuses the same names with the same message, before any work.
    assert str(refused.value) in RunConfig(device=text).problems()


def test_device_names_in_the_four_forms_pass_the_spelling_check_without_looking_at_the_hardware():
    from oodviz.config.run import RunConfig
    from oodviz.models import device_problem

    for text in ["auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:12", torch.device("cpu"), torch.device("cuda", 3)]:
        assert device_problem(text) is None
    assert (
        device_problem(torch.device("meta")) == "device 'meta' is not supported; use 'auto', 'cpu', 'cuda' or 'cuda:N'"
    )
    # A run config also looks at the hardware (issue 12): cuda:7 is refused unless 8 GPUs are visible.
    device_problems = [p for p in RunConfig(device="cuda:7").problems() if "device" in p]
    if not torch.cuda.is_available():
        assert device_problems == [
            "device='cuda:7' but CUDA is not available here (no GPU is visible to PyTorch); use device='cpu' or 'auto'"
        ]
    else:
        assert device_problems == [] if torch.cuda.device_count() > 7 else "visible here" in device_problems[0]


def test_cpu_and_auto_resolve_to_the_cpu_without_a_gpu():
    from oodviz.models import parse_device

    assert parse_device("cpu") == torch.device("cpu") and parse_device("cpu").index is None
    assert parse_device(torch.device("cpu", 0)) == torch.device("cpu")
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert parse_device("auto") == parse_device() == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_names_without_cuda_say_to_use_cpu_or_auto():
    from oodviz.models import parse_device
    from oodviz.pipeline.job import resolve_device

    for text in ["cuda", "cuda:0", "cuda:3", torch.device("cuda")]:
        with pytest.raises(ValueError, match=r"but CUDA is not available here .*; use device='cpu' or 'auto'"):
            parse_device(text)
    with pytest.raises(ValueError, match=r"device='cuda:1' but CUDA is not available here"):
        resolve_device("cuda:1")  # the run resolves its device with the same parser


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_names_get_an_index_and_an_absent_gpu_is_named():
    from oodviz.models import parse_device

    current = torch.cuda.current_device()
    assert parse_device("cuda") == parse_device(torch.device("cuda")) == torch.device("cuda", current)
    assert parse_device("cuda:0") == torch.device("cuda", 0)
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"device='cuda:{count}' but only {count} GPU.* visible here .*or 'auto'"):
        parse_device(f"cuda:{count}")


def test_imagenet_transform_is_resize_crop_scale_normalise_for_any_image_mode():
    """The preprocessing of a user's checkpoint equals torchvision's public pipeline written out (resize the
    short side with antialiasing, centre crop, scale to 0..1, ImageNet mean/std), greyscale images as RGB."""
    from torchvision import transforms as T

    from oodviz.models import imagenet_transform

    reference = T.Compose(
        [
            T.Resize(180, interpolation=T.InterpolationMode.BILINEAR, antialias=True),
            T.CenterCrop(160),
            T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    pixels = (np.random.default_rng(0).random((200, 240)) * 255).astype(np.uint8)
    grey = Image.fromarray(pixels, mode="L")
    out = imagenet_transform(crop_size=160, resize_size=180)(grey)
    assert out.shape == (3, 160, 160)
    torch.testing.assert_close(out, reference(grey.convert("RGB")), rtol=0, atol=1e-6)
    assert imagenet_transform().inner.std == [0.229, 0.224, 0.225]  # what odin's norm_std="auto" reads
