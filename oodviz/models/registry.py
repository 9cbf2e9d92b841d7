"""The backbone registry: names -> :class:`~oodviz.models.backbone.Backbone`.

``available_backbones()`` lists the built-in names: the bundled ``digits-cnn`` and ``fashion-cnn``
(offline, weights in ``oodviz/weights/``) and seven torchvision ImageNet classifiers. ``load_backbone`` also loads a
user's own model: a state-dict checkpoint of a registry architecture
(``load_backbone("resnet18", checkpoint="my.pt")``), a TorchScript file
(``load_backbone("torchscript", checkpoint="model.pt")``) or a ``torch.export`` program
(``load_backbone("export", checkpoint="model.pt2")``). ``wrap_model`` wraps a model object.

Weights (``weights=``):

- ``"default"``: the bundled weights (digits, Fashion-MNIST), or the torchvision weights of the architecture's
  ``DEFAULT`` enum member, read from the torchvision cache (``$TORCH_HOME/hub/checkpoints`` or
  ``weights_dir``). Nothing is downloaded unless ``allow_download=True``; a missing file is a
  ``FileNotFoundError`` naming the file and the folder to put it in.
- a torchvision weights name such as ``"IMAGENET1K_V2"``: that enum member, same rules.
- ``"random"`` or ``None``: random initialisation with a fixed seed (reproducible dry runs and
  tests; the global RNG is left untouched).

Every file is read with ``torch.load(..., weights_only=True)``; a file that is not what was
asked for is a ``ValueError`` saying what was expected.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import warnings
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse
from uuid import uuid4

import torch
from PIL import Image
from torch import Tensor, nn

from oodviz.models.backbone import Backbone, check_pooling
from oodviz.models.digits import (
    DIGITS_CLASSES,
    DIGITS_WEIGHTS,
    DigitsTransform,
    build_digits_cnn,
)
from oodviz.models.fashion import FASHION_CLASSES, FASHION_WEIGHTS, FashionTransform, build_fashion_cnn

#: Seed of ``weights="random"``; part of its ``weights_id``.
RANDOM_SEED = 0
USER_MODEL_NAMES = ("torchscript", "export")


# ---------------------------------------------------------------------------- transforms


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
    """Standard ImageNet preprocessing (resize, centre crop, ImageNet mean/std), any PIL mode."""
    from torchvision.transforms._presets import ImageClassification

    return RGBTransform(ImageClassification(crop_size=crop_size, resize_size=resize_size))


# ---------------------------------------------------------------------------- architectures


@dataclass(frozen=True)
class _Arch:
    name: str
    head: str  # module path of the final nn.Linear
    feature_dim: int
    build: Callable[[int], nn.Module]  # num_classes -> model with random weights
    default_classes: int
    channels_last: Callable[[str], bool]  # does layer `name` output [B, H, W, C]?
    torchvision: bool = True


def _swin_channels_last(layer: str) -> bool:
    # Swin keeps [B, H, W, C] everywhere except the patch conv, after `permute` and `avgpool`.
    return layer not in ("features.0.0", "permute", "avgpool", "flatten", "head")


def _convnext_channels_last(layer: str) -> bool:
    # Inside a CNBlock: Conv2d (0), Permute->NHWC (1), LayerNorm, Linear, GELU, Linear (2-5), Permute back (6).
    parts = layer.split(".")
    return len(parts) >= 2 and parts[-2] == "block" and parts[-1] in {"1", "2", "3", "4", "5"}


def _never_channels_last(layer: str) -> bool:
    return False


_CHANNELS_LAST = {"swin": _swin_channels_last, "convnext": _convnext_channels_last}


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

_ARCHS: dict[str, _Arch] = {
    "digits-cnn": _Arch(
        "digits-cnn", "fc", 64, build_digits_cnn, len(DIGITS_CLASSES), _never_channels_last, torchvision=False
    ),
    "fashion-cnn": _Arch(
        "fashion-cnn", "fc", 128, build_fashion_cnn, len(FASHION_CLASSES), _never_channels_last, torchvision=False
    ),
    **{
        name: _Arch(
            name,
            head,
            dim,
            _torchvision_builder(name),
            1000,
            _CHANNELS_LAST.get(name.split("_")[0], _never_channels_last),
        )
        for name, (head, dim) in _TORCHVISION.items()
    },
}


@dataclass(frozen=True)
class _Bundled:
    """A model whose weights ship in ``oodviz/weights/``: where they are, its classes, its preprocessing."""

    weights: Path
    classes: tuple[str, ...]
    transform: Callable[[], Callable]
    input_shape: tuple[int, ...]
    recreate: str  # how to rebuild the weights file


_BUNDLED: dict[str, _Bundled] = {
    "digits-cnn": _Bundled(
        DIGITS_WEIGHTS,
        tuple(DIGITS_CLASSES),
        DigitsTransform,
        (1, 8, 8),
        "`python scripts/train_digits_cnn.py` (about ten seconds on a CPU)",
    ),
    "fashion-cnn": _Bundled(
        FASHION_WEIGHTS,
        tuple(FASHION_CLASSES),
        FashionTransform,
        (1, 28, 28),
        "`python scripts/train_fashion_cnn.py` (about ten minutes on 2 CPU cores; needs Fashion-MNIST, "
        "e.g. `apt-get install dataset-fashion-mnist`)",
    ),
}


def available_backbones() -> list[str]:
    """Names ``load_backbone`` accepts without a checkpoint, the offline default first.

    (``"torchscript"`` and ``"export"`` are also accepted, with ``checkpoint=``.)
    """
    return list(_ARCHS)


def _weights_enum(arch: str, weights: str):
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

    Keys: ``name``, ``source`` (``"bundled"`` or ``"torchvision"``), ``feature_dim``,
    ``num_classes``, ``head`` (module path), ``input_shape``, ``weights_file`` (file name),
    ``weights_path`` (where it is looked for), ``weights_available`` (the file is there).
    """
    arch = _arch(name)
    if not arch.torchvision:
        bundled = _BUNDLED[arch.name]
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
    member = _weights_enum(arch.name, "default")
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


