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

    def __init__(self, layer: str | None = None, model=None):
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise ValueError(f"rankfeat: layer must be a module name such as 'layer4', or None, got {layer!r}")
        self.layer = layer
        super().__init__(model)
        self._hooked: tuple[str, nn.Module] | None = None

    def _check_fit_model(self, model) -> None:
        if self.module is None:
            raise ValueError(
                f"rankfeat replaces a layer's output inside the model, which needs an nn.Module (or an oodviz Backbone "
                f"around one); got a {type(model).__name__}"
            )
        layer = self.layer or getattr(model, "layer", None)
        if layer is not None:
            check_layers(self.name, self.module, [layer])

    def _scoring(self, device: torch.device):
        self._hooked = None
        return contextlib.nullcontext()

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

    def _replace(self, module, args, out):
        if not is_feature_map(out):
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"rankfeat: layer {self._hooked[0]!r} gave {shape}, not an unpooled feature map [B, C, H, W] with H*W > 1; "
                "choose a convolutional layer before the final pooling (e.g. 'layer4' of a ResNet)"
            )
        return without_rank1(out)

    def _score(self, batch: Batch) -> Tensor:
        if self._hooked is None:
            self._hooked = self._find_layer(batch.inputs)
        replaced = []
        hook = self._hooked[1].register_forward_hook(lambda *args: replaced.append(1) or self._replace(*args))
        try:
            logits = self.logits(batch.inputs)
        finally:
            hook.remove()
        if not replaced:
            raise ValueError(
                f"rankfeat: layer {self._hooked[0]!r} did not run during forward; choose a layer the model uses"
            )
        return -torch.logsumexp(logits.double(), dim=1)
