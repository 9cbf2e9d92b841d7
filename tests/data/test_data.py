"""Dataset sources: bundled digits and their OOD sets, noise, torchvision file formats, folders, subsampling.

Everything runs offline: torchvision datasets are tested on tiny files written here in each
dataset's real on-disk format, never downloaded.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import pickle
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import write_idx
from PIL import Image

from oodviz.data import (
    DIGITS_HELD_OUT,
    DIGITS_ID_CLASSES,
    DatasetNotFoundError,
    Sampling,
    available_datasets,
    dataset_info,
    dataset_params,
    digits_split,
    load_dataset,
    subsample_indices,
)

EXPECTED_NAMES = [
    "digits-train",
    "digits-test",
    "digits-heldout",
    "digits-inverted",
    "digits-rotated",
    "photo-patches",
    "noise-gaussian",
    "noise-uniform",
    "mnist",
    "fashion-mnist",
    "kmnist",
    "cifar10",
    "cifar100",
    "svhn",
    "dtd",
    "fashion-mnist-id",
    "fashion-mnist-heldout",
    "fashion-mnist-inverted",
    "fashion-mnist-rotated",
    "digits-28",
    "folder",
    "openood",
]


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)


# -- registry -------------------------------------------------------------------------------


def test_registry_lists_every_source_with_its_info():
    assert available_datasets() == EXPECTED_NAMES
    groups = {name: (dataset_info(name).kind, dataset_info(name).group) for name in EXPECTED_NAMES}
    assert groups["digits-train"] == ("id", None)
    assert groups["digits-test"] == ("id", None)
    assert groups["digits-heldout"] == ("ood", "near")
    assert groups["digits-inverted"] == ("ood", "near")
    assert groups["digits-rotated"] == ("ood", "near")
    assert groups["photo-patches"] == ("ood", "far")
    assert groups["noise-gaussian"] == ("ood", "far")
    assert groups["noise-uniform"] == ("ood", "far")
    assert groups["cifar10"] == ("id", None)
    assert groups["svhn"] == ("ood", "far")
    assert groups["dtd"] == ("ood", "far")
    assert dataset_info("mnist").source == "torchvision"
    assert dataset_info("digits-test").source == "bundled"
    assert dataset_info("digits-test").name == "digits-test"
    assert dataset_params("noise-uniform") == {"n": 500, "size": 8, "channels": 1, "noise_seed": 0}
    assert dataset_params("cifar10") == {"split": "test"}


def test_registry_errors_name_the_fix():
    with pytest.raises(ValueError, match="Did you mean 'digits-test'"):
        load_dataset("digit-test")
    with pytest.raises(ValueError, match="has no parameter.*colour.*its parameters: n, size, channels, noise_seed"):
        load_dataset("noise-gaussian", colour=3)
    with pytest.raises(ValueError, match="subsample_mode must be one of stratified, first, random, last"):
        load_dataset("digits-test", subsample=5, subsample_mode="middle")


# -- bundled digits -------------------------------------------------------------------------


def test_digits_split_is_stratified_disjoint_and_keeps_held_out_classes_out():
    from sklearn.datasets import load_digits

    digits = load_digits()
    train_x, train_y, train_i = digits_split("train")
    test_x, test_y, test_i = digits_split("test")
    held_x, held_y, held_i = digits_split("heldout")
    assert DIGITS_ID_CLASSES == (0, 1, 2, 3, 4, 5, 6, 7) and DIGITS_HELD_OUT == (8, 9)
    assert (len(train_y), len(test_y), len(held_y)) == (1081, 362, 354)
    assert train_x.shape == (1081, 8, 8) and train_x.dtype == np.uint8
    # disjoint, and together exactly the ID digits
    assert not set(train_i) & set(test_i)
    id_indices = np.flatnonzero(digits.target < 8)
    np.testing.assert_array_equal(np.sort(np.concatenate([train_i, test_i])), id_indices)
    np.testing.assert_array_equal(held_i, np.flatnonzero(digits.target >= 8))
    # held-out classes never in an ID split; labels are the digits
    assert set(train_y) == set(test_y) == set(range(8))
    assert set(held_y) == {8, 9}
    np.testing.assert_array_equal(train_y, digits.target[train_i])
    # stratified: every class has 25% +- one sample in test
    per_class_total = np.bincount(digits.target)[:8]
    per_class_test = np.bincount(test_y, minlength=8)
    assert np.all(np.abs(per_class_test - 0.25 * per_class_total) <= 1.0)
    np.testing.assert_array_equal(per_class_test, [45, 46, 44, 46, 45, 46, 45, 45])
    # pixels: 0..16 scaled to 0..255
    np.testing.assert_array_equal(test_x, np.round(digits.images[test_i] * 255 / 16).astype(np.uint8))
    assert train_x.max() == 255 and train_x.min() == 0
    with pytest.raises(ValueError, match="train, test, heldout"):
        digits_split("val")


def test_digits_id_datasets_serve_the_split_as_greyscale_images():
    train_x, train_y, _ = digits_split("train")
    test_x, test_y, _ = digits_split("test")
    train, test = load_dataset("digits-train"), load_dataset("digits-test")
    assert (len(train), len(test)) == (1081, 362)
    assert train.classes == test.classes == [str(c) for c in range(8)]
    assert train.name == "digits-train"
    for ds, x, y in ((train, train_x, train_y), (test, test_x, test_y)):
        for i in (0, 17, len(ds) - 1):
            image, label, source_index = ds[i]
            assert image.mode == "L" and image.size == (8, 8)
            np.testing.assert_array_equal(pixels(image), x[i])
            assert label == y[i] and source_index == i
        np.testing.assert_array_equal(ds.labels, y)


def test_digit_ood_sets():
    test_x, _, test_i = digits_split("test")
    held_x, _, _ = digits_split("heldout")
    expected = {
        "digits-heldout": held_x,
        "digits-inverted": 255 - test_x,
        "digits-rotated": np.rot90(test_x, k=1, axes=(1, 2)),
    }
    for name, arrays in expected.items():
        ds = load_dataset(name)
        assert len(ds) == len(arrays) and ds.classes == []
        assert np.all(ds.labels == -1)
        for i in (0, 5, len(ds) - 1):
            image, label, source_index = ds[i]
            assert (image.mode, image.size, label, source_index) == ("L", (8, 8), -1, i)
            np.testing.assert_array_equal(pixels(image), arrays[i])
    # the rotation really changes the digit (not symmetric), inversion flips the background
    assert not np.array_equal(expected["digits-rotated"], test_x)
    assert pixels(load_dataset("digits-inverted")[0][0])[0, 0] == 255 - test_x[0, 0, 0]
    # item names point back to load_digits()
    assert load_dataset("digits-rotated").item_name(3) == f"rotated digit load_digits()[{test_i[3]}]"
    # sources without labels stay -1 even with as_ood=False; an ID set becomes OOD with as_ood=True
    assert load_dataset("digits-heldout", as_ood=False)[0][1] == -1
    as_ood = load_dataset("digits-test", as_ood=True)
    assert as_ood[0][1] == -1 and as_ood.classes == [] and np.all(as_ood.labels == -1)


def test_photo_patches_are_textured_and_deterministic():
    ds = load_dataset("photo-patches")
    assert len(ds) == 500 and ds.classes == []
    arrays = np.stack([pixels(ds[i][0]) for i in range(len(ds))])
    assert arrays.shape == (500, 8, 8)
    assert {ds[i][0].mode for i in (0, 250)} == {"L"} and ds[0][1] == -1
    # textures, not flat colour: every patch varies (std >= 12 grey levels), and patches differ
    assert arrays.reshape(500, -1).std(axis=1).min() >= 12.0
    assert len({a.tobytes() for a in arrays}) == 500
    assert {ds.item_name(i).split()[0] for i in range(500)} == {"china.jpg", "flower.jpg"}
    again = load_dataset("photo-patches")
    np.testing.assert_array_equal(pixels(again[123][0]), arrays[123])
    other = load_dataset("photo-patches", patch_seed=1)
    assert not np.array_equal(np.stack([pixels(other[i][0]) for i in range(20)]), arrays[:20])
    rgb = load_dataset("photo-patches", n=50, size=32, channels=3)
    image = rgb[7][0]
    assert (len(rgb), image.mode, image.size) == (50, "RGB", (32, 32))
    assert pixels(image).std() > 5


# -- noise ----------------------------------------------------------------------------------


def _stack_collate(items):
    return np.stack([np.asarray(image) for image, _, _ in items]), [index for _, _, index in items]


def _loader_images(ds, workers):
    loader = torch.utils.data.DataLoader(ds, batch_size=7, num_workers=workers, collate_fn=_stack_collate)
    arrays, indices = [], []
    for batch, index in loader:
        arrays.append(batch)
        indices.extend(index)
    return np.concatenate(arrays), indices


@pytest.mark.parametrize("name", ["noise-gaussian", "noise-uniform"])
def test_noise_is_the_same_in_every_worker_and_epoch(name):
    ds = load_dataset(name, n=40)
    serial, serial_index = _loader_images(ds, 0)
    parallel, parallel_index = _loader_images(ds, 2)
    parallel_again, _ = _loader_images(ds, 2)
    assert serial.shape == (40, 8, 8) and serial_index == parallel_index == list(range(40))
    np.testing.assert_array_equal(serial, parallel)
    np.testing.assert_array_equal(parallel, parallel_again)
    # every index its own image (pytorch-ood's noise repeats across workers)
    assert len({a.tobytes() for a in serial}) == 40
    # a fresh dataset, and a random subsample, give the same item for the same source index
    np.testing.assert_array_equal(pixels(load_dataset(name, n=40)[13][0]), serial[13])
    sub = load_dataset(name, n=40, subsample=5, subsample_mode="random", seed=3)
    for image, _, source_index in (sub[i] for i in range(len(sub))):
        np.testing.assert_array_equal(pixels(image), serial[source_index])
    # another noise_seed gives other images
    assert not np.array_equal(pixels(load_dataset(name, n=40, noise_seed=1)[0][0]), serial[0])


def test_noise_distributions_sizes_and_modes():
    gaussian = np.stack([pixels(load_dataset("noise-gaussian")[i][0]) for i in range(200)]).astype(float)
    uniform = np.stack([pixels(load_dataset("noise-uniform")[i][0]) for i in range(200)]).astype(float)
    assert abs(gaussian.mean() - 127.5) < 3 and 55 < gaussian.std() < 68  # 255 * 0.25 = 64, a bit less after clipping
    assert abs(uniform.mean() - 127.5) < 3 and 70 < uniform.std() < 78  # 255 / sqrt(12) = 73.6
    assert uniform.min() == 0 and uniform.max() == 255
    ds = load_dataset("noise-gaussian", n=3, size=32, channels=3)
    image, label, index = ds[2]
    assert (len(ds), image.mode, image.size, label, index) == (3, "RGB", (32, 32), -1, 2)
    assert load_dataset("noise-uniform", size=(4, 6))[0][0].size == (6, 4)  # PIL size is (width, height)
    with pytest.raises(ValueError, match="channels must be 1"):
        load_dataset("noise-uniform", channels=2)


# -- subsampling and the dataset view -------------------------------------------------------


def test_subsampling_keeps_source_index():
    full = load_dataset("digits-test")
    first = load_dataset("digits-test", subsample=10, subsample_mode="first")
    assert len(first) == 10 and [first[i][2] for i in range(10)] == list(range(10))
    random = load_dataset("digits-test", subsample=25, subsample_mode="random", seed=7)
    indices = [random[i][2] for i in range(25)]
    assert len(set(indices)) == 25 and indices == sorted(indices) and indices != list(range(25))
    assert max(indices) < len(full)
    for i in (0, 12, 24):
        image, label, source_index = random[i]
        full_image, full_label, _ = full[source_index]
        np.testing.assert_array_equal(pixels(image), pixels(full_image))
        assert label == full_label
    np.testing.assert_array_equal(random.labels, full.labels[indices])
    same = load_dataset("digits-test", subsample=25, subsample_mode="random", seed=7)
    assert [same[i][2] for i in range(25)] == indices
    other = load_dataset("digits-test", subsample=25, subsample_mode="random", seed=8)
    assert [other[i][2] for i in range(25)] != indices
    # more than the dataset has: all of it, in order
    assert len(load_dataset("digits-test", subsample=10_000, subsample_mode="random")) == 362
    np.testing.assert_array_equal(subsample_indices(5, 9, "random"), np.arange(5))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="subsample must be a positive integer"):
            load_dataset("digits-test", subsample=bad)
    # indexing: negative from the end, out of range is an IndexError (iteration stops there)
    assert first[-1][2] == 9
    with pytest.raises(IndexError):
        first[10]


def test_transform_is_applied_to_the_image():
    ds = load_dataset(
        "digits-test",
        subsample=3,
        subsample_mode="first",
        transform=lambda image: np.asarray(image, dtype=np.float32) / 255,
    )
    array, label, index = ds[1]
    np.testing.assert_allclose(array, digits_split("test")[0][1] / 255, rtol=1e-6)
    assert (label, index) == (int(digits_split("test")[1][1]), 1)


# -- stratified subsampling (the default) ------------------------------------------------------


def proportional_shares(labels: np.ndarray, total: int) -> dict[int, int]:
    """Largest-remainder allocation of ``total`` over the classes of ``labels``, in exact fractions: each class
    gets floor(total * count / n), then the classes with the largest remainders one more (ties: lower class)."""
    classes, counts = np.unique(labels, return_counts=True)
    n = len(labels)
    quotas = {int(c): Fraction(total * int(k), n) for c, k in zip(classes, counts)}
    shares = {c: math.floor(q) for c, q in quotas.items()}
    for c in sorted(quotas, key=lambda c: (-(quotas[c] - shares[c]), c))[: total - sum(shares.values())]:
        shares[c] += 1
    return shares


def per_class(labels: np.ndarray) -> dict[int, int]:
    classes, counts = np.unique(labels, return_counts=True)
    return {int(c): int(k) for c, k in zip(classes, counts)}


@pytest.mark.parametrize("total", [1, 7, 50, 333, 1080])
def test_a_stratified_subsample_gives_each_class_its_proportional_share(total):
    full = load_dataset("digits-train")
    sub = load_dataset("digits-train", subsample=total, subsample_mode="stratified", seed=3)
    expected = {c: k for c, k in proportional_shares(full.labels, total).items() if k}
    assert len(sub) == total and per_class(sub.labels) == expected
    indices = sub.source_indices
    assert (np.diff(indices) > 0).all()  # ascending, distinct: the store keeps the dataset's order
    np.testing.assert_array_equal(sub.labels, full.labels[indices])


def test_stratified_shares_of_unequal_classes_add_up_by_largest_remainder():
    rng = np.random.default_rng(0)
    labels = rng.permutation(np.repeat([0, 1, 2, 3, -1], [50, 30, 15, 4, 1]))  # -1: items without a class
    for total in (3, 9, 17, 64):
        kept = subsample_indices(len(labels), total, "stratified", seed=5, labels=labels)
        assert len(kept) == total and per_class(labels[kept]) == {
            c: k for c, k in proportional_shares(labels, total).items() if k
        }


def test_a_stratified_subsample_is_seeded_and_uniform_within_each_class():
    labels = load_dataset("digits-test").labels
    same = [load_dataset("digits-test", subsample=40, seed=7).source_indices for _ in range(2)]
    np.testing.assert_array_equal(same[0], same[1])
    other = load_dataset("digits-test", subsample=40, seed=8).source_indices
    assert not np.array_equal(same[0], other) and per_class(labels[other]) == per_class(labels[same[0]])
    # every item of a class is drawn about equally often over seeds (not the first ones of the class)
    counts = np.zeros(len(labels))
    for seed in range(400):
        counts[subsample_indices(len(labels), 40, seed=seed, labels=labels)] += 1
    expected = 400 * 5 / np.bincount(labels)[labels]  # 5 of a class of 44-46 per draw
    assert np.abs(counts - expected).max() < 0.5 * expected.min()


def test_the_default_subsample_is_stratified_and_an_ood_sets_is_uniform():
    from oodviz.config.run import DatasetChoice

    assert DatasetChoice("digits-test").subsample_mode == "stratified"
    assert inspect.signature(load_dataset).parameters["subsample_mode"].default == "stratified"
    assert inspect.signature(subsample_indices).parameters["mode"].default == "stratified"
    default = load_dataset("digits-test", subsample=40, seed=2)
    np.testing.assert_array_equal(
        default.source_indices,
        load_dataset("digits-test", subsample=40, subsample_mode="stratified", seed=2).source_indices,
    )
    assert (default.sampling.mode, default.sampling.classes) == ("stratified", 8)
    # an OOD set has no classes: stratified is the uniform draw of mode "random"
    ood = load_dataset("digits-heldout", subsample=30, seed=2)
    random = load_dataset("digits-heldout", subsample=30, subsample_mode="random", seed=2)
    np.testing.assert_array_equal(ood.source_indices, random.source_indices)
    assert ood.sampling.describe() == "30 of 354, uniform at random (no classes), seed 2"
    assert load_dataset("digits-test").sampling.describe() == "all 362 (no subsample)"


def test_an_image_folder_subsample_holds_every_class_and_names_the_classes_it_loses(tmp_path):
    for k in range(4):
        for i in range(6):
            _png(tmp_path / f"class-{k}" / f"{i}.png", (40 * k, 0, 0))
    sub = load_dataset("folder", path=str(tmp_path), subsample=8)
    assert per_class(sub.labels) == {0: 2, 1: 2, 2: 2, 3: 2}
    assert sub.sampling == Sampling("stratified", 0, 8, 24, 4, ())
    assert sub.sampling.describe() == "8 of 24, stratified by class (4 classes), seed 0"
    first = load_dataset("folder", path=str(tmp_path), subsample=8, subsample_mode="first")
    assert per_class(first.labels) == {0: 6, 1: 2}  # what "first" takes: the folders in name order
    assert first.sampling.empty_classes == ("class-2", "class-3")
    assert load_dataset("folder", path=str(tmp_path), subsample=3).sampling.empty_classes == ("class-3",)


# -- torchvision formats, written here in their real layouts --------------------------------


def _md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _write_mnist_like(root, class_name, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    raw = root / class_name / "raw"
    raw.mkdir(parents=True)
    written = {}
    for prefix, n in (("train", 6), ("t10k", 4)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images, gz)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, gz)
        written["train" if prefix == "train" else "test"] = (images, labels)
    return written


@pytest.mark.parametrize(
    "name,class_name,gz,first_class",
    [
        ("mnist", "MNIST", False, "0 - zero"),
        ("fashion-mnist", "FashionMNIST", False, "T-shirt/top"),
        ("kmnist", "KMNIST", True, "o"),  # only the .gz archives: unpacked on load
    ],
)
def test_mnist_family_reads_idx_files(tmp_path, name, class_name, gz, first_class):
    written = _write_mnist_like(tmp_path, class_name, gz=gz)
    for split, n in (("train", 6), ("test", 4)):
        ds = load_dataset(name, root=tmp_path, split=split)
        images, labels = written[split]
        assert len(ds) == n and ds.classes[0] == first_class and len(ds.classes) == 10
        np.testing.assert_array_equal(ds.labels, labels)
        for i in range(n):
            image, label, index = ds[i]
            assert (image.mode, image.size, label, index) == ("L", (28, 28), labels[i], i)
            np.testing.assert_array_equal(pixels(image), images[i])
    if gz:
        assert (tmp_path / class_name / "raw" / "t10k-images-idx3-ubyte").is_file()
    as_ood = load_dataset(name, root=tmp_path, as_ood=True)
    assert [as_ood[i][1] for i in range(4)] == [-1] * 4 and as_ood.classes == []


def _patch_md5s(monkeypatch, cls, folder):
    # torchvision checks every CIFAR/SVHN file against the md5 of the real release, so tiny
    # test files fail its _check_integrity. Setting the expected sums, on the class and for this
    # test only (monkeypatch restores them), to those of the files written here runs the real
    # integrity check and loading code unchanged; the library itself never skips the check.
    if hasattr(cls, "split_list"):
        split_list = {
            key: [url, f, _md5(folder / f) if (folder / f).exists() else md5]
            for key, (url, f, md5) in cls.split_list.items()
        }
        monkeypatch.setattr(cls, "split_list", split_list)
        return
    monkeypatch.setattr(cls, "train_list", [[f, _md5(folder / f)] for f, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[f, _md5(folder / f)] for f, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": _md5(folder / cls.meta["filename"])})


def _write_pickle(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def _write_cifar10(root, seed=0):
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(3, 3 * 32 * 32), dtype=np.uint8)  # rows: R plane, G plane, B plane
        labels = [int(v) for v in rng.integers(0, 10, size=3)]
        _write_pickle(folder / name, {"data": data, "labels": labels, "batch_label": name})
        batches[name] = (data, labels)
    _write_pickle(folder / "batches.meta", {"label_names": [f"class{i}" for i in range(10)]})
    return folder, batches


def _hwc(rows: np.ndarray) -> np.ndarray:
    return rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


def test_cifar10_reads_python_batches(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    folder, batches = _write_cifar10(tmp_path)
    _patch_md5s(monkeypatch, CIFAR10, folder)
    train = load_dataset("cifar10", root=tmp_path, split="train")
    test = load_dataset("cifar10", root=tmp_path)  # split defaults to "test"
    assert (len(train), len(test)) == (15, 3)
    assert test.classes == [f"class{i}" for i in range(10)]
    expected_train = _hwc(np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)]))
    labels_train = sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    for i in (0, 4, 14):
        image, label, index = train[i]
        assert (image.mode, image.size, label, index) == ("RGB", (32, 32), labels_train[i], i)
        np.testing.assert_array_equal(pixels(image), expected_train[i])
    image, label, _ = test[2]
    np.testing.assert_array_equal(pixels(image), _hwc(batches["test_batch"][0])[2])
    assert label == batches["test_batch"][1][2]
    # the red channel of pixel (0, 0) is the first byte of the row
    assert pixels(image)[0, 0, 0] == batches["test_batch"][0][2, 0]


def test_cifar100_reads_fine_labels(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR100

    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    written = {}
    for name, n in (("train", 5), ("test", 2)):
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        fine = [int(v) for v in rng.integers(0, 100, size=n)]
        _write_pickle(folder / name, {"data": data, "fine_labels": fine, "coarse_labels": [0] * n})
        written[name] = (data, fine)
    _write_pickle(folder / "meta", {"fine_label_names": [f"fine{i}" for i in range(100)], "coarse_label_names": []})
    _patch_md5s(monkeypatch, CIFAR100, folder)
    ds = load_dataset("cifar100", root=tmp_path, split="train")
    assert len(ds) == 5 and len(ds.classes) == 100 and ds.classes[99] == "fine99"
    np.testing.assert_array_equal(ds.labels, written["train"][1])
    np.testing.assert_array_equal(pixels(ds[3][0]), _hwc(written["train"][0])[3])


def test_svhn_reads_mat_files_as_ood_by_default(tmp_path, monkeypatch):
    import scipy.io
    from torchvision.datasets import SVHN

    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, size=(32, 32, 3, 4), dtype=np.uint8)  # SVHN's layout: [H, W, C, N]
    y = np.array([[10], [1], [9], [10]], dtype=np.uint8)  # SVHN stores digit 0 as 10
    scipy.io.savemat(tmp_path / "test_32x32.mat", {"X": x, "y": y})
    _patch_md5s(monkeypatch, SVHN, tmp_path)
    ood = load_dataset("svhn", root=tmp_path)
    assert len(ood) == 4 and ood.classes == [] and [ood[i][1] for i in range(4)] == [-1] * 4
    labelled = load_dataset("svhn", root=tmp_path, as_ood=False)
    assert [labelled[i][1] for i in range(4)] == [0, 1, 9, 0]
    assert labelled.classes == [str(d) for d in range(10)]
    for i in range(4):
        image = labelled[i][0]
        assert (image.mode, image.size) == ("RGB", (32, 32))
        np.testing.assert_array_equal(pixels(image), x[..., i])
    with pytest.raises(DatasetNotFoundError, match="train_32x32.mat"):
        load_dataset("svhn", root=tmp_path, split="train")


def _write_dtd(root):
    base = root / "dtd" / "dtd"
    colours = {}
    for cls, values in (("banded", [(200, 30, 30), (20, 200, 40)]), ("dotted", [(10, 10, 220)])):
        (base / "images" / cls).mkdir(parents=True)
        for k, colour in enumerate(values):
            name = f"{cls}_{k:04d}.jpg"
            Image.new("RGB", (40, 30), colour).save(base / "images" / cls / name, quality=95)
            colours[f"{cls}/{name}"] = colour
    (base / "labels").mkdir()
    listing = ["dotted/dotted_0000.jpg", "banded/banded_0000.jpg", "banded/banded_0001.jpg"]
    (base / "labels" / "test1.txt").write_text("".join(line + "\n" for line in listing))
    (base / "labels" / "train1.txt").write_text("banded/banded_0000.jpg\n")
    return base, colours


def test_dtd_reads_images_and_label_files(tmp_path):
    base, colours = _write_dtd(tmp_path)
    ds = load_dataset("dtd", root=tmp_path, as_ood=False)  # split "test", partition 1
    assert len(ds) == 3 and ds.classes == ["banded", "dotted"]
    assert [ds[i][1] for i in range(3)] == [1, 0, 0]
    order = ["dotted/dotted_0000.jpg", "banded/banded_0000.jpg", "banded/banded_0001.jpg"]
    for i, key in enumerate(order):
        image = ds[i][0]
        assert (image.mode, image.size) == ("RGB", (40, 30))
        assert np.abs(pixels(image).astype(int) - np.array(colours[key])).max() <= 3  # JPEG of a flat colour
    assert ds.item_name(0).endswith(os.path.join("dotted", "dotted_0000.jpg"))
    assert len(load_dataset("dtd", root=tmp_path, split="train")) == 1
    assert load_dataset("dtd", root=tmp_path)[0][1] == -1  # OOD by default
    # a corrupt JPEG in the list is skipped and counted, not raised
    (base / "images" / "banded" / "banded_0001.jpg").write_bytes(b"not a jpeg")
    ds = load_dataset("dtd", root=tmp_path)
    assert ds[2] is None and ds.skipped == 1 and ds.skipped_indices == [2]
    assert ds[0][1] == -1
    with pytest.raises(DatasetNotFoundError, match=r"labels[/\\]val1.txt"):
        load_dataset("dtd", root=tmp_path, split="val")


@pytest.mark.parametrize(
    "name,where,first_file",
    [
        ("mnist", os.path.join("MNIST", "raw"), "train-images-idx3-ubyte"),
        ("kmnist", os.path.join("KMNIST", "raw"), "train-images-idx3-ubyte"),
        ("cifar10", "cifar-10-batches-py", "data_batch_1"),
        ("cifar100", "cifar-100-python", "train"),
        ("svhn", "", "test_32x32.mat"),
        ("dtd", os.path.join("dtd", "dtd"), "labels"),
    ],
)
def test_missing_files_say_where_and_how_to_download(tmp_path, name, where, first_file):
    with pytest.raises(DatasetNotFoundError) as caught:
        load_dataset(name, root=tmp_path / "data")
    message = str(caught.value)
    assert isinstance(caught.value, FileNotFoundError)
    assert str(tmp_path / "data" / where).rstrip(os.sep) in message
    assert first_file in message and "download=True" in message and "Allow downloads" in message


def test_files_failing_torchvision_checksums_say_so(tmp_path):
    _write_cifar10(tmp_path)  # real md5 sums not patched: torchvision rejects the files
    with pytest.raises(ValueError, match="checksums.*download=True"):
        load_dataset("cifar10", root=tmp_path)


def test_failed_download_is_reported_with_the_target_folder(tmp_path, monkeypatch):
    from torchvision.datasets import MNIST

    def offline(self):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz: no network")

    monkeypatch.setattr(MNIST, "download", offline)
    with pytest.raises(DatasetNotFoundError, match="Downloading 'mnist'.*no network.*by hand"):
        load_dataset("mnist", root=tmp_path, download=True)


def test_bad_split_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="train, test, extra"):
        load_dataset("svhn", root=tmp_path, split="val")


# -- image folders --------------------------------------------------------------------------


def _png(path, value, size=(5, 4), mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value).save(path)


def test_class_folders_label_by_sorted_name_and_skip_corrupt_files(tmp_path):
    _png(tmp_path / "dog" / "a.png", (0, 0, 255))
    _png(tmp_path / "cat" / "b.png", (255, 0, 0))
    _png(tmp_path / "cat" / "nested" / "c.PNG", (0, 255, 0))
    _png(tmp_path / "cat" / "grey.png", 77, mode="L")
    (tmp_path / "cat" / "x.png").write_bytes(b"\x89PNG garbage, not an image")
    (tmp_path / "cat" / "notes.txt").write_text("ignored")
    (tmp_path / ".cache").mkdir()
    ds = load_dataset("folder", path=str(tmp_path))
    assert ds.classes == ["cat", "dog"] and ds.name == f"folder:{tmp_path.name}"
    names = [os.path.relpath(ds.item_name(i), tmp_path) for i in range(len(ds))]
    assert names == ["cat/b.png", "cat/grey.png", "cat/x.png", "cat/nested/c.PNG", "dog/a.png"]
    np.testing.assert_array_equal(ds.labels, [0, 0, 0, 0, 1])
    items = [ds[i] for i in range(len(ds))]
    assert items[2] is None and ds.skipped == 1 and ds.skipped_indices == [2]
    assert pixels(items[0][0])[0, 0].tolist() == [255, 0, 0] and items[0][1:] == (0, 0)
    grey, label, index = items[1]
    assert (grey.mode, label, index) == ("RGB", 0, 1)  # converted to RGB by default
    assert pixels(grey)[0, 0].tolist() == [77, 77, 77]
    assert pixels(items[3][0])[3, 4].tolist() == [0, 255, 0] and items[3][1:] == (0, 3)
    assert pixels(items[4][0])[0, 0].tolist() == [0, 0, 255] and items[4][1:] == (1, 4)
    assert ds[2] is None and ds.skipped == 1  # read again (next epoch): still one skipped file
    greyscale = load_dataset("folder", path=str(tmp_path), mode="L")
    assert greyscale[4][0].mode == "L" and pixels(greyscale[1][0])[0, 0] == 77


def test_flat_folder_is_unlabelled_and_truncated_files_are_skipped(tmp_path):
    _png(tmp_path / "one.png", (1, 2, 3))
    _png(tmp_path / "two.jpg", (250, 250, 250))
    good = tmp_path / "three.png"
    _png(good, (9, 9, 9), size=(64, 64))
    data = good.read_bytes()
    (tmp_path / "half.png").write_bytes(data[: len(data) // 2])
    ds = load_dataset("folder", path=str(tmp_path))
    assert ds.classes == [] and len(ds) == 4
    assert [os.path.basename(ds.item_name(i)) for i in range(4)] == ["half.png", "one.png", "three.png", "two.jpg"]
    items = [ds[i] for i in range(4)]
    assert items[0] is None and ds.skipped == 1
    assert [item[1] for item in items[1:]] == [-1, -1, -1]
    assert pixels(items[1][0])[0, 0].tolist() == [1, 2, 3]
    sub = load_dataset("folder", path=str(tmp_path), subsample=2, subsample_mode="random", seed=1)
    for image_label_index in (sub[i] for i in range(2)):
        if image_label_index is not None:
            image, _, source_index = image_label_index
            np.testing.assert_array_equal(pixels(image), pixels(ds[source_index][0]))


def test_folder_errors_say_what_was_expected(tmp_path):
    with pytest.raises(ValueError, match=r"No images found under .*\.jpg, \.jpeg, \.png"):
        load_dataset("folder", path=str(tmp_path))
    (tmp_path / "readme.txt").write_text("no images here")
    with pytest.raises(ValueError, match="No images found"):
        load_dataset("folder", path=str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        load_dataset("folder", path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs path="):
        load_dataset("folder")
    _png(tmp_path / "cls" / "a.png", (0, 0, 0))
    _png(tmp_path / "loose.png", (0, 0, 0))
    with pytest.raises(ValueError, match="1 class subfolder.*1 image.*layout='flat'"):
        load_dataset("folder", path=str(tmp_path))
    assert len(load_dataset("folder", path=str(tmp_path), layout="flat")) == 2
    (tmp_path / "loose.png").unlink()
    (tmp_path / "empty_class").mkdir()
    with pytest.raises(ValueError, match="1 of the 2 subfolder.*hold no images"):
        load_dataset("folder", path=str(tmp_path))
