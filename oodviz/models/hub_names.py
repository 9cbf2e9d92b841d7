"""The names of timm and Hugging Face backbones, without torch (the app's form and a run's config read them):
``timm:<model name>`` and ``hf:<directory>`` (loaded by :mod:`oodviz.models.hub`), the timm models the app lists,
and which of them are transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

TIMM_PREFIX = "timm:"
HF_PREFIX = "hf:"
#: The timm models the app lists when timm is installed (any other timm name loads too): OpenOOD v1.5's ImageNet
#: transformers and CNNs (ViT-B/16, Swin-T, RegNetY-16GF), DeiT and ConvNeXt.
TIMM_LISTED = (
    "timm:vit_base_patch16_224",
    "timm:deit_small_patch16_224",
    "timm:swin_tiny_patch4_window7_224",
    "timm:convnext_tiny",
    "timm:regnety_160",
)
#: Hugging Face ``model_type`` values of transformers over patch tokens whose token layout oodviz knows
#: (:func:`oodviz.models.hub.load_hf` reads it from the config); the others count as CNNs.
HF_TRANSFORMERS = ("vit", "deit", "beit", "data2vec-vision", "dinov2", "dinov2_with_registers", "swin", "swinv2")
#: timm model-name prefixes of transformers over patch tokens.
TIMM_TRANSFORMERS = ("vit", "deit", "beit", "eva", "swin", "cait", "xcit", "flexivit", "pvt", "twins", "levit")


def hub_kind(name) -> str | None:
    """``"timm"`` for ``timm:<model>``, ``"hf"`` for ``hf:<directory>``, else ``None``."""
    if isinstance(name, str):
        if name.startswith(TIMM_PREFIX):
            return "timm"
        if name.startswith(HF_PREFIX):
            return "hf"
    return None


def hub_family(name: str) -> str:
    """``"transformer"`` or ``"cnn"`` for a ``timm:`` / ``hf:`` name, from the timm model name or the directory's
    ``config.json`` (``"cnn"`` when it cannot be read)."""
    if hub_kind(name) == "timm":
        return "transformer" if name[len(TIMM_PREFIX) :].startswith(TIMM_TRANSFORMERS) else "cnn"
    try:
        model_type = json.loads((Path(name[len(HF_PREFIX) :]) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "cnn"
    return "transformer" if model_type in HF_TRANSFORMERS else "cnn"
