"""Backbones behind a small registry: a classifier as (transform, features, logits, head).

```python
from oodviz.models import available_backbones, load_backbone, estimate_memory, openood_transform

available_backbones()                      # ["digits-cnn", "fashion-cnn", "resnet18", ..., "openood-resnet18-224x224"]
bb = load_backbone("digits-cnn")           # bundled, offline (also "fashion-cnn": 28x28 Fashion-MNIST)
bb = load_backbone("resnet18", weights="random", layer="layer3")   # D = 256 (avg-pooled)
bb = load_backbone("openood-resnet18-32x32", checkpoint="cifar100_resnet18_32x32_base_e100_lr0.1_default/s0/best.ckpt")
transform, input_shape = openood_transform("cifar100")             # OpenOOD v1.5's test preprocessing (also bb's)
bb = load_backbone("timm:vit_small_patch16_224", checkpoint="vit.pt", layer="blocks.6")  # class token (pooling="cls")
bb = load_backbone("hf:models/my-vit")     # a save_pretrained() directory, read with local files only
x = torch.stack([bb.transform(img) for img in pil_images])          # [B, *bb.input_shape]
features, logits = bb.features_and_logits(x)                        # [B, D], [B, C]
bb.head                                    # (weight [C, D], bias [C]) or None
estimate_memory(bb, {"train": 50_000}).warn_if_over(4 * 2**30)     # str or None
```

See :mod:`oodviz.models.registry` (the loaders: names, weights, checkpoints, model files), :mod:`oodviz.models.hub`
(timm and Hugging Face models, optional dependencies; their names in :mod:`oodviz.models.hub_names`) with
:mod:`oodviz.models.architectures` and :mod:`oodviz.models.checkpoints`, :mod:`oodviz.models.openood` (OpenOOD v1.5's
networks, checkpoints and test preprocessing), :mod:`oodviz.models.backbone`
(feature sources, pooling), :mod:`oodviz.models.memory` (store size estimates) and
:mod:`oodviz.models.placement` (device names, a model held on a device for a block).
"""

from oodviz.lazy import lazy_attributes

#: Each public name and the submodule that defines it. The package imports a submodule when one of its names is
#: first used, so that ``oodviz.models.memory`` (``format_bytes``) and the other torch-free parts can be imported
#: without torch (the app's results page); the architectures, loaders and modules import torch.
_SOURCES = {
    "architectures": (
        "RGBTransform",
        "available_backbones",
        "backbone_family",
        "backbone_info",
        "default_weights_dir",
        "imagenet_transform",
        "openood_transform",
        "OPENOOD_ARCHITECTURES",
        "unknown_layer_message",
    ),
    "backbone": ("POOLINGS", "TOKEN_POOLINGS", "Backbone", "FeatureShape", "TokenLayout", "pool_features"),
    "digits": ("DigitsCNN", "DigitsTransform", "digits_arrays"),
    "fashion": ("FashionCNN", "FashionTransform"),
    "hub": ("load_hf", "load_timm"),
    "hub_names": ("hub_family", "hub_kind"),
    "openood": ("OPENOOD_BENCHMARKS", "OPENOOD_NETWORKS", "OPENOOD_PREPROCESSING", "CifarResNet18"),
    "checkpoints": ("CheckpointError",),
    "memory": ("MemoryEstimate", "describe_memory", "estimate_memory", "format_bytes", "warn_if_over"),
    "placement": ("DEVICE_CHOICES", "device_problem", "model_on_device", "parse_device"),
    "registry": (
        "USER_MODEL_NAMES",
        "architecture_layer_names",
        "architecture_token_layout",
        "backbone_classes",
        "load_backbone",
        "load_scripted",
        "wrap_model",
    ),
}
__getattr__ = lazy_attributes(__name__, _SOURCES, globals())


def feature_shape(backbone, sample_input=None):
    """``backbone.feature_shape(sample_input)``: per-sample feature shape before/after pooling,
    from one forward pass of a 1-sample input (default: a fixed random tensor)."""
    return backbone.feature_shape(sample_input)


__all__ = sorted([*(name for names in _SOURCES.values() for name in names), "feature_shape"])
