"""From a chart to its images: a box or lasso on a score histogram, a point or a stretch of a ROC curve, a
selection on the feature-space map, each shows the images it covers with true class, prediction and score.

What a selection covers is computed by :mod:`oodviz.results.selection` from the run's ``scores.parquet``; this
module only draws the charts with selection on and the galleries, for the run's
:class:`oodviz.results.tables.Results` ``results``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from oodviz.figures import plots
from oodviz.figures.thumbnails import thumbnails
from oodviz.results.selection import (
    operating_point_samples,
    samples_in_range,
    selected_curve_thresholds,
    selected_range,
    selected_traces,
)
from oodviz.results.tables import ID_SPLIT
from oodviz.ui.figure_export import chart

GALLERY_SIZE = 12
COLUMNS = 6


def sample_caption(row) -> str:
    """``true class → prediction · score`` (an OOD sample's set in place of its class)."""
    truth = row.class_name if row.split == ID_SPLIT else row.dataset
    return f"{truth} → {row.predicted_name} · {row.score:.4g}"


def image_grid(images, captions, empty: str = "None.") -> None:
    """``images`` with their ``captions``, :data:`COLUMNS` a line, each line a row of columns of its own (a caption
    that wraps over three lines lowers only its own line, not every later image of its column); ``empty`` when
    there are none."""
    if not len(images):
        st.caption(empty)
        return
    images, captions = list(images), list(captions)
    for start in range(0, len(images), COLUMNS):
        line = zip(st.columns(COLUMNS), images[start : start + COLUMNS], captions[start : start + COLUMNS])
        for column, image, caption in line:
            column.image(image, caption=caption, width="stretch")


def gallery(results, rows: pd.DataFrame, empty: str = "None.") -> None:
    """Thumbnails of ``rows`` (a :data:`oodviz.results.selection.SAMPLE_COLUMNS` table), :data:`COLUMNS` a line."""
    image_grid(thumbnails(results, rows) if len(rows) else [], [sample_caption(r) for r in rows.itertuples()], empty)


def galleries_per_set(results, table: pd.DataFrame, what: str) -> None:
    """One gallery per set of ``table`` (in its order), the first :data:`GALLERY_SIZE` rows of each."""
    for dataset, rows in table.groupby("dataset", sort=False):
        shown = rows.head(GALLERY_SIZE)
        st.caption(f"{dataset}: {len(rows):,} {what}; the first {len(shown)}")
        gallery(results, shown)


def score_range_gallery(results, detector: str, low: float, high: float, datasets=None, with_id=True) -> None:
    """The images whose ``detector`` score lies in ``[low, high]``, per set (ID test first unless ``with_id`` is
    False; only the OOD sets ``datasets`` when given), lowest first."""
    table = samples_in_range(results.scores, detector, low, high, results.class_names, datasets, with_id)
    st.markdown(
        f"**Images with a {detector} score in [{low:.6g}, {high:.6g}]**: {len(table):,} "
        "(true class → prediction · score, lowest score first)"
    )
    if not len(table):
        st.caption("No image has a score in this range.")
    galleries_per_set(results, table, "in range")


def selection_of(event) -> dict:
    return (event or {}).get("selection", {}) or {}  # a dict: the state as set or as sent


def histogram_selection_gallery(results, detector: str, event, hist: dict) -> None:
    """Below a histogram of ``hist`` (:func:`oodviz.results.analysis.score_histogram`) drawn with ``on_select="rerun"``:
    the images in the box's or lasso's score range, of the sets drawn under it (a set hidden from the legend has
    no bars to select, and none of its images are shown)."""
    selection = selection_of(event)
    chosen = selected_range(selection)
    if chosen is None:
        st.caption("Drag a box (or a lasso) over the histogram to see the images in that score range.")
        return
    drawn = selected_traces(selection, list(hist["counts"]))
    if drawn is None:
        score_range_gallery(results, detector, *chosen)
    else:
        ood = [name for name in drawn if name != hist["id_label"]]
        score_range_gallery(results, detector, *chosen, datasets=ood, with_id=hist["id_label"] in drawn)


def roc_chart(results, detector: str, curves: dict, title: str, colors, dataset: str | None, key: str) -> None:
    """The ROC curves of ``curves`` (label -> :func:`oodviz.results.analysis.curves`), each point selectable: one
    point shows the images wrong at its threshold, a box or lasso over several the images between their
    thresholds. ``dataset``: the OOD set when the curves are detectors; ``None`` when they are OOD sets
    of ``detector``."""
    fig = plots.roc_figure(curves, title=f"ROC — {title}", colors=colors)
    for trace in fig.data:
        if trace.customdata is not None:  # a curve (not the chance line): its points clickable
            trace.update(mode="lines+markers", marker={"size": 5})
    event = chart(fig, key, width="stretch", on_select="rerun", selection_mode=("points", "box", "lasso"))
    chosen = selected_curve_thresholds(curves, selection_of(event))
    if not chosen:
        st.caption(
            "Click a point of a curve to see the images wrong at its threshold; with Box Select (the chart's "
            "toolbar), drag over several points to see the images between their thresholds."
        )
    for label, (low, high) in chosen.items():
        scored_by, ood_set = (label, dataset) if dataset is not None else (detector, label)
        if low == high:
            operating_point_gallery(results, scored_by, low, ood_set)
        else:
            score_range_gallery(results, scored_by, low, high, datasets=[ood_set])


def operating_point_gallery(results, detector: str, threshold: float, ood_set: str) -> None:
    """The ID images flagged and the ``ood_set`` images missed at ``threshold``, nearest it first."""
    flagged, missed = operating_point_samples(results.scores, detector, threshold, ood_set, results.class_names)
    n_id = int((results.scores.split == ID_SPLIT).sum())
    n_ood = int((results.scores.dataset == ood_set).sum() if ood_set else 0)
    st.markdown(
        f"**{detector} at threshold {threshold:.9g}** (ID vs {ood_set}): {len(flagged):,} of {n_id:,} ID images "
        f"flagged as OOD (FPR {len(flagged) / max(n_id, 1):.3f}), {len(missed):,} of {n_ood:,} {ood_set} images "
        f"accepted as ID (TPR {1 - len(missed) / max(n_ood, 1):.3f}); nearest the threshold first"
    )
    shown = flagged.head(GALLERY_SIZE)
    st.caption(f"ID flagged as OOD: the {len(shown)} nearest the threshold")
    gallery(results, shown, "No ID image is flagged at this threshold.")
    shown = missed.head(GALLERY_SIZE)
    st.caption(f"{ood_set} accepted as ID: the {len(shown)} nearest the threshold")
    gallery(results, shown, f"No {ood_set} image is missed at this threshold.")


def projection_selection_gallery(results, rows: pd.DataFrame, detector: str) -> None:
    """The images of the selected projection ``rows`` (split, dataset, index), scored by ``detector``."""
    if not len(rows):
        st.caption("Select points on the map (click, box or lasso) to see their images.")
        return
    keys = ["split", "dataset", "index"]
    table = rows[keys].merge(results.scores, on=keys, how="left")
    table = samples_in_range(table, detector, -np.inf, np.inf, results.class_names)
    st.markdown(f"**{len(rows):,} selected point(s)** (true class → prediction · {detector} score)")
    galleries_per_set(results, table, "selected")
