"""Backbones from where researchers keep their models: timm (``timm:<model name>``) and Hugging Face
(``hf:<directory>``), optional dependencies (``pip install oodviz[timm]`` / ``oodviz[hf]``).

```python
load_backbone("timm:vit_small_patch16_224", checkpoint="vit_s.pt")       # a state dict of that timm model
load_backbone("timm:resnet50", weights="random")                           # a dry run, nothing read
load_backbone("timm:vit_tiny_patch16_224", checkpoint="cifar.pt", model_args={"img_size": 32})
load_backbone("hf:/models/my-vit")     # save_pretrained() of an AutoModelForImageClassification + its processor
```

Nothing is downloaded: a timm model is built with ``pretrained=False`` and takes its weights from a local state-dict
file (``checkpoint=``; the class count from its head) or is random (seeded); a Hugging Face directory is read with
``local_files_only=True``. Each backbone brings the model's own pieces:

- preprocessing: timm's ``resolve_data_config`` / ``create_transform`` (eval), or a torchvision transform written
  from the directory's ``preprocessor_config.json`` (size, crop, mean, std), so that no processor code runs;
- head: timm's ``get_classifier()``, the Hugging Face model's ``classifier``: the penultimate features are its
  input (``features @ W.T + b == logits``);
- layers: every module (``model.named_modules()``), as for torchvision models; for a transformer the
  :class:`~oodviz.models.backbone.TokenLayout` (prefix tokens, what the head reads, which layers hold the token
  sequence), so that ``pooling="cls"`` / ``"mean"`` work and are the default of its token layers.

timm and transformers are imported inside the functions that need them, so that oodviz works without them; the
names (``hub_kind``, ``hub_family``, the timm models the app lists) are in :mod:`oodviz.models.hub_names`, without
torch.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor, nn

from oodviz.models.architectures import RANDOM_SEED, Architecture, RGBTransform, build_random, calibrate_batchnorm
from oodviz.models.backbone import Backbone, TokenLayout, check_pooling, probe_token_layout
from oodviz.models.checkpoints import build_from_state_dict, check_file, file_sha256, load_state_dict_file
from oodviz.models.hub_names import HF_PREFIX, HF_TRANSFORMERS, TIMM_PREFIX, hub_kind

# PIL's resampling codes (Hugging Face processors' ``resample``) -> torchvision's names.
_RESAMPLE = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}


def _require(package: str, extra: str):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise ImportError(
            f"{package} is not installed: install it with `pip install 'oodviz[{extra}]'` (or `pip install {package}`)"
        ) from None


# ---------------------------------------------------------------------------------------------------- timm


def _timm_create(model_name: str, num_classes: int | None, model_args: Mapping) -> nn.Module:
    timm = _require("timm", "timm")
    args = dict(model_args)
    if num_classes is not None:
        args["num_classes"] = num_classes
    if not timm.is_model(model_name):
        close = difflib.get_close_matches(model_name, timm.list_models(), n=3, cutoff=0.6)
        raise ValueError(
            f"timm has no model {model_name!r}"
            + (f" (did you mean {', '.join(repr(TIMM_PREFIX + c) for c in close)}?)" if close else "")
            + "; timm.list_models() lists them"
        )
    return timm.create_model(model_name, pretrained=False, **args)


def _module_name(model: nn.Module, module: nn.Module) -> str | None:
    return next((name for name, m in model.named_modules() if m is module), None)


@functools.cache  # the app checks its config on every rerun
def _timm_skeleton(model_name: str, args_json: str) -> tuple[tuple[str, ...], str, int, int]:
    """(layer names, classifier name, D, default class count) of a timm model, built on the meta device."""
    with torch.device("meta"):
        model = _timm_create(model_name, None, json.loads(args_json))
    head = model.get_classifier()
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"timm model {model_name!r} has a classifier of type {type(head).__name__}, not an nn.Linear: oodviz needs "
            "the final linear layer as the detectors' head; choose a timm model with a linear classifier"
        )
    names = tuple(n for n, _ in model.named_modules() if n)
    return names, _module_name(model, head), head.in_features, head.out_features


def _timm_architecture(model_name: str, model_args: Mapping) -> Architecture:
    args_json = json.dumps(dict(model_args), sort_keys=True)
    _, head, dim, classes = _timm_skeleton(model_name, args_json)
    return Architecture(
        TIMM_PREFIX + model_name,
        head,
        dim,
        lambda num_classes: _timm_create(model_name, num_classes, model_args),
        classes,
        None,
        torchvision=False,
    )


def _timm_input_size(model: nn.Module, config: dict) -> tuple[int, int, int]:
    """The input size the model takes: the data config's, unless the model was built for a fixed other size
    (``img_size=32``: the data config still says the pretrained 224)."""
    fixed = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if fixed is not None and getattr(model.patch_embed, "strict_img_size", True):
        return (config["input_size"][0], *fixed)
    return tuple(config["input_size"])


def timm_transform(model: nn.Module) -> tuple[Callable, tuple[int, ...]]:
    """The model's eval preprocessing (``resolve_data_config`` / ``create_transform``) and its ``(C, H, W)``."""
    from timm.data import create_transform, resolve_data_config

    config = resolve_data_config({}, model=model)
    config["input_size"] = _timm_input_size(model, config)
    return RGBTransform(create_transform(**config, is_training=False)), config["input_size"]


