"""OpenOOD v1.5's own networks and test preprocessing, so that its published checkpoints load unchanged.

OpenOOD v1.5 (Zhang et al. 2023, github.com/Jingkang50/OpenOOD) benchmarks each in-distribution set with one
network, trained by OpenOOD and published as raw state dicts (``torch.save(net.state_dict())``; OpenOOD's
``scripts/download/download.py --contents checkpoints --checkpoints ood_v1.5`` fetches them into ``./results``):

| benchmark | classes | network (oodviz backbone) | a checkpoint |
| --- | --- | --- | --- |
| ``cifar10`` | 10 | ``openood-resnet18-32x32`` | ``cifar10_resnet18_32x32_base_e100_lr0.1_default/s0/best.ckpt`` |
| ``cifar100`` | 100 | ``openood-resnet18-32x32`` | ``cifar100_resnet18_32x32_base_e100_lr0.1_default/s0/best.ckpt`` |
| ``imagenet200`` | 200 | ``openood-resnet18-224x224`` | ``imagenet200_resnet18_224x224_base_e90_lr0.1_default/s0/best.ckpt`` |
| ``imagenet`` | 1000 | ``resnet50`` (torchvision's) | torchvision's ``IMAGENET1K_V1`` weights |

- :class:`CifarResNet18` is OpenOOD's ``ResNet18_32x32``: a ResNet-18 for 32 x 32 images, with a 3 x 3 stride-1
  stem and no max-pool, residual blocks whose projection is called ``shortcut``, global average pooling and ``fc``.
- OpenOOD's ``ResNet18_224x224`` subclasses torchvision's ``ResNet`` with torchvision's BasicBlock layout and
  changes only ``forward`` (to return features as well), so its parameters are torchvision's ``resnet18``'s:
  :func:`build_openood_resnet18_224x224` builds that.
- OpenOOD's ImageNet-1k networks (``ResNet50``, ``Swin_T``, ``ViT_B_16``) subclass torchvision's ``ResNet``,
  ``SwinTransformer`` and ``VisionTransformer`` with torchvision's own constructor arguments, so their state dicts
  have torchvision's keys: they load as oodviz's ``resnet50``, ``swin_t`` and ``vit_b_16``.

:data:`OPENOOD_PREPROCESSING` is OpenOOD's ``default_preprocessing_dict`` (``openood/evaluation_api/preprocessor.py``)
for the four v1.5 benchmarks: its test transform is convert to RGB, resize the shorter side to ``pre_size``
(bilinear), centre crop ``img_size``, scale to 0..1, normalise by ``mean`` / ``std``
(:func:`oodviz.models.architectures.openood_transform` builds it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

#: How OpenOOD's checkpoints are downloaded (run in a clone of OpenOOD's repository; they land in ``./results``).
OPENOOD_DOWNLOAD = "python scripts/download/download.py --contents checkpoints --checkpoints ood_v1.5"


@dataclass(frozen=True)
class OpenOODPreprocessing:
    """One benchmark's test preprocessing in OpenOOD v1.5: resize the shorter side to ``pre_size`` (bilinear),
    centre crop ``img_size`` x ``img_size``, normalise ``(p / 255 - mean) / std`` per RGB channel."""

    pre_size: int
    img_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


#: OpenOOD v1.5's test preprocessing per ID benchmark (its ``default_preprocessing_dict``; the fine-grained
#: ``aircraft`` and ``cub`` entries, outside the v1.5 benchmarks, are left out).
OPENOOD_PREPROCESSING: dict[str, OpenOODPreprocessing] = {
    "cifar10": OpenOODPreprocessing(32, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": OpenOODPreprocessing(32, 32, (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)),
    "imagenet200": OpenOODPreprocessing(256, 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "imagenet": OpenOODPreprocessing(256, 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
#: The v1.5 benchmarks, in OpenOOD's order.
OPENOOD_BENCHMARKS = tuple(OPENOOD_PREPROCESSING)


@dataclass(frozen=True)
class OpenOODNetwork:
    """The network OpenOOD v1.5 benchmarks an ID set with: the oodviz ``backbone`` name, the class count, and where
    its weights come from: ``checkpoint``, the file OpenOOD's download script writes (seed 0; ``s1``, ``s2`` hold
    the other two seeds), or ``weights``, torchvision's weights name."""

    backbone: str
    num_classes: int
    checkpoint: str | None = None
    weights: str | None = None


