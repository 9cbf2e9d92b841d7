"""A classifier seen as (transform, features, logits, head): the :class:`Backbone` wrapper.

A :class:`Backbone` turns any image classifier into what the extraction engine needs:

- ``transform(pil_image) -> Tensor [C_in, H, W]``: the model's own preprocessing;
- ``features_and_logits(x [B, C_in, H, W]) -> (features [B, D], logits [B, C])``, both float32;
- ``head``: the final linear layer ``(weight [C, D], bias [C])`` when ``features`` is its input
  (so ``features @ weight.T + bias == logits``), otherwise ``None``;
- ``weights_id``: a string that changes whenever the weights do (the feature store's cache key).

Where the features come from (``source``):

- ``"penultimate"``: the input of the model's final ``nn.Linear`` (captured with a forward
  pre-hook), i.e. the features after the model's own pooling. ``head`` is that layer.
- ``"layer"``: the output of any named module (``layer="layer3"``, see :meth:`Backbone.layer_names`),
  pooled to ``[B, D]``: feature maps ``[B, C, H, W]`` over ``H, W`` (channels-last maps of Swin
  and ConvNeXt block internals over their spatial axes), token sequences ``[B, T, D]`` over ``T``;
  ``pooling="avg"`` or ``"max"``; for a transformer's token sequence also ``"cls"`` (the class token,
  what a ViT's head reads) or ``"mean"`` (the mean of the patch tokens, class, register and
  distillation tokens left out: what the head of a mean-pooled ViT reads); ``pooling="none"``
  flattens, which can make ``D`` huge (the memory estimate shows it). Without a ``pooling`` a token
  layer takes what the model's own head reads (:class:`TokenLayout`), every other layer ``"avg"``.
  ``head`` is ``None``.
- ``"output"``: models without hooks (TorchScript, exported programs, plain callables) follow
  an output contract: ``model(x)`` returns ``(features [B, D], logits [B, C])``, or logits
  ``[B, C]`` plus a ``model.features(x)`` method, or logits only (then ``features`` are the
  logits and ``head`` is ``None``). ``head`` is set only when a linear layer of the model is
  verified to map the features to the logits.

Hooks are attached for one forward call and removed right after, so the model object is left
exactly as it was given. ``features_and_logits`` runs on the device of ``x``; move the model with
:meth:`Backbone.to`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from oodviz.models.architectures import unknown_layer_message

POOLINGS = ("avg", "max", "cls", "mean", "none")
#: The poolings that read a transformer's token sequence by position (class token first, patch tokens last).
TOKEN_POOLINGS = ("cls", "mean")
Head = tuple[Tensor, Tensor]

#: Input used for probes (shape discovery, head verification): fixed, so probes are reproducible.
_PROBE_SEED = 1234


@dataclass(frozen=True)
class FeatureShape:
    """What one sample's features look like before and after pooling.

    ``raw``: the per-sample shape the layer produces (``(C, H, W)``, ``(H, W, C)`` channels-last,
    ``(T, D)`` tokens or ``(D,)``); ``layout``: ``"nchw"``, ``"nhwc"``, ``"tokens"`` or ``"vector"``;
    ``feature_dim``: ``D`` after pooling (what is stored per sample); ``pooled_dim``: ``D`` that
    ``pooling="avg"``/``"max"`` would give (equal to ``feature_dim`` unless ``pooling="none"``);
    ``num_classes``: ``C``.
    """

    raw: tuple[int, ...]
    layout: str
    feature_dim: int
    pooled_dim: int
    num_classes: int


@dataclass(frozen=True)
class TokenLayout:
    """Where a transformer keeps what in its token sequence ``[B, T, D]``, found by the loader from the model.

    ``prefix``: the tokens before the patch tokens (class token, register and distillation tokens: timm's
    ``num_prefix_tokens``); the class token, when the model has one, is token 0. ``head_pooling``: what the
    model's own head reads, ``"cls"`` or ``"mean"`` (of the patch tokens), the default of a token layer.
    ``layers``: the modules whose output is the whole sequence ``[B, T, D]``, prefix tokens included (the
    encoder blocks and what follows them; not the patch embedding, which comes before the class token), in
    the model's module order.
    """

    prefix: int
    head_pooling: str
    layers: tuple[str, ...]


def probe_token_layout(
    model: nn.Module,
    input_shape: Sequence[int],
    prefix: int,
    head_pooling: str,
    last_hidden: Callable[[Tensor], Tensor],
    device: torch.device | str | None = None,
) -> TokenLayout | None:
    """The :class:`TokenLayout` of a transformer, from one forward pass of a fixed random input ``[1,
    *input_shape]``: its layers are the modules whose output has the ``T`` tokens of ``last_hidden(x)`` (the
    model's final sequence ``[B, T, D]``). ``None`` when ``last_hidden`` gives no token sequence. ``device``: where
    the input is made (``"meta"`` for a model built on the meta device: shapes only, nothing computed)."""
    seen: dict[str, tuple] = {}

    def record(name: str) -> Callable:
        def hook(_module, _args, out) -> None:  # returns None: the output is left as it is
            seen.setdefault(name, tuple(out.shape) if isinstance(out, Tensor) else ())

        return hook

    x = torch.randn((1, *input_shape), generator=torch.Generator().manual_seed(_PROBE_SEED))
    if device is not None:
        x = x.to(device)
    hooks = [module.register_forward_hook(record(name)) for name, module in model.named_modules() if name]
    try:
        with torch.no_grad(), _eval_mode(model):
            last = last_hidden(x)
    finally:
        for hook in hooks:
            hook.remove()
    if last.ndim != 3:
        return None
    tokens = last.shape[1]
    layers = tuple(n for n, _ in model.named_modules() if len(seen.get(n, ())) == 3 and seen[n][1] == tokens)
    return TokenLayout(prefix=prefix, head_pooling=head_pooling, layers=layers)


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise ValueError(
            f"pooling must be one of {POOLINGS}, got {pooling!r}; 'avg' is the usual choice for feature maps, "
            "'cls' or 'mean' for a transformer's tokens"
        )
    return pooling


def _layout(value: Tensor, channels_last: bool) -> str:
    if value.ndim == 2:
        return "vector"
    if value.ndim == 3:
        return "tokens"
    return "nhwc" if (channels_last and value.ndim == 4) else "nchw"


def pool_features(value: Tensor, pooling: str = "avg", channels_last: bool = False, prefix_tokens: int = 0) -> Tensor:
    """Reduce one layer's output ``[B, ...]`` to features ``[B, D]``.

    ``[B, D]`` is returned as is. ``[B, T, D]`` (tokens) is reduced over ``T``; ``[B, C, H, W]``
    (or ``[B, C, *spatial]``) over the spatial axes; with ``channels_last=True`` a 4-D input is
    ``[B, H, W, C]`` and reduced over ``H, W``. ``pooling`` is ``"avg"``, ``"max"`` or ``"none"``
    (flatten everything after the batch axis: ``D = C * H * W``); for tokens ``[B, T, D]`` also
    ``"cls"`` (token 0, ``value[:, 0]``) or ``"mean"`` (the patch tokens' mean,
    ``value[:, prefix_tokens:].mean(1)``: the class, register and distillation tokens left out).
    """
    check_pooling(pooling)
    if value.ndim < 2:
        raise ValueError(f"a feature layer must give [B, ...] with at least 2 axes, got shape {tuple(value.shape)}")
    if value.ndim == 2:
        return value
    if pooling in TOKEN_POOLINGS:
        if value.ndim != 3:
            raise ValueError(
                f"pooling={pooling!r} reads a transformer's token sequence [B, T, D]; this layer gives "
                f"{list(value.shape)}, a feature map: use pooling='avg' or 'max'"
            )
        if not 0 <= prefix_tokens < value.shape[1]:
            raise ValueError(
                f"prefix_tokens={prefix_tokens} leaves no patch tokens in a sequence of {value.shape[1]} tokens"
            )
        return value[:, 0] if pooling == "cls" else value[:, prefix_tokens:].mean(dim=1)
    if pooling == "none":
        return value.flatten(1)
    if value.ndim == 3:
        dims: tuple[int, ...] = (1,)
    elif value.ndim == 4 and channels_last:
        dims = (1, 2)
    else:
        dims = tuple(range(2, value.ndim))
    return value.mean(dim=dims) if pooling == "avg" else value.amax(dim=dims)


def _pooled_dim(raw: tuple[int, ...], layout: str) -> int:
    if layout in ("vector", "tokens", "nhwc"):
        return raw[-1]
    return raw[0]


def _never_channels_last(layer: str) -> bool:
    return False


@contextmanager
def _eval_mode(model):
    """Eval mode for a probe (no BatchNorm statistics updated), each module's mode restored after."""
    if not isinstance(model, nn.Module) or isinstance(model, torch.jit.ScriptModule):
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _first_tensor_device(model) -> torch.device:
    if isinstance(model, nn.Module):
        for tensor in model.parameters():
            return tensor.device
        for tensor in model.buffers():
            return tensor.device
    return torch.device("cpu")


def _is_linear(module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    # TorchScript keeps the Python class name of scripted submodules here.
    return getattr(module, "original_name", None) == "Linear" and hasattr(module, "weight")


class Backbone:
    """An image classifier with its transform, feature source and weights identity.

    Made by :func:`oodviz.models.load_backbone` (registry names, checkpoints, TorchScript) or
    :func:`oodviz.models.wrap_model` (a model object already in memory); see the module docstring
    for what ``source``, ``head`` and ``pooling`` mean.

    Attributes: ``name``, ``model``, ``transform``, ``input_shape`` (``(C_in, H, W)`` of one
    transformed sample), ``layer``, ``pooling``, ``classes`` (list of class names or ``None``),
    ``weights_id``, ``source`` (``"penultimate"``, ``"layer"`` or ``"output"``), ``arch``
    (registry architecture or ``None``) and ``tokens`` (the :class:`TokenLayout` of a transformer whose
    loader knows it, else ``None``: ``pooling="cls"`` / ``"mean"`` need it).

    ``pooling=None`` takes the layer's default, :attr:`default_pooling`: ``tokens.head_pooling`` for a layer in
    ``tokens.layers``, ``"avg"`` otherwise; ``pooling`` is that resolved name (what the feature store's key holds:
    ``None`` and the name it resolves to give the same features, and share their stores).
    """

    def __init__(
        self,
        name: str,
        model: Callable[[Tensor], object],
        transform: Callable,
        *,
        input_shape: Sequence[int],
        weights_id: str,
        head_module: str | None = None,
        layer: str | None = None,
        pooling: str | None = None,
        classes: Sequence[str] | None = None,
        arch: str | None = None,
        channels_last: Callable[[str], bool] | None = None,
        tokens: TokenLayout | None = None,
    ):
        self.name = name
        self.model = model
        self.transform = transform
        self.input_shape = tuple(int(s) for s in input_shape)
        self.weights_id = weights_id
        self.layer = layer
        self.tokens = tokens
        self.pooling = check_pooling(self.default_pooling if pooling is None else pooling)
        self.arch = arch
        self._channels_last = channels_last or _never_channels_last
        self._shape: FeatureShape | None = None
        self._output_head: str | None = None
        self._head_module = head_module

        modules = dict(model.named_modules()) if isinstance(model, nn.Module) else {}
        if layer is not None:
            if isinstance(model, torch.jit.ScriptModule) or not isinstance(model, nn.Module):
                raise ValueError(
                    f"layer={layer!r} needs hooks, which TorchScript modules and plain callables do not support; "
                    "make the model return (features, logits) from forward instead and pass layer=None"
                )
            if layer not in modules:
                note = "Backbone.layer_names() lists all of them (the names of model.named_modules())."
                raise ValueError(unknown_layer_message(name, layer, list(modules), note))
            self.source = "layer"
            self._hooked = modules[layer]
        elif head_module is not None:
            if head_module not in modules or not _is_linear(modules[head_module]):
                raise ValueError(f"{name}: head_module {head_module!r} must name the model's final nn.Linear")
            self.source = "penultimate"
            self._hooked = modules[head_module]
            self._head_name = head_module
        else:
            self.source = "output"
            self._hooked = None
        self._classes = None if classes is None else [str(c) for c in classes]
        if self._classes is not None and self.source == "penultimate" and len(self._classes) != self.num_classes:
            raise ValueError(
                f"{name}: {len(self._classes)} class names given but the head has {self.num_classes} outputs"
            )

    # ------------------------------------------------------------------ identity and shapes

    @property
    def default_pooling(self) -> str:
        """What ``pooling=None`` gives this backbone's layer: what the model's own head reads
        (``tokens.head_pooling``, ``"cls"`` or ``"mean"``) for a layer holding the model's token sequence, ``"avg"``
        for every other layer (a feature map's global average, as a CNN's head reads it)."""
        token_layer = self.tokens is not None and self.layer is not None and self.layer in self.tokens.layers
        return self.tokens.head_pooling if token_layer else "avg"

    @property
    def classes(self) -> list[str] | None:
        """Class names, index ``i`` naming logit ``i``; ``None`` when unknown."""
        return self._classes

    @property
    def device(self) -> torch.device:
        """Device of the model's first parameter (CPU for parameter-less callables)."""
        return _first_tensor_device(self.model)

    def to(self, device: torch.device | str) -> Backbone:
        """Move the model to ``device`` (in place, like ``nn.Module.to``) and return ``self``."""
        if isinstance(self.model, nn.Module):
            self.model.to(device)
        return self

    @property
    def head(self) -> Head | None:
        """The final linear layer ``(weight [C, D], bias [C])`` mapping ``features`` to ``logits``,
        detached, on the model's device; ``None`` when the features are not its input."""
        if self.source == "penultimate":
            weight = self._hooked.weight.detach()
            bias = self._hooked.bias
            bias = bias.detach() if bias is not None else torch.zeros(weight.shape[0], device=weight.device)
            return weight, bias
        if self.source == "output":
            self.feature_shape()  # the first probe looks for a verified head
            if self._output_head is not None:
                return self._head_params(self._output_head)
        return None

    @property
    def num_classes(self) -> int:
        """``C``, the number of logits."""
        if self.source == "penultimate":
            return int(self._hooked.weight.shape[0])
        return self.feature_shape().num_classes

    @property
    def feature_dim(self) -> int:
        """``D``, the length of one sample's stored feature vector (after pooling)."""
        if self.source == "penultimate":
            return int(self._hooked.weight.shape[1])
        return self.feature_shape().feature_dim

    def feature_shape(self, sample_input: Tensor | None = None) -> FeatureShape:
        """Shape of one sample's features before and after pooling, from one forward pass.

        ``sample_input``: a model input ``[1, *input_shape]``; default a fixed random tensor of
        ``input_shape`` on the model's device. The result is cached after the first call. The
        probe runs in eval mode (no BatchNorm statistics change). Penultimate features need no
        probe: their shape is the head's.
        """
        if self._shape is not None and sample_input is None:
            return self._shape
        if self.source == "penultimate" and sample_input is None:
            d, c = self.feature_dim, self.num_classes
            self._shape = FeatureShape(raw=(d,), layout="vector", feature_dim=d, pooled_dim=d, num_classes=c)
            return self._shape
        if sample_input is None:
            generator = torch.Generator().manual_seed(_PROBE_SEED)
            sample_input = torch.randn((1, *self.input_shape), generator=generator).to(self.device)
        with _eval_mode(self.model):
            raw, features, logits = self._run(sample_input, grad=False)
        layout = _layout(raw, self._is_channels_last())
        raw_shape = tuple(int(s) for s in raw.shape[1:])
        shape = FeatureShape(
            raw=raw_shape,
            layout=layout,
            feature_dim=int(features.shape[1]),
            pooled_dim=_pooled_dim(raw_shape, layout),
            num_classes=int(logits.shape[1]),
        )
        if self.source == "output" and self._shape is None:
            self._output_head = self._find_output_head(features, logits)
        self._shape = shape
        return shape

    def with_layer(self, layer: str | None = None, pooling: str | None = None) -> Backbone:
        """Another view of the same model (shared, not copied) with features from ``layer``.

        ``layer=None`` goes back to the penultimate features (where the model has a head); ``pooling=None``
        is the layer's default (see the class docstring). The new backbone's ``feature_dim`` is found with
        one probe forward.
        """
        other = Backbone(
            self.name,
            self.model,
            self.transform,
            input_shape=self.input_shape,
            weights_id=self.weights_id,
            head_module=self._head_module,
            layer=layer,
            pooling=pooling,
            classes=self._classes,
            arch=self.arch,
            channels_last=self._channels_last,
            tokens=self.tokens,
        )
        if other.source != "penultimate":
            other.feature_shape()
        return other

    def layer_names(self) -> list[str]:
        """Names accepted by ``layer=`` (``model.named_modules()``, the root excluded)."""
        if not isinstance(self.model, nn.Module):
            return []
        return [n for n, _ in self.model.named_modules() if n]

    def estimate_feature_bytes(self, n_samples: int) -> int:
        """Bytes of ``n_samples`` float32 feature vectors: ``n_samples * D * 4``."""
        return int(n_samples) * self.feature_dim * 4

    # ------------------------------------------------------------------ extraction

    def features_and_logits(self, x: Tensor, grad: bool = False) -> tuple[Tensor, Tensor]:
        """Model input ``x [B, *input_shape]`` -> ``(features [B, D], logits [B, C])``, float32.

        Runs under ``torch.no_grad()`` unless ``grad=True`` (for detectors that differentiate
        through the model, such as ODIN). The model must be on ``x``'s device.
        """
        _, features, logits = self._run(x, grad=grad)
        return features, logits

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.features_and_logits(x)

    def _is_channels_last(self) -> bool:
        return self.source == "layer" and bool(self._channels_last(self.layer))

    def _run(self, x: Tensor, grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        """One forward: (raw feature-layer output, features [B, D], logits [B, C])."""
        if not isinstance(x, Tensor):
            raise ValueError(
                f"{self.name}: model input must be a tensor [B, *{self.input_shape}], got {type(x).__name__}"
            )
        with torch.enable_grad() if grad else torch.no_grad():
            if self.source == "output":
                raw, logits = self._run_output_contract(x)
            else:
                raw, logits = self._run_hooked(x)
            features = self.pool(raw)
        if logits.ndim != 2 or len(logits) != len(x):
            raise ValueError(
                f"{self.name}: the model returned logits of shape {tuple(logits.shape)} for {len(x)} inputs; "
                "expected [B, C]"
            )
        return raw, features.float(), logits.float()

    @contextmanager
    def capture(self) -> Iterator[list]:
        """Hook this backbone's feature source for the body of a ``with``: the yielded list receives its raw
        output at every call (the head's input for penultimate features, the layer's output otherwise); the
        hook is removed on exit. Several views of one model (:meth:`with_layer`) capturing at once read their
        features in one forward pass; :meth:`captured_features` turns what one captured into features."""
        if self.source == "output":
            raise ValueError(f"{self.name}: a model without hooks cannot capture a layer's output")
        captured: list = []
        if self.source == "penultimate":
            handle = self._hooked.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        else:
            handle = self._hooked.register_forward_hook(lambda _m, _args, out: captured.append(out))
        try:
            yield captured
        finally:
            handle.remove()

    def captured_features(self, captured: list) -> Tensor:
        """Features ``[B, D]`` (float32, pooled) from what :meth:`capture` collected in one forward pass."""
        return self.pool(self._captured_output(captured))

    def pool(self, raw: Tensor) -> Tensor:
        """This backbone's features ``[B, D]`` (float32) from its layer's raw output ``[B, ...]``."""
        return pool_features(raw, self.pooling, self._is_channels_last(), self._prefix_tokens(raw)).float()

    def _prefix_tokens(self, raw: Tensor) -> int:
        """The tokens before the patch tokens in ``raw`` for ``pooling="cls"`` / ``"mean"`` (0 otherwise); a
        ValueError when the layer's tokens are not the model's sequence with its class token at 0."""
        if self.pooling not in TOKEN_POOLINGS or raw.ndim != 3:
            return 0
        if self.tokens is None:
            raise ValueError(
                f"{self.name}: pooling={self.pooling!r} needs to know where the class and patch tokens are, which "
                "oodviz knows for vit_b_16 and timm and Hugging Face vision transformers (timm:<model>, "
                "hf:<directory>); for this model use pooling='avg' or 'max'"
            )
        if self.layer not in self.tokens.layers:
            raise ValueError(
                f"{self.name}: layer {self.layer!r} gives {raw.shape[1]} tokens but not the model's token sequence "
                f"with its class token first (it comes before the class token is added, or reshapes the tokens); "
                f"pooling={self.pooling!r} reads the layers from {self.tokens.layers[0]!r} to "
                f"{self.tokens.layers[-1]!r} (Backbone.tokens.layers), or use pooling='avg' or 'max' here"
            )
        return self.tokens.prefix

    def _captured_output(self, captured: list) -> Tensor:
        what = f"layer {self.layer!r}" if self.source == "layer" else f"head {self._head_name!r}"
        if not captured:
            raise ValueError(
                f"{self.name}: {what} did not run during forward, so it cannot give features; choose another layer"
            )
        # A module called several times per forward (shared blocks): the last call is the one that counts.
        raw = captured[-1]
        if not isinstance(raw, Tensor):
            raise ValueError(
                f"{self.name}: {what} returns a {type(raw).__name__}, not a tensor; "
                "choose a layer whose output is one tensor"
            )
        return raw

    def _run_hooked(self, x: Tensor) -> tuple[Tensor, Tensor]:
        with self.capture() as captured:
            out = self.model(x)
        raw = self._captured_output(captured)
        if not isinstance(out, Tensor) and isinstance(getattr(out, "logits", None), Tensor):
            out = out.logits  # a Hugging Face model's output object (ModelOutput)
        logits = out[-1] if isinstance(out, (tuple, list)) else out
        if not isinstance(logits, Tensor):
            raise ValueError(f"{self.name}: the model returned a {type(out).__name__}; expected logits [B, C]")
        return raw, logits

    def _run_output_contract(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out = self.model(x)
        if isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, Tensor) for t in out):
            return out[0], out[1]
        if isinstance(out, Tensor):
            method = getattr(self.model, "features", None)
            if callable(method) and not isinstance(method, nn.Module):
                return method(x), out
            return out, out
        raise ValueError(
            f"{self.name}: the model returned {type(out).__name__}; the contract for models without hooks is "
            "forward(x) -> logits [B, C], or -> (features [B, D], logits [B, C]), optionally with a "
            "features(x) -> [B, D] method"
        )

    def _find_output_head(self, features: Tensor, logits: Tensor) -> str | None:
        """Prefix of a ``<prefix>weight [C, D]`` (+ ``<prefix>bias [C]``) parameter pair that
        provably maps the features to the logits, else ``None``. Works on parameters, not module
        types, so TorchScript and exported programs qualify too."""
        if not isinstance(self.model, nn.Module) or features is logits or features.ndim != 2:
            return None
        params = dict(self.model.named_parameters())
        wanted = (logits.shape[1], features.shape[1])
        candidates = [
            n[: -len("weight")] for n, p in params.items() if n.endswith("weight") and tuple(p.shape) == wanted
        ]
        for prefix in reversed(candidates):
            weight, bias = self._head_params(prefix)
            with torch.no_grad():
                predicted = features @ weight.float().T + bias.float()
            if torch.allclose(predicted, logits, rtol=1e-4, atol=1e-4 * (1 + float(logits.abs().max()))):
                return prefix
        return None

    def _head_params(self, prefix: str) -> Head:
        params = dict(self.model.named_parameters())
        weight = params[prefix + "weight"].detach()
        bias = params.get(prefix + "bias")
        if bias is None or tuple(bias.shape) != (weight.shape[0],):
            return weight, torch.zeros(weight.shape[0], device=weight.device, dtype=weight.dtype)
        return weight, bias.detach()

    def __repr__(self) -> str:
        where = {
            "penultimate": "penultimate",
            "layer": f"layer={self.layer!r}, pooling={self.pooling!r}",
            "output": "model output",
        }
        dims = (
            f"D={self.feature_dim}, C={self.num_classes}"
            if (self.source == "penultimate" or self._shape)
            else "D=?, C=?"
        )
        return f"Backbone({self.name!r}, {where[self.source]}, {dims}, weights_id={self.weights_id[:24]!r})"
