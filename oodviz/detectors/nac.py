"""NAC-UE: how much of each neuron's in-distribution behaviour an input's neuron states fall in (neuron activation
coverage).

Liu, Tian, Li, Ma & Wang, *Neuron Activation Coverage: Rethinking Out-of-distribution Detection and Generalization*,
ICLR 2024, https://arxiv.org/abs/2306.02879 (NAC-UE, its uncertainty estimate; the authors' code,
``BierOne/ood_coverage``, is OpenOOD's ``nac`` postprocessor of their pull request #232, behind the leaderboard's NAC
rows; pytorch-ood 0.4's ``NACUE``).

Runs the classifier again (a model-based detector with a fit, see :mod:`oodviz.detectors.model_fit`), with a
backward pass per batch. With model inputs ``x`` ``[B, ...]``, logits ``f(x)`` ``[B, C]``, ``p = softmax(f(x))``
and the uniform distribution ``u = 1 / C``:

    KL(x)     = KL(u || p) = -log C - 1/C sum_k log p_k(x)                 (its gradient in the logits: p - u)

For each layer ``l`` of ``layers`` (``L`` of them) with output ``z`` ``[B, N_l, ...]`` (a neuron a channel: axis 1 of
a map ``[B, N_l, H, W]``, the last axis of tokens ``[B, T, N_l]``, each column of ``[B, N_l]``; ``P`` positions per
neuron, ``H W``, ``T`` or 1) and its gradient ``g = dKL / dz`` (the same shape; each sample's own: the gradient of the
batch's sum), the **neuron state** of neuron ``i`` ``[B, N_l]``:

    s_i    = mean_P(z_i) * mean_P(g_i)     pooling="mean" (default)
           = sum_P(z_i) * sum_P(g_i)       pooling="sum" (the authors' code: the same, alpha times P^2)
           = mean_P(z_i * g_i)             pooling="product" (pytorch-ood 0.4)
    zhat_i = sigmoid(alpha_l * s_i)        in [0, 1]

(the three agree where ``P = 1``: the default layer, and every ``[B, N_l]`` output). **Fit** (in-distribution inputs,
one pass; labels not needed, rows labelled -1 left out): the histogram of each neuron's states over the fit inputs,

    kappa_li[j] = #{fit inputs whose zhat_i falls in interval j}         [N_l, K_l] counts

over ``K_l`` intervals of ``[0, 1]`` from ``bins`` ``M_l`` (``edges``, below). **Score**, the coverage of each
neuron at the interval ``j_i(x)`` its state falls in, averaged over the neurons and the layers:

    Phi_li(x) = min(kappa_li[j_i(x)] / O*_l, 1)                           in [0, 1]
    score(x)  = -1/L sum_l 1/N_l sum_i Phi_li(x)                          in [-1, 0]

the paper's coverage ``Phi = min(kappa, r) / r`` with ``r = o_star`` (the authors' ``O``, pytorch-ood's ``o_star``):
a state that ``o_star`` or more fit inputs share counts fully. NAC-UE is the coverage (higher = more ID); its
negation is the OOD score, **higher = more OOD**. Shapes: ``inputs`` ``[B, ...]`` -> states ``[B, N_l]`` per layer
-> scores ``[B]``.

**Intervals** (``edges``), with ``m = floor(M / 2)``:

- ``"authors"`` (default): the authors' thresholds, dense around 0.5 (where ``s`` is near 0) and coarse towards 0
  and 1: ``t = log_1000(linspace(1, sqrt(1000), m))`` from 0 to 0.5, mirrored to ``1 - t`` above it, the last one
  raised to 1.01; ``K = 2 m - 2`` intervals ``[t_j, t_(j+1))``. (Their code appends one more interval, ``[1.01,
  1.2)``, which a sigmoid never reaches, and needs an even ``M``; it is left out here, which changes no score.)
- ``"geometric"``: pytorch-ood 0.4's, dense near 0 and 1: edges ``e = logspace(log10(1e-6), log10(0.5), m + 1)``
  mirrored to ``1 - e``, the state clamped to ``[1e-6, 1 - 1e-6]``, ``K = 2 m`` intervals ``(e_j, e_(j+1)]`` (the
  first closed). (For an odd ``M`` pytorch-ood keeps an ``M``-th bin that nothing reaches; left out here.)

**Layers.** ``layers``: module names (``model.named_modules()``, a module run twice: its last output) and
``"penultimate"``, the input of the model's final linear layer (the last ``nn.Linear`` that runs in a forward,
found on the first fit batch: the head of a ResNet or a ViT, whose input is the authors' ``avgpool`` and
``encoder.ln`` class-token layers); None (default) is ``["penultimate"]``, the authors' default layer. A layer's
output is copied as it leaves its module (so a later in-place operation, ``ReLU(inplace=True)``, does not change the
value or the gradient read). ``alpha``, ``bins`` and ``o_star`` are one value for every layer or a list of one per
layer: the authors tune them per layer (their CIFAR-10 ResNet-18, ``avgpool layer3 layer2 layer1``: ``alpha`` 100,
1000, 0.001, 0.001; ``M`` 50, 500, 50, 500; ``O`` 50, 100, 5, 100, sums pooled), because ``s`` differs by orders of
magnitude between layers. Layers are averaged, as the authors' code does (pytorch-ood sums them: ``L`` times this,
the same ranking).

**Parameters and grid.** Defaults ``alpha = 100``, ``M = 50``, ``O* = 50`` are pytorch-ood 0.4's and the authors'
CIFAR-10 values at ``avgpool``. ``o_star`` changes only the score (``score_params``: tuning rescores, no refit); it
is a count of fit inputs, so it scales with the fit set (the authors and pytorch-ood build the histograms from 1,000
training images: a run's ``id_fit`` subsample, or a larger ``o_star``). ``default_grid`` is the union of the authors'
sweeps at ``avgpool`` (CIFAR-10, CIFAR-100, ImageNet-1k): ``alpha`` in 1, 50, 100, 3000; ``M`` in 50, 500; ``O`` in
10, 50, 500 (8 fits, 24 scorings of the validation images).

**Against pytorch-ood 0.4** (``NACUE``): the same states and histograms with ``pooling="product"`` and
``edges="geometric"`` (its default reduction of a map is the mean of ``z * g``; of a ``[B, T, D]`` output it
flattens, ``T D`` neurons, where this pools the tokens); its score sums the layers (``L`` times this); its loss is
``-mean_k log(p_k + 1e-12)``, whose gradient drops the classes with ``p_k`` below about ``1e-12`` (the gradient here
is the exact ``p - u`` of ``log_softmax``, as the authors'); it computes in float32, this in float64 from the
float32 outputs and gradients (a state within float32 rounding of an interval edge may fall on the other side).

**OpenOOD's variant** (the authors' code, pull request #232; OpenOOD v1.5's main branch has no ``nac``):
``openood_params = {"pooling": "sum"}`` (its ``avg_pooling`` sums ``z`` and ``g`` over the positions; the authors'
``alpha`` values assume sums). Its ``layers`` and per-layer ``alpha``, ``bins``, ``o_star`` depend on the network and
the benchmark (searched on OOD validation data, ``APS_mode``), so they stay with the user; its fit set is a
class-balanced draw of 1,000 training images (``valid_num``), a run's ``id_fit``. Its ViT layers (``ln_2`` of the
last blocks) are summed over the tokens as here (their ``pooling_vit_mlp``); its Swin layers are channels-last
``[B, H, W, C]`` maps, which this reads as channels-first: name layers with channels on axis 1 or last of tokens.

**Memory and cost.** Fit: ``sum_l N_l K_l`` int64 counts whatever the number of inputs (a ResNet-50's head input at
``M = 50``: 2048 x 48 x 8 bytes = 0.8 MB), and one batch's forward and backward pass. Score: one forward and one
backward pass per batch, the activations and their gradients alive together (``activation_copies = 2``, the batch
sized from memory as odin's: a run's batch probe, else :mod:`oodviz.detectors.modelmemory`); the model's parameters
are frozen for the backward pass and put back (they collect no ``.grad``), and it runs with autocast off, in the
model's own precision, as odin's step.

**Merging.** The histograms are counts and two fits on disjoint inputs add up exactly (:meth:`NACUE.add_histograms`),
but the fit runs the model on the fit images, so this detector has no state protocol
(:mod:`oodviz.detectors.protocol`, whose ``update`` reads feature batches of a store): in a run split over ranks every
rank fits it on all the ID fit images, as gram and mahalanobis_odin. Not in the default detector list
(``in_defaults = False``): a backward pass per input, on the fit images too.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.columns import PENULTIMATE
from oodviz.detectors.model_fit import FittedModelDetector, check_layer_list, check_layers
from oodviz.detectors.odin import frozen, without_autocast
from oodviz.detectors.teaching import Teaching

#: how a neuron's state is read from its output and gradient over its positions (see the module docstring)
POOLINGS = ("mean", "sum", "product")
#: the interval edges of the histograms: the authors' (dense around 0.5) or pytorch-ood's (dense near 0 and 1)
EDGES = ("authors", "geometric")
#: the clamp of pytorch-ood's geometric intervals
GEOMETRIC_FLOOR = 1e-6


def interval_edges(kind: str, bins: int) -> Tensor:
    """The ``K + 1`` edges (float64, ascending) of the ``K`` intervals of ``edges=kind`` for ``bins`` ``M``."""
    m = bins // 2
    if kind == "authors":
        low = np.log(np.linspace(1.0, math.sqrt(1000.0), m)) / np.log(1000.0)  # 0 .. 0.5
        edges = np.concatenate([low[:-1], 1.0 - low[::-1]])  # 0 .. 0.5 .. 1
        edges[-1] += 0.01
        return torch.from_numpy(edges)
    # pytorch-ood's float32 numbers: its middle edge is 0.49999997, so a state of exactly 0.5 (s = 0: a silent
    # neuron, common after a ReLU) falls in the upper half, as there
    ends = torch.tensor([GEOMETRIC_FLOOR, 0.5]).log10()
    low = torch.logspace(float(ends[0]), float(ends[1]), m + 1)  # 1e-6 .. 0.5, float32
    return torch.cat([low, 1.0 - low.flip(0)[1:]]).double()


def interval_of(states: Tensor, edges: Tensor, kind: str) -> Tensor:
    """The interval (long, ``0..K-1``) each state of ``states`` (float64 in ``[0, 1]``) falls in."""
    k = len(edges) - 1
    if kind == "authors":  # [t_j, t_(j+1)): every state in [0, 1] is inside [0, 1.01)
        return (torch.bucketize(states, edges, right=True) - 1).clamp_(0, k - 1)
    clamped = states.clamp(GEOMETRIC_FLOOR, 1.0 - GEOMETRIC_FLOOR)  # (e_j, e_(j+1)], the first closed
    return (torch.bucketize(clamped, edges, right=False) - 1).clamp_(0, k - 1)


def neuron_values(output: Tensor, gradient: Tensor, pooling: str) -> Tensor:
    """``s`` ``[B, N]`` (float64) of a layer's output and its gradient (``[B, N]``, ``[B, T, N]`` or ``[B, N, ...]``)."""
    z, g = output.detach().double(), gradient.detach().double()
    if z.ndim == 2:
        return z * g
    if z.ndim == 3:  # tokens [B, T, N]: the positions are axis 1
        z, g = z.transpose(1, 2), g.transpose(1, 2)
    z, g = z.flatten(2), g.flatten(2)  # [B, N, P]
    if pooling == "product":
        return (z * g).mean(dim=2)
    if pooling == "sum":
        return z.sum(dim=2) * g.sum(dim=2)
    return z.mean(dim=2) * g.mean(dim=2)


