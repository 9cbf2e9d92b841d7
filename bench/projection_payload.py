"""The bytes a feature map sends to the browser (issue 15.4): a 60,000-point PCA map, before and after.

- **before**: the figure as ``oodviz/ui/explore.py`` built it up to commit 1048d14: every point drawn, a
  per-point hover string (``"<set> #<index><br>true <class> · predicted <class>"``), int64 row numbers as
  customdata and float64 coordinates;
- **after**: :func:`oodviz.figures.projection_map.projection_figure` of the :func:`~oodviz.figures.projection_map.drawn_rows`
  subsample (at most ``MAP_POINTS``, seeded) plus the hover panel's data
  (:func:`~oodviz.figures.projection_map.hover_data`) with a sprite of ``SPRITE_BUDGET`` bytes, the most
  ``oodviz project`` writes (incompressible bytes: the base64 is as long as a real sprite's of that size).

Bytes are those of the JSON the page gets (``plotly.io.to_json`` of the figure, as ``st.plotly_chart`` sends
it; ``json.dumps`` of the component's data), for each colouring. Usage::

    .venv/bin/python bench/projection_payload.py [--points 60000]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from oodviz.figures.projection_map import SPRITE_BUDGET, drawn_rows, hover_data, projection_figure

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def synthetic_map(n: int, seed: int = 0) -> pd.DataFrame:
    """A projection of ``n`` points: 1/2 ID test (10 classes), the rest in three OOD sets, with a score."""
    rng = np.random.default_rng(seed)
    sets = rng.choice(["cifar10-test", "svhn", "places365", "textures"], size=n, p=[0.5, 0.2, 0.2, 0.1])
    is_id = sets == "cifar10-test"
    return pd.DataFrame(
        {
            "split": np.where(is_id, "id_test", "ood"),
            "dataset": sets,
            "index": rng.integers(0, 30_000, n),
            "label": np.where(is_id, rng.integers(0, 10, n), -1),
            "prediction": rng.integers(0, 10, n),
            "x": rng.normal(size=n),
            "y": rng.normal(size=n),
            "score": rng.normal(size=n),
        }
    )


def before(frame: pd.DataFrame, color_by: str) -> go.Figure:
    """The figure of commit 1048d14 (every point, per-point hover text)."""
    text = np.array(
        [
            f"{d} #{i}<br>true {CLASSES[c] if s == 'id_test' else 'OOD'} · predicted {CLASSES[p]}"
            for s, d, i, c, p in zip(frame.split, frame.dataset, frame["index"], frame.label, frame.prediction)
        ],
        dtype=object,
    )
    fig = go.Figure()
    point = {"mode": "markers", "hovertemplate": "%{hovertext}<extra></extra>"}
    if color_by in ("dataset", "label"):
        for value, rows in frame.groupby(color_by, sort=False):
            at = rows.index.to_numpy()
            fig.add_trace(
                go.Scattergl(
                    x=rows.x, y=rows.y, name=str(value), marker={"size": 4}, customdata=at, hovertext=text[at], **point
                )
            )
    else:
        marker = {"size": 4, "color": frame[color_by], "colorscale": "Viridis", "colorbar": {"title": color_by}}
        fig.add_trace(
            go.Scattergl(x=frame.x, y=frame.y, marker=marker, customdata=np.arange(len(frame)), hovertext=text, **point)
        )
    fig.update_layout(template="plotly_white", height=500, title="t", dragmode="lasso")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=60_000)
    args = parser.parse_args()
    frame = synthetic_map(args.points)
    out = {"points": args.points, "cpus": os.cpu_count(), "sprite_budget": SPRITE_BUDGET}
    for color_by in ("dataset", "label", "score"):
        started = time.perf_counter()
        old = len(pio.to_json(before(frame, color_by), validate=False))
        old_s = time.perf_counter() - started
        started = time.perf_counter()
        drawn = frame.iloc[drawn_rows(len(frame))].reset_index(drop=True)
        figure = len(pio.to_json(projection_figure(drawn, color_by, "t", "meta"), validate=False))
        keys = drawn.head(2000)[["split", "dataset", "index"]]
        hover = len(json.dumps(hover_data(drawn, CLASSES, keys, os.urandom(SPRITE_BUDGET))))
        new_s = time.perf_counter() - started
        out[color_by] = {
            "before_bytes": old,
            "before_s": round(old_s, 3),
            "after_points": len(drawn),
            "after_figure_bytes": figure,
            "after_hover_bytes": hover,
            "after_bytes": figure + hover,
            "after_s": round(new_s, 3),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
