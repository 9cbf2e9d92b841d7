"""The risk–coverage figure: a pure Plotly function of :func:`oodviz.analysis.risk_coverage_curves`.

Each detector's score rejects the most OOD-looking ID test samples first; the curve shows the
classifier's error rate (risk) among the samples kept against their share (coverage). Lower is
better; the dashed oracle rejects exactly the misclassified samples first. This module never
imports streamlit.
"""

from __future__ import annotations

import plotly.graph_objects as go

from oodviz.analysis import ORACLE
from oodviz.metrics import COVERAGE_LEVEL
from oodviz.plots import figure_layout, line_styles

ORACLE_COLOR = "#888888"


def risk_coverage_figure(curves: dict, title: str = "Risk–coverage (reject the highest scores first)") -> go.Figure:
    """One line per entry of ``curves`` (``{name: {"coverage", "risk", "aurc", "risk_at_95_coverage"}}``),
    named with its AURC, each detector in its own :func:`oodviz.plots.line_styles` style and the oracle grey and
    dashed; a dotted line marks 95% coverage."""
    fig = go.Figure()
    styles = line_styles([name for name in curves if name != ORACLE])
    for name, curve in curves.items():
        oracle = name == ORACLE
        fig.add_trace(
            go.Scatter(
                x=curve["coverage"],
                y=curve["risk"],
                mode="lines",
                name=f"{name} (AURC {curve['aurc']:.4g})",
                line={"color": ORACLE_COLOR, "dash": "dash"} if oracle else styles[name],
                hovertemplate=f"{name}<br>coverage %{{x:.3f}}<br>risk %{{y:.4f}}<extra></extra>",
            )
        )
    fig.add_vline(x=COVERAGE_LEVEL, line={"dash": "dot", "width": 1, "color": "#111111"})
    return figure_layout(
        fig,
        title,
        xaxis={"title": "coverage (share of ID test samples accepted)", "range": [0, 1]},
        yaxis={"title": "risk (error rate among the accepted)", "rangemode": "tozero"},
    )
