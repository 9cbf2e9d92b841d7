"""oodviz.figures.thumbnails: each scores row's image, re-read from its dataset, through a bounded cache."""

import copy

import numpy as np
import pandas as pd
from PIL import Image

from oodviz.data import digits_split, load_dataset
from oodviz.figures import thumbnails as T
from oodviz.results.analysis import failure_cases


def _upscaled(pixels: np.ndarray, factor: int) -> np.ndarray:
    big = np.repeat(np.repeat(pixels, factor, axis=0), factor, axis=1)
    return np.stack([big] * 3, axis=-1)


def test_thumbnails_of_the_default_run_are_the_dataset_pixels_upscaled(default_results):
    flagged, accepted = failure_cases(default_results.scores, "vim", k=3)
    images = T.thumbnails(default_results, pd.concat([flagged, accepted]), size=64)
    assert len(images) == 6
    assert all(im.size == (64, 64) and im.mode == "RGB" and im.info["oodviz"] == "ok" for im in images)
    test_images = digits_split("test")[0]  # digits-test serves these pixels, source index = position
    for image, index in zip(images[:3], flagged["index"]):
        np.testing.assert_array_equal(np.asarray(image), _upscaled(test_images[index], 8))
    for image, (dataset, index) in zip(images[3:], zip(accepted["dataset"], accepted["index"])):
        choice = next(c for c in default_results.config["ood"] if c["name"] == dataset)
        ds = load_dataset(dataset, as_ood=True, **choice["params"])
        item = ds[int(np.flatnonzero(ds.source_indices == index)[0])][0]
        expected = np.asarray(item.convert("RGB").resize((64, 64), Image.Resampling.NEAREST))
        np.testing.assert_array_equal(np.asarray(image), expected)
    # the heldout digits come from both splits: check one against the raw pixels too
    heldout = default_results.scores[default_results.scores.dataset == "digits-heldout"].iloc[[5]]
    (image,) = T.thumbnails(default_results.config, heldout, size=32)
    np.testing.assert_array_equal(np.asarray(image), _upscaled(digits_split("heldout")[0][heldout["index"].iloc[0]], 4))


def test_thumbnails_map_source_indices_of_a_subsampled_dataset(default_results):
    config = copy.deepcopy(default_results.config)
    config["id_test"].update(subsample=40, subsample_mode="random")
    ds = load_dataset("digits-test", subsample=40, subsample_mode="random", seed=config["seed"])
    assert not np.array_equal(ds.source_indices, np.arange(40))  # positions differ from source indices
    picks = [3, 0, 39]
    rows = pd.DataFrame({"split": "id_test", "dataset": "digits-test", "index": ds.source_indices[picks]})
    images = T.thumbnails(config, rows, size=16)
    raw = digits_split("test")[0]
    for image, pick in zip(images, picks):
        np.testing.assert_array_equal(np.asarray(image), _upscaled(raw[ds.source_indices[pick]], 2))
    left_out = int(np.setdiff1d(np.arange(362), ds.source_indices)[0])
    gone = pd.DataFrame({"split": ["id_test"], "dataset": ["digits-test"], "index": [left_out]})
    assert T.thumbnails(config, gone)[0].info["oodviz"] == "missing"  # not in the subsample any more


def test_thumbnails_placeholder_for_a_dataset_that_cannot_be_opened(default_results, tmp_path):
    config = copy.deepcopy(default_results.config)
    config["ood"].append(
        {
            "name": "folder",
            "params": {"path": str(tmp_path / "moved-away")},
            "subsample": None,
            "subsample_mode": "first",
            "group": None,
        }
    )
    rows = pd.DataFrame(
        {
            "split": ["ood", "ood", "ood", "id_test"],
            "dataset": ["folder", "not-in-config", "digits-heldout", "digits-test"],
            "index": [0, 0, 0, 0],
        }
    )
    images = T.thumbnails(config, rows, size=48)
    assert [im.info["oodviz"] for im in images] == ["missing", "missing", "ok", "ok"]
    missing = np.asarray(images[0])
    assert missing.shape == (48, 48, 3)
    np.testing.assert_array_equal(missing[0, 0], T.PLACEHOLDER_GREY)
    share_grey = np.all(missing == T.PLACEHOLDER_GREY, axis=-1).mean()
    assert 0.7 < share_grey < 1.0  # grey with the text "missing" drawn on it
    np.testing.assert_array_equal(np.asarray(images[1]), missing)


def test_fit_image_letterboxes_and_shrinks():
    wide = Image.fromarray(np.arange(32, dtype=np.uint8).reshape(4, 8) * 8)
    out = np.asarray(T.fit_image(wide, 16))
    assert out.shape == (16, 16, 3)
    np.testing.assert_array_equal(out[:4], 255)  # white bands above and below
    np.testing.assert_array_equal(out[12:], 255)
    np.testing.assert_array_equal(out[4:12, :, 0], np.repeat(np.repeat(np.asarray(wide), 2, 0), 2, 1))
    big = T.fit_image(Image.new("RGB", (200, 100), (10, 200, 30)), 64)
    assert big.size == (64, 64) and big.getpixel((32, 32)) == (10, 200, 30) and big.getpixel((32, 2)) == (255, 255, 255)


def test_thumbnail_datasets_are_cached_in_a_bounded_lru(default_results, monkeypatch):
    T.clear_dataset_cache()
    rows = default_results.scores.groupby("dataset").head(2)  # two rows of each of the 7 datasets
    T.thumbnails(default_results, rows, size=8)
    assert len(T._DATASET_CACHE) == 7
    cached = dict(T._DATASET_CACHE)
    T.thumbnails(default_results, rows, size=8)
    assert all(T._DATASET_CACHE[k] is ds for k, ds in cached.items())  # re-used, not re-opened
    monkeypatch.setattr(T, "DATASET_CACHE_SIZE", 3)
    T.clear_dataset_cache()
    images = T.thumbnails(default_results, rows, size=8)
    assert len(T._DATASET_CACHE) == 3 and all(im.info["oodviz"] == "ok" for im in images)
    assert list(T._DATASET_CACHE)[-1][0] == rows["dataset"].iloc[-1]  # most recently used last
    T.clear_dataset_cache()
    assert not T._DATASET_CACHE


def test_prefetch_opens_the_runs_datasets_so_the_first_gallery_opens_none(default_results, monkeypatch):
    rows = default_results.scores.groupby("dataset").head(1)  # one row of each of the 7 datasets
    T.clear_dataset_cache()
    expected = [np.asarray(im) for im in T.thumbnails(default_results, rows, size=8)]  # each dataset opened here
    T.clear_dataset_cache()
    thread = T.prefetch_datasets(default_results)
    thread.join(timeout=120)
    assert not thread.is_alive() and T.prefetch_datasets(default_results) is None  # all open: nothing to do

    def refuse(*args, **kwargs):
        raise AssertionError("a dataset was opened again")

    monkeypatch.setattr("oodviz.data.load_dataset", refuse)
    images = T.thumbnails(default_results, rows, size=8)
    assert [im.info["oodviz"] for im in images] == ["ok"] * 7
    assert all(np.array_equal(np.asarray(im), e) for im, e in zip(images, expected))
    T.clear_dataset_cache()