def _arch(name: str) -> _Arch:
    key = name.strip().lower() if isinstance(name, str) else name
    if key in _ARCHS:
        return _ARCHS[key]
    known = list(_ARCHS) + list(USER_MODEL_NAMES)
    close = difflib.get_close_matches(str(key), known, n=3, cutoff=0.5)
    raise ValueError(
        f"unknown backbone {name!r}"
        + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
        + f"; available: {', '.join(known)}. For your own model use load_backbone('torchscript', checkpoint=path), "
        "load_backbone('<architecture>', checkpoint=state_dict_path) or wrap_model(model, ...)"
    )


# ---------------------------------------------------------------------------- files


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _archive_kind(path: Path) -> str | None:
    """``"torchscript"``, ``"export"``, ``"state_dict"`` (a torch.save zip) or ``None`` (not a zip)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return None
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return "torchscript"
    if any(n.endswith("/archive_format") or "/models/" in n for n in names):
        return "export"
    return "state_dict"


def _check_file(path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {str(path)!r} does not exist")
    return path


def _short(error: BaseException, limit: int = 200) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _examples(keys, n: int = 4) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:n])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


def _load_state_dict_file(path: Path, expected: str) -> dict[str, Tensor]:
    """``torch.load(weights_only=True)``, unwrapped to a ``{str: Tensor}`` state dict."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        kind = _archive_kind(path)
        if kind in USER_MODEL_NAMES:
            what = "a TorchScript file" if kind == "torchscript" else "a torch.export program"
            raise ValueError(
                f"{path} is {what}, not a state dict; load it with load_backbone({kind!r}, checkpoint={str(path)!r})"
            ) from None
        raise ValueError(
            f"{path} could not be read as a state dict ({_short(error)}). Expected {expected}, "
            "saved with torch.save(model.state_dict(), path) (plain tensors only: files are read with "
            "weights_only=True)."
        ) from None
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    is_state_dict = (
        isinstance(obj, Mapping) and obj and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items())
    )
    if not is_state_dict:
        if isinstance(obj, Mapping):
            got = f"a dict with keys {_examples(map(repr, obj))} that are not all str -> tensor"
        else:
            got = f"a {type(obj).__name__}"
        raise ValueError(
            f"{path} holds {got}. Expected {expected}: a mapping of parameter names to tensors, "
            "or {'state_dict': ...} / {'model': ...} around one."
        )
    return dict(obj)