def _timm_tokens(model: nn.Module) -> tuple[int, str] | None:
    """(prefix tokens, head pooling) of a timm transformer (its ``forward_features`` gives ``[B, T, D]``)."""
    if not hasattr(model, "num_prefix_tokens"):
        return None
    # 'token': the head reads the class token; 'avg' (and 'map', 'max': attention or max over the patch tokens)
    # read the patch tokens, whose mean is the nearest of oodviz's poolings.
    return int(model.num_prefix_tokens), "cls" if getattr(model, "global_pool", "token") == "token" else "mean"


def _timm_channels_last(model: nn.Module) -> Callable[[str], bool]:
    """Does layer ``name`` of a timm model output ``[B, H, W, C]``? Models built channels-last say so
    (``output_fmt == "NHWC"``: Swin, every layer but the patch convolution); elsewhere a linear layer or layer
    norm on a 4-D map works on its last axis (ConvNeXt's block internals), see :func:`last_axis_layers`."""
    modules = dict(model.named_modules())
    if getattr(model, "output_fmt", "NCHW") == "NHWC":
        return lambda name: not isinstance(modules.get(name), nn.Conv2d)
    return last_axis_layers(model)


def load_timm(
    model_name: str,
    weights: str | None = "default",
    checkpoint: str | os.PathLike | None = None,
    *,
    layer: str | None = None,
    pooling: str | None = None,
    classes: Sequence[str] | None = None,
    transform: Callable | None = None,
    input_shape: Sequence[int] | None = None,
    model_args: Mapping | None = None,
) -> Backbone:
    """``timm:<model_name>``: built with ``timm.create_model(model_name, pretrained=False, **model_args)``.

    Weights from ``checkpoint`` (a state dict of that model, e.g. ``torch.save(model.state_dict(), path)``; the
    class count from its classifier's shape), or random (``weights="random"``, seeded). ``weights="default"``
    (pretrained) without a checkpoint is refused: nothing is downloaded. ``model_args``: what the model was built
    with, JSON values (``{"img_size": 32}``, ``{"global_pool": "avg"}``). The rest as
    :func:`oodviz.models.load_backbone`.
    """
    model_args = dict(model_args or {})
    arch = _timm_architecture(model_name, model_args)
    random = checkpoint is None and weights in (None, "random")
    if checkpoint is not None:
        path = check_file(checkpoint)
        state = load_state_dict_file(path, f"a state dict of the timm model {model_name}")
        model = build_from_state_dict(arch, state, path)
        # model_args such as global_pool change the features, not the file: both make the cache key
        weights_id = f"sha256:{file_sha256(path)}" + (
            f":{json.dumps(model_args, sort_keys=True)}" if model_args else ""
        )
    elif random:
        model = build_random(arch, arch.default_classes, calibrate=False)
        weights_id = f"random:{arch.name}:{json.dumps(model_args, sort_keys=True)}:seed={RANDOM_SEED}"
    elif weights == "default":
        raise FileNotFoundError(
            f"{arch.name}: oodviz does not download pretrained weights. On a machine with internet save them "
            f'(python -c "import timm, torch; torch.save(timm.create_model({model_name!r}, pretrained=True)'
            f".state_dict(), '{model_name}.pt')\"), copy the file here and pass checkpoint='{model_name}.pt' (the "
            "app's checkpoint field), or use weights='random' for a dry run."
        )
    else:
        raise ValueError(f"{arch.name} takes weights='default' with a checkpoint file, or 'random'; got {weights!r}")
    default_transform, default_shape = timm_transform(model)
    if random:  # as build_random does for the registry's CNNs: usable BatchNorm statistics for a dry run
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            calibrate_batchnorm(model, tuple(input_shape or default_shape))
    model.eval()
    return _finish(
        arch.name,
        model,
        transform or default_transform,
        input_shape or (default_shape if transform is None else None),
        weights_id,
        arch.head,
        layer,
        pooling,
        classes,
        _timm_channels_last(model),
        _timm_tokens(model),
        lambda x: model.forward_features(x),
    )


