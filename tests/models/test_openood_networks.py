"""OpenOOD v1.5's networks and test preprocessing (oodviz.models.openood): its checkpoints' keys and shapes, the
numbers a checkpoint gives through load_backbone against a float64 re-computation, the benchmarks' transforms
against PIL and numpy, and the refusals.

The expected keys are written here from OpenOOD's module definitions (``openood/networks/resnet18_32x32.py``:
``conv1``, ``bn1``, ``layer1..4`` of two ``BasicBlock`` each with a ``shortcut`` projection where the stride or the
width changes, ``fc``; ``resnet18_224x224.py``: torchvision's ``ResNet`` with ``BasicBlock`` x [2, 2, 2, 2], whose
projections are ``downsample``), the preprocessing numbers from its ``evaluation_api/preprocessor.py``.
"""

import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn import functional as F

from oodviz.models import available_backbones, backbone_info, load_backbone, openood_transform
from oodviz.models.openood import OPENOOD_BENCHMARKS, CifarResNet18, build_openood_resnet18_224x224

SMALL, BIG = "openood-resnet18-32x32", "openood-resnet18-224x224"
BN = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")

# (module, kind, shape of the conv/linear weight or BatchNorm width), in OpenOOD's registration order
RESNET18_32X32 = [
    ("conv1", "conv", (64, 3, 3, 3)),
    ("bn1", "bn", 64),
    ("layer1.0.conv1", "conv", (64, 64, 3, 3)),
    ("layer1.0.bn1", "bn", 64),
    ("layer1.0.conv2", "conv", (64, 64, 3, 3)),
    ("layer1.0.bn2", "bn", 64),
    ("layer1.1.conv1", "conv", (64, 64, 3, 3)),
    ("layer1.1.bn1", "bn", 64),
    ("layer1.1.conv2", "conv", (64, 64, 3, 3)),
    ("layer1.1.bn2", "bn", 64),
    ("layer2.0.conv1", "conv", (128, 64, 3, 3)),
    ("layer2.0.bn1", "bn", 128),
    ("layer2.0.conv2", "conv", (128, 128, 3, 3)),
    ("layer2.0.bn2", "bn", 128),
    ("layer2.0.shortcut.0", "conv", (128, 64, 1, 1)),
    ("layer2.0.shortcut.1", "bn", 128),
    ("layer2.1.conv1", "conv", (128, 128, 3, 3)),
    ("layer2.1.bn1", "bn", 128),
    ("layer2.1.conv2", "conv", (128, 128, 3, 3)),
    ("layer2.1.bn2", "bn", 128),
    ("layer3.0.conv1", "conv", (256, 128, 3, 3)),
    ("layer3.0.bn1", "bn", 256),
    ("layer3.0.conv2", "conv", (256, 256, 3, 3)),
    ("layer3.0.bn2", "bn", 256),
    ("layer3.0.shortcut.0", "conv", (256, 128, 1, 1)),
    ("layer3.0.shortcut.1", "bn", 256),
    ("layer3.1.conv1", "conv", (256, 256, 3, 3)),
    ("layer3.1.bn1", "bn", 256),
    ("layer3.1.conv2", "conv", (256, 256, 3, 3)),
    ("layer3.1.bn2", "bn", 256),
    ("layer4.0.conv1", "conv", (512, 256, 3, 3)),
    ("layer4.0.bn1", "bn", 512),
    ("layer4.0.conv2", "conv", (512, 512, 3, 3)),
    ("layer4.0.bn2", "bn", 512),
    ("layer4.0.shortcut.0", "conv", (512, 256, 1, 1)),
    ("layer4.0.shortcut.1", "bn", 512),
    ("layer4.1.conv1", "conv", (512, 512, 3, 3)),
    ("layer4.1.bn1", "bn", 512),
    ("layer4.1.conv2", "conv", (512, 512, 3, 3)),
    ("layer4.1.bn2", "bn", 512),
    ("fc", "linear", 512),
]
# torchvision's ResNet: a 7 x 7 stem, the same blocks, projections named downsample
RESNET18_224X224 = [
    ("conv1", "conv", (64, 3, 7, 7)),
    *[
        (name.replace("shortcut", "downsample"), kind, shape)
        for name, kind, shape in RESNET18_32X32
        if name not in ("conv1", "fc")
    ],
    ("fc", "linear", 512),
]
# OpenOOD's default_preprocessing_dict: pre_size, img_size, mean, std
PREPROCESSING = {
    "cifar10": (32, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": (32, 32, (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)),
    "imagenet200": (256, 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "imagenet": (256, 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def expected_keys(modules, num_classes: int) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every state-dict entry of ``modules``, as PyTorch names a Conv2d without bias, a BatchNorm2d
    and a Linear's parameters and buffers."""
    keys = []
    for name, kind, shape in modules:
        if kind == "conv":
            keys.append((f"{name}.weight", shape))
        elif kind == "bn":
            keys += [(f"{name}.{k}", () if k == "num_batches_tracked" else (shape,)) for k in BN]
        else:
            keys += [(f"{name}.weight", (num_classes, shape)), (f"{name}.bias", (num_classes,))]
    return keys


def random_checkpoint(modules, num_classes: int, seed: int) -> dict[str, torch.Tensor]:
    """A state dict with OpenOOD's key names, filled with random numbers of a trained network's scale (conv weights
    He-scaled, BatchNorm statistics away from 0 and 1), built from the module list alone."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, kind, shape in modules:
        if kind == "conv":
            state[f"{name}.weight"] = torch.randn(shape, generator=g) * (2 / (shape[1] * shape[2] * shape[3])) ** 0.5
        elif kind == "bn":
            state[f"{name}.weight"] = 0.5 + torch.rand(shape, generator=g)
            state[f"{name}.bias"] = 0.1 * torch.randn(shape, generator=g)
            state[f"{name}.running_mean"] = 0.1 * torch.randn(shape, generator=g)
            state[f"{name}.running_var"] = 0.5 + torch.rand(shape, generator=g)
            state[f"{name}.num_batches_tracked"] = torch.tensor(7)
        else:
            state[f"{name}.weight"] = torch.randn(num_classes, shape, generator=g) / shape**0.5
            state[f"{name}.bias"] = 0.1 * torch.randn(num_classes, generator=g)
    return state


def reference_forward(state, x, big: bool) -> dict[str, torch.Tensor]:
    """OpenOOD's forward pass written out with torch.nn.functional over the state dict, in float64: the features
    (``[B, 512]``, the pooled ``layer4``), logits and each layer's pooled output."""
    s = {k: v.double() for k, v in state.items()}
    x = x.double()

    def bn(t, name):
        w, b, mean, var = (s[f"{name}.{k}"] for k in BN[:4])
        return F.batch_norm(t, mean, var, w, b, training=False, eps=1e-5)

    out = F.relu(bn(F.conv2d(x, s["conv1.weight"], stride=2 if big else 1, padding=3 if big else 1), "bn1"))
    if big:
        out = F.max_pool2d(out, kernel_size=3, stride=2, padding=1)
    pooled = {}
    projection = "downsample" if big else "shortcut"
    for layer in range(1, 5):
        for block in range(2):
            p = f"layer{layer}.{block}"
            stride = 2 if layer > 1 and block == 0 else 1
            inner = F.relu(bn(F.conv2d(out, s[f"{p}.conv1.weight"], stride=stride, padding=1), f"{p}.bn1"))
            inner = bn(F.conv2d(inner, s[f"{p}.conv2.weight"], padding=1), f"{p}.bn2")
            if f"{p}.{projection}.0.weight" in s:
                skip = bn(F.conv2d(out, s[f"{p}.{projection}.0.weight"], stride=stride), f"{p}.{projection}.1")
            else:
                skip = out
            out = F.relu(inner + skip)
        pooled[f"layer{layer}"] = out.mean(dim=(2, 3))
    features = pooled["layer4"]
    return {"features": features, "logits": features @ s["fc.weight"].T + s["fc.bias"], **pooled}


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4) -> bool:
    return torch.allclose(a.double(), b, rtol=rtol, atol=rtol * float(b.abs().max()))


@pytest.mark.parametrize(
    ("build", "modules", "classes"),
    [
        (CifarResNet18, RESNET18_32X32, 10),
        (CifarResNet18, RESNET18_32X32, 100),
        (build_openood_resnet18_224x224, RESNET18_224X224, 200),
    ],
    ids=["32x32-cifar10", "32x32-cifar100", "224x224-imagenet200"],
)
def test_state_dict_keys_and_shapes_are_openoods(build, modules, classes):
    with torch.device("meta"):
        state = build(classes).state_dict()
    assert [(k, tuple(v.shape)) for k, v in state.items()] == expected_keys(modules, classes)


@pytest.mark.parametrize(
    ("name", "modules", "classes", "size"),
    [(SMALL, RESNET18_32X32, 10, 32), (BIG, RESNET18_224X224, 200, 64)],
    ids=["32x32", "224x224-at-64px"],
)
def test_a_checkpoint_gives_openoods_logits_features_and_layers(tmp_path, name, modules, classes, size):
    state = random_checkpoint(modules, classes, seed=classes)
    path = tmp_path / "best.ckpt"
    torch.save(state, path)  # a raw state dict, as OpenOOD saves it
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(5))
    reference = reference_forward(state, x, big=name == BIG)
    assert reference["logits"].std() > 0.1  # numbers that can tell a wrong network from a right one

    backbone = load_backbone(name, checkpoint=path)
    features, logits = backbone.features_and_logits(x)
    assert features.shape == (3, 512) and logits.shape == (3, classes)
    assert _close(features, reference["features"]) and _close(logits, reference["logits"])
    weight, bias = backbone.head  # the head detectors read: fc
    assert torch.equal(weight, state["fc.weight"]) and torch.equal(bias, state["fc.bias"])
    assert backbone.num_classes == classes and backbone.weights_id.startswith("sha256:")

    assert {f"layer{i}" for i in range(1, 5)} <= set(backbone.layer_names())
    layer3 = load_backbone(name, checkpoint=path, layer="layer3")
    features3, logits3 = layer3.features_and_logits(x)
    assert features3.shape == (3, 256) and _close(features3, reference["layer3"]) and layer3.head is None
    assert _close(logits3, reference["logits"])


def _made_images() -> list[Image.Image]:
    """A non-square RGBA image (alpha varying) and a non-square greyscale one, with pixels all over 0..255."""
    rng = np.random.default_rng(3)
    rgba = Image.fromarray(rng.integers(0, 256, (37, 45, 4), dtype=np.uint8), "RGBA")  # 45 wide, 37 high
    grey = Image.fromarray(rng.integers(0, 256, (70, 50), dtype=np.uint8), "L")  # 50 wide, 70 high
    return [rgba, grey]


def reference_preprocessing(image: Image.Image, benchmark: str) -> np.ndarray:
    """OpenOOD's documented test steps in PIL and numpy: RGB, the shorter side resized to pre_size (bilinear, the
    longer side truncated to keep the aspect), centre crop img_size (offset rounded), ``(p / 255 - mean) / std``
    -> ``[3, img_size, img_size]``."""
    pre_size, img_size, mean, std = PREPROCESSING[benchmark]
    rgb = image.convert("RGB")
    w, h = rgb.size
    size = (pre_size, int(pre_size * h / w)) if w <= h else (int(pre_size * w / h), pre_size)
    resized = np.asarray(rgb.resize(size, Image.Resampling.BILINEAR), dtype=np.float64)
    top, left = round((size[1] - img_size) / 2), round((size[0] - img_size) / 2)
    crop = resized[top : top + img_size, left : left + img_size] / 255.0
    return ((crop - np.array(mean)) / np.array(std)).transpose(2, 0, 1)


@pytest.mark.parametrize("benchmark", OPENOOD_BENCHMARKS)
def test_the_transform_is_openoods_test_preprocessing(benchmark):
    from oodviz.detectors.odin import transform_std

    assert benchmark in PREPROCESSING
    transform, shape = openood_transform(benchmark)
    img_size = PREPROCESSING[benchmark][1]
    assert shape == (3, img_size, img_size)
    for image in _made_images():
        out = transform(image)
        assert out.dtype == torch.float32 and tuple(out.shape) == shape
        assert np.allclose(out.numpy(), reference_preprocessing(image, benchmark), rtol=0, atol=1e-5)
    again = pickle.loads(pickle.dumps(transform))  # DataLoader workers get it pickled
    assert torch.equal(again(_made_images()[0]), transform(_made_images()[0]))
    assert transform_std(transform) == pytest.approx(PREPROCESSING[benchmark][3])  # odin's norm_std="auto"
    assert openood_transform(f" {benchmark.upper()} ")[1] == shape


def test_unknown_benchmark_names_the_benchmarks():
    with pytest.raises(ValueError, match="cifar10.*cifar100.*imagenet200.*imagenet"):
        openood_transform("cifar-10")


def test_default_weights_are_refused_with_openoods_download_script():
    for name in (SMALL, BIG):
        with pytest.raises(ValueError, match=r"scripts/download/download\.py .*--checkpoints ood_v1\.5") as caught:
            load_backbone(name)
        assert "checkpoint=" in str(caught.value) and "weights='random'" in str(caught.value)
        with pytest.raises(ValueError, match="no weights 'IMAGENET1K_V1'"):
            load_backbone(name, weights="IMAGENET1K_V1")


def test_a_cifar100_checkpoint_has_100_classes_and_cifar100s_preprocessing(tmp_path):
    path = tmp_path / "best.ckpt"
    torch.save(random_checkpoint(RESNET18_32X32, 100, seed=1), path)
    backbone = load_backbone(SMALL, checkpoint=path)
    assert backbone.num_classes == 100 and backbone.input_shape == (3, 32, 32) and backbone.classes is None
    image = _made_images()[0]
    assert np.allclose(backbone.transform(image).numpy(), reference_preprocessing(image, "cifar100"), atol=1e-5)
    assert not np.allclose(backbone.transform(image).numpy(), reference_preprocessing(image, "cifar10"), atol=1e-3)
    # the transform a benchmark names wins over the class count's
    named = load_backbone(SMALL, checkpoint=path, transform=openood_transform("cifar10")[0])
    assert np.allclose(named.transform(image).numpy(), reference_preprocessing(image, "cifar10"), atol=1e-5)


def test_listed_with_random_weights_and_info():
    names = available_backbones()
    assert names.index(SMALL) == names.index("mobilenet_v3_large") + 1 and names.index(BIG) == names.index(SMALL) + 1
    for name, classes, shape in ((SMALL, 10, (3, 32, 32)), (BIG, 200, (3, 224, 224))):
        info = backbone_info(name)
        assert (info["source"], info["feature_dim"], info["num_classes"], info["head"]) == (
            "openood",
            512,
            classes,
            "fc",
        )
        assert info["input_shape"] == shape and info["weights_available"] is False
        backbone = load_backbone(name, weights="random")
        assert backbone.weights_id == f"random:{name}:seed=0" and backbone.input_shape == shape
        x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
        features, logits = backbone.features_and_logits(x)
        assert logits.shape == (2, classes) and features.std() > 0  # BatchNorm calibrated: features that vary
        weight, bias = backbone.head
        assert torch.allclose(features @ weight.T + bias, logits, atol=1e-4)