def _align_keys(state: dict[str, Tensor], expected: set[str]) -> dict[str, Tensor]:
    """Strip ``module.`` (DataParallel/DDP) and, when that makes more keys match, one common prefix."""
    state = {(k[len("module.") :] if k.startswith("module.") else k): v for k, v in state.items()}
    firsts = {k.split(".", 1)[0] for k in state}
    if len(firsts) == 1 and all("." in k for k in state):
        stripped = {k.split(".", 1)[1]: v for k, v in state.items()}
        if len(expected & stripped.keys()) > len(expected & state.keys()):
            return stripped
    return state


def _check_state_dict(reference: Mapping[str, Tensor], state: Mapping[str, Tensor], arch: _Arch, path: Path) -> None:
    missing = [k for k in reference if k not in state]
    unexpected = [k for k in state if k not in reference]
    mismatched = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in reference.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing keys (e.g. {_examples(missing, 3)})")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected keys (e.g. {_examples(unexpected, 3)})")
        if mismatched:
            problems.append(f"{len(mismatched)} shape mismatches, file vs model (e.g. {'; '.join(mismatched[:2])})")
        raise ValueError(
            f"{path} is not a state dict of the {arch.name} architecture: {', '.join(problems)}. Expected the "
            f"state dict of {arch.name} (keys like {_examples(list(reference), 3)}, head {arch.head}.weight); "
            "name the architecture the checkpoint was trained with, or use load_backbone('torchscript', "
            "checkpoint=...) for a TorchScript file."
        )


def _build_loaded(arch: _Arch, state: dict[str, Tensor], path: Path) -> nn.Module:
    """The architecture with the weights of ``state``; the class count comes from the head's shape.

    Built on the meta device (no time spent on a random initialisation that is overwritten),
    then the file's tensors are assigned, as float32.
    """
    with torch.device("meta"):
        skeleton = arch.build(arch.default_classes)
    state = _align_keys(state, set(skeleton.state_dict()))
    head_weight = state.get(f"{arch.head}.weight")
    num_classes = arch.default_classes
    if isinstance(head_weight, Tensor) and head_weight.ndim == 2:
        num_classes = int(head_weight.shape[0])
        if num_classes != arch.default_classes:
            with torch.device("meta"):
                skeleton = arch.build(num_classes)
    _check_state_dict(skeleton.state_dict(), state, arch, path)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    skeleton.load_state_dict(state, strict=True, assign=True)
    leftover = [n for n, t in [*skeleton.named_parameters(), *skeleton.named_buffers()] if t.is_meta]
    if not leftover:
        return skeleton
    model = _build_random(arch, num_classes, calibrate=False)  # a buffer outside the state dict: build for real
    model.load_state_dict(state, strict=True)
    return model


def _build_random(arch: _Arch, num_classes: int, calibrate: bool = True) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_SEED)
        model = arch.build(num_classes)
        head = dict(model.named_modules())[arch.head]
        if not head.weight.any():
            # torchvision zero-initialises the ViT head (for fine-tuning); a dry run needs logits that vary.
            nn.init.normal_(head.weight, std=head.weight.shape[1] ** -0.5)
        if calibrate:
            _calibrate_batchnorm(model, _default_transform(arch)[1])
    return model


def _calibrate_batchnorm(model: nn.Module, input_shape: tuple[int, ...]) -> None:
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


# ---------------------------------------------------------------------------- loading