# ---------------------------------------------------------------------------------------------------- Hugging Face


def _hf_directory(directory: str | os.PathLike) -> Path:
    path = Path(directory).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a saved Hugging Face model: expected a directory with config.json and the weights "
            "(model.save_pretrained(directory) and processor.save_pretrained(directory) on a machine that has them; "
            "oodviz reads only local files)"
        )
    return path


def _hf_config(path: Path):
    transformers = _require("transformers", "hf")
    return transformers.AutoConfig.from_pretrained(path, local_files_only=True)


def _hf_build(config) -> nn.Module:
    from transformers import AutoModelForImageClassification

    try:
        return AutoModelForImageClassification.from_config(config)
    except ValueError as error:
        raise ValueError(
            f"the Hugging Face model type {config.model_type!r} is not an image classifier "
            f"(AutoModelForImageClassification): {error}"
        ) from None


@functools.cache
def _hf_layer_names(path: str, config_mtime: float) -> tuple[str, ...]:
    with torch.device("meta"):
        model = _hf_build(_hf_config(Path(path)))
    return tuple(n for n, _ in model.named_modules() if n)


def _hf_weights_digest(path: Path) -> str:
    """sha256 over the directory's config and weight files (names and bytes): the weights' identity."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    for file in files:
        digest.update(file.name.encode())
        digest.update(file_sha256(file).encode())
    return digest.hexdigest()


def hf_transform(path: Path) -> tuple[Callable, tuple[int, ...]]:
    """A torchvision transform from the directory's ``preprocessor_config.json`` (resize, centre crop, scale to
    0..1, normalise: the image processor's values, none of its code) and the ``(C, H, W)`` it gives."""
    from torchvision import transforms

    file = path / "preprocessor_config.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} has no preprocessor_config.json, where the model's preprocessing is written: save the image "
            "processor too (AutoImageProcessor.from_pretrained(...).save_pretrained(directory)), or pass transform= "
            "and input_shape="
        )
    config = json.loads(file.read_text())
    if not config.get("do_rescale", True) or abs(config.get("rescale_factor", 1 / 255) - 1 / 255) > 1e-9:
        raise ValueError(
            f"{file}: oodviz writes a transform for pixels rescaled by 1/255 (do_rescale with rescale_factor 1/255) "
            "only; pass transform= and input_shape="
        )
    interpolation = transforms.InterpolationMode[_RESAMPLE.get(config.get("resample", 2), "BILINEAR")]
    steps: list = []
    size = config.get("size") or {}
    crop = config.get("crop_size") or {}
    if isinstance(size, int):
        size = {"shortest_edge": size}
    if config.get("do_resize", True) and "height" in size:
        steps.append(transforms.Resize((size["height"], size["width"]), interpolation=interpolation))
        out = (size["height"], size["width"])
    elif config.get("do_resize", True) and "shortest_edge" in size:
        edge = size["shortest_edge"]
        # ConvNeXt's processor: below 384, resize to edge / crop_pct and crop the centre edge x edge
        if "crop_pct" in config and edge < 384:
            steps += [transforms.Resize(int(edge / config["crop_pct"]), interpolation), transforms.CenterCrop(edge)]
            out = (edge, edge)
        else:
            steps.append(transforms.Resize(edge, interpolation=interpolation))
            out = None
    else:
        raise ValueError(f"{file}: size {size!r} gives no fixed input size; pass transform= and input_shape=")
    if config.get("do_center_crop") and crop:
        steps.append(transforms.CenterCrop((crop["height"], crop["width"])))
        out = (crop["height"], crop["width"])
    if out is None:
        raise ValueError(
            f"{file}: resizing the shortest edge without a crop gives no fixed input size; pass transform="
        )
    steps.append(transforms.ToTensor())  # to 0..1: the rescale by 1/255
    if config.get("do_normalize", True):
        steps.append(transforms.Normalize(config["image_mean"], config["image_std"]))
    return RGBTransform(transforms.Compose(steps)), (3, *out)


