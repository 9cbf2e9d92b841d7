"""The backbone registry: names -> :class:`~oodviz.models.backbone.Backbone`.

``available_backbones()`` lists the built-in names: the bundled ``digits-cnn`` and ``fashion-cnn``
(offline, weights in ``oodviz/weights/``), seven torchvision ImageNet classifiers and OpenOOD v1.5's
``openood-resnet18-32x32`` (CIFAR-10/100) and ``openood-resnet18-224x224`` (ImageNet-200), which take OpenOOD's
checkpoints (:mod:`oodviz.models.openood`). ``load_backbone`` also loads a
user's own model: a state-dict checkpoint of a registry architecture
(``load_backbone("resnet18", checkpoint="my.pt")``), a TorchScript file
(``load_backbone("torchscript", checkpoint="model.pt")``) or a ``torch.export`` program
(``load_backbone("export", checkpoint="model.pt2")``), a timm model (``load_backbone("timm:convnext_tiny",
checkpoint="my.pt")``) or a saved Hugging Face classifier (``load_backbone("hf:path/to/directory")``), see
:mod:`oodviz.models.hub`. ``wrap_model`` wraps a model object.

Weights (``weights=``):

- ``"default"``: the bundled weights (digits, Fashion-MNIST), or the torchvision weights of the architecture's
  ``DEFAULT`` enum member, read from the torchvision cache (``$TORCH_HOME/hub/checkpoints`` or
  ``weights_dir``). Nothing is downloaded unless ``allow_download=True``; a missing file is a
  ``FileNotFoundError`` naming the file and the folder to put it in. OpenOOD's networks have no default weights:
  a ``ValueError`` names OpenOOD's download script and ``checkpoint=``.
- a torchvision weights name such as ``"IMAGENET1K_V2"``: that enum member, same rules.
- ``"random"`` or ``None``: random initialisation with a fixed seed (reproducible dry runs and
  tests; the global RNG is left untouched).

Every file is read with ``torch.load(..., weights_only=True)``; a file that is not what was
asked for is a ``ValueError`` saying what was expected.

The architectures live in :mod:`oodviz.models.architectures`, reading and checking weight files in
:mod:`oodviz.models.checkpoints`; this module holds the public loaders.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from uuid import uuid4

import torch
from PIL import Image
from torch import Tensor, nn

from oodviz.models.architectures import (
    BUNDLED,
    OPENOOD_ARCHITECTURES,
    RANDOM_SEED,
    USER_MODEL_NAMES,
    architecture,
    architecture_classes,
    architecture_module_names,
    available_backbones,
    build_random,
    default_transform,
    imagenet_transform,
    openood_weights_message,
    weights_enum,
)
from oodviz.models.backbone import Backbone, TokenLayout, check_pooling, probe_token_layout
from oodviz.models.checkpoints import (
    CheckpointError,
    archive_kind,
    build_from_state_dict,
    check_file,
    file_sha256,
    load_state_dict_file,
    short_error,
    torchvision_state_dict,
)
from oodviz.models.hub import hub_classes, hub_layer_names, hub_token_layout, load_hf, load_timm
from oodviz.models.hub_names import HF_PREFIX, TIMM_PREFIX, hub_kind


def load_backbone(
    name: str,
    weights: str | None = "default",
    checkpoint: str | os.PathLike | None = None,
    layer: str | None = None,
    pooling: str | None = None,
    weights_dir: str | os.PathLike | None = None,
    *,
    allow_download: bool = False,
    classes: Sequence[str] | None = None,
    transform: Callable | None = None,
    input_shape: Sequence[int] | None = None,
    model_args: Mapping | None = None,
) -> Backbone:
    """Load a backbone by registry name, or a user's model from ``checkpoint``.

    - ``name``: one of :func:`available_backbones`, or ``"torchscript"`` / ``"export"`` with
      ``checkpoint`` (see :func:`load_scripted`), or ``"timm:<model name>"`` / ``"hf:<directory>"``
      (:func:`oodviz.models.hub.load_timm`, :func:`oodviz.models.hub.load_hf`; nothing is downloaded).
    - ``weights``: ``"default"``, a torchvision weights name (``"IMAGENET1K_V2"``) or enum member,
      ``"random"`` or ``None`` (= random); see the module docstring. Ignored when ``checkpoint``
      is given.
    - ``checkpoint``: a state-dict file of architecture ``name`` (a raw state dict, or
      ``{"state_dict": ...}`` / ``{"model": ...}``; ``module.`` prefixes are stripped); the
      number of classes comes from the head weight's shape, so a 10-class resnet18 loads.
    - ``layer``: a module name (``"layer3"``, ``"encoder.layers.encoder_layer_6"``) whose output
      gives the features instead of the penultimate layer; ``head`` is then ``None``.
    - ``pooling``: ``"avg"``, ``"max"`` or ``"none"`` for a ``layer``'s feature maps or tokens
      (``"none"`` flattens: ``D = C * H * W``, check :func:`estimate_memory`); for the tokens of ``vit_b_16``
      or a timm or Hugging Face transformer also ``"cls"`` (the class token) or ``"mean"`` (the patch tokens' mean).
      ``None`` (default): what the model's own head reads for such tokens, ``"avg"`` for everything else.
    - ``weights_dir``: folder holding torchvision weight files (default
      :func:`default_weights_dir`); ``allow_download``: let torchvision fetch a missing file.
    - ``classes``: class names for a checkpoint; ``transform`` / ``input_shape``: override the
      preprocessing (a checkpoint trained on other images than ImageNet needs its own). OpenOOD's networks
      default to their benchmark's preprocessing, chosen by the class count (a 100-class
      ``openood-resnet18-32x32`` checkpoint gets CIFAR-100's); ``transform=openood_transform(benchmark)[0]``
      names it.
    - ``model_args``: for ``timm:`` names, what ``timm.create_model`` builds the model with
      (``{"img_size": 32}``), as the checkpoint was trained.

    The model is returned in eval mode on the CPU.
    """
    if pooling is not None:
        check_pooling(pooling)
    hub = hub_kind(name)
    if model_args is not None and hub != "timm":
        raise ValueError(f"model_args are for timm:<model name> backbones, not {name!r}")
    if hub is not None:
        options = {"layer": layer, "pooling": pooling, "classes": classes, "transform": transform}
        options["input_shape"] = input_shape
        if hub == "timm":
            return load_timm(name[len(TIMM_PREFIX) :], weights, checkpoint, **options, model_args=model_args)
        return load_hf(name[len(HF_PREFIX) :], weights, checkpoint, **options)
    key = name.strip().lower() if isinstance(name, str) else name
    if key in USER_MODEL_NAMES:
        if checkpoint is None:
            raise ValueError(f"load_backbone({name!r}) needs checkpoint=<path to the file>")
        return load_scripted(
            checkpoint, kind=key, transform=transform, input_shape=input_shape, classes=classes, layer=layer
        )
    arch = architecture(name)

    if checkpoint is not None:
        path = check_file(checkpoint)
        expected = f"a state dict of the {arch.name} architecture"
        state = load_state_dict_file(path, expected)
        model = build_from_state_dict(arch, state, path)
        weights_id = f"sha256:{file_sha256(path)}"
        default_classes = None
    elif weights is None or weights == "random":
        model = build_random(arch, arch.default_classes)
        weights_id = f"random:{arch.name}:seed={RANDOM_SEED}"
        default_classes = architecture_classes(arch)
    elif arch.name in OPENOOD_ARCHITECTURES:
        raise ValueError(openood_weights_message(arch, weights))
    elif not arch.torchvision:
        if weights != "default":
            raise ValueError(f"{arch.name} has weights 'default' (bundled) or 'random', got {weights!r}")
        bundled = BUNDLED[arch.name]
        path = bundled.weights
        if not path.is_file():
            raise FileNotFoundError(
                f"the bundled {arch.name} weights are missing: expected {path}. Recreate them with "
                f"{bundled.recreate}, or use weights='random' for a dry run."
            )
        model = build_from_state_dict(arch, load_state_dict_file(path, f"the {arch.name} state dict"), path)
        weights_id = f"sha256:{file_sha256(path)}"
        default_classes = list(bundled.classes)
    else:
        member = weights_enum(arch.name, weights)
        state, file_path = torchvision_state_dict(arch, member, weights_dir, allow_download)
        model = build_from_state_dict(arch, state, file_path)
        weights_id = f"sha256:{file_sha256(file_path)}"
        default_classes = list(member.meta["categories"])

    model.eval()
    if transform is None:
        transform, default_shape = default_transform(arch, dict(model.named_modules())[arch.head].out_features)
    else:
        default_shape = None
    shape = tuple(input_shape) if input_shape is not None else (default_shape or _infer_input_shape(transform))
    tokens = None
    if arch.tokens is not None:
        prefix, head_pooling, sequence = arch.tokens
        tokens = probe_token_layout(model, shape, prefix, head_pooling, lambda x: _module_output(model, sequence, x))
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
        tokens=tokens,
    )
    if layer is not None:
        backbone.feature_shape()  # one probe forward: D is known (and checked) before any run
        _check_classes(backbone, classes)
    return backbone


def _module_output(model: nn.Module, name: str, x: Tensor) -> Tensor:
    """The output of ``model``'s module ``name`` in a forward pass of ``x``."""
    captured = []
    handle = dict(model.named_modules())[name].register_forward_hook(lambda _m, _args, out: captured.append(out))
    try:
        model(x)
    finally:
        handle.remove()
    return captured[-1]


def _infer_input_shape(transform: Callable) -> tuple[int, ...]:
    try:
        sample = transform(Image.new("RGB", (256, 256)))
    except Exception as error:
        raise ValueError(
            f"could not run the given transform on a 256 x 256 RGB image ({short_error(error)}); pass input_shape=(C, H, W)"
        ) from None
    if not isinstance(sample, Tensor) or sample.ndim != 3:
        raise ValueError(
            "transform must turn a PIL image into a tensor [C, H, W]; pass input_shape=(C, H, W) if it does"
        )
    return tuple(sample.shape)


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
    path = check_file(checkpoint)
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
                with _torch_export_log_quiet():  # it logs the traceback of the error raised: said once, below
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
        found = archive_kind(path)
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
                        f"load_backbone('<architecture>', checkpoint=...) naming one of {', '.join(available_backbones())}."
                    )
            except Exception:
                pass
        raise CheckpointError(path, f"{path} is not {expected} ({short_error(error)}).{hint}") from None
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
        raise CheckpointError(
            path,
            f"the {kind} model in {path} does not follow the contract {contract} on an input of shape "
            f"[1, {', '.join(map(str, shape))}] ({short_error(error)}); pass input_shape= / transform= matching the model",
        ) from None
    _check_classes(backbone, classes)
    return backbone