def load_backbone(
    name: str,
    weights: str | None = "default",
    checkpoint: str | os.PathLike | None = None,
    layer: str | None = None,
    pooling: str = "avg",
    weights_dir: str | os.PathLike | None = None,
    *,
    allow_download: bool = False,
    classes: Sequence[str] | None = None,
    transform: Callable | None = None,
    input_shape: Sequence[int] | None = None,
) -> Backbone:
    """Load a backbone by registry name, or a user's model from ``checkpoint``.

    - ``name``: one of :func:`available_backbones`, or ``"torchscript"`` / ``"export"`` with
      ``checkpoint`` (see :func:`load_scripted`).
    - ``weights``: ``"default"``, a torchvision weights name (``"IMAGENET1K_V2"``) or enum member,
      ``"random"`` or ``None`` (= random); see the module docstring. Ignored when ``checkpoint``
      is given.
    - ``checkpoint``: a state-dict file of architecture ``name`` (a raw state dict, or
      ``{"state_dict": ...}`` / ``{"model": ...}``; ``module.`` prefixes are stripped); the
      number of classes comes from the head weight's shape, so a 10-class resnet18 loads.
    - ``layer``: a module name (``"layer3"``, ``"encoder.layers.encoder_layer_6"``) whose output
      gives the features instead of the penultimate layer; ``head`` is then ``None``.
    - ``pooling``: ``"avg"`` (default), ``"max"`` or ``"none"`` for a ``layer``'s feature maps or
      tokens (``"none"`` flattens: ``D = C * H * W``, check :func:`estimate_memory`).
    - ``weights_dir``: folder holding torchvision weight files (default
      :func:`default_weights_dir`); ``allow_download``: let torchvision fetch a missing file.
    - ``classes``: class names for a checkpoint; ``transform`` / ``input_shape``: override the
      preprocessing (a checkpoint trained on other images than ImageNet needs its own).

    The model is returned in eval mode on the CPU.
    """
    check_pooling(pooling)
    key = name.strip().lower() if isinstance(name, str) else name
    if key in USER_MODEL_NAMES:
        if checkpoint is None:
            raise ValueError(f"load_backbone({name!r}) needs checkpoint=<path to the file>")
        return load_scripted(
            checkpoint, kind=key, transform=transform, input_shape=input_shape, classes=classes, layer=layer
        )
    arch = _arch(name)

    if checkpoint is not None:
        path = _check_file(checkpoint)
        expected = f"a state dict of the {arch.name} architecture"
        state = _load_state_dict_file(path, expected)
        model = _build_loaded(arch, state, path)
        weights_id = f"sha256:{file_sha256(path)}"
        default_classes = None
    elif weights is None or weights == "random":
        model = _build_random(arch, arch.default_classes)
        weights_id = f"random:{arch.name}:seed={RANDOM_SEED}"
        default_classes = _default_classes(arch)
    elif not arch.torchvision:
        if weights != "default":
            raise ValueError(f"{arch.name} has weights 'default' (bundled) or 'random', got {weights!r}")
        bundled = _BUNDLED[arch.name]
        path = bundled.weights
        if not path.is_file():
            raise FileNotFoundError(
                f"the bundled {arch.name} weights are missing: expected {path}. Recreate them with "
                f"{bundled.recreate}, or use weights='random' for a dry run."
            )
        model = _build_loaded(arch, _load_state_dict_file(path, f"the {arch.name} state dict"), path)
        weights_id = f"sha256:{file_sha256(path)}"
        default_classes = list(bundled.classes)
    else:
        member = _weights_enum(arch.name, weights)
        state, file_path = _torchvision_state_dict(arch, member, weights_dir, allow_download)
        model = _build_loaded(arch, state, file_path)
        weights_id = f"sha256:{file_sha256(file_path)}"
        default_classes = list(member.meta["categories"])

    model.eval()
    if transform is None:
        transform, default_shape = _default_transform(arch)
    else:
        default_shape = None
    shape = tuple(input_shape) if input_shape is not None else (default_shape or _infer_input_shape(transform))
    backbone = Backbone(
        arch.name,
        model,
        transform,
        input_shape=shape,
        weights_id=weights_id,
        head_module=arch.head,
        layer=layer,
        pooling=pooling,
        classes=classes if classes is not None else default_classes,
        arch=arch.name,
        channels_last=arch.channels_last,
    )
    if layer is not None:
        backbone.feature_shape()  # one probe forward: D is known (and checked) before any run
        _check_classes(backbone, classes)
    return backbone