def _hf_tokens(config) -> tuple[int, str] | None:
    """(prefix tokens, head pooling) of a Hugging Face transformer of a :data:`HF_TRANSFORMERS` type, from its
    config: Swin has no class token and its head averages the tokens; the others have a class token (DeiT adds a
    distillation token, DINOv2 register tokens), read by the head unless ``use_mean_pooling`` (BEiT) says the
    patch tokens' mean. ``None`` for other types: where their tokens are is not known."""
    if config.model_type not in HF_TRANSFORMERS:
        return None
    if config.model_type.startswith("swin"):
        return 0, "mean"
    prefix = 1 + (config.model_type == "deit") + int(getattr(config, "num_register_tokens", 0) or 0)
    return prefix, "mean" if getattr(config, "use_mean_pooling", False) else "cls"


def _hf_last_hidden(model: nn.Module, x: Tensor) -> Tensor:
    return model(x, output_hidden_states=True).hidden_states[-1]


def load_hf(
    directory: str | os.PathLike,
    weights: str | None = "default",
    checkpoint: str | os.PathLike | None = None,
    *,
    layer: str | None = None,
    pooling: str | None = None,
    classes: Sequence[str] | None = None,
    transform: Callable | None = None,
    input_shape: Sequence[int] | None = None,
) -> Backbone:
    """``hf:<directory>``: an ``AutoModelForImageClassification`` saved with ``save_pretrained(directory)``,
    read with ``local_files_only=True`` (``weights="random"``: its config with random weights, seeded).

    The class names are the config's ``id2label``; the head is the model's ``classifier``; the preprocessing is
    written from ``preprocessor_config.json`` (:func:`hf_transform`). The rest as :func:`oodviz.models.load_backbone`.
    """
    if checkpoint is not None:
        raise ValueError(
            "an hf:<directory> model takes its weights from the directory (save_pretrained); leave checkpoint unset"
        )
    path = _hf_directory(directory)
    config = _hf_config(path)
    if weights == "default":
        from transformers import AutoModelForImageClassification

        try:
            model = AutoModelForImageClassification.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"{str(path)!r} could not be loaded as a Hugging Face image classifier with local files only: {error}"
            ) from None
        weights_id = f"sha256:{_hf_weights_digest(path)}"
    elif weights is None or weights == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            model = _hf_build(config)
        weights_id = f"random:hf:{file_sha256(path / 'config.json')}:seed={RANDOM_SEED}"
    else:
        raise ValueError(
            f"an hf:<directory> model takes weights='default' (the directory's) or 'random'; got {weights!r}"
        )
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"the Hugging Face model in {str(path)!r} has no linear `classifier` (found {type(head).__name__}): oodviz "
            "needs it as the detectors' head"
        )
    model.eval()
    if transform is None:
        transform, default_shape = hf_transform(path)
    else:
        default_shape = None
    default_classes = _hf_labels(config)
    if default_classes is not None and len(default_classes) != head.out_features:
        default_classes = None
    return _finish(
        HF_PREFIX + str(directory),
        model,
        transform,
        input_shape or default_shape,
        weights_id,
        _module_name(model, head),
        layer,
        pooling,
        classes if classes is not None else default_classes,
        last_axis_layers(model),
        _hf_tokens(config),
        lambda x: _hf_last_hidden(model, x),
    )


# ---------------------------------------------------------------------------------------------------- shared


def hub_layer_names(name: str, model_args: Mapping | None = None) -> list[str]:
    """The names ``layer=`` accepts for a ``timm:`` / ``hf:`` backbone, from the model built on the meta device."""
    if hub_kind(name) == "timm":
        return list(_timm_skeleton(name[len(TIMM_PREFIX) :], json.dumps(dict(model_args or {}), sort_keys=True))[0])
    path = _hf_directory(name[len(HF_PREFIX) :])
    return list(_hf_layer_names(str(path.resolve()), (path / "config.json").stat().st_mtime))


def hub_token_layout(name: str, model_args: Mapping | None = None) -> TokenLayout | None:
    """The token layout of a ``timm:`` / ``hf:`` backbone (see
    :func:`oodviz.models.registry.architecture_token_layout`), from the model built on the meta device."""
    if hub_kind(name) == "timm":
        return _timm_token_layout(name[len(TIMM_PREFIX) :], json.dumps(dict(model_args or {}), sort_keys=True))
    path = _hf_directory(name[len(HF_PREFIX) :])
    return _hf_token_layout(str(path.resolve()), (path / "config.json").stat().st_mtime)


@functools.cache
def _timm_token_layout(model_name: str, args_json: str) -> TokenLayout | None:
    from timm.data import resolve_data_config

    with torch.device("meta"):
        model = _timm_create(model_name, None, json.loads(args_json))
    info = _timm_tokens(model)
    if info is None:
        return None
    shape = _timm_input_size(model, resolve_data_config({}, model=model))
    return probe_token_layout(model, shape, *info, lambda x: model.forward_features(x), device="meta")