def _per_layer(name: str, what: str, value, kind, check, n_layers: int | None) -> list:
    """``value`` (one or a list of one per layer) as a list, each checked by ``check``; ValueError naming the fix."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or not all(isinstance(v, kind) and not isinstance(v, bool) and check(v) for v in values):
        raise ValueError(f"{name}: {what}, or a list of one per layer; got {value!r}")
    if isinstance(value, (list, tuple)) and n_layers is not None and len(values) != n_layers:
        raise ValueError(f"{name}: {len(values)} values of a per-layer parameter for {n_layers} layers: {value!r}")
    return values


class NACUE(FittedModelDetector):
    name = "nac"
    fitted_shapes = {**FittedModelDetector.fitted_shapes, "counts_": "H"}
    summary = (
        "Minus the coverage of the input's neuron states (output times KL gradient, through a sigmoid) by the ID "
        "fit inputs' per-neuron histograms (runs the model)."
    )
    paper = "https://arxiv.org/abs/2306.02879"
    default_grid = {"alpha": (1.0, 50.0, 100.0, 3000.0), "bins": (50, 500), "o_star": (10, 50, 500)}
    score_params = ("o_star",)
    param_choices = {"pooling": POOLINGS, "edges": EDGES}
    openood_params = {"pooling": "sum"}
    teaching = Teaching(
        formula=(
            r"s(x) = -\operatorname{mean}_{l,i}\, c_{li}(x),\quad c_{li} = \min(1, \kappa_{li} / O^*),"
            r"\quad \hat z_{li} = \sigma(\alpha\, z_{li}\, g_{li}),\quad g_{li} = \partial_{z_{li}} \mathrm{KL}(u \,\|\, p),"
            r"\quad \kappa_{li} = \#\,\text{ID states in } \hat z_{li}\text{'s bin}"
        ),
        citation=(
            "Liu, Tian, Li, Ma & Wang, *Neuron Activation Coverage: Rethinking Out-of-distribution Detection and "
            "Generalization*, ICLR 2024"
        ),
        reads=(
            "the model itself (one forward and one backward pass per input) and the ID inputs of the fit split "
            "(per-neuron histograms of their states)"
        ),
        fails_when="alpha and O* want tuning per layer and fit-set size; untuned, saturated sigmoids put most states in one interval.",
    )
    #: the default detector list by backbone family is issue 17.4's; a backward pass per input: a run lists it explicitly
    in_defaults = False
    #: the forward pass's activations, kept for the backward pass, and their gradients
    activation_copies = 2

    def __init__(
        self,
        layers: list[str] | None = None,
        alpha: float | list[float] = 100.0,
        bins: int | list[int] = 50,
        o_star: int | list[int] = 50,
        pooling: str = "mean",
        edges: str = "authors",
        model=None,
    ):
        name = self.name
        check_layer_list(name, layers, "['penultimate', 'layer3']", " (the penultimate features)")
        if pooling not in POOLINGS:
            raise ValueError(
                f"{name}: pooling must be one of {POOLINGS} (how a neuron's state is read over its positions: 'mean' "
                f"of the output times 'mean' of the gradient, their 'sum's, or the mean of their 'product'), "
                f"got {pooling!r}"
            )
        if edges not in EDGES:
            raise ValueError(
                f"{name}: edges must be one of {EDGES} (the histograms' intervals: the authors', dense around 0.5, "
                f"or pytorch-ood's 'geometric', dense near 0 and 1), got {edges!r}"
            )
        n_layers = 1 if layers is None else len(layers)
        smallest = 4 if edges == "authors" else 2
        _per_layer(
            name, "alpha is the sigmoid's steepness, a finite number > 0 (the authors use 0.001 to 3000)", alpha,
            (int, float), lambda v: math.isfinite(v) and v > 0, n_layers,
        )  # fmt: skip
        _per_layer(
            name, f"bins is the number of intervals M, an integer >= {smallest} with edges={edges!r}", bins, int,
            lambda v: v >= smallest, n_layers,
        )  # fmt: skip
        _per_layer(
            name, "o_star is the count of fit inputs that covers a state fully, an integer >= 1", o_star, int,
            lambda v: v >= 1, n_layers,
        )  # fmt: skip
        self.layers = None if layers is None else list(layers)
        self.alpha = [float(v) for v in alpha] if isinstance(alpha, (list, tuple)) else float(alpha)
        self.bins = list(bins) if isinstance(bins, (list, tuple)) else bins
        self.o_star = list(o_star) if isinstance(o_star, (list, tuple)) else o_star
        self.pooling = pooling
        self.edges = edges
        super().__init__(model)

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """int64 counts of layers whose widths add up to a few times ``D``, at up to 1,000 intervals (the authors'
        largest ``M``)."""
        return 8 * 4 * n_features * 1000

    # -- parameters per layer ------------------------------------------------------------------------
    @property
    def layer_names(self) -> list[str]:
        """``layers``, None read as ``["penultimate"]``."""
        return self.layers or [PENULTIMATE]

    def per_layer(self, param: str) -> list:
        """The value of ``alpha``, ``bins`` or ``o_star`` for each layer."""
        value = getattr(self, param)
        return list(value) if isinstance(value, list) else [value] * len(self.layer_names)

    def _check_fitted_params(self) -> None:
        value = self.o_star
        if isinstance(value, list) and len(value) != len(self.layer_names):
            raise ValueError(f"{self.name}: {len(value)} o_star values for {len(self.layer_names)} layers")

    def interval_edges(self) -> list[Tensor]:
        """Each layer's interval edges (float64 ``[K_l + 1]``)."""
        return [interval_edges(self.edges, m) for m in self.per_layer("bins")]

    # -- the model's layers ----------------------------------------------------------------------------
    def _check_fit_model(self, model) -> None:
        if self.module is None:
            raise ValueError(
                f"{self.name} reads the outputs of the model's layers and their gradients, which needs an nn.Module (or "
                f"an oodviz Backbone around one); got a {type(model).__name__}"
            )
        check_layers(self.name, self.module, [n for n in self.layer_names if n != PENULTIMATE])

    def _find_head(self, x: Tensor) -> str:
        """The name of the last ``nn.Linear`` module that runs in one forward of ``x[:1]`` (the classifier's head)."""
        names = {m: name for name, m in self.module.named_modules() if isinstance(m, torch.nn.Linear)}
        called: list[str] = []
        hooks = [m.register_forward_pre_hook(lambda mod, _: called.append(names[mod])) for m in names]
        try:
            self.logits(x[:1])
        finally:
            for hook in hooks:
                hook.remove()
        if not called:
            raise ValueError(
                f"{self.name}: no nn.Linear runs in the model's forward, so it has no 'penultimate' layer (the head's "
                f"input); name the layers: create({self.name!r}, layers=[...])"
            )
        return called[-1]

    def neuron_states(self, x: Tensor) -> tuple[list[Tensor], int]:
        """The states ``zhat`` ``[B, N_l]`` (float64, in ``[0, 1]``) of every layer for inputs ``x`` on the model's
        device (one forward and one backward pass), and the number of logits ``C``."""
        if PENULTIMATE in self.layer_names and getattr(self, "head_module_", None) is None:
            self.head_module_ = self._find_head(x)
        modules = dict(self.module.named_modules())
        outputs: dict[str, Tensor] = {}

        def keep_output(layer):  # the output as it leaves the module; the rest of the forward gets a copy
            def hook(_module, _args, out):
                if not isinstance(out, Tensor) or out.ndim < 2 or len(out) != len(x):
                    shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                    raise ValueError(
                        f"{self.name}: layer {layer!r} gives {shape} for {len(x)} inputs, not a tensor [B, N, ...]; "
                        "choose another layer"
                    )
                outputs[layer] = out
                return out.clone()

            return hook

        def keep_input(_module, args):  # the head's input (the penultimate features); the head gets a copy
            outputs[PENULTIMATE] = args[0]
            return (args[0].clone(), *args[1:])

        names = self.layer_names
        with torch.inference_mode(False):
            x = x.clone() if torch.is_inference(x) else x
            x = x.detach().requires_grad_(True)  # the parameters are frozen: the graph hangs on the input
            hooks = [modules[n].register_forward_hook(keep_output(n)) for n in names if n != PENULTIMATE]
            if PENULTIMATE in names:
                hooks.append(modules[self.head_module_].register_forward_pre_hook(keep_input))
            try:
                with torch.enable_grad(), frozen(self.module), without_autocast(x.device):
                    logits = self.logits(x, grad=True)
                    missing = [n for n in names if n not in outputs]
                    if missing:
                        raise ValueError(
                            f"{self.name}: layer(s) {missing} did not run during the forward pass; choose layers it uses"
                        )
                    # KL(u || p) summed over the batch, less its constant -log C: each sample's own gradient
                    loss = -logits.log_softmax(dim=1).mean(dim=1).sum()
                    tensors = [outputs[n] for n in names]
                    gradients = torch.autograd.grad(loss, tensors, allow_unused=True)
            finally:
                for hook in hooks:
                    hook.remove()
        unused = [n for n, g in zip(names, gradients, strict=True) if g is None]
        if unused:
            raise ValueError(
                f"{self.name}: the logits do not depend on layer(s) {unused}; choose layers before the head"
            )
        states = [
            torch.sigmoid(alpha * neuron_values(z, g, self.pooling))
            for z, g, alpha in zip(tensors, gradients, self.per_layer("alpha"), strict=True)
        ]
        return states, logits.shape[1]

    def state_intervals(self, states: list[Tensor]) -> Tensor:
        """``[B, sum_l N_l]`` (long): each neuron's interval as an index into the flat ``counts_`` (layer by layer,
        neuron by neuron, interval by interval)."""
        columns, offset = [], 0
        for zhat, edges in zip(states, self.interval_edges(), strict=True):
            k = len(edges) - 1
            neurons = torch.arange(zhat.shape[1], device=zhat.device) * k
            columns.append(offset + neurons + interval_of(zhat, edges.to(zhat.device), self.edges))
            offset += zhat.shape[1] * k
        return torch.cat(columns, dim=1)

    def _check_widths(self, states: list[Tensor]) -> None:
        widths = [zhat.shape[1] for zhat in states]
        if widths != self.layer_widths_:
            raise ValueError(
                f"{self.name}: the layers {self.layer_names} give {widths} neurons, but the detector was fitted on "
                f"{self.layer_widths_}; fit it with this model"
            )

    # -- fit ---------------------------------------------------------------------------------------
    def fit_begin(self, head=None) -> None:
        """A new fit (the head is not needed: the penultimate layer is found in the model)."""
        super().fit_begin(None)
        self.head_module_ = None
        self.layer_widths_ = self.layer_intervals_ = self.counts_ = None
        self.fit_rows_ = 0
        self._n_logits = None

    def fit_step(self, batch: Batch) -> Tensor:
        x = batch.inputs
        if batch.labels is not None:  # OOD rows, label -1, left out
            x = x[batch.labels >= 0]
        if not len(x):
            return torch.zeros(len(batch))
        states, n_logits = self.neuron_states(x)
        if self.layer_widths_ is None:
            self.layer_widths_ = [zhat.shape[1] for zhat in states]
            self.layer_intervals_ = [len(edges) - 1 for edges in self.interval_edges()]
            total = sum(n * k for n, k in zip(self.layer_widths_, self.layer_intervals_, strict=True))
            self.counts_ = torch.zeros(total, dtype=torch.long, device=x.device)
            self._n_logits = n_logits
        self._check_widths(states)
        # the state changes only after the passes: a retried batch (out-of-memory back-off) leaves it as one call would
        flat = self.state_intervals(states).flatten().to(self.counts_.device)
        self.counts_ += torch.bincount(flat, minlength=len(self.counts_))
        self.fit_rows_ += len(x)
        return torch.zeros(len(batch))

    def _end_pass(self, pass_index: int, values: Tensor) -> None:
        if not self.fit_rows_:
            raise ValueError(
                f"{self.name}.fit got no in-distribution inputs: the batches were empty or every label was -1 (OOD)"
            )

    def end_pass(self, pass_index: int, values: Tensor) -> None:
        super().end_pass(pass_index, values)
        self._set_widths()

    def fit(self, batches, head=None, device=None):
        super().fit(batches, head=head, device=device)
        self._set_widths()  # the layers' neurons and the model's logits, not the head's
        return self

    def _set_widths(self) -> None:
        self.n_features_in_ = int(sum(self.layer_widths_))
        self.n_classes_ = getattr(self, "_n_logits", None) or self.n_classes_

    def add_histograms(self, other: NACUE) -> NACUE:
        """Add the histograms of ``other``, a ``nac`` with the same parameters fitted with the same model on other
        inputs: the result is the fit on the inputs of both (counts: exact). Returns self."""
        if type(other) is not type(self) or other.get_params() | {"model": None} != self.get_params() | {"model": None}:
            raise ValueError(f"{self.name}.add_histograms needs a {type(self).__name__} with the same parameters")
        for detector in (self, other):
            if getattr(detector, "counts_", None) is None:
                raise ValueError(f"{self.name}.add_histograms: both detectors must be fitted")
        if (other.layer_widths_, other.head_module_) != (self.layer_widths_, self.head_module_):
            raise ValueError(
                f"{self.name}.add_histograms: the detectors were fitted on other layers ({other.layer_widths_} and "
                f"{self.layer_widths_} neurons); fit both with the same model"
            )
        self.counts_ = self.counts_ + other.counts_.to(self.counts_.device)
        self.fit_rows_ += other.fit_rows_
        return self

    # -- score -------------------------------------------------------------------------------------
    def coverage(self, states: list[Tensor]) -> Tensor:
        """``1/L sum_l 1/N_l sum_i Phi_li`` ``[B]`` (float64) of the states of a batch."""
        self._check_widths(states)
        counts = self.counts_.to(states[0].device)[self.state_intervals(states)]  # [B, sum_l N_l]
        layers = []
        for part, o_star in zip(counts.split(self.layer_widths_, dim=1), self.per_layer("o_star"), strict=True):
            # sum_i min(kappa, O*) in integers, one division: inputs covered alike get the same score, bit for bit
            layers.append(part.clamp(max=o_star).sum(dim=1).double() / (o_star * part.shape[1]))
        return torch.stack(layers, dim=1).mean(dim=1)

    def _score(self, batch: Batch) -> Tensor:
        states, _ = self.neuron_states(batch.inputs)
        return -self.coverage(states)
