"""What the page gets of a feature map: a seeded subsample of at most MAP_POINTS points with compact per-point
data (no hover text), a sprite of hover thumbnails that holds each chosen sample's own image, and on demand any
other drawn point's thumbnail (the request checked: it comes from the browser)."""

import base64
import io
import json

import numpy as np
import pandas as pd
import plotly.io as pio
import pytest
from PIL import Image

from oodviz.figures.projection_map import (
    ANSWER_TILES,
    HOVER_THUMBNAILS,
    KEYS,
    MAP_POINTS,
    SPRITE_COLUMNS,
    THUMBNAIL_SIZE,
    drawn_rows,
    hover_data,
    projection_figure,
    requested_rows,
    thumbnail_answer,
    thumbnails_path,
    write_hover_thumbnails,
)


def decode(b64: str, dtype) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype=np.dtype(dtype).newbyteorder("<"))


def synthetic_map(n: int, seed: int = 1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    ood = rng.random(n) < 0.4
    return pd.DataFrame(
        {
            "split": np.where(ood, "ood", "id_test"),
            "dataset": np.where(ood, np.where(rng.random(n) < 0.5, "far", "near"), "id"),
            "index": rng.permutation(10 * n)[:n],
            "label": np.where(ood, -1, rng.integers(0, 10, n)),
            "prediction": rng.integers(0, 10, n),
            "x": rng.normal(size=n),
            "y": rng.normal(size=n),
            "score": rng.normal(size=n),
        }
    )


def test_a_large_map_draws_a_seeded_uniform_subsample_and_a_small_one_every_point():
    rows = drawn_rows(60_000)
    assert len(rows) == MAP_POINTS and np.all(np.diff(rows) > 0)  # distinct, in table order
    np.testing.assert_array_equal(rows, np.sort(np.random.default_rng(0).permutation(60_000)[:MAP_POINTS]))
    np.testing.assert_array_equal(drawn_rows(500), np.arange(500))


@pytest.mark.parametrize("color_by", ["dataset", "label", "score"])
def test_the_figure_sends_each_points_row_as_int32_customdata_and_no_text(color_by):
    drawn = synthetic_map(3000)
    spec = json.loads(pio.to_json(projection_figure(drawn, color_by, "t", "meta-token"), validate=False))
    assert spec["layout"]["meta"] == "meta-token"
    positions = []
    for trace in spec["data"]:
        assert "text" not in trace and "hovertext" not in trace and trace["hoverinfo"] == "none"
        assert trace["customdata"]["dtype"] == "i4" and trace["x"]["dtype"] == "f4"
        at = decode(trace["customdata"]["bdata"], np.int32)
        np.testing.assert_array_equal(decode(trace["x"]["bdata"], np.float32), drawn.x.to_numpy(np.float32)[at])
        np.testing.assert_array_equal(decode(trace["y"]["bdata"], np.float32), drawn.y.to_numpy(np.float32)[at])
        if color_by != "score":
            assert set(drawn[color_by].iloc[at].astype(str)) == {trace["name"]}
        positions.append(at)
    np.testing.assert_array_equal(np.sort(np.concatenate(positions)), np.arange(len(drawn)))  # each point once


def test_the_hover_data_decodes_to_each_drawn_points_names_and_tile():
    drawn = synthetic_map(1000)
    keys = drawn.iloc[[700, 3, 512]][["split", "dataset", "index"]].reset_index(drop=True)
    data = hover_data(drawn, [f"class{c}" for c in range(10)], keys, b"RIFF-not-decoded-here")
    sets = np.array(data["sets"])[decode(data["set"], np.uint8)]
    np.testing.assert_array_equal(sets, drawn.dataset.to_numpy())
    np.testing.assert_array_equal(decode(data["index"], np.int32), drawn["index"].to_numpy())
    np.testing.assert_array_equal(decode(data["label"], np.int16), drawn.label.to_numpy())  # -1: OOD
    np.testing.assert_array_equal(decode(data["prediction"], np.int16), drawn.prediction.to_numpy())
    tile_of = dict(zip(decode(data["positions"], np.int32), decode(data["tiles"], np.int32)))
    assert tile_of == {700: 0, 3: 1, 512: 2}
    assert data["sprite"] == "data:image/webp;base64," + base64.b64encode(b"RIFF-not-decoded-here").decode()
    assert hover_data(drawn, [], None, None)["sprite"] is None
    assert data["answer_tiles"] == ANSWER_TILES


def test_the_map_id_names_the_run_and_the_drawn_samples_in_order():
    drawn = synthetic_map(500)
    map_id = hover_data(drawn, [], run="runs/a")["map_id"]
    assert hover_data(drawn.copy(), ["other names"], run="runs/a")["map_id"] == map_id  # the same samples, in order
    assert hover_data(drawn, [], run="runs/b")["map_id"] != map_id
    assert hover_data(drawn.iloc[::-1].reset_index(drop=True), [], run="runs/a")["map_id"] != map_id
    assert hover_data(drawn.assign(index=drawn["index"] + 1), [], run="runs/a")["map_id"] != map_id


def tile(sheet: Image.Image, k: int) -> np.ndarray:
    x, y = (k % SPRITE_COLUMNS) * THUMBNAIL_SIZE, (k // SPRITE_COLUMNS) * THUMBNAIL_SIZE
    return np.asarray(sheet.crop((x, y, x + THUMBNAIL_SIZE, y + THUMBNAIL_SIZE)).convert("L"), dtype=np.float64)


def test_oodviz_project_writes_a_sprite_whose_tiles_are_the_samples_images_within_its_budget(default_run_copy):
    from sklearn.datasets import load_digits

    from oodviz.data import digits_split
    from oodviz.figures.projection import project_run

    frame = project_run(default_run_copy, "pca")
    keys = pd.read_parquet(thumbnails_path(default_run_copy, "pca", ".parquet"))
    # the first HOVER_THUMBNAILS rows of the seeded order, every one drawn on the map
    expected = frame.iloc[np.random.default_rng(0).permutation(len(frame))[:HOVER_THUMBNAILS]]
    assert keys.equals(expected[["split", "dataset", "index"]].reset_index(drop=True))
    assert set(expected.index) <= set(drawn_rows(len(frame)))
    sheet = Image.open(io.BytesIO(thumbnails_path(default_run_copy, "pca", ".webp").read_bytes()))
    assert sheet.format == "WEBP" and sheet.width == SPRITE_COLUMNS * THUMBNAIL_SIZE
    # an ID test digit's tile is sklearn's 8x8 image of it, in 4x4-pixel blocks (lossy WebP: correlated, not equal)
    images, _, source = digits_split("test")
    digits = load_digits().images
    checked = 0
    for k, row in keys.iterrows():
        if row.dataset == "digits-test" and checked < 20:
            reference = np.kron(digits[source[row["index"]]], np.ones((4, 4)))
            assert np.corrcoef(tile(sheet, k).ravel(), reference.ravel())[0, 1] > 0.95, row
            checked += 1
    assert checked == 20
    # a smaller budget: fewer thumbnails, a prefix of the same order, the sprite within it
    config = json.loads((default_run_copy / "config.json").read_text())
    count = write_hover_thumbnails(default_run_copy, "pca", frame, config, budget=20_000)
    assert 0 < count < HOVER_THUMBNAILS and thumbnails_path(default_run_copy, "pca", ".webp").stat().st_size <= 20_000
    assert pd.read_parquet(thumbnails_path(default_run_copy, "pca", ".parquet")).equals(keys.head(count))


def decode_url(url: str, kind: str) -> np.ndarray:
    prefix = f"data:image/{kind};base64,"
    assert url.startswith(prefix)
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url[len(prefix) :]))).convert("RGB"))


