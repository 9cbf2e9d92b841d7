"""The Fashion-MNIST preset: the real files (Debian's dataset-fashion-mnist), its datasets, fashion-cnn, the preset.

Tests that need the real files are skipped, with the reason, where the package is not installed
and no copy is under ``$OODVIZ_TEST_DATA_ROOT`` (``make test`` installs it where it may: root
with apt). The search order and the error messages are tested everywhere, on fake folders.
"""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

import oodviz.data.torchvision_sets as tv_sets
from oodviz.cli import main as cli_main
from oodviz.config.run import PRESETS, ConfigError, RunConfig, fashion_mnist_config, preset
from oodviz.data import (
    FASHION_HELD_OUT,
    FASHION_ID_CLASSES,
    FASHION_ID_NAMES,
    DatasetNotFoundError,
    available_datasets,
    dataset_info,
    load_dataset,
)
from oodviz.data.fashion import FASHION_CLASSES as ALL_CLASSES
from oodviz.data.fashion import digits_28, fashion_arrays, fashion_split
from oodviz.models import available_backbones, backbone_info, load_backbone
from oodviz.models.fashion import (
    FASHION_CLASSES,
    FASHION_MEAN,
    FASHION_METADATA,
    FASHION_STD,
    FASHION_WEIGHTS,
    FashionTransform,
    normalize_fashion,
)

DEBIAN = "/usr/share/datasets/fashion-mnist"
RAW = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
HAVE_FILES = tv_sets.system_copy("fashion-mnist") is not None or bool(os.environ.get("OODVIZ_TEST_DATA_ROOT"))
needs_files = pytest.mark.skipif(
    not HAVE_FILES,
    reason=f"Fashion-MNIST is not installed: no {DEBIAN}/*-ubyte.gz (apt-get install dataset-fashion-mnist, which "
    "`make test` runs as root) and no OODVIZ_TEST_DATA_ROOT holding FashionMNIST/raw/",
)


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> str:
    """A data root for the real files: ``$OODVIZ_TEST_DATA_ROOT``, else a fresh one the Debian copy is unpacked into."""
    if os.environ.get("OODVIZ_TEST_DATA_ROOT"):
        return os.environ["OODVIZ_TEST_DATA_ROOT"]
    return str(tmp_path_factory.mktemp("fashion-data"))


