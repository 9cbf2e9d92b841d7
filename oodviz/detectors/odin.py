"""ODIN: temperature scaling plus a small input perturbation towards higher confidence.

Liang, Li & Srikant, *Enhancing The Reliability of Out-of-distribution Image Detection in Neural
Networks*, ICLR 2018, https://arxiv.org/abs/1706.02690

Runs the classifier again (a model-based detector, see :class:`~oodviz.detectors.base.ModelDetector`):
with model inputs ``x`` ``[B, ...]`` (``Batch.inputs``, transformed as the model expects), logits
``f(x)`` ``[B, C]``, temperature ``T`` and the softmax ``S(x; T) = softmax(f(x) / T)``,

    y_hat = argmax_k f_k(x)
    x'    = x - epsilon * sign(-grad_x log S_y_hat(x; T)) / std          (one backward pass)
    score(x) = -max_k S_k(x'; T)                                        (a second forward)

The paper's confidence is ``max_k S_k(x'; T)``; its negation is the OOD score (higher = more OOD),
as in pytorch-ood 0.4. The gradient of ``-log S_y_hat`` is taken for the whole batch at once from
the *sum* of the per-sample losses, so a sample's gradient (and score) does not depend on the other
samples of its batch (pytorch-ood averages, which only rescales the gradient before ``sign``).
Only the input gets a gradient: the model's parameters are switched to ``requires_grad=False``
for the backward pass (no weight gradients are computed, which halves its cost) and switched back
afterwards; they collect no ``.grad``. ``epsilon = 0`` skips the backward pass and is
temperature-scaled MSP. The model runs in eval mode (see ``ModelDetector``).

**Precision.** The gradient step runs with autocast off (in the model's own precision): under fp16
autocast the input gradient, of order ``|W| / T``, underflows to zero and so would its sign. The
loss is multiplied by ``T`` before the backward pass (the sign is unchanged) so that a model whose
weights are themselves half precision keeps gradients of order 1. The second forward pass runs in
the caller's autocast, if any.

**Input normalisation.** ``epsilon`` is a step in *pixel* units (images in ``[0, 1]``) in the
paper's code, which divides the sign of the gradient of each channel by the standard deviation the
inputs were normalised with; pytorch-ood does the same when it is given ``norm_std`` and otherwise
steps in the units of the model input. oodviz's ``norm_std``:

- ``"auto"`` (default): the per-channel ``std`` of the model's normalisation when a Backbone's
  transform exposes one (torchvision's weight transforms, a ``Normalize`` inside a ``Compose``),
  so that ``epsilon`` is in pixel units as in the paper; otherwise 1 (a plain ``nn.Module`` or
  callable, or a transform without a ``std``, such as the bundled ``digits-cnn``'s): ``epsilon`` is
  then in the units of the model input, like pytorch-ood without ``norm_std``;
- ``None`` or ``1``: the units of the model input;
- a number or a list of one number per channel (axis 1 of the inputs): divide by it.

Defaults ``T = 1000`` and ``epsilon = 0.0014`` are the paper's (and pytorch-ood's). Shapes:
``inputs`` ``[B, C_in, ...]`` -> scores ``[B]``.

OpenOOD v1.5's ``odin`` postprocessor computes this score (its ``torch.ge(grad, 0)`` maps a zero gradient to +1 where
``sign`` gives 0 here; its loss is the batch mean, the same sign) with ``temperature`` 1000 and ``noise``
(``epsilon``) 0.0014 by default, tuned on the benchmark's validation sets over ``T`` in 1, 10, 100, 1000 and
``epsilon`` in 0.0014, 0.0028 (``APS_mode: True``; ``default_grid`` here is the same grid): the values behind its
figures depend on the benchmark. It divides the gradient's sign by the per-channel std of the benchmark's
normalisation (its ``normalization_dict``; 0.5 for a dataset it does not list), which is the std
``norm_std="auto"`` reads from the transform under OpenOOD's preprocessing (``preprocessing = "openood:<benchmark>"``,
the same numbers) or torchvision's ImageNet weights. So ``openood_params = {}``.
"""

import contextlib

import torch
from torch import Tensor
from torch.nn import functional as F

from oodviz.batch import Batch
from oodviz.detectors.base import ModelDetector
from oodviz.detectors.teaching import Teaching


def transform_std(transform) -> list[float] | None:
    """The per-channel ``std`` of the normalisation inside ``transform``, or None if it exposes none.

    Looks at ``transform.std`` (torchvision's ``Normalize`` and weight transforms), then inside
    ``transform.inner`` (oodviz's ``RGBTransform``) and ``transform.transforms`` (``Compose``).
    """
    seen = 0
    stack = [transform]
    while stack and seen < 64:
        seen += 1
        item = stack.pop(0)
        if item is None:
            continue
        std = getattr(item, "std", None)
        if std is not None and not callable(std):
            try:
                values = [float(v) for v in torch.as_tensor(std, dtype=torch.float64).flatten()]
            except (TypeError, ValueError, RuntimeError):
                values = []
            if values and all(v > 0 for v in values):
                return values
        stack.append(getattr(item, "inner", None))
        stack.extend(getattr(item, "transforms", None) or [])
    return None


