"""Gram: deviations of higher-order Gram-matrix statistics of several layers from their in-distribution range.

Sastry & Oore, *Detecting Out-of-Distribution Examples with Gram Matrices*, ICML 2020,
https://arxiv.org/abs/1912.12510

Runs the classifier again (a model-based detector with a fit, see :mod:`oodviz.detectors.model_fit`).
For a layer ``l`` with output ``F`` ``[B, C_l, ...]`` (axis 1 the channels, the rest flattened to
``n`` positions: ``F_i`` is ``C_l x n``) and a pole ``p`` in ``1..poles``, each sample's statistic is the
row sums of its ``p``-th order Gram matrix:

    G_i^p = (F_i^p) (F_i^p)^T                 (F^p elementwise, C_l x C_l)
    g_i^(l,p) = sign(G_i^p 1) |G_i^p 1|^(1/p)   [C_l]

computed as ``F_i^p (F_i^p^T 1)`` (the Gram matrix itself is never formed), in float64.

Fit (labels needed): for every class ``c``, layer and pole, the elementwise minimum and maximum
``m_c, M_c`` of ``g`` over the in-distribution samples of class ``c``, leaving out a held-out
``holdout`` fraction of each class; then the expected deviation ``E_l`` of each layer, the mean of
``delta_l`` over the held-out samples (against their own class's range; 1 when none are held out or
the mean is 0). Score, with ``y_hat`` the predicted class (argmax of the logits):

    delta_l(x) = sum_p sum_j relu(m_yhat,j - g_j) / |m_yhat,j + 1e-6| + relu(g_j - M_yhat,j) / |M_yhat,j + 1e-6|
    score(x) = sum_l delta_l(x) / E_l

the total deviation, higher = more OOD. This is pytorch-ood 0.4's ``Gram`` (row sums of the Gram
matrix, the paper's normalisation by held-out deviations) with one difference: the held-out samples
are every 10th (for ``holdout=0.1``: the ``j``-th sample of a class, counted from 0 in stream order,
when ``int((j + 1) h) > int(j h)``, ``int(n_c h)`` of them), where pytorch-ood draws them with
``torch.randperm``; so fits are reproducible and the fit is two streaming passes (bounds, then
deviations) with a state of ``2 K P sum_l C_l`` numbers (``K`` classes, ``P`` poles). ``holdout=0``
is one pass and no normalisation.

``layers``: module names (``model.named_modules()``) whose outputs are used (a module that runs more than once
in a forward: its last output), or None for the layers ``auto_layers`` finds on the first fit batch:

- ``"maps"`` (default): every leaf module whose output is a feature map ``[B, C, H, W]``, each once;
- ``"conv_relu"``: every call of every ``nn.Conv2d`` and ``nn.ReLU`` module, in the order the forward makes them,
  whatever the shape of its output (``[B, C, ...]``, axis 1 the channels); a module called twice (the ``relu`` of
  a torchvision ResNet block) gives two layers. ReLUs written as ``F.relu`` inside ``forward`` are not modules and
  give none.

``poles``: the largest ``p`` (the paper uses 1..10). ``divide_by_msp=True`` divides the score by the maximum
softmax probability of the logits, ``score(x) / max_k softmax_k(f(x))``. Shapes: ``inputs`` ``[B, ...]`` -> scores
``[B]``.

OpenOOD v1.5's ``gram`` postprocessor (``openood/postprocessors/gram_postprocessor.py``) computes the same row sums
(``G_p``), deviations (``delta``, the same ``1e-6``) and per-layer normalisation by the mean deviation of held-out
samples, with: the output of every call of every ``nn.Conv2d`` and ``nn.ReLU`` module as its layers (its
``FeatureExtractor``'s forward hooks; on its ResNet18_32x32, whose ReLUs are functional, the convolutions), the
powers 1..5 (``powers: [1,2,3,4,5]``, the only value of its sweep), and the total deviation divided by the maximum
softmax probability (its confidence is ``-deviations / msp``): ``openood_params = {"poles": 5, "divide_by_msp":
True, "auto_layers": "conv_relu"}`` (``protocol = "openood"``). Its held-out part is ``int(0.1 n_c)`` samples of
each class, as here, but drawn with Python's ``random.sample``, unseeded in its evaluator, after all the
statistics of the fit split are held in memory. A random draw of exactly ``int(h n_c)`` rows per class needs each
``n_c`` before the first pass, and so a third pass over the fit images (or memory that grows with ``N``); since
OpenOOD's own draw cannot be reproduced anyway (no seed), the normalisation here keeps its every-10th rows: the same
count, another choice of rows, a difference of the order of OpenOOD's own from one evaluation to the next. Where a
layer's mean held-out deviation is 0, OpenOOD divides by it (an infinite or NaN score) and this uses 1.

Not mergeable (the state protocol, :mod:`oodviz.detectors.protocol`): it runs the model on the fit images;
in a run split over ranks every rank fits it on all the ID fit images (the same answer, without the speed-up).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import check_all_classes_seen
from oodviz.detectors.model_fit import FittedModelDetector, check_layers, layers_whose_output, module_calls
from oodviz.detectors.teaching import Teaching

#: how ``layers=None`` finds the layers: every leaf module with a feature-map output, or every call of an
#: ``nn.Conv2d`` or ``nn.ReLU`` (OpenOOD's)
AUTO_LAYERS = ("maps", "conv_relu")


def conv_relu_calls(detector: FittedModelDetector, x: Tensor) -> list[str]:
    """The names of the ``nn.Conv2d`` and ``nn.ReLU`` modules of ``detector.module``, once per call, in the order one
    forward of ``x[:1]`` makes the calls (OpenOOD's ``FeatureExtractor``'s layers), of the calls with an output
    ``[B, C, ...]``."""
    names = {m: name for name, m in detector.module.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.ReLU))}
    return module_calls(detector, x, names, _is_layer_output)


def _is_layer_output(out) -> bool:
    return isinstance(out, Tensor) and out.ndim >= 2


def gram_rows(maps: Tensor, poles: int) -> Tensor:
    """``g`` ``[B, poles, C_l]`` (float64) of a layer output ``[B, C_l, ...]``, for ``p = 1..poles``."""
    f = maps.detach().double().reshape(len(maps), maps.shape[1], -1)
    rows = []
    for p in range(1, poles + 1):
        fp = f**p
        sums = (fp @ fp.sum(dim=1, keepdim=True).transpose(1, 2)).squeeze(2)  # F^p (F^p^T 1)
        rows.append(sums.sign() * sums.abs() ** (1.0 / p))
    return torch.stack(rows, dim=1)


def deviations(g: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Elementwise out-of-range deviations ``[B, P, W]`` of ``g`` from the bounds ``low``, ``high`` (same shape)."""
    return (low - g).relu() / (low + 1e-6).abs() + (g - high).relu() / (high + 1e-6).abs()