def write_idx(path, array: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    data = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    with gzip.open(str(path) + ".gz", "wb") if gz else open(path, "wb") as f:
        f.write(data)


def _fake_fashion(folder, gz: bool, seed: int = 0) -> dict:
    """Tiny but valid Fashion-MNIST files (20 train, 10 test, every class) in ``folder``."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for prefix, n in (("train", 20), ("t10k", 10)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(folder / f"{prefix}-images-idx3-ubyte", images, gz)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, gz)
        written[prefix] = images, labels
    return written


@pytest.fixture
def fake_system(tmp_path, monkeypatch):
    """A fake Debian folder (only .gz archives) standing in for /usr/share/datasets/fashion-mnist."""
    folder = tmp_path / "usr-share-datasets-fashion-mnist"
    written = _fake_fashion(folder, gz=True)
    monkeypatch.setitem(tv_sets.SYSTEM_DIRS, "fashion-mnist", str(folder))
    return folder, written


# -- registry and class bookkeeping (no files needed) -------------------------------------------


def test_preset_datasets_are_registered_with_their_groups():
    names = available_datasets()
    expected = {
        "fashion-mnist-id": ("id", None),
        "fashion-mnist-heldout": ("ood", "near"),
        "fashion-mnist-inverted": ("ood", "near"),
        "fashion-mnist-rotated": ("ood", "near"),
        "digits-28": ("ood", "far"),
    }
    for name, (kind, group) in expected.items():
        assert name in names
        info = dataset_info(name)
        assert (info.kind, info.group, info.image) == (kind, group, "28x28 L")


def test_id_classes_are_fashion_mnist_order_without_shirt_and_ankle_boot():
    assert [ALL_CLASSES[c] for c in FASHION_HELD_OUT] == ["Shirt", "Ankle boot"]
    assert FASHION_ID_CLASSES == (0, 1, 2, 3, 4, 5, 7, 8)
    assert FASHION_ID_NAMES == ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Sneaker", "Bag"]
    assert FASHION_CLASSES == FASHION_ID_NAMES  # the model's copy agrees with the data layer


def test_digits_28_are_mnist_style():
    images = digits_28()
    assert images.shape == (1797, 28, 28) and images.dtype == np.uint8
    assert not images[:, :4].any() and not images[:, -4:].any() and not images[:, :, :4].any()  # 20x20 box, centred
    ds = load_dataset("digits-28")
    image, label, index = ds[5]
    assert (image.mode, image.size, label, index) == ("L", (28, 28), -1, 5)
    assert "load_digits()[5]" in ds.item_name(5)


# -- where the files come from --------------------------------------------------------------------


def test_system_copy_is_unpacked_into_the_data_root_and_never_written(tmp_path, fake_system):
    folder, written = fake_system
    before = sorted(os.listdir(folder))
    root = tmp_path / "data"
    ds = load_dataset("fashion-mnist", root=root, split="train")
    assert len(ds) == 20 and ds.classes[6] == "Shirt"
    np.testing.assert_array_equal(np.asarray(ds[3][0]), written["train"][0][3])
    assert sorted(os.listdir(folder)) == before  # only read
    assert sorted(os.listdir(root / "FashionMNIST" / "raw")) == sorted(RAW)  # torchvision reads from here now
    ids = load_dataset("fashion-mnist-id", root=root, split="test")
    assert len(ids) == 8 and list(ids.labels) == [0, 1, 2, 3, 4, 5, 6, 7]  # 0-5, 7, 8 relabelled


def test_the_data_root_comes_before_the_system_copy(tmp_path, fake_system):
    root = tmp_path / "data"
    own = _fake_fashion(root / "FashionMNIST" / "raw", gz=False, seed=1)
    ds = load_dataset("fashion-mnist", root=root, split="test")
    np.testing.assert_array_equal(np.asarray(ds[0][0]), own["t10k"][0][0])


def test_the_system_copy_comes_before_a_download(tmp_path, fake_system, monkeypatch):
    import torchvision.datasets.mnist

    def no_network(*args, **kwargs):
        raise AssertionError("must not download when the system copy is there")

    monkeypatch.setattr(torchvision.datasets.mnist, "download_and_extract_archive", no_network)
    assert len(load_dataset("fashion-mnist-heldout", root=tmp_path / "data", download=True)) == 2


def test_missing_everywhere_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(tv_sets.SYSTEM_DIRS, "fashion-mnist", str(tmp_path / "nothing-here"))
    for name in ("fashion-mnist", "fashion-mnist-id", "fashion-mnist-rotated"):
        with pytest.raises(DatasetNotFoundError) as caught:
            load_dataset(name, root=tmp_path / "data")
        message = str(caught.value)
        assert "apt-get install dataset-fashion-mnist" in message and "download=True" in message
        assert str(tmp_path / "data" / "FashionMNIST" / "raw") in message


def test_failed_download_says_so(tmp_path, monkeypatch):
    from torchvision.datasets import FashionMNIST

    def offline(self):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz: no network")

    monkeypatch.setitem(tv_sets.SYSTEM_DIRS, "fashion-mnist", str(tmp_path / "nothing-here"))
    monkeypatch.setattr(FashionMNIST, "download", offline)
    with pytest.raises(DatasetNotFoundError, match="Downloading 'fashion-mnist'.*no network"):
        load_dataset("fashion-mnist-id", root=tmp_path / "data", download=True)


def test_an_unwritable_data_root_is_reported(tmp_path, fake_system):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(DatasetNotFoundError, match="unpacking it into the data root.*writable data root"):
        load_dataset("fashion-mnist", root=blocker)


# -- the real files -------------------------------------------------------------------------------


@needs_files
def test_real_files_counts_and_classes(data_root):
    for split, n in (("train", 60_000), ("test", 10_000)):
        ds = load_dataset("fashion-mnist", root=data_root, split=split)
        assert len(ds) == n and ds.classes == list(ALL_CLASSES)
        assert np.bincount(ds.labels, minlength=10).tolist() == [n // 10] * 10
        image, label, _ = ds[0]
        assert (image.mode, image.size) == ("L", (28, 28))
    train = load_dataset("fashion-mnist-id", root=data_root, split="train")
    test = load_dataset("fashion-mnist-id", root=data_root, split="test")
    assert (len(train), len(test)) == (48_000, 8_000)
    assert train.classes == test.classes == FASHION_ID_NAMES
    assert np.bincount(train.labels).tolist() == [6_000] * 8 and np.bincount(test.labels).tolist() == [1_000] * 8
    heldout = load_dataset("fashion-mnist-heldout", root=data_root)
    assert len(heldout) == 2_000 and heldout.classes == [] and (heldout.labels == -1).all()
    names = [heldout.item_name(i) for i in range(len(heldout))]
    assert sum(n.endswith(" Shirt") for n in names) == 1_000 and sum(n.endswith(" Ankle boot") for n in names) == 1_000
    # the ID labels are the Fashion-MNIST labels remapped; images are the untouched pixels
    images, labels = fashion_arrays("test", data_root)
    positions = fashion_split("test", data_root)[2]  # where each ID test image is in Fashion-MNIST's test split
    for i in (0, 1, 4_321, 7_999):
        image, label, index = test[i]
        position = positions[index]
        assert FASHION_ID_CLASSES[label] == labels[position]
        assert test.item_name(i).startswith(f"fashion-mnist test[{position}] ")
        np.testing.assert_array_equal(np.asarray(image), images[position])


@needs_files
def test_real_shifted_sets_are_the_id_test_images_transformed(data_root):
    test = load_dataset("fashion-mnist-id", root=data_root, split="test")
    inverted = load_dataset("fashion-mnist-inverted", root=data_root)
    rotated = load_dataset("fashion-mnist-rotated", root=data_root)
    assert len(inverted) == len(rotated) == 8_000
    for i in (0, 123, 7_999):
        original = np.asarray(test[i][0])
        np.testing.assert_array_equal(np.asarray(inverted[i][0]), 255 - original)
        np.testing.assert_array_equal(np.asarray(rotated[i][0]), np.rot90(original))
        assert inverted[i][1] == rotated[i][1] == -1


@needs_files
def test_normalisation_constants_match_the_training_images(data_root):
    """Mean and standard deviation of every training pixel in [0, 1], in float64 from the exact histogram of the
    uint8 values (no 300 MB float copy of the 37.6 million pixels)."""
    counts = np.bincount(fashion_split("train", data_root)[0].ravel(), minlength=256)
    values = np.arange(256) / 255.0
    mean = (counts * values).sum() / counts.sum()
    std = np.sqrt((counts * (values - mean) ** 2).sum() / counts.sum())
    assert mean == pytest.approx(FASHION_MEAN, abs=1e-4)
    assert std == pytest.approx(FASHION_STD, abs=1e-4)


# -- the bundled model ----------------------------------------------------------------------------


def test_fashion_cnn_is_registered_and_small():
    assert available_backbones()[:2] == ["digits-cnn", "fashion-cnn"]
    info = backbone_info("fashion-cnn")
    assert info["source"] == "bundled" and info["input_shape"] == (1, 28, 28)
    assert info["feature_dim"] == 128 and info["num_classes"] == 8 and info["weights_available"]
    assert FASHION_WEIGHTS.stat().st_size < 1_000_000
    meta = json.loads(FASHION_METADATA.read_text())
    assert meta["classes"] == FASHION_CLASSES and meta["held_out_classes"] == ["Shirt", "Ankle boot"]
    assert (meta["mean"], meta["std"]) == (FASHION_MEAN, FASHION_STD)
    backbone = load_backbone("fashion-cnn")
    assert backbone.weights_id == f"sha256:{meta['sha256']}"
    assert backbone.classes == FASHION_CLASSES and backbone.head[0].shape == (8, 128)


@pytest.mark.parametrize(
    "image",
    [
        Image.new("L", (28, 28), 0),
        Image.new("RGB", (300, 200), (10, 200, 30)),
        Image.new("RGBA", (64, 64), (0, 0, 0, 0)),
        Image.new("1", (28, 28), 1),
        Image.new("P", (8, 8)),
        Image.new("I;16", (40, 40), 1000),
        Image.new("F", (12, 30), 0.5),
    ],
    ids=["L28", "RGB", "RGBA", "1", "P8", "I16", "F"],
)
def test_transform_accepts_any_pil_image(image):
    x = FashionTransform()(image)
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and torch.isfinite(x).all()


def test_transform_normalises_like_training():
    pixels = np.arange(28 * 28, dtype=np.int64).reshape(28, 28) % 256
    x = FashionTransform()(Image.fromarray(pixels.astype(np.uint8)))
    expected = (torch.tensor(pixels, dtype=torch.float32) / 255 - FASHION_MEAN) / FASHION_STD
    torch.testing.assert_close(x[0], expected)
    torch.testing.assert_close(normalize_fashion(pixels[None].astype(np.uint8))[0], x)


@needs_files
def test_recorded_accuracy_is_what_the_bundled_model_scores(data_root):
    meta = json.loads(FASHION_METADATA.read_text())
    backbone = load_backbone("fashion-cnn")
    test = load_dataset("fashion-mnist-id", root=data_root, split="test")
    images = np.stack([np.asarray(test[i][0]) for i in range(len(test))])
    with torch.no_grad():
        logits = torch.cat(
            [backbone.model(normalize_fashion(images[i : i + 2000])) for i in range(0, len(images), 2000)]
        )
    accuracy = float((logits.argmax(1).numpy() == test.labels).mean())
    assert accuracy == pytest.approx(meta["test_accuracy"], abs=5e-4)
    assert meta["n_test"] == 8_000 and meta["n_train"] == 48_000 and accuracy > 0.9


# -- the preset -----------------------------------------------------------------------------------


def test_presets():
    assert set(PRESETS) == {"digits", "fashion-mnist"}
    assert preset("digits") == RunConfig()
    config = preset("fashion-mnist").validate()
    assert config.backbone == "fashion-cnn"
    assert (config.id_fit.name, config.id_fit.params, config.id_test.params) == (
        "fashion-mnist-id",
        {"split": "train"},
        {"split": "test"},
    )
    assert [c.name for c in config.ood] == [
        "fashion-mnist-heldout",
        "fashion-mnist-inverted",
        "fashion-mnist-rotated",
        "digits-28",
        "photo-patches",
        "noise-gaussian",
        "noise-uniform",
    ]
    assert all(c.params == {"size": 28} for c in config.ood[4:])
    assert [d.name for d in config.detectors] == [d.name for d in RunConfig().detectors]
    config.ood.pop()
    assert len(preset("fashion-mnist").ood) == 7  # every call is a fresh copy
    with pytest.raises(ConfigError, match="unknown preset 'cifar'.*digits, fashion-mnist"):
        preset("cifar")


def test_example_config_is_the_preset():
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    assert RunConfig.load(examples / "fashion-mnist.toml") == preset("fashion-mnist")
    assert RunConfig.load(examples / "fashion-mnist-quick.toml").validate().backbone == "fashion-cnn"


def test_cli_preset_and_config_are_exclusive(capsys):
    with pytest.raises(SystemExit) as caught:
        cli_main(["run", "some.toml", "--preset", "fashion-mnist"])
    assert caught.value.code == 2 and "not allowed with argument config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["run", "--preset", "nope"])


def small_preset(data_root: str) -> RunConfig:
    """The preset on a subsample: 2000 fit, 500 test, 200 images per OOD set (random, seeded)."""
    config = fashion_mnist_config()
    config.data_root = data_root
    config.id_fit.subsample, config.id_test.subsample = 2000, 500
    for choice in [config.id_fit, config.id_test, *config.ood]:
        choice.subsample_mode = "random"
    for choice in config.ood:
        choice.subsample = 200
    return config


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory, data_root):
    """`oodviz run --preset fashion-mnist` end to end, with the preset subsampled for speed."""
    if not HAVE_FILES:
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    out = tmp_path_factory.mktemp("fashion-runs") / "preset"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(PRESETS, "fashion-mnist", lambda: small_preset(data_root))
        assert cli_main(["run", "--preset", "fashion-mnist", "--out", str(out)]) == 0
    return out


@needs_files
def test_preset_runs_end_to_end(preset_run):
    from oodviz.runs.rundir import RunDir

    run = RunDir(preset_run)
    assert run.read_status()["state"] == "done"
    config = RunConfig.from_dict(run.read_config())
    assert config.backbone == "fashion-cnn" and config.id_fit.subsample == 2000
    scores = pd.read_parquet(preset_run / "scores.parquet")
    id_rows = scores[scores.split == "id_test"]
    assert len(id_rows) == 500 and set(id_rows.label) <= set(range(8))
    assert (id_rows.label == id_rows.prediction).mean() > 0.85
    counts = scores[scores.split == "ood"].groupby("dataset").size().to_dict()
    assert counts == {c.name: 200 for c in config.ood}
    metrics = pd.read_csv(preset_run / "metrics.csv")
    detectors = set(metrics.detector)
    assert {"msp", "energy", "mahalanobis", "knn"} <= detectors
    table = metrics.set_index(["detector", "ood_dataset"])
    assert set(metrics.group) == {"near", "far"}
    # Far OOD is easy for feature-space detectors; the held-out classes are harder but caught.
    assert table.loc[("mahalanobis", "noise-uniform"), "auroc"] > 0.95
    assert table.loc[("knn", "digits-28"), "auroc"] > 0.9
    assert 0.6 < table.loc[("knn", "fashion-mnist-heldout"), "auroc"]
    per_class = pd.read_csv(preset_run / "per_class.csv")
    assert set(per_class.class_name) == set(FASHION_ID_NAMES)


@needs_files
def test_preset_thumbnails_are_the_real_28x28_images(preset_run):
    from oodviz.figures.thumbnails import fit_image, thumbnails
    from oodviz.results.tables import load_results

    results = load_results(preset_run)
    scores = pd.read_parquet(preset_run / "scores.parquet")
    rows = pd.concat(
        [scores[scores.split == "id_test"].head(3), scores[scores.dataset == "fashion-mnist-heldout"].head(3)]
    )
    config = RunConfig.from_dict(results.config)
    images = thumbnails(results, rows, size=56)
    for image, (split, dataset, index) in zip(images, zip(rows.split, rows.dataset, rows["index"])):
        assert image.info["oodviz"] == "ok" and image.size == (56, 56)
        choice = config.id_test if split == "id_test" else next(c for c in config.ood if c.name == dataset)
        source = load_dataset(choice.name, root=config.data_root, **choice.params).source
        original, _ = source.load(int(index))
        assert original.size == (28, 28)
        assert np.array_equal(np.asarray(image), np.asarray(fit_image(original, 56)))


def test_app_runs_the_preset_in_one_click(tmp_path, monkeypatch):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    import oodviz.ui.new_run as ui_main

    submitted = []

    class Submitted:
        run_id = "submitted"

    def fake_submit(config, root, nproc_per_node=1):  # the real one starts a worker process
        submitted.append(config)
        return Submitted()

    monkeypatch.setattr(ui_main, "submit", fake_submit)
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(tmp_path))
    app = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app.py"), default_timeout=60)
    app.run()
    labels = [b.label for b in app.button]
    assert "Run the default" in labels and "Run Fashion-MNIST" in labels
    next(b for b in app.button if b.label == "Run Fashion-MNIST").click().run()
    assert not app.exception
    assert submitted == [preset("fashion-mnist")]
    assert "submitted" in app.query_params["run"]