def check_norm_std(name: str, norm_std):
    """``norm_std`` checked (``"auto"``, None, a positive number or a list of them), a one-number list as its number;
    ValueError naming detector ``name`` and the fix otherwise."""
    if norm_std is None or norm_std == "auto":
        return norm_std
    values = [norm_std] if isinstance(norm_std, (int, float)) and not isinstance(norm_std, bool) else norm_std
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        values = None
    if not values or not all(v > 0 for v in values):
        raise ValueError(
            f"{name}: norm_std must be 'auto', None, a positive number or a list of positive per-channel standard "
            f"deviations (e.g. [0.229, 0.224, 0.225] for ImageNet), got {norm_std!r}"
        )
    return values[0] if isinstance(norm_std, (int, float)) else values


def channel_std(norm_std, model) -> list[float] | None:
    """The per-channel divisor of an input step for the (checked) ``norm_std`` of a detector running ``model``, or
    None for none: ``"auto"`` reads the model's transform (:func:`transform_std`; see the module docstring)."""
    if norm_std == "auto":
        return transform_std(getattr(model, "transform", None))
    if norm_std is None:
        return None
    return norm_std if isinstance(norm_std, list) else [norm_std]


def signed_step(name: str, gradient: Tensor, std: list[float] | None) -> Tensor:
    """``sign(gradient) / std`` (``std`` per channel, axis 1 of the inputs; None: ``sign(gradient)``), the step of
    an input perturbation; ValueError naming detector ``name`` when ``std`` does not fit the channels."""
    step = gradient.sign()
    if std is None:
        return step
    if gradient.ndim < 2 or len(std) not in (1, gradient.shape[1]):
        channels = gradient.shape[1] if gradient.ndim > 1 else 0
        raise ValueError(
            f"{name}: norm_std has {len(std)} values but the inputs have {channels} channels (axis 1 of shape "
            f"{tuple(gradient.shape)}); give one std per channel, or norm_std=None"
        )
    std = torch.tensor(std, dtype=step.dtype, device=step.device)
    return step / std.view(1, -1, *([1] * (gradient.ndim - 2)))


@contextlib.contextmanager
def frozen(module):
    """Parameters without ``requires_grad`` for the block (no weight gradients to compute), then as before."""
    params = [p for p in module.parameters() if p.requires_grad] if module is not None else []
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def without_autocast(device: torch.device):
    """Autocast off on ``device`` for the block: under fp16 autocast the input gradient, of order ``W / T``, underflows
    to 0 and its sign with it; the gradient step runs in the model's own precision (float32 for most models)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class ODIN(ModelDetector):
    name = "odin"
    summary = "Negative max softmax at temperature T of the input nudged by epsilon towards higher confidence (runs the model)."
    paper = "https://arxiv.org/abs/1706.02690"
    default_grid = {"temperature": (1.0, 10.0, 100.0, 1000.0), "epsilon": (0.0014, 0.0028)}
    teaching = Teaching(
        formula=r"s(x) = -\max_k S_k(x';T),\quad S(x;T) = \operatorname{softmax}\big(f(x)/T\big),\quad x' = x - \varepsilon\, \operatorname{sign}(-\nabla_x \log S_{\hat y}(x;T))",
        citation="Liang, Li & Srikant, *Enhancing The Reliability of Out-of-distribution Image Detection in Neural Networks*, ICLR 2018",
        reads="the model itself: one backward and two forward passes per input",
        fails_when="Its temperature and step size are tuned per dataset; with defaults on a new model it can be worse than MSP.",
    )

    #: the forward pass's activations, kept for the backward pass, and their gradients
    activation_copies = 2

    def __init__(self, temperature: float = 1000.0, epsilon: float = 0.0014, norm_std="auto", model=None):
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"{self.name}: temperature must be > 0 (the paper uses 1000), got {temperature!r}")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon >= 0:
            raise ValueError(
                f"{self.name}: epsilon is a step size and must be >= 0 (the paper uses 0.0014), got {epsilon!r}"
            )
        self.temperature = float(temperature)
        self.epsilon = float(epsilon)
        self.norm_std = check_norm_std(self.name, norm_std)
        super().__init__(model)

    def channel_std(self) -> list[float] | None:
        """The per-channel divisor of the gradient step, or None for none (see the module docstring)."""
        return channel_std(self.norm_std, self.model)

    def step(self, gradient: Tensor) -> Tensor:
        """The step ``x - x'`` per unit of ``epsilon`` for the input gradient ``gradient`` of ``-log S_y_hat``:
        ``sign(gradient) / std``, same shape (i-ODIN's keeps one element of it, :mod:`oodviz.detectors.iodin`)."""
        return signed_step(self.name, gradient, self.channel_std())

    def perturb(self, x: Tensor) -> Tensor:
        """``x' = x - epsilon * sign(-grad_x log S_y_hat(x; T)) / std`` (:meth:`step`), same shape as ``x``, no graph."""
        with torch.inference_mode(False):
            x = x.clone() if torch.is_inference(x) else x
            x = x.detach().requires_grad_(True)
            with torch.enable_grad(), frozen(self.module), without_autocast(x.device):
                logits = self.logits(x, grad=True) / self.temperature
                # times T: the same sign, gradients of order 1 rather than 1/T for a half-precision model
                loss = self.temperature * F.cross_entropy(logits, logits.argmax(dim=1), reduction="sum")
                (gradient,) = torch.autograd.grad(loss, x)
            return (x - self.epsilon * self.step(gradient)).detach()

    def _score(self, batch: Batch) -> Tensor:
        x = batch.inputs
        if self.epsilon > 0:
            x = self.perturb(x)
        logits = self.logits(x) / self.temperature
        return -logits.softmax(dim=1).amax(dim=1)
