"""Plotly figures of a run's results: pure functions of what :mod:`oodviz.results.analysis` returns.

Convention everywhere (and stated on the axes): **OOD is the positive class; higher score =
more OOD**. Colours are consistent across figures: the ID set is always :data:`ID_COLOR`; each
OOD dataset gets its own colour from :func:`color_map` (pass the same ``colors`` mapping to
every figure of a page, e.g. ``color_map(ood_datasets_of(scores))``, to keep them identical;
without it, colours are given in order of appearance, which matches when the order is the run's).
ROC and PR curves without ``colors`` are not OOD sets but detectors: each gets its own
:func:`line_styles` style, up to 24 colours before dashes, as there are often 20 detectors or more.

All figures use the ``plotly_white`` template's page and axis styling (:data:`TEMPLATE`) and a compact height. This module never imports
streamlit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.colors import qualitative

from oodviz.results.analysis import ORACLE
from oodviz.results.metrics import COVERAGE_LEVEL

#: ``plotly_white``'s layout (white page, grey grid, colourway, colour scales) without its per-trace defaults and
#: its polar, ternary, 3-D and map settings that no figure here uses: the whole template is ~7 KB of every
#: chart's JSON, sent again at each slider step; this is ~2 KB.
TEMPLATE = go.layout.Template(
    layout={
        key: value
        for key, value in pio.templates["plotly_white"].layout.to_plotly_json().items()
        if key not in ("polar", "ternary", "scene", "geo")
    }
)
HEIGHT = 350
SMALL_HEIGHT = 250
#: The ID set's colour: a dark grey on the light theme's white; :data:`ID_COLOR_DARK` on the dark theme's near-black,
#: where the dark grey's bars at 0.55 opacity all but vanished (:func:`id_color`)
ID_COLOR = "#4C4C4C"
ID_COLOR_DARK = "#B3B3B3"
#: The key of a colour map (:func:`color_map`) that gives every ID label its colour
ID_KEY = "ID"
#: OOD colours (Plotly's qualitative "D3"-like set without grey), assigned in order
OOD_COLORS = (
    "#D62728",
    "#1F77B4",
    "#FF7F0E",
    "#2CA02C",
    "#9467BD",
    "#8C564B",
    "#E377C2",
    "#BCBD22",
    "#17BECF",
    "#AEC7E8",
    "#FFBB78",
    "#98DF8A",
    "#FF9896",
    "#C5B0D5",
)
#: Colours of lines that are not OOD sets (detectors): Plotly's "Dark24", 24 colours far enough apart and dark
#: enough for 2 px lines on white (OOD_COLORS' pale half is not)
LINE_COLORS = tuple(qualitative.Dark24)
#: Dashes of :func:`line_styles`: every colour of LINE_COLORS solid first, then all dashed, and so on
LINE_DASHES = ("solid", "dash", "dot", "dashdot")
#: Dashed threshold and coverage marks: a mid grey, seen on the light theme's white and on the dark theme's near-black
#: plot (Streamlit draws each chart in the browser's theme; a near-black line vanished in the dark one)
THRESHOLD_COLOR = "#888888"
SCORE_AXIS = "score (higher = more OOD)"
CONVENTION = "OOD = positive class; higher score = more OOD"


def is_id_label(label: str) -> bool:
    """True for the ID set's label (``"ID"`` or ``"ID (<dataset>)"``, as in :func:`score_histogram`)."""
    return label == "ID" or str(label).startswith("ID (")


def id_color(theme: str | None) -> str:
    """The ID set's colour on a page of Streamlit's ``theme`` type ("light", "dark"; None: not known, light)."""
    return ID_COLOR_DARK if theme == "dark" else ID_COLOR


def color_map(names, colors: dict | None = None, id_colour: str = ID_COLOR) -> dict:
    """Colour of each name: ID labels get ``colors[ID_KEY]`` where ``colors`` has it, else ``id_colour``
    (:func:`id_color`); the others :data:`OOD_COLORS` in order (cycling); names already in ``colors`` keep theirs."""
    result = dict(colors or {})
    used = sum(1 for name, _ in result.items() if not is_id_label(name))
    for name in names:
        if name in result:
            continue
        if is_id_label(name):
            result[name] = result.get(ID_KEY, id_colour)
        else:
            result[name] = OOD_COLORS[used % len(OOD_COLORS)]
            used += 1
    return result


