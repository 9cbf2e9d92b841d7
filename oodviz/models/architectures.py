"""The built-in architectures: what each is, how to build it, its preprocessing and default weights.

:data:`ARCHITECTURES` maps a registry name (:func:`available_backbones`) to an :class:`Architecture`:
the builder (``num_classes -> nn.Module`` with random weights), the module path of its final
``nn.Linear``, the feature size ``D``, the class count of its default weights, which layers
output channels-last maps and, for ViT, where its class token is. :data:`BUNDLED` says where the bundled models' weights are
(``oodviz/weights/``); torchvision models take torchvision's weight enums (:func:`weights_enum`); OpenOOD v1.5's
networks (:data:`OPENOOD_ARCHITECTURES`, :mod:`oodviz.models.openood`) have no weights of their own: they take OpenOOD's
checkpoints, preprocessed as the checkpoint's benchmark (:func:`openood_transform`).
``build_random`` makes the seeded random model of ``weights="random"``.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from PIL import Image
from torch import Tensor, nn

from oodviz.models.digits import DIGITS_CLASSES, DIGITS_WEIGHTS, DigitsTransform, build_digits_cnn
from oodviz.models.fashion import FASHION_CLASSES, FASHION_WEIGHTS, FashionTransform, build_fashion_cnn
from oodviz.models.hub_names import TIMM_LISTED, hub_family, hub_kind
from oodviz.models.openood import (
    OPENOOD_DOWNLOAD,
    OPENOOD_NETWORKS,
    OPENOOD_PREPROCESSING,
    build_openood_resnet18_32x32,
    build_openood_resnet18_224x224,
    check_benchmark,
    network_benchmark,
)

#: Seed of ``weights="random"``; part of its ``weights_id``.
RANDOM_SEED = 0
#: Names load_backbone takes for a model file instead of an architecture.
USER_MODEL_NAMES = ("torchscript", "export")


class RGBTransform:
    """Wraps an RGB transform so that greyscale, palette, RGBA, CMYK ... PIL images work too.

    ``image.convert("RGB")`` first, then ``inner`` (e.g. torchvision's ``ImageClassification``:
    resize, centre crop, scale to 0..1, normalise) -> ``[3, H, W]``. Picklable.
    """

    def __init__(self, inner: Callable):
        self.inner = inner

    def __call__(self, image) -> Tensor:
        if isinstance(image, Image.Image) and image.mode != "RGB":
            image = image.convert("RGB")
        elif isinstance(image, Tensor) and image.ndim == 3 and image.shape[0] == 1:
            image = image.expand(3, -1, -1)
        return self.inner(image)

    def __repr__(self) -> str:
        return f"RGBTransform(convert('RGB') then {self.inner!r})"


def imagenet_transform(crop_size: int = 224, resize_size: int = 256) -> RGBTransform:
    """Standard ImageNet preprocessing (resize, centre crop, ImageNet mean/std), any PIL mode: torchvision's
    ImageNet weights' own preset, reached through the public ``Weights.transforms`` (the class is private)."""
    from torchvision.models import ResNet18_Weights

    return RGBTransform(ResNet18_Weights.IMAGENET1K_V1.transforms(crop_size=crop_size, resize_size=resize_size))


