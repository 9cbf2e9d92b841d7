"""What the page draws of a run's 2-D projection (:mod:`oodviz.figures.projection`): a bounded, seeded subsample of its
points as a plotly figure with compact per-point data, and the hover thumbnails as one sprite image.

The browser gets at most :data:`MAP_POINTS` points, chosen uniformly by one seeded permutation of the
projection's rows (:func:`map_order`); the first :data:`HOVER_THUMBNAILS` of the same permutation (fewer when
their sprite would pass :data:`SPRITE_BUDGET` bytes) have a thumbnail, so every thumbnailed sample is drawn.

Per drawn point the page sends ``x, y`` (float32), ``customdata`` (its int32 position in the drawn table, which a
selection returns) and, for the hover panel (:mod:`oodviz.ui.hover_thumbnail`), its set code (uint8), source
index (int32), true class and prediction (int16): 21 bytes before base64, no per-point text. The sprite is
``<run>/projection-<method>-thumbnails.webp`` (tiles of :data:`THUMBNAIL_SIZE` px, :data:`SPRITE_COLUMNS` a line,
in permutation order) with the samples' keys in ``projection-<method>-thumbnails.parquet``; it is made with the
projection (``oodviz project``, a subprocess), never in the page. Any other drawn point's thumbnail is sent on
demand: the page asks for a few drawn rows (:func:`requested_rows` checks them, they are untrusted) and
:func:`thumbnail_answer` returns their images (lossless WebP).
"""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from oodviz.figures.plots import ID_COLOR, ID_KEY, color_map
from oodviz.figures.thumbnails import thumbnails
from oodviz.files import write_atomic
from oodviz.results.tables import ID_SPLIT, OOD_SPLIT, write_table

MAP_POINTS = 15_000
HOVER_THUMBNAILS = 2_000
THUMBNAIL_SIZE = 32
SPRITE_COLUMNS = 40
SPRITE_BUDGET = 256 * 1024  # bytes of the WebP sprite (before base64)
SPRITE_QUALITY = 80
KEYS = ["split", "dataset", "index"]
ANSWER_TILES = 8  # thumbnails per on-demand answer: the hovered point and its nearest drawn neighbours


def map_order(n: int, seed: int = 0) -> np.ndarray:
    """The seeded permutation of ``range(n)`` that picks the drawn points and the thumbnailed ones."""
    return np.random.default_rng(seed).permutation(n)


def drawn_rows(n: int, max_points: int = MAP_POINTS, seed: int = 0) -> np.ndarray:
    """The rows of a ``n``-row projection the page draws: all when ``n <= max_points``, else the first
    ``max_points`` of :func:`map_order`, in table order."""
    return np.arange(n) if n <= max_points else np.sort(map_order(n, seed)[:max_points])


def thumbnails_path(run_dir, method: str, suffix: str) -> Path:
    return Path(run_dir) / f"projection-{method}-thumbnails{suffix}"