def _default_classes(arch: _Arch) -> list[str] | None:
    if not arch.torchvision:
        return list(_BUNDLED[arch.name].classes)
    return list(_weights_enum(arch.name, "default").meta["categories"])


def _default_transform(arch: _Arch) -> tuple[Callable, tuple[int, ...]]:
    if not arch.torchvision:
        bundled = _BUNDLED[arch.name]
        return bundled.transform(), bundled.input_shape
    preset = _weights_enum(arch.name, "default").transforms()
    crop = preset.crop_size[0]
    return RGBTransform(preset), (3, crop, crop)


def _infer_input_shape(transform: Callable) -> tuple[int, ...]:
    try:
        sample = transform(Image.new("RGB", (256, 256)))
    except Exception as error:
        raise ValueError(
            f"could not run the given transform on a 256 x 256 RGB image ({_short(error)}); pass input_shape=(C, H, W)"
        ) from None
    if not isinstance(sample, Tensor) or sample.ndim != 3:
        raise ValueError(
            "transform must turn a PIL image into a tensor [C, H, W]; pass input_shape=(C, H, W) if it does"
        )
    return tuple(sample.shape)


def _torchvision_state_dict(arch: _Arch, member, weights_dir, allow_download: bool) -> tuple[dict, Path]:
    folder = Path(weights_dir) if weights_dir is not None else default_weights_dir()
    file_name = os.path.basename(urlparse(member.url).path)
    path = folder / file_name
    if not path.is_file():
        if not allow_download:
            raise FileNotFoundError(
                f"{arch.name} weights {type(member).__name__}.{member.name} are not available offline: expected the file "
                f"{file_name!r} in {str(folder)!r}. Download {member.url} on a machine with internet and copy it there "
                f"(or pass weights_dir=<folder holding it>), or pass allow_download=True. "
                "For a dry run without pretrained weights use weights='random'."
            )
        try:
            torch.hub.load_state_dict_from_url(member.url, model_dir=str(folder), progress=False, check_hash=True)
        except Exception as error:
            raise FileNotFoundError(
                f"downloading {member.url} into {str(folder)!r} failed ({_short(error)}); copy {file_name!r} there by hand, "
                "or use weights='random' for a dry run"
            ) from None
    return _load_state_dict_file(path, f"the torchvision {arch.name} weights {member.name}"), path


# ---------------------------------------------------------------------------- user models