@contextmanager
def _torch_export_log_quiet():
    """``torch.export``'s loggers quiet while a program is loaded: on a file it cannot read it logs warnings (one
    with the traceback of the error it then raises) before it raises."""
    logger = logging.getLogger("torch.export")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # its modules' loggers have no level of their own: they take this one
    try:
        yield
    finally:
        logger.setLevel(level)


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
    pooling: str | None = None,
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


def backbone_classes(name: str, weights: str | None = "default", checkpoint=None) -> list[str] | None:
    """The class names ``load_backbone(name, weights, checkpoint)`` gives the backbone, without loading it:
    the bundled models' classes, the torchvision weights' categories (also for ``"random"``), ``None`` for a
    checkpoint (its classes are not recorded in the file) or a model file; for ``timm:`` / ``hf:`` names
    :func:`oodviz.models.hub.hub_classes`."""
    if hub_kind(name):
        return hub_classes(name, weights, checkpoint)
    key = name.strip().lower() if isinstance(name, str) else name
    if key in USER_MODEL_NAMES or checkpoint is not None:
        return None
    arch = architecture(name)
    if weights in (None, "random", "default") or not arch.torchvision:
        return architecture_classes(arch)
    return list(weights_enum(arch.name, weights).meta["categories"])


def architecture_token_layout(name: str, model_args: Mapping | None = None) -> TokenLayout | None:
    """The :class:`~oodviz.models.backbone.TokenLayout` of registry backbone ``name`` or a ``timm:`` / ``hf:``
    backbone (which layers hold its token sequence, what its head reads: where ``pooling="cls"`` / ``"mean"`` apply
    and what ``pooling=None`` gives), found with one forward pass of the architecture built on the meta device: no
    weights read, nothing computed. ``None`` for a model without a token sequence oodviz knows (the CNNs, Swin's
    maps). A ValueError (or the loader's FileNotFoundError / ImportError) when the model cannot be built."""
    if hub_kind(name):
        return hub_token_layout(name, model_args)
    return _registry_token_layout(architecture(name).name)


@functools.cache  # the app checks its config on every rerun
def _registry_token_layout(name: str) -> TokenLayout | None:
    arch = architecture(name)
    if arch.tokens is None:
        return None
    prefix, head_pooling, sequence = arch.tokens
    with torch.device("meta"):
        model = arch.build(arch.default_classes)
    _, shape = default_transform(arch, arch.default_classes)
    return probe_token_layout(
        model, shape, prefix, head_pooling, lambda x: _module_output(model, sequence, x), device="meta"
    )


def architecture_layer_names(name: str, model_args: Mapping | None = None) -> list[str]:
    """The names ``layer=`` accepts for registry backbone ``name`` or a ``timm:`` / ``hf:`` backbone
    (``model.named_modules()``, the root excluded), read from the architecture built on the meta device: no
    weights read, no memory used. ``model_args``: a ``timm:`` model's constructor arguments (its layers can
    depend on them)."""
    if hub_kind(name):
        return hub_layer_names(name, model_args)
    return architecture_module_names(name)
