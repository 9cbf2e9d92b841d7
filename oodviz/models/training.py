"""The training loop behind the bundled backbones (``scripts/train_digits_cnn.py``, ``scripts/train_fashion_cnn.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def train_classifier(
    model: torch.nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    augment: Callable[[Tensor, torch.Generator], Tensor],
    generator: torch.Generator,
    on_epoch: Callable[[int, float], None] | None = None,
) -> float:
    """Train ``model`` on ``x [N, ...]`` and labels ``y [N]`` by cross-entropy; returns the seconds taken.

    AdamW with a one-cycle learning rate peaking at ``lr``; each epoch visits the samples in an
    order drawn from ``generator``, in mini-batches of ``batch_size`` passed through
    ``augment(batch, generator)``. Deterministic given the generator, the model's initial weights,
    the thread count and ``torch.use_deterministic_algorithms(True)``. ``on_epoch(epoch, mean_loss)``
    runs after each epoch (0-based).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * -(-len(x) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(x), generator=generator)
        total = 0.0
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            loss = F.cross_entropy(model(augment(x[idx], generator)), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item() * len(idx)
        if on_epoch is not None:
            on_epoch(epoch, total / len(x))
    return time.perf_counter() - start