def openood_transform(benchmark: str) -> tuple[RGBTransform, tuple[int, int, int]]:
    """OpenOOD v1.5's test preprocessing of ID benchmark ``benchmark`` (``"cifar10"``, ``"cifar100"``,
    ``"imagenet200"``, ``"imagenet"``: :data:`oodviz.models.openood.OPENOOD_PREPROCESSING`) and the ``(C, H, W)``
    it produces.

    As OpenOOD's ``TestStandardPreProcessor``: any PIL mode converted to RGB, the shorter side resized to
    ``pre_size`` with PIL's bilinear filter (torchvision's ``Resize`` on a PIL image), centre crop ``img_size``,
    ``ToTensor`` (``p / 255``), ``Normalize(mean, std)``. Picklable; ODIN's ``norm_std="auto"`` finds its ``std``.
    (For torchvision-pretrained ImageNet-1k models OpenOOD's ``eval_ood_imagenet.py`` uses the weights' own
    transform instead, which is oodviz's default for ``resnet50`` / ``swin_t`` / ``vit_b_16``.)
    """
    from torchvision import transforms

    steps = OPENOOD_PREPROCESSING[check_benchmark(benchmark)]
    inner = transforms.Compose(
        [
            transforms.Resize(steps.pre_size, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.CenterCrop(steps.img_size),
            transforms.ToTensor(),
            transforms.Normalize(list(steps.mean), list(steps.std)),
        ]
    )
    return RGBTransform(inner), (3, steps.img_size, steps.img_size)


@dataclass(frozen=True)
class Architecture:
    """A registry architecture: how to build it, where its head is, its feature size and class count."""

    name: str
    head: str  # module path of the final nn.Linear
    feature_dim: int
    build: Callable[[int], nn.Module]  # num_classes -> model with random weights
    default_classes: int
    channels_last: Callable[[str], bool] | None  # does layer `name` output [B, H, W, C]? (None: never)
    torchvision: bool = True
    # a transformer's (prefix tokens, what its head reads, the module giving its final token sequence)
    tokens: tuple[int, str, str] | None = None


def _swin_channels_last(layer: str) -> bool:
    # Swin keeps [B, H, W, C] everywhere except the patch conv, after `permute` and `avgpool`.
    return layer not in ("features.0.0", "permute", "avgpool", "flatten", "head")


def _convnext_channels_last(layer: str) -> bool:
    # Inside a CNBlock: Conv2d (0), Permute->NHWC (1), LayerNorm, Linear, GELU, Linear (2-5), Permute back (6).
    parts = layer.split(".")
    return len(parts) >= 2 and parts[-2] == "block" and parts[-1] in {"1", "2", "3", "4", "5"}


_CHANNELS_LAST = {"swin": _swin_channels_last, "convnext": _convnext_channels_last}
# ViT-B/16: its class token first, read by the head from the encoder's output (Swin has no class token: its
# stages are maps)
_TOKENS = {"vit_b_16": (1, "cls", "encoder")}


def _torchvision_builder(arch: str) -> Callable[[int], nn.Module]:
    def build(num_classes: int) -> nn.Module:
        import torchvision

        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)

    return build


_TORCHVISION = {
    # name: (head module, D)
    "resnet18": ("fc", 512),
    "resnet50": ("fc", 2048),
    "vit_b_16": ("heads.head", 768),
    "swin_t": ("head", 768),
    "convnext_tiny": ("classifier.2", 768),
    "efficientnet_b0": ("classifier.1", 1280),
    "mobilenet_v3_large": ("classifier.3", 1280),
}


ARCHITECTURES: dict[str, Architecture] = {
    "digits-cnn": Architecture("digits-cnn", "fc", 64, build_digits_cnn, len(DIGITS_CLASSES), None, torchvision=False),
    "fashion-cnn": Architecture(
        "fashion-cnn", "fc", 128, build_fashion_cnn, len(FASHION_CLASSES), None, torchvision=False
    ),
    **{
        name: Architecture(
            name,
            head,
            dim,
            _torchvision_builder(name),
            1000,
            _CHANNELS_LAST.get(name.split("_")[0]),
            tokens=_TOKENS.get(name),
        )
        for name, (head, dim) in _TORCHVISION.items()
    },
    # OpenOOD v1.5's networks: CIFAR-10/100 (default 10 classes) and ImageNet-200 (default 200)
    "openood-resnet18-32x32": Architecture(
        "openood-resnet18-32x32", "fc", 512, build_openood_resnet18_32x32, 10, None, torchvision=False
    ),
    "openood-resnet18-224x224": Architecture(
        "openood-resnet18-224x224", "fc", 512, build_openood_resnet18_224x224, 200, None, torchvision=False
    ),
}
#: The architectures that are OpenOOD v1.5's networks: no weights of their own (``weights="default"`` is refused
#: with the way to get OpenOOD's checkpoints), each checkpoint preprocessed as its benchmark.
OPENOOD_ARCHITECTURES = ("openood-resnet18-32x32", "openood-resnet18-224x224")


