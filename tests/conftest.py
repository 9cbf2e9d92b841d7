"""Shared fixtures: a small, seeded classification problem with a linear head."""

from dataclasses import dataclass

import pytest
import torch

from oodviz import Batch


@dataclass
class Problem:
    """ID fit/test data and an OOD set from one synthetic model: features [N, D], head (W, b)."""

    fit_x: torch.Tensor
    fit_y: torch.Tensor
    test_x: torch.Tensor
    ood_x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor

    @property
    def head(self):
        return self.weight, self.bias

    def logits(self, x):
        return x @ self.weight.T + self.bias

    def batches(self, x, y=None, size=97):
        """``x`` as a list of Batch of (mostly) ``size`` rows, logits from the head."""
        logits = self.logits(x)
        return [
            Batch(x[i : i + size], logits[i : i + size], None if y is None else y[i : i + size])
            for i in range(0, len(x), size)
        ]

    def fit_batches(self, size=97):
        return self.batches(self.fit_x, self.fit_y, size)

    @property
    def eval_x(self):
        """ID test followed by OOD features."""
        return torch.cat([self.test_x, self.ood_x])


def make_problem(n_classes=6, dim=12, n_fit=1200, n_test=300, n_ood=300, seed=0, offset=0.0) -> Problem:
    g = torch.Generator().manual_seed(seed)
    centres = 1.5 * torch.randn(n_classes, dim, generator=g)  # overlapping classes: some errors
    mixing = torch.eye(dim) + 0.3 * torch.randn(dim, dim, generator=g)  # correlated features

    def sample(n, shift=0.0):
        y = torch.arange(n) % n_classes
        x = (torch.randn(n, dim, generator=g) @ mixing) + centres[y] + shift + offset
        return x, y

    fit_x, fit_y = sample(n_fit)
    test_x, _ = sample(n_test)
    ood_x = 1.5 * torch.randn(n_ood, dim, generator=g) @ mixing + offset  # between the classes
    # A head that classifies well: nearest-centre scores as a linear layer, scaled down so the
    # softmax is not saturated.
    weight = 0.05 * centres
    bias = 0.05 * (-0.5 * (centres**2).sum(dim=1) - centres @ torch.full((dim,), offset))
    return Problem(fit_x, fit_y, test_x, ood_x, weight, bias)


@pytest.fixture(scope="session")
def problem() -> Problem:
    return make_problem()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