def load_scripted(
    checkpoint: str | os.PathLike,
    *,
    kind: str = "torchscript",
    transform: Callable | None = None,
    input_shape: Sequence[int] | None = None,
    classes: Sequence[str] | None = None,
    layer: str | None = None,
) -> Backbone:
    """A TorchScript file (``kind="torchscript"``) or ``torch.export`` program (``kind="export"``).

    The model contract (hooks cannot be attached to these): ``forward(x [B, C_in, H, W])``
    returns logits ``[B, C]``, or ``(features [B, D], logits [B, C])``; with logits only, a
    ``features(x) -> [B, D]`` method (``@torch.jit.export``) gives the features, otherwise the
    logits double as features (``head`` is then ``None``, fine for logit-based detectors). When
    a linear layer of the model maps the features to the logits exactly, it becomes ``head``.

    ``transform`` defaults to ImageNet preprocessing at 224 x 224 (any PIL mode -> RGB);
    ``input_shape`` is inferred from it. ``weights_id`` is the sha256 of the file.
    """
    path = _check_file(checkpoint)
    if layer is not None:
        raise ValueError(
            f"layer={layer!r} is not supported for {kind} models: hooks cannot be attached to them. Return "
            "(features, logits) from forward, or load the state dict with load_backbone('<architecture>', checkpoint=...)"
        )
    contract = "forward(x [B, C, H, W]) returning logits [B, C] or (features [B, D], logits [B, C])"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "torchscript":
                model = torch.jit.load(str(path), map_location="cpu")
            else:
                model = torch.export.load(str(path)).module()
    except Exception as error:
        if kind == "torchscript":
            expected = (
                "a TorchScript file (torch.jit.script(model).save(path) or torch.jit.trace(model, x).save(path)) "
                f"with {contract}"
            )
        else:
            expected = (
                f"a torch.export program (torch.export.save(torch.export.export(model, (x,)), path)) with {contract}"
            )
        hint = ""
        found = _archive_kind(path)
        if found in USER_MODEL_NAMES and found != kind:
            what = "a TorchScript file" if found == "torchscript" else "a torch.export program"
            hint = f" It looks like {what}: use load_backbone({found!r}, checkpoint=...)."
        elif found == "state_dict":
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    obj = torch.load(path, map_location="cpu", weights_only=True)
                if isinstance(obj, Mapping):
                    hint = (
                        " It looks like a state dict saved with torch.save: load it with "
                        f"load_backbone('<architecture>', checkpoint=...) naming one of {', '.join(_ARCHS)}."
                    )
            except Exception:
                pass
        raise ValueError(f"{path} is not {expected} ({_short(error)}).{hint}") from None
    if kind == "torchscript":
        model.eval()  # an exported program is fixed in the mode it was exported in (export in eval mode)
    if transform is None:
        transform = imagenet_transform()
        shape = tuple(input_shape) if input_shape is not None else (3, 224, 224)
    else:
        shape = tuple(input_shape) if input_shape is not None else _infer_input_shape(transform)
    backbone = Backbone(
        kind, model, transform, input_shape=shape, weights_id=f"sha256:{file_sha256(path)}", classes=classes
    )
    try:
        backbone.feature_shape()
    except Exception as error:
        raise ValueError(
            f"the {kind} model in {path} does not follow the contract {contract} on an input of shape "
            f"[1, {', '.join(map(str, shape))}] ({_short(error)}); pass input_shape= / transform= matching the model"
        ) from None
    _check_classes(backbone, classes)
    return backbone


def _check_classes(backbone: Backbone, classes) -> None:
    if classes is not None and len(classes) != backbone.num_classes:
        raise ValueError(f"{len(classes)} class names given but the model has {backbone.num_classes} outputs")


def _state_dict_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for key, value in model.state_dict().items():
        digest.update(key.encode())
        digest.update(str(tuple(value.shape)).encode())
        digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def wrap_model(
    model: Callable[[Tensor], object],
    transform: Callable,
    *,
    name: str = "custom",
    head: str | None = None,
    layer: str | None = None,
    pooling: str = "avg",
    input_shape: Sequence[int] | None = None,
    classes: Sequence[str] | None = None,
    weights_id: str | None = None,
) -> Backbone:
    """A :class:`Backbone` around a model object already in memory.

    - ``head``: module name of the model's final ``nn.Linear`` (``"fc"``); its input becomes the
      features. Without ``head`` and ``layer`` the model follows the output contract of
      :func:`load_scripted`. ``layer`` / ``pooling`` as in :func:`load_backbone`.
    - ``weights_id``: defaults to the sha256 of an ``nn.Module``'s state dict; a plain callable
      gets a fresh random id (its features are then never reused from a cache).

    The model is used as given (not copied, not put in eval mode).
    """
    if not callable(model):
        raise ValueError(f"model must be callable (an nn.Module or a function of a tensor), got {type(model).__name__}")
    if weights_id is None:
        weights_id = (
            f"sha256:{_state_dict_digest(model)}" if isinstance(model, nn.Module) else f"uncached:{uuid4().hex}"
        )
    shape = tuple(input_shape) if input_shape is not None else _infer_input_shape(transform)
    backbone = Backbone(
        name,
        model,
        transform,
        input_shape=shape,
        weights_id=weights_id,
        head_module=head if layer is None else None,
        layer=layer,
        pooling=pooling,
        classes=classes,
    )
    if backbone.source != "penultimate":
        backbone.feature_shape()
    _check_classes(backbone, classes)
    return backbone