@dataclass(frozen=True)
class BundledWeights:
    """A model whose weights ship in ``oodviz/weights/``: where they are, its classes, its preprocessing."""

    weights: Path
    classes: tuple[str, ...]
    transform: Callable[[], Callable]
    input_shape: tuple[int, ...]
    recreate: str  # how to rebuild the weights file


BUNDLED: dict[str, BundledWeights] = {
    "digits-cnn": BundledWeights(
        DIGITS_WEIGHTS,
        tuple(DIGITS_CLASSES),
        DigitsTransform,
        (1, 8, 8),
        "`python scripts/train_digits_cnn.py` (about ten seconds on a CPU)",
    ),
    "fashion-cnn": BundledWeights(
        FASHION_WEIGHTS,
        tuple(FASHION_CLASSES),
        FashionTransform,
        (1, 28, 28),
        "`python scripts/train_fashion_cnn.py` (about ten minutes on 2 CPU cores; needs Fashion-MNIST, "
        "e.g. `apt-get install dataset-fashion-mnist`)",
    ),
}


def available_backbones() -> list[str]:
    """Names ``load_backbone`` accepts without a checkpoint, the offline default first; then, when timm is
    installed, a few timm models (:data:`oodviz.models.hub_names.TIMM_LISTED`; they take a checkpoint file or random
    weights).

    (``"torchscript"`` and ``"export"`` are also accepted, with ``checkpoint=``; so are any ``timm:<model name>``
    and ``hf:<directory>``, see :mod:`oodviz.models.hub`.)
    """
    return list(ARCHITECTURES) + (list(TIMM_LISTED) if importlib.util.find_spec("timm") else [])


#: Registry architectures built from attention blocks over patch tokens; every other one is a CNN.
TRANSFORMERS = ("vit_b_16", "swin_t")
BACKBONE_FAMILIES = ("cnn", "transformer")


def backbone_family(name) -> str:
    """``"transformer"`` for the registry's vision transformers (:data:`TRANSFORMERS`: ViT, Swin) and timm /
    Hugging Face transformers (:func:`oodviz.models.hub_names.hub_family`), else ``"cnn"`` (the bundled CNNs, ResNets,
    ConvNeXt, EfficientNet, MobileNet, and a user's own model file, whose architecture oodviz cannot see). Case
    and surrounding spaces are ignored; any other value is a CNN."""
    if hub_kind(name):
        return hub_family(name)
    key = name.strip().lower() if isinstance(name, str) else name
    return "transformer" if key in TRANSFORMERS else "cnn"