def test_a_thumbnail_answer_is_each_asked_points_own_image_pixel_for_pixel(default_run):
    from sklearn.datasets import load_digits

    from oodviz.data import digits_split
    from oodviz.figures.thumbnails import thumbnails

    config = json.loads((default_run.path / "config.json").read_text())
    drawn = pd.read_parquet(default_run.path / "scores.parquet")[KEYS]  # any table of samples, row k = point k
    digits_test = np.flatnonzero(drawn.dataset == "digits-test")
    others = np.flatnonzero(drawn.dataset != "digits-test")
    rows = [int(digits_test[-1]), int(others[7]), int(digits_test[3]), int(others[-1]), int(digits_test[3])]
    answer = thumbnail_answer(config, drawn, {"rows": rows})
    assert answer["rows"] == rows[:4]  # in order, once each
    images = thumbnails(config, drawn.iloc[rows[:4]], size=THUMBNAIL_SIZE)
    source = digits_split("test")[2]
    for row, url, image in zip(answer["rows"], answer["images"], images):
        shown = decode_url(url, "webp")  # lossless: oodviz.figures.thumbnails' pixels exactly
        np.testing.assert_array_equal(shown, np.asarray(image.convert("RGB")))
        assert shown.shape == (THUMBNAIL_SIZE, THUMBNAIL_SIZE, 3) and image.info["oodviz"] == "ok"
        if drawn.dataset.iloc[row] == "digits-test":  # and sklearn's digit: 0..16 to 0..255, in 4x4-pixel blocks
            digit = np.round(load_digits().images[source[drawn["index"].iloc[row]]] * 255 / 16)
            for channel in range(3):
                np.testing.assert_array_equal(shown[..., channel], np.kron(digit, np.ones((4, 4))))
    assert len(json.dumps(answer)) < 4 * 1024  # a few KiB for a batch of digits


@pytest.mark.parametrize(
    "request_",
    [
        None,
        [3],
        "rows=3",
        {},
        {"rows": 3},
        {"rows": []},
        {"rows": [100]},  # n = 100: one past the last row
        {"rows": [-1]},
        {"rows": [1.0]},
        {"rows": [1.5]},
        {"rows": ["3"]},
        {"rows": [True]},
        {"rows": [None]},
        {"rows": [[1]]},
        {"rows": [2**70]},
        {"rows": [3, 200]},
        {"rows": list(range(ANSWER_TILES + 1))},
    ],
)
def test_a_thumbnail_request_other_than_1_to_8_integer_rows_in_range_is_refused(request_):
    with pytest.raises(ValueError):
        requested_rows(request_, 100)
    with pytest.raises(ValueError):  # refused before any dataset is opened (the config names none)
        thumbnail_answer({}, synthetic_map(100)[KEYS], request_)


def test_a_valid_thumbnail_request_gives_its_rows_in_order_once_each():
    assert requested_rows({"rows": [99, 0, 99, 5]}, 100) == [99, 0, 5]
    assert requested_rows({"rows": list(range(ANSWER_TILES)), "other": "ignored"}, ANSWER_TILES) == list(
        range(ANSWER_TILES)
    )