def sprite(images, columns: int = SPRITE_COLUMNS, size: int = THUMBNAIL_SIZE) -> bytes:
    """``images`` (``size`` x ``size`` RGB) as one lossy WebP sheet, ``columns`` tiles a line, row by row."""
    from PIL import Image

    sheet = Image.new("RGB", (columns * size, max(1, -(-len(images) // columns)) * size), (255, 255, 255))
    for k, image in enumerate(images):
        sheet.paste(image, ((k % columns) * size, (k // columns) * size))
    buffer = io.BytesIO()
    sheet.save(buffer, "WEBP", quality=SPRITE_QUALITY, method=4)
    return buffer.getvalue()


def write_hover_thumbnails(
    run_dir, method: str, frame: pd.DataFrame, config: dict, budget: int = SPRITE_BUDGET, seed: int = 0
) -> int:
    """Write the hover sprite of ``frame`` (a projection, :data:`oodviz.figures.projection.PROJECTION_COLUMNS`) and its
    keys; the thumbnails come from the run ``config``'s datasets (:func:`oodviz.figures.thumbnails.thumbnails`). Takes
    the first :data:`HOVER_THUMBNAILS` rows of :func:`map_order`, fewer until the sprite fits ``budget`` bytes.
    Returns how many samples have a thumbnail."""

    chosen = frame.iloc[map_order(len(frame), seed)[:HOVER_THUMBNAILS]]
    images = thumbnails(config, chosen, size=THUMBNAIL_SIZE)
    count = len(images)
    encoded = sprite(images)
    while len(encoded) > budget and count > 1:  # a prefix of the same order: still a seeded uniform subsample
        count = max(1, int(count * budget / len(encoded) * 0.9))
        encoded = sprite(images[:count])
    write_table(thumbnails_path(run_dir, method, ".parquet"), chosen[KEYS].head(count).reset_index(drop=True))
    write_atomic(thumbnails_path(run_dir, method, ".webp"), encoded)
    return count


def requested_rows(request, n: int) -> list[int]:
    """The drawn rows whose thumbnails the page asks for, checked: ``request`` (sent by the browser, untrusted)
    must be ``{"rows": [...]}`` with 1 to :data:`ANSWER_TILES` integers (not bools, not floats) in ``[0, n)``.
    Returns them in order, without repeats; raises ValueError for anything else."""
    rows = request.get("rows") if isinstance(request, dict) else None
    if not isinstance(rows, list) or not 1 <= len(rows) <= ANSWER_TILES:
        raise ValueError(f"a thumbnail request is a list of 1 to {ANSWER_TILES} drawn rows")
    if not all(type(row) is int and 0 <= row < n for row in rows):
        raise ValueError(f"a thumbnail request's rows are integers in [0, {n})")
    return list(dict.fromkeys(rows))


def lossless_webp_url(image) -> str:
    """``image`` (PIL, RGB) as a lossless WebP ``data:`` URL (its pixels exactly; about 150 bytes for a 32 px
    digit, half its PNG)."""
    buffer = io.BytesIO()
    image.save(buffer, "WEBP", lossless=True)
    return "data:image/webp;base64," + base64.b64encode(buffer.getvalue()).decode()


def thumbnail_answer(config: dict, drawn_keys: pd.DataFrame, request) -> dict:
    """The answer to a hover panel's ``request`` for thumbnails (:func:`requested_rows` of ``drawn_keys``, the
    drawn table's :data:`KEYS`, row ``k`` the point whose customdata is ``k``): ``{"rows": [k, ...],
    "images": [url, ...]}``, each image the sample's :func:`oodviz.figures.thumbnails.thumbnails` at
    :data:`THUMBNAIL_SIZE` px (from the run ``config``'s datasets, kept open process-wide) as a lossless WebP
    data URL, pixel for pixel. Raises ValueError for a request that is not a valid one."""

    rows = requested_rows(request, len(drawn_keys))
    images = thumbnails(config, drawn_keys.iloc[rows], size=THUMBNAIL_SIZE)
    return {"rows": rows, "images": [lossless_webp_url(image) for image in images]}


def _b64(values: np.ndarray, dtype) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()).decode()


def hover_data(
    drawn: pd.DataFrame, class_names, thumbnail_keys=None, sprite_bytes: bytes | None = None, run: str = ""
) -> dict:
    """What the hover panel needs for the ``drawn`` table (its row ``k`` is the point whose customdata is
    ``k``): ``map_id``, a digest of ``run`` (the run's path) and the drawn samples' keys in order, under which
    the page keeps the thumbnails it was sent on demand (the same map drawn again needs none again); set names
    and codes, source indices, true classes (``-1`` OOD) and predictions as base64
    little-endian arrays (uint8, int32, int16, int16), the class names, how many thumbnails one request for
    others may ask (:data:`ANSWER_TILES`), and when ``sprite_bytes`` is given the sprite as a data URL with
    ``positions`` (drawn rows) and ``tiles`` (their tile numbers)."""
    sets = list(dict.fromkeys(drawn.dataset.astype(str)))
    code = drawn.dataset.astype(str).map({name: k for k, name in enumerate(sets)}).to_numpy()
    label = np.where(drawn.split.to_numpy() == "id_test", drawn.label.to_numpy(), -1)
    digest = hashlib.sha256(run.encode())
    digest.update(pd.util.hash_pandas_object(drawn[KEYS], index=False).to_numpy().tobytes())
    data = {
        "map_id": digest.hexdigest()[:32],
        "sets": sets,
        "classes": [str(c) for c in class_names or []],
        "set": _b64(code, np.uint8),
        "index": _b64(drawn["index"].to_numpy(), np.int32),
        "label": _b64(label, np.int16),
        "prediction": _b64(drawn.prediction.to_numpy(), np.int16),
        "sprite": None,
        "answer_tiles": ANSWER_TILES,
    }
    if sprite_bytes is not None and thumbnail_keys is not None and len(thumbnail_keys):
        tiles = thumbnail_keys[KEYS].assign(tile=np.arange(len(thumbnail_keys)))
        at = drawn[KEYS].assign(position=np.arange(len(drawn))).merge(tiles, on=KEYS)
        data.update(
            sprite="data:image/webp;base64," + base64.b64encode(sprite_bytes).decode(),
            size=THUMBNAIL_SIZE,
            columns=SPRITE_COLUMNS,
            positions=_b64(at.position.to_numpy(), np.int32),
            tiles=_b64(at.tile.to_numpy(), np.int32),
        )
    return data


def map_title(method: str, drawn: int, samples: int) -> str:
    """The map's title: the method and how many of the run's ``samples`` (its ID test and OOD samples, every
    one of which PCA projects) are ``drawn``, fewer for a t-SNE or UMAP subsample or a map of more than
    :data:`MAP_POINTS`."""
    shown = f"all {samples:,}" if drawn == samples else f"{drawn:,} of the run's {samples:,}"
    return f"{method.upper()} of the features ({shown} ID test and OOD samples)"


def set_colors(drawn: pd.DataFrame, colors: dict | None = None) -> dict:
    """Colour of each set of ``drawn`` as in every other figure of the page: the ID test set ``colors``'
    :data:`~oodviz.figures.plots.ID_KEY` colour (default :data:`~oodviz.figures.plots.ID_COLOR`), each OOD set its colour in ``colors`` (the page's
    :func:`~oodviz.figures.plots.color_map` of the run's OOD sets) or else the next of :func:`~oodviz.figures.plots.color_map`
    in order of appearance (the run's order)."""
    sets = drawn.dataset.astype(str)
    palette = color_map(pd.unique(sets[drawn.split == OOD_SPLIT]), colors)
    return palette | dict.fromkeys(pd.unique(sets[drawn.split == ID_SPLIT]), (colors or {}).get(ID_KEY, ID_COLOR))


def projection_figure(
    drawn: pd.DataFrame, color_by: str, title: str, meta: str, colors: dict | None = None
) -> go.Figure:
    """The map of the ``drawn`` points coloured by ``color_by`` (``"dataset"``, ``"label"`` or a score column):
    one trace per set (coloured by :func:`set_colors` with the page's ``colors``) or class, or one coloured by
    the score. Each point's ``customdata`` is its row in ``drawn`` (int32); plotly's own hover label is off
    (``hoverinfo="none"``: the hover panel shows the point); ``layout.meta`` is ``meta``, by which the panel
    finds the chart."""
    fig = go.Figure()
    point = {"mode": "markers", "hoverinfo": "none"}
    xy = drawn[["x", "y"]].to_numpy(dtype=np.float32)
    if color_by in ("dataset", "label"):
        palette = set_colors(drawn, colors) if color_by == "dataset" else {}
        for value, rows in drawn.groupby(color_by, sort=False):
            at = rows.index.to_numpy()
            fig.add_trace(
                go.Scattergl(
                    x=xy[at, 0],
                    y=xy[at, 1],
                    name=str(value),
                    marker={"size": 4, "color": palette.get(str(value))},  # classes: plotly's colourway
                    customdata=at.astype(np.int32),
                    **point,
                )
            )
    else:
        colour = drawn[color_by].to_numpy(dtype=np.float32)
        marker = {"size": 4, "color": colour, "colorscale": "Viridis", "colorbar": {"title": color_by}}
        fig.add_trace(
            go.Scattergl(
                x=xy[:, 0], y=xy[:, 1], marker=marker, customdata=np.arange(len(drawn), dtype=np.int32), **point
            )
        )
    fig.update_layout(template="plotly_white", height=500, title=title, dragmode="lasso", meta=meta)
    return fig