def architecture(name: str) -> Architecture:
    """The architecture registered as ``name`` (case and surrounding spaces ignored), or a ValueError
    listing the names, with close matches, and the ways to load a model of one's own."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key in ARCHITECTURES:
        return ARCHITECTURES[key]
    known = list(ARCHITECTURES) + list(USER_MODEL_NAMES)
    close = difflib.get_close_matches(str(key), known, n=3, cutoff=0.5)
    raise ValueError(
        f"unknown backbone {name!r}"
        + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
        + f"; available: {', '.join(known)}. For your own model use load_backbone('torchscript', checkpoint=path), "
        "load_backbone('<architecture>', checkpoint=state_dict_path), 'timm:<model name>', 'hf:<directory>' "
        "or wrap_model(model, ...)"
    )


def weights_enum(arch: str, weights: str):
    """The torchvision weights enum member of ``arch`` named ``weights`` (``"default"``, a member name or
    a member itself), or a ValueError listing the members."""
    from torchvision.models import get_model_weights

    enum = get_model_weights(arch)
    if weights == "default":
        return enum.DEFAULT
    if isinstance(weights, enum):  # a torchvision weights enum member, e.g. ResNet18_Weights.IMAGENET1K_V1
        return weights
    try:
        return enum[weights]
    except KeyError:
        raise ValueError(
            f"{arch} has no weights {weights!r}; use 'default', 'random', None or one of "
            f"{', '.join(repr(m.name) for m in enum)}"
        ) from None


def default_weights_dir() -> Path:
    """Where torchvision caches weights: ``torch.hub.get_dir()/checkpoints`` (``$TORCH_HOME/hub/checkpoints``)."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def backbone_info(name: str, weights_dir: str | os.PathLike | None = None) -> dict:
    """What a registry backbone is, without building it (cheap; for menus and dry-run checks).

    Keys: ``name``, ``source`` (``"bundled"``, ``"torchvision"`` or ``"openood"``), ``feature_dim``,
    ``num_classes``, ``head`` (module path), ``input_shape``, ``weights_file`` (file name),
    ``weights_path`` (where it is looked for), ``weights_available`` (the file is there). OpenOOD's networks
    have no weights file of their own (``None``, ``None``, ``False``: they take a checkpoint); their
    ``num_classes`` and ``input_shape`` are their first benchmark's (CIFAR-10, ImageNet-200).
    """
    arch = architecture(name)
    if arch.name in OPENOOD_ARCHITECTURES:
        return {
            "name": arch.name,
            "source": "openood",
            "feature_dim": arch.feature_dim,
            "num_classes": arch.default_classes,
            "head": arch.head,
            "input_shape": default_transform(arch)[1],
            "weights_file": None,
            "weights_path": None,
            "weights_available": False,
        }
    if not arch.torchvision:
        bundled = BUNDLED[arch.name]
        return {
            "name": arch.name,
            "source": "bundled",
            "feature_dim": arch.feature_dim,
            "num_classes": arch.default_classes,
            "head": arch.head,
            "input_shape": bundled.input_shape,
            "weights_file": bundled.weights.name,
            "weights_path": str(bundled.weights),
            "weights_available": bundled.weights.is_file(),
        }
    member = weights_enum(arch.name, "default")
    file_name = os.path.basename(urlparse(member.url).path)
    path = Path(weights_dir or default_weights_dir()) / file_name
    crop = member.transforms().crop_size[0]
    return {
        "name": arch.name,
        "source": "torchvision",
        "feature_dim": arch.feature_dim,
        "num_classes": len(member.meta["categories"]),
        "head": arch.head,
        "input_shape": (3, crop, crop),
        "weights_file": file_name,
        "weights_path": str(path),
        "weights_available": path.is_file(),
    }


def architecture_classes(arch: Architecture) -> list[str] | None:
    """Class names of the architecture's default weights (bundled classes, or torchvision's categories); ``None``
    for OpenOOD's networks (no weights of their own; a checkpoint's classes are not in the file)."""
    if arch.name in OPENOOD_ARCHITECTURES:
        return None
    if not arch.torchvision:
        return list(BUNDLED[arch.name].classes)
    return list(weights_enum(arch.name, "default").meta["categories"])


def default_transform(arch: Architecture, num_classes: int | None = None) -> tuple[Callable, tuple[int, ...]]:
    """The preprocessing of the architecture's default weights and the ``(C, H, W)`` it produces.

    For OpenOOD's networks, the preprocessing of the benchmark trained with ``num_classes`` classes
    (:func:`oodviz.models.openood.network_benchmark`: a 100-class ``openood-resnet18-32x32`` is CIFAR-100's,
    with CIFAR-100's mean and std), by default the first one's (CIFAR-10, ImageNet-200)."""
    if arch.name in OPENOOD_ARCHITECTURES:
        return openood_transform(network_benchmark(arch.name, num_classes))
    if not arch.torchvision:
        bundled = BUNDLED[arch.name]
        return bundled.transform(), bundled.input_shape
    preset = weights_enum(arch.name, "default").transforms()
    crop = preset.crop_size[0]
    return RGBTransform(preset), (3, crop, crop)


