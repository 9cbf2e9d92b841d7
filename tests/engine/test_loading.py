"""Batched transforms of in-memory datasets and num_workers="auto" (issue 13.7).

The batch path must give the numbers of the per-image PIL path: the reference is the same backbone
with a transform that hides its ``batch`` method (so every item goes through PIL one by one).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oodviz.config.run import RunConfig
from oodviz.data import load_dataset
from oodviz.data.base import ImageDataset
from oodviz.data.bundled import ArraySource
from oodviz.engine import extract
from oodviz.engine.batched import check_pass_options, make_loader
from oodviz.engine.loading import MAX_WORKERS_CPU, MAX_WORKERS_CUDA, auto_workers, batch_transform
from oodviz.models import load_backbone


class _OneByOne:
    """The same transform without ``batch``: the per-image PIL path, as before batching."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, image):
        return self.inner(image)


def _per_image(backbone):
    other = load_backbone(backbone.name)
    other.transform = _OneByOne(backbone.transform)
    return other


def _fashion_like(n: int = 70, seed: int = 0) -> ImageDataset:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 8, size=n)
    return ImageDataset("fashion-like", ArraySource(images, labels, [str(c) for c in range(8)]))


@pytest.mark.parametrize(
    ("backbone_name", "dataset"),
    [
        ("digits-cnn", lambda: load_dataset("digits-test")),
        (
            "digits-cnn",
            lambda: load_dataset("noise-gaussian", n=50, as_ood=True, subsample=37, subsample_mode="random"),
        ),
        ("fashion-cnn", _fashion_like),
        ("fashion-cnn", lambda: load_dataset("noise-uniform", n=40, size=28, as_ood=True)),
    ],
)
def test_batched_transform_gives_the_per_image_features(tmp_path, backbone_name, dataset):
    backbone = load_backbone(backbone_name)
    data = dataset()
    assert batch_transform(data, backbone.transform) is not None
    batched = extract(backbone, data, tmp_path / "batched", batch_size=32, sync=False)
    reference = extract(_per_image(backbone), data, tmp_path / "per-image", batch_size=32, sync=False)
    for field in ("features", "logits", "labels", "indices"):
        got, want = getattr(batched, field), getattr(reference, field)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6, err_msg=field)


def test_array_backed_batches_never_make_a_pil_image(monkeypatch):
    backbone = load_backbone("digits-cnn")
    data = load_dataset("digits-test")

    def no_pil(self, index):
        raise AssertionError("a PIL image was made for an array-backed dataset")

    monkeypatch.setattr(ArraySource, "load", no_pil)
    loader, _ = make_loader(data, backbone.transform, 100, 0, torch.device("cpu"))
    rows = [(x.shape, len(labels), dropped) for x, labels, _, dropped in loader]
    assert rows == [((100, 1, 8, 8), 100, 0)] * 3 + [((62, 1, 8, 8), 62, 0)]


def test_rgb_or_resized_pixels_fall_back_to_the_per_image_path():
    backbone = load_backbone("digits-cnn")
    rgb = ImageDataset("rgb", ArraySource(np.zeros((4, 8, 8, 3), np.uint8), None, []))
    larger = ImageDataset("larger", ArraySource(np.zeros((4, 16, 16), np.uint8), None, []))
    assert batch_transform(rgb, backbone.transform) is None
    assert batch_transform(larger, backbone.transform) is None


def test_auto_workers_follow_the_cores_and_the_dataset(tmp_path):
    backbone = load_backbone("digits-cnn")
    folder = tmp_path / "images" / "a"
    folder.mkdir(parents=True)
    from PIL import Image

    Image.new("L", (8, 8)).save(folder / "x.png")
    files = load_dataset("folder", path=str(tmp_path / "images"))
    arrays = load_dataset("digits-test")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [auto_workers(arrays, backbone.transform, d, cpus=64) for d in (cpu, cuda)] == [0, 0]
    assert [auto_workers(files, backbone.transform, cpu, cpus=c) for c in (1, 2, 8, 64)] == [0, 1, 2, MAX_WORKERS_CPU]
    assert [auto_workers(files, backbone.transform, cuda, cpus=c) for c in (1, 4, 64)] == [0, 3, MAX_WORKERS_CUDA]


def test_extraction_records_the_workers_in_force(tmp_path):
    store = extract(load_backbone("digits-cnn"), load_dataset("digits-test"), tmp_path, num_workers="auto", sync=False)
    assert store.meta["num_workers"] == 0


def test_num_workers_auto_is_the_config_default_and_other_words_are_refused():
    assert RunConfig().num_workers == "auto"
    assert not [p for p in RunConfig().problems() if "num_workers" in p]
    assert any("num_workers must be an integer >= 0 or 'auto'" in p for p in RunConfig(num_workers="many").problems())
    with pytest.raises(ValueError, match="or 'auto'"):
        check_pass_options(8, "many", "fp32")