class Gram(FittedModelDetector):
    name = "gram"
    fitted_shapes = {**FittedModelDetector.fitted_shapes, "minimum_": "CPG", "maximum_": "CPG", "layer_norm_": "L"}
    summary = "Deviation of per-layer Gram-matrix statistics from their range on the predicted class (runs the model)."
    paper = "https://arxiv.org/abs/1912.12510"
    teaching = Teaching(
        formula=r"s(x) = \sum_l \frac{1}{E_l} \sum_{p, j} \delta^{lp}_j,\quad \delta^{lp}_j = \frac{\mathrm{relu}(m_{\hat y j} - g^{lp}_j)}{|m_{\hat y j}|} + \frac{\mathrm{relu}(g^{lp}_j - M_{\hat y j})}{|M_{\hat y j}|}",
        citation="Sastry & Oore, *Detecting Out-of-Distribution Examples with Gram Matrices*, ICML 2020",
        reads="the model itself (the feature maps of several layers) and the ID inputs and labels of the fit split (per-class ranges)",
        fails_when="Needs unpooled layers: on pooled vectors or token sequences the Gram statistics are those of one position and say little.",
    )
    needs_labels = True
    #: the default detector list by backbone family is issue 17.4's; until then a run lists it explicitly
    in_defaults = False

    param_choices = {"auto_layers": AUTO_LAYERS}
    openood_params = {"poles": 5, "divide_by_msp": True, "auto_layers": "conv_relu"}

    def __init__(
        self,
        layers: list[str] | None = None,
        poles: int = 10,
        holdout: float = 0.1,
        divide_by_msp: bool = False,
        auto_layers: str = "maps",
        model=None,
    ):
        if layers is not None and (
            isinstance(layers, str) or not layers or not all(isinstance(n, str) and n for n in layers)
        ):
            raise ValueError(
                f"gram: layers must be a list of module names (e.g. ['layer1', 'layer2']) or None, got {layers!r}"
            )
        if isinstance(poles, bool) or not isinstance(poles, int) or poles < 1:
            raise ValueError(
                f"gram: poles is the largest power p and must be an integer >= 1 (the paper uses 10), got {poles!r}"
            )
        if isinstance(holdout, bool) or not isinstance(holdout, (int, float)) or not 0 <= holdout < 1:
            raise ValueError(f"gram: holdout is the fraction of each class held out, 0 <= holdout < 1, got {holdout!r}")
        if not isinstance(divide_by_msp, bool):
            raise ValueError(f"gram: divide_by_msp must be true or false, got {divide_by_msp!r}")
        if auto_layers not in AUTO_LAYERS:
            raise ValueError(
                f"gram: auto_layers must be one of {AUTO_LAYERS} (how layers=None finds the layers: 'maps' every leaf "
                f"module with a [B, C, H, W] output, 'conv_relu' every call of an nn.Conv2d or nn.ReLU), "
                f"got {auto_layers!r}"
            )
        self.layers = None if layers is None else list(layers)
        self.poles = poles
        self.holdout = float(holdout)
        self.divide_by_msp = divide_by_msp
        self.auto_layers = auto_layers
        super().__init__(model)

    @property
    def fit_passes(self) -> int:
        """Two passes (bounds, then held-out deviations), one with ``holdout=0``."""
        return 2 if self.holdout > 0 else 1

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """Bounds of ten poles for per-layer widths adding up to a few times ``D``."""
        return 2 * 8 * 10 * n_classes * 4 * n_features

    # -- the model's layers ----------------------------------------------------------------------
    def _check_fit_model(self, model) -> None:
        if self.module is None:
            raise ValueError(
                f"gram reads the outputs of the model's layers, which needs an nn.Module (or an oodviz Backbone around "
                f"one); got a {type(model).__name__}"
            )
        check_layers(self.name, self.module, self.layers or [])

    def _auto_layers(self, x: Tensor) -> list[str]:
        if self.auto_layers == "conv_relu":
            found = conv_relu_calls(self, x)
            if not found:
                raise ValueError(
                    "gram found no nn.Conv2d or nn.ReLU module that runs in the forward (auto_layers='conv_relu'); "
                    "name the layers: create('gram', layers=[...])"
                )
            return found
        found = layers_whose_output(self, x, lambda out: isinstance(out, Tensor) and out.ndim == 4, leaves=True)
        if not found:
            raise ValueError(
                "gram found no layer with a feature map output [B, C, H, W]; name the layers: create('gram', layers=[...])"
            )
        return found

    def statistics(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``g`` of every layer and pole, ``[B, P, sum_l C_l]`` (float64), and the logits ``[B, C]`` of one forward."""
        modules = dict(self.module.named_modules())
        outputs: dict[str, Tensor] = {}
        calls: list[tuple[str, Tensor]] = []  # every call, in order (auto_layers="conv_relu")
        per_call = self.layers is None and self.auto_layers == "conv_relu"

        def keep(name):  # the statistic at once: a later in-place op (ReLU(inplace=True)) may change the output
            if per_call:
                return lambda mod, _, out: (
                    calls.append((name, gram_rows(out, self.poles))) if _is_layer_output(out) else None
                )
            return lambda mod, _, out: outputs.__setitem__(name, gram_rows(out, self.poles))

        hooks = [modules[name].register_forward_hook(keep(name)) for name in dict.fromkeys(self.layers_)]
        try:
            logits = self.logits(x)
        finally:
            for hook in hooks:
                hook.remove()
        if per_call:
            if [name for name, _ in calls] != self.layers_:
                raise ValueError(
                    f"gram: the model's nn.Conv2d / nn.ReLU calls changed since the layers were found ({len(calls)} "
                    f"calls, {len(self.layers_)} layers); its forward must make the same calls for every batch"
                )
            found = [g for _, g in calls]
        else:
            missing = [name for name in self.layers_ if name not in outputs]
            if missing:
                raise ValueError(f"gram: layer(s) {missing} did not run during forward; choose layers the model uses")
            found = [outputs[name] for name in self.layers_]
        if self.layer_widths_ is None:
            self.layer_widths_ = [g.shape[2] for g in found]
        return torch.cat(found, dim=2), logits

    # -- fit ---------------------------------------------------------------------------------------
    def fit_begin(self, head=None) -> None:
        super().fit_begin(head)
        self.layers_ = self.layers
        self.layer_widths_ = self.minimum_ = self.maximum_ = self.layer_norm_ = None
        self._pass, self._seen, self._held_sums, self._held_count = 0, None, None, 0

    def _held_out(self, labels: Tensor, n_classes: int) -> Tensor:
        """Which rows are held out (see the module docstring), advancing the per-class counters."""
        if self._seen is None:
            self._seen = torch.zeros(n_classes, dtype=torch.long, device=labels.device)
        one_hot = torch.nn.functional.one_hot(labels, n_classes)
        j = (one_hot.cumsum(dim=0) - 1).gather(1, labels[:, None]).squeeze(1) + self._seen[labels]  # index in class
        self._seen += one_hot.sum(dim=0)
        h = self.holdout
        return torch.floor((j + 1).double() * h) > torch.floor(j.double() * h)

    def fit_step(self, batch: Batch) -> Tensor:
        if self.layers_ is None:
            self.layers_ = self._auto_layers(batch.inputs)
        g, logits = self.statistics(batch.inputs)
        n_classes = logits.shape[1]
        labels = batch.labels
        if labels is None or bool(((labels < 0) | (labels >= n_classes)).any()):
            raise ValueError(f"gram fits per class: give each input its class label 0..{n_classes - 1}")
        held = self._held_out(labels, n_classes) if self.holdout > 0 else torch.zeros_like(labels, dtype=torch.bool)
        if self._pass == 0:
            if self.minimum_ is None:
                self.minimum_ = g.new_full((n_classes, *g.shape[1:]), math.inf)
                self.maximum_ = g.new_full((n_classes, *g.shape[1:]), -math.inf)
            kept, kept_labels = g[~held], labels[~held]
            index = kept_labels[:, None, None].expand_as(kept)
            self.minimum_.scatter_reduce_(0, index, kept, reduce="amin")
            self.maximum_.scatter_reduce_(0, index, kept, reduce="amax")
            return torch.zeros(len(labels))
        per_layer = self._per_layer(deviations(g, self.minimum_[labels], self.maximum_[labels]))[held]
        self._held_sums = per_layer.sum(dim=0) + (0 if self._held_sums is None else self._held_sums)
        self._held_count += len(per_layer)
        return torch.zeros(len(labels))

    def _per_layer(self, elementwise: Tensor) -> Tensor:
        """``[B, L]``: ``[B, P, sum_l C_l]`` summed over the poles and within each layer's channels."""
        return torch.stack([part.sum(dim=(1, 2)) for part in elementwise.split(self.layer_widths_, dim=2)], dim=1)

    def _end_pass(self, pass_index: int, values: Tensor) -> None:
        if pass_index == 0:
            empty = torch.nonzero(torch.isinf(self.minimum_[:, 0, 0])).flatten().tolist()
            check_all_classes_seen(self.name, empty, "inputs outside the held-out part")
            self.layer_norm_ = torch.ones(len(self.layers_), dtype=torch.float64, device=self.minimum_.device)
            self._seen = None
        elif self._held_count:
            mean = self._held_sums / self._held_count
            self.layer_norm_ = torch.where(mean > 0, mean, 1.0)
        self._pass = pass_index + 1

    def _score(self, batch: Batch) -> Tensor:
        g, logits = self.statistics(batch.inputs)
        predicted = logits.argmax(dim=1)
        per_layer = self._per_layer(deviations(g, self.minimum_[predicted], self.maximum_[predicted]))
        total = (per_layer / self.layer_norm_).sum(dim=1)
        if self.divide_by_msp:  # OpenOOD's: the deviation over the maximum softmax probability
            return total / logits.double().softmax(dim=1).amax(dim=1)
        return total
