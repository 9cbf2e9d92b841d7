"""A tiny CNN with a feature map (``[B, 32, 8, 8]``) and its inputs, for the model-based detectors that read one
(test_adascale.py, test_rankfeat.py, test_gram.py, test_model_based.py)."""

import torch
from torch import nn

from oodviz.models import wrap_model


class WideCNN(nn.Module):
    """body (conv - ReLU - conv - ReLU: a feature map ``[B, 32, 8, 8]``) - avg pool - fc; inputs [B, 3, 8, 8], C = 5."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 5)
        with torch.no_grad():
            self.fc.weight.mul_(4.0)
        self.eval()

    def feature_map(self, x):
        return self.body(x)

    def head(self, maps):
        return self.fc(self.pool(maps).flatten(1))

    def forward(self, x):
        return self.head(self.body(x))


def images(n=40, seed=1, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g) * torch.linspace(0.2, spread, n).view(-1, 1, 1, 1)


def wide_backbone_of(model):
    return wrap_model(model, lambda image: image, head="fc", input_shape=(3, 8, 8), name="wide")


def labelled_images(n=90, seed=5):
    x = images(n, seed=seed, spread=2.0)
    return x, torch.arange(n) % 5
