"""Small stand-ins for the engine's tests (test_engine.py, test_store.py): a tiny CNN behind the backbone contract, a
dataset of random images, and the in-memory forward pass a store must equal."""

from __future__ import annotations

import numpy as np
import torch
from kernels import assert_kernel_close
from PIL import Image
from torch import nn


class TinyCNN(nn.Module):
    """conv -> BN -> ReLU -> global average pool -> features [B, 6] -> linear -> logits [B, 3]."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 3)
        with torch.no_grad():  # make eval-mode BN differ from train-mode BN
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
        self.seen_training: list[bool] = []

    def features(self, x):
        self.seen_training.append(self.training)
        return torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))

    def forward(self, x):
        return self.fc(self.features(x))


def to_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


class TinyBackbone:
    """The backbone contract: name, model, transform, features_and_logits, head, weights_id."""

    def __init__(self, model=None, name="tiny", oom_above: int | None = None, oom_message: str | None = None):
        self.name = name
        self.model = TinyCNN() if model is None else model
        self.weights_id = "tiny-seed0"
        self.calls = 0
        self.batch_sizes: list[int] = []
        self.oom_above = oom_above
        self.oom_message = oom_message

    def transform(self, image):
        return to_tensor(image)

    def features_and_logits(self, x):
        self.calls += 1
        self.batch_sizes.append(len(x))
        if self.oom_above is not None and len(x) > self.oom_above:
            if self.oom_message is None:
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(x)} GiB")
            raise RuntimeError(self.oom_message)
        features = self.model.features(x)
        return features, self.model.fc(features)

    @property
    def head(self):
        return self.model.fc.weight.detach(), self.model.fc.bias.detach()

    feature_dim = 6
    num_classes = 3


class ListDataset:
    """``ds[i] -> (PIL image, label, source_index)`` or ``None`` for the indices in ``corrupt``."""

    classes = ["a", "b", "c"]

    def __init__(self, n=10, name="toy", corrupt=(), fail_at=None, seed=0, size=8):
        rng = np.random.default_rng(seed)
        self.images = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]
        self.labels = [i % 3 for i in range(n)]
        self.name = name
        self.corrupt = set(corrupt)
        self.fail_at = fail_at

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        if self.fail_at is not None and i == self.fail_at:
            raise RuntimeError(f"disk error at item {i}")
        if i in self.corrupt:
            return None
        return self.images[i], self.labels[i], 100 + i


def reference(backbone: TinyBackbone, dataset: ListDataset):
    """Features, logits, labels, source indices of the readable items, by one in-memory forward pass."""
    keep = [i for i in range(len(dataset)) if dataset[i] is not None]
    x = torch.stack([backbone.transform(dataset.images[i]) for i in keep])
    model = backbone.model
    was_training = model.training
    model.eval()
    with torch.no_grad():
        features = model.features(x)
        logits = model.fc(features)
    model.train(was_training)
    labels = np.array([dataset.labels[i] for i in keep])
    return features.numpy(), logits.numpy(), labels, np.array([100 + i for i in keep])


def assert_store_equals(store, features, logits, labels, indices):
    """The store holds the in-memory forward pass's rows: features and logits to float32 rounding (the store's
    batches have other shapes than the one in-memory pass, and oneDNN picks kernels by shape)."""
    assert_kernel_close(np.asarray(store.features), features)
    assert_kernel_close(np.asarray(store.logits), logits)
    np.testing.assert_array_equal(store.labels, labels)
    np.testing.assert_array_equal(store.indices, indices)
    np.testing.assert_array_equal(store.predictions, np.asarray(store.logits).argmax(axis=1))
