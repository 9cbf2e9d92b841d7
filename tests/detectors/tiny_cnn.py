"""A tiny real CNN and its inputs, for the detectors that run the model (test_model_based.py, test_persist.py)."""

import torch
from torch import nn

from oodviz.models import wrap_model


class TinyCNN(nn.Module):
    """conv - BN - ReLU - conv - ReLU - avg pool - (dropout) - fc; inputs [B, 3, 8, 8], C = 5."""

    def __init__(self, dropout: float = 0.0, n_classes: int = 5, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.fc = nn.Linear(16, n_classes)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.2, 0.2)
            self.bn.running_var.uniform_(0.5, 1.5)
            self.fc.weight.mul_(8.0)  # a spread of confidences
        self.eval()

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc(self.drop(self.flatten(x)))


def inputs(n=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    return x * torch.linspace(0.2, 3.0, n).view(-1, 1, 1, 1)  # from flat to busy images


def backbone_of(model):
    return wrap_model(model, lambda image: image, head="fc", input_shape=(3, 8, 8), name="tiny")