#: Benchmark -> its network. ImageNet-1k's is torchvision's ResNet-50 with its V1 weights (OpenOOD's
#: ``eval_ood_imagenet.py --tvs-pretrained``, ``--tvs-version 1`` by default; torchvision's ``DEFAULT`` is V2).
OPENOOD_NETWORKS: dict[str, OpenOODNetwork] = {
    "cifar10": OpenOODNetwork(
        "openood-resnet18-32x32", 10, checkpoint="results/cifar10_resnet18_32x32_base_e100_lr0.1_default/s0/best.ckpt"
    ),
    "cifar100": OpenOODNetwork(
        "openood-resnet18-32x32", 100, checkpoint="results/cifar100_resnet18_32x32_base_e100_lr0.1_default/s0/best.ckpt"
    ),
    "imagenet200": OpenOODNetwork(
        "openood-resnet18-224x224",
        200,
        checkpoint="results/imagenet200_resnet18_224x224_base_e90_lr0.1_default/s0/best.ckpt",
    ),
    "imagenet": OpenOODNetwork("resnet50", 1000, weights="IMAGENET1K_V1"),
}


def check_benchmark(benchmark: str) -> str:
    """``benchmark`` (case and surrounding spaces ignored) when it is one of :data:`OPENOOD_BENCHMARKS`, else a
    ValueError naming them."""
    key = benchmark.strip().lower() if isinstance(benchmark, str) else benchmark
    if key not in OPENOOD_PREPROCESSING:
        raise ValueError(
            f"unknown OpenOOD v1.5 benchmark {benchmark!r}; choose one of {', '.join(map(repr, OPENOOD_BENCHMARKS))}"
        )
    return key


def network_benchmark(backbone: str, num_classes: int | None = None) -> str:
    """The benchmark whose network is ``backbone`` with ``num_classes`` outputs (``"cifar100"`` for a 100-class
    ``openood-resnet18-32x32``); for another or no class count, the backbone's first benchmark (``"cifar10"``)."""
    mine = [name for name, net in OPENOOD_NETWORKS.items() if net.backbone == backbone]
    if not mine:
        raise ValueError(f"{backbone!r} is not one of OpenOOD v1.5's networks")
    return next((name for name in mine if OPENOOD_NETWORKS[name].num_classes == num_classes), mine[0])


class ResidualBlock(nn.Module):
    """A ResNet basic block: ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``, 3 x 3 convolutions without
    bias, the first one strided. ``shortcut`` is the identity, or, when the block changes the stride or the width,
    a strided 1 x 1 convolution then BatchNorm (``shortcut.0``, ``shortcut.1``)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


class CifarResNet18(nn.Module):
    """OpenOOD's ``ResNet18_32x32``, input ``[B, 3, 32, 32]`` (any size works: the pooling is global).

    ``conv1`` (3 x 3, stride 1, 64 channels, no bias) - ``bn1`` - ReLU, no max-pool; ``layer1`` .. ``layer4``: two
    :class:`ResidualBlock` each, 64, 128, 256, 512 channels, the first block of layers 2-4 at stride 2 (32, 32,
    16, 8, 4 pixels); ``avgpool`` (global) -> 512-d features ``[B, 512]`` -> ``fc = Linear(512, C)``. The parameter
    and buffer names are OpenOOD's, so its checkpoints load with ``load_state_dict`` as they are. About 11.2
    million parameters.
    """

    feature_dim = 512
    widths = (64, 128, 256, 512)

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, self.widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(self.widths[0])
        c_in = self.widths[0]
        for i, width in enumerate(self.widths, start=1):
            stride = 1 if i == 1 else 2
            setattr(self, f"layer{i}", nn.Sequential(ResidualBlock(c_in, width, stride), ResidualBlock(width, width)))
            c_in = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.feature_dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """``x [B, 3, H, W]`` -> logits ``[B, C]``."""
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_openood_resnet18_32x32(num_classes: int = 10) -> CifarResNet18:
    return CifarResNet18(num_classes)


def build_openood_resnet18_224x224(num_classes: int = 200) -> nn.Module:
    """OpenOOD's ``ResNet18_224x224``: torchvision's ``resnet18`` (7 x 7 stride-2 stem, max-pool, the same
    blocks with ``downsample`` projections, ``avgpool``, ``fc``), random weights."""
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=num_classes)
