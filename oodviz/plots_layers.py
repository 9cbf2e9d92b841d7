"""The "which layer?" figure: a pure Plotly function of :func:`oodviz.layers.layer_ranking`.

One line per detector across the run's layers (in the order given: shallow to deep where the run recorded the
model's order; the combined score last), at the
mean AUROC over the OOD datasets; the best layer of each detector is marked. This module never
imports streamlit.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from oodviz.plots import figure_layout, line_styles


def layer_ranking_figure(
    ranking: pd.DataFrame, layers: list[str], by_depth: bool, title: str = "Which layer? (mean AUROC)"
) -> go.Figure:
    """``ranking``: :func:`oodviz.layers.layer_ranking`; ``layers``: the x axis order (the run's layers,
    then :data:`oodviz.layers.COMBINED` when the table has it); ``by_depth``: whether that order is the model's,
    shallow to deep (the axis says which order it is). A detector's best layer (rank 1) is a
    larger marker; hovering a point shows its AUROC, FPR95 and rank. Each detector has its own
    :func:`oodviz.plots.line_styles` style."""
    fig = go.Figure()
    styles = line_styles(ranking.detector.unique())
    for detector, rows in ranking.groupby("detector", sort=False):
        rows = rows.set_index("layer").reindex([layer for layer in layers if layer in set(rows.layer)])
        fig.add_trace(
            go.Scatter(
                x=list(rows.index),
                y=rows.auroc,
                mode="lines+markers",
                name=detector,
                line=styles[detector],
                marker={"size": [14 if rank == 1 else 7 for rank in rows["rank"]]},
                customdata=rows[["fpr95", "rank"]].to_numpy(),
                hovertemplate=(
                    f"{detector} at %{{x}}<br>AUROC %{{y:.4f}}<br>FPR95 %{{customdata[0]:.4f}}"
                    "<br>rank %{customdata[1]}<extra></extra>"
                ),
            )
        )
    return figure_layout(
        fig,
        title,
        xaxis={
            "title": "layer (shallow to deep)" if by_depth else "layer (in the order the run lists them)",
            "type": "category",
            "categoryorder": "array",
            "categoryarray": layers,
        },
        yaxis={"title": "mean AUROC over the OOD sets (higher is better)"},
    )