@functools.cache
def _hf_token_layout(path: str, config_mtime: float) -> TokenLayout | None:
    config = _hf_config(Path(path))
    info = _hf_tokens(config)
    if info is None:
        return None
    with torch.device("meta"):
        model = _hf_build(config)
    size = getattr(config, "image_size", 224)
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    shape = (int(getattr(config, "num_channels", 3)), height, width)
    return probe_token_layout(model, shape, *info, lambda x: _hf_last_hidden(model, x), device="meta")


def hub_classes(name: str, weights: str | None = "default", checkpoint=None) -> list[str] | None:
    """Class names a ``timm:`` / ``hf:`` backbone gets without loading it: a Hugging Face config's ``id2label``
    (when its labels are not the placeholders ``LABEL_<i>``), ``None`` for timm (a state dict holds none)."""
    if hub_kind(name) != "hf":
        return None
    return _hf_labels(_hf_config(_hf_directory(name[len(HF_PREFIX) :])))


def _hf_labels(config) -> list[str] | None:
    """The config's ``id2label`` as a list, ``None`` when it holds only the placeholders ``LABEL_<i>``."""
    label = config.id2label or {}
    names = [str(label[i]) for i in range(len(label))]
    return None if all(n == f"LABEL_{i}" for i, n in enumerate(names)) else names


def last_axis_layers(model: nn.Module) -> Callable[[str], bool]:
    """Does layer ``name`` output channels-last maps ``[B, H, W, C]`` when its output is 4-D? True for a linear
    layer or layer norm (they work on the last axis; not the ``*2d`` norms, which permute around it), and for a
    module without parameters (activation, dropout; not stochastic depth) right after one of those in its parent,
    as in ConvNeXt blocks (``norm -> fc1 -> act -> fc2`` on ``[B, H, W, C]``). A rule read from the modules, not
    the data: a model that permutes elsewhere can defeat it (``layout`` of :meth:`Backbone.feature_shape` says
    what was assumed)."""
    modules = dict(model.named_modules())

    def acts_on_last_axis(module: nn.Module) -> bool:
        if isinstance(module, nn.Linear):
            return True
        named_2d = "2d" in type(module).__name__.lower() or getattr(module, "data_format", "") == "channels_first"
        return isinstance(module, nn.LayerNorm) and not named_2d

    def rule(name: str) -> bool:
        module = modules.get(name)
        if module is None:
            return False
        if acts_on_last_axis(module) or type(module).__name__.endswith("Mlp"):
            return True
        parent, _, child = name.rpartition(".")
        # stochastic depth (an Identity at rate 0) drops a residual branch after it is permuted back to
        # [B, C, H, W], in timm's and Hugging Face's ConvNeXt alike
        drop_path = "droppath" in type(module).__name__.lower() or "drop_path" in child
        if next(module.parameters(), None) is not None or drop_path:
            return False
        siblings = [n for n, _ in modules[parent].named_children()]
        before = siblings.index(child) - 1
        return before >= 0 and rule(f"{parent}.{siblings[before]}" if parent else siblings[before])

    return rule


def _finish(
    name: str,
    model: nn.Module,
    transform: Callable,
    input_shape: Sequence[int] | None,
    weights_id: str,
    head: str,
    layer: str | None,
    pooling: str | None,
    classes: Sequence[str] | None,
    channels_last: Callable[[str], bool],
    token_info: tuple[int, str] | None,
    last_hidden: Callable[[Tensor], Tensor],
) -> Backbone:
    """The Backbone of a loaded timm / Hugging Face model: its token layout found with one probe forward."""
    if pooling is not None:
        check_pooling(pooling)
    if input_shape is None:
        sample = transform(Image.new("RGB", (256, 256)))
        input_shape = tuple(sample.shape)
    tokens = None if token_info is None else probe_token_layout(model, input_shape, *token_info, last_hidden)
    backbone = Backbone(
        name,
        model,
        transform,
        input_shape=input_shape,
        weights_id=weights_id,
        head_module=head,
        layer=layer,
        pooling=pooling,
        classes=classes,
        arch=name,
        channels_last=channels_last,
        tokens=tokens,
    )
    if layer is not None:
        backbone.feature_shape()  # one probe forward: D is known (and checked) before any run
    if classes is not None and len(classes) != backbone.num_classes:
        raise ValueError(f"{len(classes)} class names given but the model has {backbone.num_classes} outputs")
    return backbone