def line_styles(names) -> dict:
    """Line style (``{"color", "dash"}``) of each name, in order: :data:`LINE_COLORS` solid, then the same
    colours dashed, dotted, dash-dotted (distinct for up to 96 names, then cycling). For lines that are not
    OOD sets, such as one per detector, which :func:`color_map`'s 14 colours would repeat."""
    return {
        name: {
            "color": LINE_COLORS[i % len(LINE_COLORS)],
            "dash": LINE_DASHES[i // len(LINE_COLORS) % len(LINE_DASHES)],
        }
        for i, name in enumerate(names)
    }


def figure_layout(fig: go.Figure, title: str | None, height: int = HEIGHT, **layout) -> go.Figure:
    """The look every oodviz figure shares (template, title, margins, legend), then ``layout`` (plotly's
    ``update_layout`` arguments, ``xaxis_title`` style included).

    Set property by property without plotly's checks, as plotly sets its own default template: the check (of the
    template above all) took 0.1-0.2 s a figure in ``update_layout``, most of a slider step's work;
    ``tests/figures/test_plots.py`` checks that every figure comes out as ``update_layout`` makes it."""
    settings = {
        "template": TEMPLATE,
        "title": {"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}} if title else None,
        "height": height,
        "margin": {"l": 55, "r": 15, "t": 45 if title else 15, "b": 45},
        "legend": {"font": {"size": 11}},
        "hoverlabel": {"namelength": -1},
    }
    validate, fig.layout._validate = fig.layout._validate, False
    try:
        for key, value in settings.items():
            if value is not None:  # no title: none set (update_layout(title=None) sets nothing either)
                fig.layout[key] = value
    finally:
        fig.layout._validate = validate
    return fig.update_layout(**layout) if layout else fig


# -- histogram ------------------------------------------------------------------------------------
HISTOGRAM_MODES = ("count", "density", "log count")
#: Sets drawn at first (the ID set and the first OOD sets); the others are one legend click away.
MAX_VISIBLE = 6


def hidden_at_first(labels: list[str], visible=None) -> list[str]:
    """The sets of :func:`histogram_figure` that start hidden: those not in ``visible`` (default: beyond the first
    :data:`MAX_VISIBLE`), in order; a page names them, as a hidden set is otherwise easy to miss."""
    shown = set(labels[:MAX_VISIBLE] if visible is None else visible)
    return [label for label in labels if label not in shown]


def histogram_figure(
    hist: dict,
    threshold: float | None = None,
    title: str | None = None,
    threshold_label: str = "95% OOD recall",
    colors: dict | None = None,
    mode: str = "count",
    visible=None,
) -> go.Figure:
    """Overlaid score histograms of the ID set and each OOD dataset (:func:`score_histogram`).

    One bar trace per set (x = bin centres, width = bin width, opacity 0.55, overlaid; equal bins are sent as
    the first centre ``x0`` and the step ``dx``, not as arrays). ``mode``:

    - ``"count"``: y = samples per bin;
    - ``"density"``: y = ``count / (n_set x bin width)``, each set normalised to area 1, so a 500-image
      set and an 8,000-image one have comparable heights;
    - ``"log count"``: the counts on a log axis (empty bins are not drawn).

    ``visible``: the labels drawn at first (default: the first :data:`MAX_VISIBLE`); the others start
    hidden (``"legendonly"``, :func:`hidden_at_first`), shown by a click on their legend entry. ``threshold`` draws a vertical
    dashed line annotated ``threshold_label``; scores at or right of it are flagged as OOD. End bins
    also hold the clipped outliers.
    """
    if mode not in HISTOGRAM_MODES:
        raise ValueError(f"mode must be one of {HISTOGRAM_MODES}, got {mode!r}")
    edges = np.asarray(hist["edges"], dtype=np.float64)
    centres = (edges[:-1] + edges[1:]) / 2
    widths = np.diff(edges)
    labels = list(hist["counts"])
    hidden = set(hidden_at_first(labels, visible))
    palette = color_map(labels, colors)
    if np.allclose(widths, widths[0], rtol=1e-6):  # np.linspace edges: bar i at x0 + i dx
        bins = {"x0": float(centres[0]), "dx": float(widths[0]), "width": float(widths[0])}
    else:
        bins = {"x": centres.astype(np.float32), "width": widths.astype(np.float32)}
    fig = go.Figure()
    for label in labels:
        counts = np.asarray(hist["counts"][label])
        total = counts.sum()
        share = counts / total if total else np.zeros_like(counts, dtype=np.float64)
        # float32, two hover columns, and equal bins as x0 + i dx: a slider step resends this figure
        fig.add_trace(
            go.Bar(
                **bins,
                y=(share / widths if mode == "density" else counts).astype(np.float32),
                name=label,
                visible="legendonly" if label in hidden else True,
                marker={"color": palette[label], "line": {"width": 0}},
                opacity=0.55,
                customdata=np.column_stack([counts, share]).astype(np.float32),
                hovertemplate=(
                    f"<b>{label}</b><br>score ≈ %{{x:.4g}}"
                    "<br>%{customdata[0]:.0f} samples (%{customdata[1]:.1%} of the set)<extra></extra>"
                ),
            )
        )
    detector = hist.get("detector")
    if title is None:
        title = f"{detector} scores" if detector else "Scores"
    clipped = hist.get("clipped_low", 0) + hist.get("clipped_high", 0)
    figure_layout(
        fig,
        title,
        barmode="overlay",
        bargap=0,
        xaxis_title=SCORE_AXIS + (" — end bins include clipped outliers" if clipped else ""),
        yaxis_title={"count": "samples", "density": "density (each set's area = 1)", "log count": "samples (log)"}[
            mode
        ],
        legend={"title": {"text": "click to show or hide"}, "font": {"size": 11}},
    )
    if mode == "log count":
        fig.update_yaxes(type="log")
    if threshold is not None:
        threshold_line(fig, float(threshold), f"{threshold_label}: {float(threshold):.4g}")
    return fig


def threshold_line(fig: go.Figure, x: float, text: str) -> go.Figure:
    """A vertical dashed line at ``x`` over the whole plot height, annotated ``text`` at its top right: what
    ``fig.add_vline(x, annotation_position="top right")`` draws, set unchecked (add_vline's checks were a third
    of the histogram's build, redone at every slider step); ``tests/figures/test_plots.py`` checks both agree."""
    validate, fig.layout._validate = fig.layout._validate, False
    try:
        fig.layout["shapes"] = [
            {
                "type": "line",
                "x0": x,
                "x1": x,
                "xref": "x",
                "y0": 0,
                "y1": 1,
                "yref": "y domain",
                "line": {"color": THRESHOLD_COLOR, "width": 2, "dash": "dash"},
            }
        ]
        fig.layout["annotations"] = [
            {
                "text": text,
                "x": x,
                "xref": "x",
                "y": 1,
                "yref": "y domain",
                "xanchor": "left",
                "yanchor": "top",
                "showarrow": False,
                "font": {"size": 11},
            }
        ]
    finally:
        fig.layout._validate = validate
    return fig


# -- metrics heatmap ------------------------------------------------------------------------------
def metrics_heatmap(table: pd.DataFrame, metric: str = "AUROC", higher_is_better: bool = True) -> go.Figure:
    """A detector x OOD-set heatmap: ``table`` has one row per detector and one column per OOD set (the
    values of ``metric``); each cell prints its value (3 decimals). Green is better: dark green at the
    high end for a higher-is-better metric (AUROC), at the low end otherwise (FPR95); the colour scale
    spans the table's own range. The OOD-set names stand rotated above the columns, below the title."""
    values = table.to_numpy(dtype=np.float64)
    scale = "Greens" if higher_is_better else "Greens_r"
    fig = go.Figure(
        go.Heatmap(
            z=values,
            x=[str(c) for c in table.columns],
            y=[str(i) for i in table.index],
            colorscale=scale,
            text=[[f"{v:.3f}" for v in row] for row in values],
            texttemplate="%{text}",
            textfont={"size": 10},
            hovertemplate=f"%{{y}} on %{{x}}: {metric} %{{z:.3f}}<extra></extra>",
            colorbar={"title": {"text": metric}, "thickness": 12},
        )
    )
    figure_layout(
        fig,
        f"{metric} per detector and OOD set ({'higher' if higher_is_better else 'lower'} is better)",
        height=max(HEIGHT, 60 + 22 * len(table)),
        # The title, at the figure's top, reserves its own height; the x axis's automargin then pushes the top
        # margin past the rotated names, whatever their length, so the two never overlap. This holds only with
        # a top margin below the title's height: a larger one takes the title in and nothing is reserved.
        title_yref="container",
        title_y=1,
        title_yanchor="top",
        title_pad={"t": 10, "b": 6},
        title_automargin=True,
        xaxis={"side": "top", "tickangle": -30, "automargin": True},
        yaxis={"autorange": "reversed"},
        margin={"l": 110, "r": 15, "t": 15, "b": 15},
    )
    return fig


# -- ROC / PR -------------------------------------------------------------------------------------
def _curve_figure(
    curves_by_label: dict, x: str, y: str, metric: str, metric_name: str, line_shape: str, colors: dict | None
) -> go.Figure:
    if colors is None:
        styles = line_styles(curves_by_label)
    else:
        styles = {label: {"color": color} for label, color in color_map(list(curves_by_label), colors).items()}
    fig = go.Figure()
    for label, curve in curves_by_label.items():
        thresholds = curve.get("roc_thresholds" if x == "fpr" else "pr_thresholds")
        fig.add_trace(
            go.Scatter(
                x=np.asarray(curve[x], dtype=np.float32),  # float32: half the bytes, far finer than a pixel
                y=np.asarray(curve[y], dtype=np.float32),
                mode="lines",
                line={**styles[label], "width": 2, "shape": line_shape},
                name=f"{label} ({metric_name} {curve[metric]:.3f})",
                customdata=None if thresholds is None else np.asarray(thresholds, dtype=np.float32),
                hovertemplate=(
                    f"<b>{label}</b><br>{x} %{{x:.3f}}, {y} %{{y:.3f}}"
                    + ("<br>threshold %{customdata:.4g}" if thresholds is not None else "")
                    + "<extra></extra>"
                ),
            )
        )
    return fig


def roc_figure(curves_by_label: dict, title: str = "ROC (OOD = positive)", colors: dict | None = None) -> go.Figure:
    """ROC curves of :func:`curves` results, one line per label, AUROC in each legend entry, and
    the dashed chance diagonal. x: ID flagged as OOD (FPR); y: OOD detected (TPR). ``colors``: the OOD
    sets' colours (:func:`color_map`) when the labels are OOD sets; ``None`` when they are detectors, each
    then drawn in its own :func:`line_styles` style."""
    fig = _curve_figure(curves_by_label, "fpr", "tpr", "auroc", "AUROC", "linear", colors)
    fig.add_trace(
        go.Scatter(
            x=[0.0, 1.0],
            y=[0.0, 1.0],
            mode="lines",
            name="chance (AUROC 0.5)",
            line={"color": "#BBBBBB", "width": 1, "dash": "dash"},
            hoverinfo="skip",
            showlegend=False,
        )
    )
    figure_layout(
        fig,
        title,
        xaxis={"title": "false-positive rate (ID flagged as OOD)", "range": [0, 1], "constrain": "domain"},
        yaxis={"title": "true-positive rate (OOD detected)", "range": [0, 1.02]},
    )
    return fig


def pr_figure(
    curves_by_label: dict, title: str = "Precision-recall, OOD = positive (PR-Out)", colors: dict | None = None
) -> go.Figure:
    """PR-Out curves of :func:`curves` results (OOD positive), one line per label, AUPR-Out in each
    legend entry. Drawn as steps (``vh``) so the area under each line is its AUPR-Out (average
    precision). ``colors``: as in :func:`roc_figure`."""
    fig = _curve_figure(curves_by_label, "recall", "precision", "aupr_out", "AUPR-Out", "vh", colors)
    figure_layout(
        fig,
        title,
        xaxis={"title": "recall (OOD detected)", "range": [0, 1]},
        yaxis={"title": "precision (flagged that are OOD)", "range": [0, 1.02]},
    )
    return fig


# -- per class ------------------------------------------------------------------------------------
def per_class_bar(
    per_class: pd.DataFrame, title: str = "False alarms per ID class", color: str = ID_COLOR
) -> go.Figure:
    """False-alarm rate (ID test samples flagged as OOD) per true ID class, in the table's order
    (:func:`oodviz.results.tables.per_class_at_threshold` sorts worst first); hover shows the counts,
    accuracy and mean score."""
    names = [str(c) for c in per_class["class_name"]]
    fig = go.Figure(
        go.Bar(
            x=names,
            y=per_class["false_alarm_rate"].to_numpy(dtype=np.float64),
            marker={"color": color},
            customdata=np.column_stack(
                [per_class["false_alarms"], per_class["n"], per_class["accuracy"], per_class["mean_score"]]
            ),
            hovertemplate=(
                "<b>class %{x}</b><br>%{customdata[0]:d} of %{customdata[1]:d} flagged as OOD (%{y:.1%})"
                "<br>classifier accuracy %{customdata[2]:.1%}<br>mean score %{customdata[3]:.4g}<extra></extra>"
            ),
            name="false-alarm rate",
        )
    )
    figure_layout(
        fig,
        title,
        xaxis={"title": "true ID class", "type": "category", "categoryorder": "array", "categoryarray": names},
        yaxis={"title": "ID flagged as OOD", "tickformat": ".0%", "rangemode": "tozero"},
        showlegend=False,
    )
    return fig


# -- memory ---------------------------------------------------------------------------------------
MEMORY_LINES = (
    ("cpu_rss_mib", "CPU RSS", "#1F77B4", "solid"),
    ("gpu_allocated_mib", "GPU allocated", "#D62728", "solid"),
    ("gpu_peak_mib", "GPU peak", "#D62728", "dot"),
)


def memory_figure(timeline: pd.DataFrame, title: str = "Memory", stages: Sequence[str] = ()) -> go.Figure:
    """A small live memory chart of :func:`memory_timeline`: CPU RSS and, when the run reports
    them, GPU allocated and GPU peak (MiB) over seconds since the start; hover names the stage by its number k
    in ``stages`` (the run's plan: "Stage k of N" in the live panel; default: in order of appearance).

    Binary float32 coordinates and an int16 stage number per point: the chart's size depends on its number of
    points only, not on which stages (of names of any length) its points fall in."""
    fig = go.Figure()
    names = timeline["stage"].astype(object).where(timeline["stage"].notna(), "") if "stage" in timeline else None
    number = None
    if names is not None:
        order = {name: k for k, name in enumerate(stages or dict.fromkeys(names), start=1)}
        number = names.map(lambda name: order.get(name, 0)).to_numpy(dtype=np.int16)
    for column, name, color, dash in MEMORY_LINES:
        if column not in timeline or not timeline[column].notna().any():
            continue
        fig.add_trace(
            go.Scatter(
                x=timeline["time_s"].to_numpy(dtype=np.float32),
                y=timeline[column].to_numpy(dtype=np.float32),
                mode="lines",
                name=name,
                line={"color": color, "width": 2, "dash": dash},
                customdata=number,
                hovertemplate=f"{name} %{{y:,.0f}} MiB<br>%{{x:.1f}} s"
                + ("<br>stage %{customdata}" if number is not None else "")
                + "<extra></extra>",
            )
        )
    figure_layout(
        fig,
        title,
        height=SMALL_HEIGHT,
        xaxis_title="seconds since start",
        yaxis={"title": "MiB", "rangemode": "tozero"},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"},
    )
    return fig


# -- comparing runs -------------------------------------------------------------------------------
def spaced_labels(x: np.ndarray, y: np.ndarray, names: list[str], spacing: float) -> list[str]:
    """The names to print beside points ``(x, y)``: greedily, from the highest ``y + x`` down, a point's name when no
    point already named lies within ``spacing`` (Euclidean, in axis units), else ``""`` (its name stays in the
    hover): names that would print over each other are not drawn."""
    labels = [""] * len(names)
    named: list[tuple[float, float]] = []
    for i in sorted(range(len(names)), key=lambda i: -(x[i] + y[i]) if np.isfinite(x[i] + y[i]) else np.inf):
        if not np.isfinite(x[i] + y[i]):
            continue
        if all((x[i] - a) ** 2 + (y[i] - b) ** 2 >= spacing**2 for a, b in named):
            labels[i] = names[i]
            named.append((x[i], y[i]))
    return labels


#: the distance between two named points of :func:`compare_scatter`, a share of its axes' range
LABEL_SPACING = 0.035


def compare_scatter(means: pd.DataFrame, title: str, label_a: str = "run A", label_b: str = "run B") -> go.Figure:
    """One point per detector: x = its value in run A, y = in run B (``means`` has columns ``auroc_a``,
    ``auroc_b``, indexed by detector), and the dashed diagonal y = x: points above it did better in B. Names that
    would overlap are left to the hover (:func:`spaced_labels`)."""
    low = float(np.nanmin(means[["auroc_a", "auroc_b"]].to_numpy(dtype=np.float64)))
    low = max(0.0, min(low - 0.02, 0.5))
    x, y = means["auroc_a"].to_numpy(dtype=np.float64), means["auroc_b"].to_numpy(dtype=np.float64)
    names = [str(d) for d in means.index]
    fig = go.Figure(
        [
            go.Scatter(
                x=[low, 1.0], y=[low, 1.0], mode="lines", line={"color": "#BBBBBB", "dash": "dash"}, hoverinfo="skip"
            ),
            go.Scatter(
                x=x,
                y=y,
                mode="markers+text",
                text=spaced_labels(x, y, names, LABEL_SPACING * (1.01 - low)),
                customdata=names,
                textposition="top center",
                textfont={"size": 10},
                cliponaxis=False,  # a name near AUROC 1 stays whole
                marker={"color": OOD_COLORS[1], "size": 8},
                hovertemplate="<b>%{customdata}</b><br>A %{x:.3f}<br>B %{y:.3f}<extra></extra>",
            ),
        ]
    )
    figure_layout(
        fig,
        title,
        height=520,
        showlegend=False,
        # square axes: the plot narrows to keep the range (else plotly widens x past AUROC 1 to fill the width)
        xaxis={"title": f"AUROC in {label_a} (A)", "range": [low, 1.01], "constrain": "domain"},
        yaxis={"title": f"AUROC in {label_b} (B)", "range": [low, 1.01], "scaleanchor": "x"},
    )
    return fig


# -- risk–coverage: reject the most OOD-looking ID test samples first; lower risk is better ----------------------
ORACLE_COLOR = "#888888"


def risk_coverage_figure(curves: dict, title: str = "Risk–coverage (reject the highest scores first)") -> go.Figure:
    """One line per entry of ``curves`` (``{name: {"coverage", "risk", "aurc", "risk_at_95_coverage"}}``),
    named with its AURC, each detector in its own :func:`oodviz.figures.plots.line_styles` style and the oracle grey and
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
    fig.add_vline(x=COVERAGE_LEVEL, line={"dash": "dot", "width": 1, "color": THRESHOLD_COLOR})
    return figure_layout(
        fig,
        title,
        xaxis={"title": "coverage (share of ID test samples accepted)", "range": [0, 1]},
        yaxis={"title": "risk (error rate among the accepted)", "rangemode": "tozero"},
    )


# -- which layer?: one line per detector across the run's layers ------------------------------------------------
def layer_ranking_figure(
    ranking: pd.DataFrame, layers: list[str], by_depth: bool, title: str = "Which layer? (mean AUROC)"
) -> go.Figure:
    """``ranking``: :func:`oodviz.results.layers.layer_ranking`; ``layers``: the x axis order (the run's layers,
    then :data:`oodviz.results.layers.COMBINED` when the table has it); ``by_depth``: whether that order is the model's,
    shallow to deep (the axis says which order it is). A detector's best layer (rank 1) is a
    larger marker; hovering a point shows its AUROC, FPR95 and rank. Each detector has its own
    :func:`oodviz.figures.plots.line_styles` style."""
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