def openood_weights_message(arch: Architecture, weights) -> str:
    """Why OpenOOD network ``arch`` cannot load ``weights`` (it has none of its own) and how to load OpenOOD's."""
    benchmark = network_benchmark(arch.name)
    example = OPENOOD_NETWORKS[benchmark].checkpoint
    return (
        f"{arch.name} has {'no default weights' if weights == 'default' else f'no weights {weights!r}'}: it is OpenOOD v1.5's "
        f"network, whose trained weights are OpenOOD's checkpoints (none offline). Download them with OpenOOD's "
        f"`{OPENOOD_DOWNLOAD}` (in a clone of github.com/Jingkang50/OpenOOD; they land in ./results) and load one "
        f"with load_backbone({arch.name!r}, checkpoint='{example}'), or use weights='random' for a dry run"
    )


def build_random(arch: Architecture, num_classes: int, calibrate: bool = True) -> nn.Module:
    """The architecture with ``num_classes`` outputs and random weights seeded by :data:`RANDOM_SEED`
    (the global RNG untouched); ``calibrate`` gives its BatchNorm layers usable running statistics."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_SEED)
        model = arch.build(num_classes)
        head = dict(model.named_modules())[arch.head]
        if not head.weight.any():
            # torchvision zero-initialises the ViT head (for fine-tuning); a dry run needs logits that vary.
            nn.init.normal_(head.weight, std=head.weight.shape[1] ** -0.5)
        if calibrate:
            calibrate_batchnorm(model, default_transform(arch)[1])
    return model


def calibrate_batchnorm(model: nn.Module, input_shape: tuple[int, ...]) -> None:
    """Set BatchNorm running statistics from one random batch (seeded by the caller).

    With freshly initialised statistics (mean 0, variance 1) the eval-mode activations of deep
    random networks such as EfficientNet and MobileNetV3 shrink to ~1e-14, so a dry run would
    see all-zero features. One forward of 2 random inputs of the model's input size, with only the
    norm layers in train mode, gives them a usable scale.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batch
    model.eval()
    for m in norms:  # only the norms learn statistics; dropout and stochastic depth stay off
        m.train()
    with torch.no_grad():
        model(torch.randn(2, *input_shape))
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    model.eval()


def architecture_module_names(name: str) -> list[str]:
    """The names of ``model.named_modules()`` (the root excluded) of registry backbone ``name``'s architecture, built on
    the meta device: no weights read, no memory used."""
    return list(_layer_names(architecture(name).name))


def unknown_layer_message(owner: str, layer: str, names: list[str], note: str = "") -> str:
    """``"<owner> has no layer '<layer>'; did you mean ...? Its top-level layers: a, b."`` for a ``layer`` not in
    ``names`` (``model.named_modules()`` names): the closest names, when any, then the top-level ones and ``note``."""
    close = difflib.get_close_matches(layer, names, n=5, cutoff=0.5)
    top = [n for n in names if n and "." not in n]
    return (
        f"{owner} has no layer {layer!r}"
        + (f"; did you mean {', '.join(map(repr, close))}?" if close else ".")
        + f" Its top-level layers: {', '.join(top)}."
        + (f" {note}" if note else "")
    )


@functools.cache  # the app checks its config on every rerun
def _layer_names(name: str) -> tuple[str, ...]:
    arch = ARCHITECTURES[name]
    with torch.device("meta"):
        model = arch.build(arch.default_classes)
    return tuple(n for n, _ in model.named_modules() if n)
