"""RankFeat: remove the rank-1 component of a feature map, then the energy of the logits.

Song, Sebe & Wang, *RankFeat: Rank-1 Feature Removal for Out-of-distribution Detection*, NeurIPS
2022, https://arxiv.org/abs/2209.08590

Runs the classifier again (a model-based detector, see :class:`~oodviz.detectors.base.ModelDetector`)
with the output of one of its layers, the feature map ``X`` ``[B, C, H, W]``, replaced on its way
through the network: each sample's ``X_i`` as a ``C x HW`` matrix loses its rank-1 part

    X_i' = X_i - s_1 u_1 v_1^T          (s_1, u_1, v_1: the largest singular value and its vectors)

and the rest of the network maps ``X'`` to logits ``g(X')`` ``[B, C_out]``:

    score(x) = -logsumexp_k g_k(X')

the energy (the paper's confidence is the negative energy; higher = more OOD). The paper's point:
the dominant singular direction is larger and more generic for OOD inputs, so removing it lowers
their logits more. This is pytorch-ood 0.4's ``RankFeat`` (``backbone`` up to the layer, ``head``
the rest, energy score) and the paper's, which also uses ``torch.linalg.svd``; its power-iteration
variant is an approximation of the same ``s_1 u_1 v_1^T``.

``layer`` names the module (``model.named_modules()``, e.g. ``"layer4"`` of a ResNet) whose output is
replaced, through a forward hook: the model runs unchanged otherwise. ``layer=None`` takes the
Backbone's own ``layer`` when it has one, else the last module (in the order the forward finishes
them) whose output is a map ``[B, C, H, W]`` with ``H W > 1`` (``layer4`` of a ResNet, the last
convolutional block), found on the first batch of each ``score`` call. A model with no such output
(pooled features only, a ViT's token sequence, a plain callable) is a ValueError naming the fix.
The SVD runs in float32 (also under autocast). Shapes: ``inputs`` ``[B, ...]`` -> scores ``[B]``.

``fuse_layer`` names a second, earlier layer (``"layer3"`` of a ResNet, with ``layer`` its ``"layer4"``): the model
then runs twice per batch, once with ``layer``'s output losing its rank-1 part and once with ``fuse_layer``'s (the
rest of the network unchanged, so the later block sees the earlier block's map with its rank-1 part removed), and
the two forwards' logits are averaged before the energy:

    score(x) = -logsumexp_k (g_k(X'_layer) + g_k(X'_fuse)) / 2

the paper's "Block 3 + Block 4" fusion (its Table 1 and code). OpenOOD v1.5's ``rankfeat`` postprocessor
(``openood/postprocessors/rankfeat_postprocessor.py``) computes exactly that, with ``torch.linalg.svd``
(``accelerate: False``) and temperature 1: the rank-1 part removed from ``intermediate_forward(x, 4)`` (the output
of ``layer4``) then ``avgpool`` and ``fc``, and from ``intermediate_forward(x, 3)`` (``layer3``) then ``layer4``,
``avgpool`` and ``fc``, the two logits averaged: ``openood_params = {"fuse_layer": "layer3"}`` (``protocol =
"openood"``), ``layer`` left to find ``layer4`` (the last feature map of a ResNet). OpenOOD runs it on its ResNets
only (their ``intermediate_forward``); a model without a ``layer3`` is a ValueError naming its layers.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from oodviz.batch import Batch
from oodviz.detectors.base import ModelDetector
from oodviz.detectors.model_fit import check_layers, layers_whose_output
from oodviz.detectors.teaching import Teaching


def without_rank1(maps: Tensor) -> Tensor:
    """``maps`` ``[B, C, H, W]`` with each sample's rank-1 part ``s_1 u_1 v_1^T`` (of its ``C x HW`` matrix)
    removed; same shape and dtype."""
    m = maps.float().reshape(len(maps), maps.shape[1], -1)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    rank1 = s[:, :1, None] * u[:, :, :1] @ vh[:, :1, :]
    return (m - rank1).reshape(maps.shape).to(maps.dtype)


def is_feature_map(value) -> bool:
    return isinstance(value, Tensor) and value.ndim == 4 and value.shape[2] * value.shape[3] > 1


class RankFeat(ModelDetector):
    name = "rankfeat"
    summary = "Energy of the logits after removing the rank-1 part of a layer's feature maps (runs the model)."
    paper = "https://arxiv.org/abs/2209.08590"
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_k e^{g_k(X - s_1 u_1 v_1^\top)}",
        citation="Song, Sebe & Wang, *RankFeat: Rank-1 Feature Removal for Out-of-distribution Detection*, NeurIPS 2022",
        reads="the model itself: one forward per input with a layer's feature maps rewritten; nothing to fit",
        fails_when="Collapses on pooled layers and transformers: a 1x1 map is its own rank-1 part, so it needs CNN maps (H*W > 1).",
    )
    #: the default detector list by backbone family is issue 17.4's; until then a run lists it explicitly
    in_defaults = False

    openood_params = {"fuse_layer": "layer3"}

    def __init__(self, layer: str | None = None, fuse_layer: str | None = None, model=None):
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise ValueError(f"rankfeat: layer must be a module name such as 'layer4', or None, got {layer!r}")
        if fuse_layer is not None and (not isinstance(fuse_layer, str) or not fuse_layer):
            raise ValueError(
                f"rankfeat: fuse_layer must be a module name such as 'layer3' (an earlier block, whose removal's "
                f"logits are averaged with layer's), or None, got {fuse_layer!r}"
            )
        self.layer = layer
        self.fuse_layer = fuse_layer
        super().__init__(model)
        self._hooked: list[tuple[str, nn.Module]] | None = None

    def _check_fit_model(self, model) -> None:
        if self.module is None:
            raise ValueError(
                f"rankfeat replaces a layer's output inside the model, which needs an nn.Module (or an oodviz Backbone "
                f"around one); got a {type(model).__name__}"
            )
        layer = self.layer or getattr(model, "layer", None)
        check_layers(self.name, self.module, [name for name in (layer, self.fuse_layer) if name is not None])

    def _scoring(self, device: torch.device):
        self._hooked = None
        return contextlib.nullcontext()

    def _find_layers(self, x: Tensor) -> list[tuple[str, nn.Module]]:
        """The names and modules whose outputs are replaced, one forward each: ``layer``'s (see the module docstring;
        one extra forward for ``layer=None``), then ``fuse_layer``'s when given."""
        layer, module = self._find_layer(x)
        if self.fuse_layer is None:
            return [(layer, module)]
        if self.fuse_layer == layer:
            raise ValueError(
                f"rankfeat: fuse_layer {self.fuse_layer!r} is the layer itself; name an earlier block (e.g. 'layer3' "
                "with layer 'layer4'), or leave fuse_layer None"
            )
        return [(layer, module), (self.fuse_layer, self.module.get_submodule(self.fuse_layer))]

    def _find_layer(self, x: Tensor) -> tuple[str, nn.Module]:
        """The name and module whose output is replaced (see the module docstring); one extra forward for ``layer=None``."""
        layer = self.layer or getattr(self.model, "layer", None)
        if layer is None:
            finished = layers_whose_output(self, x, is_feature_map, leaves=False)
            if not finished:
                raise ValueError(
                    "rankfeat needs a layer whose output is a feature map [B, C, H, W] with H*W > 1, and this model has "
                    "none (pooled features or tokens only); choose a convolutional model, or name a layer with "
                    "create('rankfeat', layer=...)"
                )
            layer = finished[-1]
        return layer, self.module.get_submodule(layer)

    def _replace(self, name: str, out):
        if not is_feature_map(out):
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"rankfeat: layer {name!r} gave {shape}, not an unpooled feature map [B, C, H, W] with H*W > 1; "
                "choose a convolutional layer before the final pooling (e.g. 'layer4' of a ResNet)"
            )
        return without_rank1(out)

    def _logits_without_rank1(self, x: Tensor, name: str, module: nn.Module) -> Tensor:
        """The logits ``[B, C]`` of one forward with ``module``'s output losing its rank-1 part."""
        replaced = []
        hook = module.register_forward_hook(lambda _, args, out: replaced.append(1) or self._replace(name, out))
        try:
            logits = self.logits(x)
        finally:
            hook.remove()
        if not replaced:
            raise ValueError(f"rankfeat: layer {name!r} did not run during forward; choose a layer the model uses")
        return logits.double()

    def _score(self, batch: Batch) -> Tensor:
        if self._hooked is None:
            self._hooked = self._find_layers(batch.inputs)
        logits = [self._logits_without_rank1(batch.inputs, name, module) for name, module in self._hooked]
        fused = logits[0] if len(logits) == 1 else (logits[0] + logits[1]) / 2
        return -torch.logsumexp(fused, dim=1)
