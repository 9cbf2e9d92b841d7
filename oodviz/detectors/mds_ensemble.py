"""MDS ensemble: Mahalanobis with input pre-processing at several layers, the layers' distances combined.

Lee, Lee, Lee & Shin, *A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial
Attacks*, NeurIPS 2018, https://arxiv.org/abs/1807.03888 (its "feature ensemble"; OpenOOD v1.5's ``mds_ensemble``
postprocessor).

Runs the classifier again (a model-based detector with a fit, see :mod:`oodviz.detectors.model_fit`). For model
inputs ``x`` ``[B, ...]`` and each layer ``l`` of ``layers`` (``L`` of them), the layer's features ``f_l(x)``
``[B, D_l]`` are the mean of its output ``[B, D_l, ...]`` over every axis after the channels (axis 1), as the
paper's and OpenOOD's ``mean`` feature type (an output ``[B, D_l]`` is taken as it is); ``"penultimate"`` names
the model's own features (a Backbone's, by default the head's input).

**Fit** (in-distribution inputs and labels ``y`` in ``0..C-1``, one pass; OOD rows, label -1, ignored): at every
layer, the Gaussians of :mod:`~oodviz.detectors.mahalanobis` on ``f_l``, class means ``mu_lk`` ``[C, D_l]`` and the
tied covariance ``Sigma_l = 1/N sum_k sum_{i: y_i = k} (f_l,i - mu_lk)(f_l,i - mu_lk)^T`` ``[D_l, D_l]``, each
streamed in float64 by mahalanobis's own accumulator (:class:`~oodviz.detectors.widefit.ClassGaussianStream`) and
finished by its own code (:func:`~oodviz.detectors.mahalanobis.tied_gaussian`; a ``mahalanobis`` fitted on one
layer's features holds the same arrays, bit for bit).

**Score**, with ``M_lk(x) = (f_l(x) - mu_lk)^T Sigma_l^+ (f_l(x) - mu_lk)``, for every layer separately:

    k_l(x)   = argmin_k M_lk(x)                                             (the closest class at layer l)
    x'_l     = x - epsilon * sign(grad_x M_l,k_l(x)) / std                  (a backward pass per layer)
    M_l(x)   = min_k M_lk(x'_l)                                             (a forward per layer)
    score(x) = sum_l w_l M_l(x)

Shapes: ``inputs`` ``[B, C_in, ...]`` -> ``M_l`` ``[B, L]`` -> scores ``[B]``; higher = more OOD. Each layer's term
is :mod:`~oodviz.detectors.mahalanobis_odin`'s at that layer (its step, its sign conventions, ``norm_std``, the
closest class on the unperturbed features and held fixed in the gradient, the gradient of the batch's sum), as in the
paper's code and OpenOOD's, which perturb the input once per layer. ``epsilon = 0`` is one forward pass for every
layer: the multi-layer Mahalanobis without pre-processing.

**Weights.** The paper and OpenOOD weight the layers with a logistic regression fitted on validation data with OOD
(or adversarial) samples, ``w = alpha``: OpenOOD's confidence is ``sum_l alpha_l (-M_l / 2)``, so
``weights=alpha_list`` (as it is) gives the same ranking. Labelled OOD data is what a detector should not need
(and it biases the weights towards that OOD set), so oodviz fits no regression: ``weights=None`` (default) weights
each layer by ``w_l = 1 / r_l``, ``r_l`` the rank of ``Sigma_l`` (``D_l`` unless some directions have no ID
variance). ``r_l`` is the mean of ``M_l,y`` over the fit inputs at their own class (``trace(Sigma_l^+ Sigma_l)``),
so each layer's distance counts in units of its typical in-distribution size and the widest layer does not drown
the others; equal raw weights (``weights=[1, 1, ...]``) would let the layer with the most channels decide. A
list of ``L`` numbers (e.g. a regression's coefficients fitted on your own validation data, for which
:meth:`MDSEnsemble.layer_distances` gives the ``[B, L]`` distances of a batch: the model in eval mode on the inputs'
device) replaces them; it changes only the score (``score_params``: no refit).

**Layers.** ``layers``: module names (``model.named_modules()``) and ``"penultimate"``, each module's output of
the *last* time it runs in a forward pass. ``None`` (default): the end of every resolution stage among the model's
top-level modules (``model.named_children()``): of those whose output is a feature map ``[B, C, H, W]`` with
``H W > 1``, the last of each spatial size, found on the first fit batch. For torchvision's ResNets that is
``relu, layer1, layer2, layer3, layer4``, the paper's five features (the last one's mean is the penultimate
features); a model whose top level is one ``Sequential`` gives a single layer that way, so name its blocks (the
bundled digits-cnn: ``["features.1", "features.3", "features.6"]``); none found: ``["penultimate"]``. A token
sequence ``[B, T, D]`` would be averaged over ``D``: for a transformer name layers with ``[B, D]`` outputs.

Defaults: ``epsilon = 0.0014`` and one step per layer as OpenOOD's ``mds_ensemble`` (whose configuration reads only
the first feature of its network's list, the stem's output, with ``alpha = [1]``); the default grid is the paper's
list, as mahalanobis_odin's. Differences from OpenOOD: no feature reduction (its ``reduce_dim_list`` is ``none`` by
default), the ``mean`` feature type only (not ``flat`` or ``stat``), the pseudo-inverse (OpenOOD: sklearn's
``EmpiricalCovariance`` precision, the same ``Sigma_l``), ``sign(0) = 0`` (OpenOOD maps a zero gradient to +1),
``norm_std`` as odin's (OpenOOD divides by a fixed 0.5 for three channels: ``norm_std=0.5``), no logistic
regression (above).

**Memory and cost.** Fit: mahalanobis's state at every layer, ``O(C sum_l D_l + sum_l D_l^2)`` float64 whatever the
number of inputs, and one batch's forward pass (no graph); the fitted state keeps the whitened Gaussians only (no
``D_l x D_l`` covariance). Score: ``L`` backward and ``L + 1`` forward passes per batch (one forward with
``epsilon = 0``), one layer's graph at a time (``activation_copies = 2``, the batch sized from memory like odin's).

**Merging.** As mahalanobis_odin: the statistics merge exactly, but the fit runs the model on the fit images, so
there is no state protocol; a sharded run fits it on every rank over all the ID fit images.

**OpenOOD's variant.** Under ``protocol = "openood"``: ``openood_params = {"norm_std": 0.5}``, OpenOOD's fixed
divisor whatever the benchmark (``epsilon`` is already its 0.0014, the only value of its sweep). Its layer, the
first of its network's ``feature_list`` (the stem's output after the ReLU and, on the 224 x 224 ResNets, the
max-pool: ``"maxpool"`` of a torchvision ResNet; OpenOOD's ResNet18_32x32 applies its stem's ReLU as ``F.relu``, an
output that no module gives), depends on the network, so it stays with ``layers``; with one layer the weight is one
positive factor, which does not change the ranking.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.columns import PENULTIMATE
from oodviz.detectors.base import all_finite, check_all_classes_seen
from oodviz.detectors.mahalanobis import nearest_distance, tied_gaussian
from oodviz.detectors.mahalanobis_odin import EPSILON_GRID, check_epsilon
from oodviz.detectors.model_fit import FittedModelDetector, check_layer_list, check_layers, features_and_logits
from oodviz.detectors.odin import channel_std, check_norm_std, frozen, signed_step, without_autocast
from oodviz.detectors.teaching import Teaching
from oodviz.detectors.widefit import ClassGaussianStream


def channel_means(name: str, layer: str, output) -> Tensor:
    """``[B, D_l]`` float32: the mean of a layer's output ``[B, D_l, ...]`` over every axis after 1 (a ``[B, D_l]``
    output as it is)."""
    if not isinstance(output, Tensor) or output.ndim < 2:
        shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
        raise ValueError(f"{name}: layer {layer!r} gives {shape}, not a tensor [B, C, ...]; choose another layer")
    return output.float() if output.ndim == 2 else output.float().flatten(2).mean(dim=2)


class MDSEnsemble(FittedModelDetector):
    name = "mds_ensemble"
    fitted_shapes = {
        **FittedModelDetector.fitted_shapes,
        "class_means_": "CF",
        "center_": "F",
        "whitening_": "FK",
        "whitened_means_": "LCK",
        "whitened_norms_": "LC",
    }
    summary = (
        "Weighted sum over several layers of mahalanobis_odin's distance, the input nudged towards the closest class "
        "mean at each (runs the model)."
    )
    paper = "https://arxiv.org/abs/1807.03888"
    default_grid = {"epsilon": EPSILON_GRID}
    openood_params = {"norm_std": 0.5}
    score_params = ("epsilon", "norm_std", "weights")
    teaching = Teaching(
        formula=(
            r"s(x) = \sum_l w_l \min_k M_{lk}(x'_l),\quad M_{lk}(x) = (f_l(x) - \mu_{lk})^\top \Sigma_l^{-1} "
            r"(f_l(x) - \mu_{lk}),\quad x'_l = x - \varepsilon\, \operatorname{sign}\big(\nabla_x M_{l \hat k_l}(x)\big),"
            r"\quad w_l = 1 / \operatorname{rank} \Sigma_l"
        ),
        citation="Lee et al., *A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial Attacks*, NeurIPS 2018",
        reads="the model itself (a backward and a forward per layer and input) and the ID inputs and labels of the fit split (Gaussians per layer)",
        fails_when="The paper's layer weights come from labelled OOD data; with fixed weights early layers can add noise, at L times the cost.",
    )
    needs_labels = True
    #: the default detector list by backbone family is issue 17.4's; passes per layer: a run lists it explicitly
    in_defaults = False
    #: one layer's forward activations, kept for its backward pass, and their gradients
    activation_copies = 2

    def __init__(
        self,
        layers: list[str] | None = None,
        epsilon: float = 0.0014,
        norm_std="auto",
        weights: list[float] | None = None,
        model=None,
    ):
        check_layer_list(self.name, layers, "['layer1', 'layer2', 'layer3', 'layer4']")
        if weights is not None:
            if isinstance(weights, (str, bytes)) or not isinstance(weights, (list, tuple)) or not weights:
                raise ValueError(
                    f"{self.name}: weights must be None or a list of one number per layer, got {weights!r}"
                )
            if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
                raise ValueError(f"{self.name}: weights must be finite numbers, got {weights!r}")
            if layers is not None and len(weights) != len(layers):
                raise ValueError(
                    f"{self.name}: {len(weights)} weights for {len(layers)} layers; give one weight per layer"
                )
        self.layers = None if layers is None else list(layers)
        self.epsilon = check_epsilon(self.name, epsilon)
        self.norm_std = check_norm_std(self.name, norm_std)
        self.weights = None if weights is None else [float(w) for w in weights]
        super().__init__(model)

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """Mahalanobis's state at layers whose widths add up to about ``2 D`` (a ResNet's five: 1.9 x the last) and
        whose squares add up to about ``1.4 D^2``: the scatters of all, the factorisation of the widest."""
        return int(8 * ((1.4 + 1.5) * n_features**2 + 2 * n_classes * 2 * n_features))

    def _check_fitted_params(self) -> None:
        layers = getattr(self, "layers_", None)
        if self.weights is not None and layers is not None and len(self.weights) != len(layers):
            raise ValueError(
                f"{self.name}: {len(self.weights)} weights for the {len(layers)} fitted layers {layers}; give one "
                "weight per layer"
            )

    def channel_std(self) -> list[float] | None:
        """The per-channel divisor of the gradient steps, or None for none (as odin's)."""
        return channel_std(self.norm_std, self.model)

    # -- the layers ------------------------------------------------------------------------------
    def _check_fit_model(self, model) -> None:
        names = [n for n in self.layers or [] if n != PENULTIMATE]
        if self.module is None and (self.layers is None or names):
            raise ValueError(
                f"{self.name} reads the outputs of the model's layers, which needs an nn.Module (or an oodviz Backbone "
                f"around one); got a {type(model).__name__}: use layers=['penultimate'] for its features alone"
            )
        if self.module is not None:
            check_layers(self.name, self.module, names)

    def _auto_layers(self, x: Tensor) -> list[str]:
        """The end of every resolution stage among the top-level modules (see the module docstring)."""
        children = dict(self.module.named_children())
        calls: list[tuple[str, tuple]] = []  # (name, output shape) of every call of a top-level module, in order
        hooks = [
            module.register_forward_hook(
                lambda mod, _, out, name=name: (
                    calls.append((name, tuple(out.shape))) if isinstance(out, Tensor) else None
                )
            )
            for name, module in children.items()
        ]
        try:
            with torch.no_grad():
                features_and_logits(self.model, x[:1])
        finally:
            for hook in hooks:
                hook.remove()
        last_call = {name: i for i, (name, _) in enumerate(calls)}
        stage_end: dict[tuple, int] = {}
        for i, (name, shape) in enumerate(calls):
            if len(shape) == 4 and shape[2] * shape[3] > 1 and last_call[name] == i:
                stage_end[shape[2:]] = i
        return [calls[i][0] for i in sorted(stage_end.values())] or [PENULTIMATE]

    def layer_features(self, x: Tensor, names: list[str], grad: bool = False) -> list[Tensor]:
        """``f_l(x)`` ``[B, D_l]`` (float32) of each layer of ``names``, from one forward pass of ``x``; ``grad`` keeps
        the graph."""
        modules = dict(self.module.named_modules()) if self.module is not None else {}
        outputs: dict[str, Tensor] = {}

        def keep(layer):  # the channel means at once: a later in-place op (ReLU(inplace=True)) may change the output
            return lambda mod, _, out: outputs.__setitem__(layer, channel_means(self.name, layer, out))

        hooks = [modules[n].register_forward_hook(keep(n)) for n in names if n != PENULTIMATE]
        try:
            with torch.enable_grad() if grad else torch.no_grad():
                features, _ = features_and_logits(self._require_model(), x, grad=grad)
        finally:
            for hook in hooks:
                hook.remove()
        missing = [n for n in names if n != PENULTIMATE and n not in outputs]
        if missing:
            raise ValueError(f"{self.name}: layer(s) {missing} did not run in the forward pass; choose layers it uses")
        if PENULTIMATE in names and (not isinstance(features, Tensor) or features.ndim != 2):
            raise ValueError(f"{self.name}: the model's features are not [B, D]; leave 'penultimate' out of layers")
        return [features.float() if n == PENULTIMATE else outputs[n] for n in names]

    # -- fit ---------------------------------------------------------------------------------------
    def fit_begin(self, head=None) -> None:
        """A new fit: the head is not kept (the Gaussians' classes are those of the labels, ``0..max label``)."""
        super().fit_begin(None)
        self.layers_ = self.layers
        self._streams, self._rows = None, 0

    def fit_step(self, batch: Batch) -> Tensor:
        labels = batch.labels
        if labels is None:
            raise ValueError(
                f"{self.name} fits per class: give each input its class label, Batch(inputs=..., labels=...)"
            )
        if self.layers_ is None:
            self.layers_ = self._auto_layers(batch.inputs)
        if self.weights is not None and len(self.weights) != len(self.layers_):
            raise ValueError(
                f"{self.name}: {len(self.weights)} weights for the {len(self.layers_)} layers {self.layers_}; give one "
                "weight per layer"
            )
        per_layer = self.layer_features(batch.inputs, self.layers_)
        known = labels >= 0  # OOD rows, label -1, left out
        labels = labels[known].long()
        per_layer = [f[known] for f in per_layer]
        for layer, features in zip(self.layers_, per_layer, strict=True):
            if not all_finite(features):
                raise ValueError(f"{self.name}: layer {layer!r} gave NaN or infinite features for some fit inputs")
        if len(labels):  # the state changes only after the forward pass: a retried batch leaves it as one call would
            if self._streams is None:
                self._streams = [ClassGaussianStream() for _ in self.layers_]
            for stream, features in zip(self._streams, per_layer, strict=True):
                stream.update(features, labels)
            self._rows += len(labels)
        return torch.zeros(len(batch))

    def _end_pass(self, pass_index: int, values: Tensor) -> None:
        if not self._rows:
            raise ValueError(
                f"{self.name}.fit got no in-distribution inputs: the batches were empty or every label was -1 (OOD)"
            )
        streams, self._streams = self._streams, None
        fitted = []
        for stream in streams:  # one layer's D_l x D_l matrices at a time
            moments = stream.release()
            check_all_classes_seen(self.name, moments.empty_classes())
            gaussian = tied_gaussian(moments)
            gaussian.pop("covariance_", None)
            fitted.append(gaussian)
            del moments
        ranks = [g["whitening_"].shape[1] for g in fitted]
        width = max(max(ranks), 1)
        self.layer_widths_ = [g["center_"].shape[0] for g in fitted]
        self.layer_ranks_ = ranks
        self.class_counts_ = fitted[0]["class_counts_"]
        self.class_means_ = torch.cat([g["class_means_"] for g in fitted], dim=1)  # [C, F] float64
        self.center_ = torch.cat([g["center_"] for g in fitted])  # [F]
        # each layer's whitening in its rows, zero-padded to the widest rank: the zero columns add nothing
        self.whitening_ = torch.cat(
            [torch.nn.functional.pad(g["whitening_"], (0, width - g["whitening_"].shape[1])) for g in fitted]
        )  # [F, K]
        self.whitened_means_ = torch.stack(
            [torch.nn.functional.pad(g["whitened_means_"], (0, width - g["whitened_means_"].shape[1])) for g in fitted]
        )  # [L, C, K]
        self.whitened_norms_ = torch.stack([g["whitened_norms_"] for g in fitted])  # [L, C]

    def end_pass(self, pass_index: int, values: Tensor) -> None:
        super().end_pass(pass_index, values)
        self._set_widths()

    def fit(self, batches, head=None, device=None):
        super().fit(batches, head=head, device=device)
        self._set_widths()  # the layers' widths, not the head's
        return self

    def _set_widths(self) -> None:
        self.n_features_in_, self.n_classes_ = int(sum(self.layer_widths_)), len(self.class_means_)

    # -- score -------------------------------------------------------------------------------------
    def layer_weights(self) -> Tensor:
        """``w_l`` ``[L]`` (float64): ``weights``, or ``1 / rank(Sigma_l)`` (see the module docstring)."""
        if self.weights is not None:
            if len(self.weights) != len(self.layers_):
                raise ValueError(
                    f"{self.name}: {len(self.weights)} weights for the {len(self.layers_)} fitted layers {self.layers_}"
                )
            return torch.tensor(self.weights, dtype=torch.float64)
        return 1.0 / torch.tensor(self.layer_ranks_, dtype=torch.float64).clamp(min=1)

    def distance(self, layer: int, features: Tensor) -> Tensor:
        """``min_k M_lk`` ``[B]`` at layer number ``layer`` of its features ``[B, D_l]``, differentiable in them (the
        closest class held fixed)."""
        start = sum(self.layer_widths_[:layer])
        rows = slice(start, start + self.layer_widths_[layer])
        whitened = (features - self.center_[rows]) @ self.whitening_[rows]
        return nearest_distance(whitened, self.whitened_means_[layer], self.whitened_norms_[layer])

    def perturb(self, x: Tensor, layer: int) -> Tensor:
        """``x'_l = x - epsilon * sign(grad_x M_l,k_l(x)) / std`` for layer number ``layer``, same shape, no graph."""
        with torch.inference_mode(False):
            for key in ("center_", "whitening_", "whitened_means_"):  # fitted under inference mode: not in a graph
                if torch.is_inference(getattr(self, key)):
                    setattr(self, key, getattr(self, key).clone())
            x = x.clone() if torch.is_inference(x) else x
            x = x.detach().requires_grad_(True)
            with torch.enable_grad(), frozen(self.module), without_autocast(x.device):
                (features,) = self.layer_features(x, [self.layers_[layer]], grad=True)
                (gradient,) = torch.autograd.grad(self.distance(layer, features).sum(), x)
            return (x - self.epsilon * signed_step(self.name, gradient, self.channel_std())).detach()

    def layer_distances(self, x: Tensor) -> Tensor:
        """``M_l(x)`` ``[B, L]`` (float32) of inputs ``x`` on the model's device: each layer's distance of the input
        perturbed for it (of ``x`` itself with ``epsilon = 0``)."""
        if self.epsilon == 0:
            per_layer = self.layer_features(x, self.layers_)
            return torch.stack([self.distance(i, f) for i, f in enumerate(per_layer)], dim=1)
        columns = []
        for i, layer in enumerate(self.layers_):
            (features,) = self.layer_features(self.perturb(x, i), [layer])
            columns.append(self.distance(i, features))
        return torch.stack(columns, dim=1)

    def _score(self, batch: Batch) -> Tensor:
        distances = self.layer_distances(batch.inputs)
        return distances.double() @ self.layer_weights().to(distances.device)
