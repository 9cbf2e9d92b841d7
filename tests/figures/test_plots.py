"""oodviz.figures.plots: figures carry the data of oodviz.results.analysis, the convention and consistent colours."""

import numpy as np
import pandas as pd
import pytest
from helpers import synthetic_scores

from oodviz.figures import plots as P
from oodviz.figures.plots import layer_ranking_figure
from oodviz.results import analysis as A
from oodviz.results.tables import default_threshold, ood_datasets_of, per_class_at_threshold


@pytest.fixture(scope="module")
def scores():
    return synthetic_scores(seed=1)


def test_histogram_figure_bars_and_threshold_line(scores):
    hist = A.score_histogram(scores, "det", bins=20)
    threshold = default_threshold(scores, "det")
    fig = P.histogram_figure(hist, threshold=threshold)
    edges = hist["edges"]
    assert [t.name for t in fig.data] == ["ID (id-set)", "far-set", "near-set"]
    for trace in fig.data:
        assert trace.type == "bar" and trace.opacity == pytest.approx(0.55)
        centres = trace.x0 + trace.dx * np.arange(len(trace.y))  # equal bins: x0 + i dx, no x array sent
        assert trace.x is None
        np.testing.assert_allclose(centres, (edges[:-1] + edges[1:]) / 2)
        np.testing.assert_allclose(np.full(len(trace.y), trace.width), np.diff(edges))
        np.testing.assert_array_equal(np.asarray(trace.y), hist["counts"][trace.name])
    assert fig.layout.barmode == "overlay"
    (line,) = fig.layout.shapes
    assert line.x0 == line.x1 == pytest.approx(threshold) and line.type == "line"
    assert fig.layout.annotations[0].text == f"95% OOD recall: {threshold:.4g}"
    assert "higher = more OOD" in fig.layout.xaxis.title.text
    assert fig.layout.yaxis.title.text == "samples"
    assert fig.layout.title.text == "det scores" and fig.layout.height == 350
    assert fig.layout.template.layout.plot_bgcolor == "white"  # plotly_white
    # ID always has the ID colour; OOD sets get distinct colours
    colours = [t.marker.color for t in fig.data]
    assert colours[0] == P.ID_COLOR and len(set(colours)) == 3


def test_the_threshold_line_is_what_plotly_add_vline_draws(scores):
    import plotly.graph_objects as go

    hist = A.score_histogram(scores, "det", bins=20)
    drawn = P.histogram_figure(hist, threshold=0.25, threshold_label="every set")
    expected = P.histogram_figure(hist)
    expected.add_vline(
        x=0.25,
        line={"color": P.THRESHOLD_COLOR, "width": 2, "dash": "dash"},
        annotation_text="every set: 0.25",
        annotation_position="top right",
        annotation_font_size=11,
    )
    assert drawn.to_plotly_json() == expected.to_plotly_json()
    assert go.Figure(drawn.to_dict()).to_plotly_json() == drawn.to_plotly_json()  # plotly's checks accept it


def test_histogram_figure_density_log_and_custom_label(scores):
    hist = A.score_histogram(scores, "tied", bins=10)
    fig = P.histogram_figure(hist, threshold=1.0, threshold_label="threshold", mode="density", title="T")
    widths = np.diff(hist["edges"])
    for trace in fig.data:
        counts = np.asarray(hist["counts"][trace.name], dtype=np.float64)
        np.testing.assert_allclose(np.asarray(trace.y), counts / (counts.sum() * widths))
        assert (np.asarray(trace.y) * widths).sum() == pytest.approx(1.0)  # each set's area is 1, whatever its size
    assert fig.layout.annotations[0].text == "threshold: 1" and fig.layout.shapes[0].x0 == 1.0
    assert fig.layout.yaxis.title.text.startswith("density") and fig.layout.title.text == "T"
    log = P.histogram_figure(hist, mode="log count")
    assert log.layout.yaxis.type == "log"
    np.testing.assert_array_equal(np.asarray(log.data[0].y), hist["counts"][log.data[0].name])
    assert not P.histogram_figure(hist).layout.shapes  # no threshold, no line
    with pytest.raises(ValueError, match="mode must be one of"):
        P.histogram_figure(hist, mode="fraction")


def test_histograms_show_at_most_six_sets_at_first_in_distinct_colours():
    rng = np.random.default_rng(0)
    hist = {
        "edges": np.linspace(0, 1, 11),
        "counts": {"ID (x)": rng.integers(0, 50, 10), **{f"set{i}": rng.integers(0, 50, 10) for i in range(8)}},
    }
    fig = P.histogram_figure(hist)
    visible = [t.name for t in fig.data if t.visible is True]
    assert visible == ["ID (x)", "set0", "set1", "set2", "set3", "set4"]  # the others: one legend click away
    assert all(t.visible == "legendonly" for t in fig.data[6:])
    colours = [t.marker.color for t in fig.data]
    assert len(set(colours)) == len(colours)
    chosen = P.histogram_figure(hist, visible=["ID (x)", "set7"])
    assert [t.name for t in chosen.data if t.visible is True] == ["ID (x)", "set7"]


def test_metrics_heatmap_cells_are_the_table(scores):
    table = pd.DataFrame({"near": [0.9, 0.7], "far": [0.99, 0.5]}, index=["energy", "msp"])
    fig = P.metrics_heatmap(table, "AUROC")
    (cells,) = fig.data
    np.testing.assert_array_equal(np.asarray(cells.z), table.to_numpy())
    assert list(cells.x) == ["near", "far"] and list(cells.y) == ["energy", "msp"]
    assert [list(row) for row in cells.text] == [["0.900", "0.990"], ["0.700", "0.500"]]
    assert "higher is better" in fig.layout.title.text
    assert "lower is better" in P.metrics_heatmap(table, "FPR95", higher_is_better=False).layout.title.text


def test_metrics_heatmap_keeps_its_title_clear_of_the_rotated_set_names():
    """The set names stand rotated above the columns: the title, pinned to the figure's top, reserves its height
    (plotly's title automargin) and the x axis's automargin puts the names below it. Plotly reserves nothing when
    the top margin already holds the title, hence a top margin below the title's height (font size and padding).
    Checked rendered (kaleido) at 700 and 1,000 px wide: 20 detectors x 7 and 9 sets of up to 22 characters."""
    sets = ["fashion-mnist-heldout", "fashion-mnist-inverted", "fashion-mnist-rotated", "digits-28", "noise-uniform"]
    table = pd.DataFrame(np.full((20, len(sets)), 0.9), index=[f"detector{i}" for i in range(20)], columns=sets)
    layout = P.metrics_heatmap(table, "AUROC").layout
    assert layout.xaxis.side == "top" and layout.xaxis.tickangle == -30 and layout.xaxis.automargin is True
    title = layout.title
    assert title.yref == "container" and title.y == 1 and title.yanchor == "top" and title.automargin is True
    assert layout.margin.t < title.font.size + title.pad.t + title.pad.b


def test_roc_figure_lines_legend_and_chance(scores):
    by_label = {name: A.curves(scores, "det", name, max_points=50) for name in ood_datasets_of(scores)}
    fig = P.roc_figure(by_label)
    assert len(fig.data) == 3
    for trace, (name, c) in zip(fig.data[:2], by_label.items()):
        np.testing.assert_allclose(np.asarray(trace.x), c["fpr"], rtol=1e-6)  # float32 on the wire
        np.testing.assert_allclose(np.asarray(trace.y), c["tpr"], rtol=1e-6)
        assert trace.name == f"{name} (AUROC {c['auroc']:.3f})"
    chance = fig.data[2]
    assert list(chance.x) == [0.0, 1.0] and list(chance.y) == [0.0, 1.0] and chance.line.dash == "dash"
    assert "ID flagged as OOD" in fig.layout.xaxis.title.text
    assert "OOD detected" in fig.layout.yaxis.title.text
    assert "OOD = positive" in fig.layout.title.text


def test_pr_figure_lines_and_legend(scores):
    by_label = {"all OOD": A.curves(scores, "det", None), "far-set": A.curves(scores, "det", "far-set")}
    fig = P.pr_figure(by_label)
    assert len(fig.data) == 2
    for trace, (name, c) in zip(fig.data, by_label.items()):
        np.testing.assert_allclose(np.asarray(trace.x), c["recall"], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(trace.y), c["precision"], rtol=1e-6)
        assert trace.name == f"{name} (AUPR-Out {c['aupr_out']:.3f})"
        assert trace.line.shape == "vh"
        # the area under the drawn steps is the AUPR-Out (average precision)
        assert np.sum(np.diff(c["recall"]) * c["precision"][1:]) == pytest.approx(c["aupr_out"], abs=1e-12)
    assert fig.layout.xaxis.title.text.startswith("recall")


def test_detector_curves_have_one_distinct_style_each(scores):
    """Curves without ``colors`` (one per detector, often 20 or more) each get a colour of their own up to 24,
    then the colours again dashed (they used to take the 14 OOD-set colours, which repeat after 14 curves)."""
    curve = A.curves(scores, "det", "near-set", max_points=20)
    detectors = [f"detector{i}" for i in range(20)]
    for figure in (P.roc_figure, P.pr_figure):
        lines = [trace.line for trace in figure(dict.fromkeys(detectors, curve)).data[:20]]
        assert len({(line.color, line.dash) for line in lines}) == 20
        assert len({line.color for line in lines}) == 20
    many = [trace.line for trace in P.roc_figure({f"d{i}": curve for i in range(30)}).data[:30]]
    assert len({(line.color, line.dash) for line in many}) == 30
    assert [line.dash for line in many[23:26]] == ["solid", "dash", "dash"]
    ranking = pd.DataFrame(
        [
            {"detector": d, "layer": layer, "auroc": 0.8, "fpr95": 0.5, "rank": r}
            for d in detectors
            for r, layer in ((1, "a"), (2, "b"))
        ]
    )
    layer_lines = [trace.line for trace in layer_ranking_figure(ranking, ["a", "b"], by_depth=True).data]
    assert len({(line.color, line.dash) for line in layer_lines}) == 20


def test_colours_are_consistent_across_figures(scores):
    names = ood_datasets_of(scores)
    colors = P.color_map(names)
    assert colors == {"far-set": P.OOD_COLORS[0], "near-set": P.OOD_COLORS[1]}
    hist = P.histogram_figure(A.score_histogram(scores, "det"), colors=colors)
    # ROC of near-set only: it keeps near-set's colour, not the first palette colour
    roc = P.roc_figure({"near-set": A.curves(scores, "det", "near-set")}, colors=colors)
    assert hist.data[2].marker.color == roc.data[0].line.color == P.OOD_COLORS[1]
    assert roc.data[0].line.dash is None  # OOD sets: their colour alone, drawn solid
    assert P.color_map(["ID (x)", "a"]) == {"ID (x)": P.ID_COLOR, "a": P.OOD_COLORS[0]}


def _luminance(hex_color: str) -> float:
    """WCAG relative luminance of ``#RRGGBB``."""
    channels = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def _contrast(a: str, b: str) -> float:
    high, low = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_the_id_sets_grey_follows_the_theme_and_stands_out_on_its_background(scores):
    """Streamlit draws a chart on white (light theme) or #0E1117 (dark): the ID set's bars must stand out on both
    (WCAG's 3:1 for graphics); the dark grey of the light theme did not on near-black (1.9:1)."""
    assert _contrast(P.id_color("light"), "#FFFFFF") >= 3 and _contrast(P.id_color(None), "#FFFFFF") >= 3
    assert _contrast(P.id_color("dark"), "#0E1117") >= 3 > _contrast(P.ID_COLOR, "#0E1117")
    colors = P.color_map([P.ID_KEY, *ood_datasets_of(scores)], id_colour=P.id_color("dark"))
    assert colors[P.ID_KEY] == P.ID_COLOR_DARK and colors["far-set"] == P.OOD_COLORS[0]  # OOD colours unchanged
    hist = P.histogram_figure(A.score_histogram(scores, "det"), colors=colors)
    assert hist.data[0].name.startswith("ID") and hist.data[0].marker.color == P.ID_COLOR_DARK


def test_per_class_bar(scores):
    table = per_class_at_threshold(scores, "det", 0.8, ["zero", "one", "two", "three"])
    fig = P.per_class_bar(table)
    (bar,) = fig.data
    assert list(bar.x) == list(table.class_name)
    np.testing.assert_allclose(np.asarray(bar.y), table.false_alarm_rate)
    custom = np.asarray(bar.customdata, dtype=np.float64)
    np.testing.assert_array_equal(custom[:, 0], table.false_alarms)
    np.testing.assert_array_equal(custom[:, 1], table.n)
    assert fig.layout.xaxis.type == "category" and list(fig.layout.xaxis.categoryarray) == list(table.class_name)
    assert fig.layout.yaxis.tickformat == ".0%" and "flagged as OOD" in fig.layout.yaxis.title.text


def test_memory_figure_lines():
    events = [
        {
            "time": 10.0 + i,
            "stage": "extract",
            "event": "progress",
            "cpu_rss": (500 + 10 * i) * 2**20,
            "gpu_allocated": 100 * i * 2**20,
            "gpu_reserved": 2**30,
            "gpu_peak": 200 * i * 2**20,
        }
        for i in range(5)
    ]
    fig = P.memory_figure(A.memory_timeline(events))
    assert [t.name for t in fig.data] == ["CPU RSS", "GPU allocated", "GPU peak"]
    np.testing.assert_allclose(np.asarray(fig.data[0].x), [0, 1, 2, 3, 4])
    np.testing.assert_allclose(np.asarray(fig.data[0].y), [500, 510, 520, 530, 540])
    np.testing.assert_allclose(np.asarray(fig.data[1].y), [0, 100, 200, 300, 400])
    np.testing.assert_allclose(np.asarray(fig.data[2].y), [0, 200, 400, 600, 800])
    assert fig.layout.yaxis.title.text == "MiB" and fig.layout.height == P.SMALL_HEIGHT
    cpu_events = [{k: v for k, v in e.items() if not k.startswith("gpu")} for e in events]
    cpu_only = P.memory_figure(A.memory_timeline(cpu_events))
    assert [t.name for t in cpu_only.data] == ["CPU RSS"]
    assert len(P.memory_figure(pd.DataFrame(columns=["time_s", "stage", "event", "cpu_rss_mib"])).data) == 0


def test_figures_stay_small(scores):
    big = pd.concat([synthetic_scores(seed=s) for s in range(20)], ignore_index=True)  # 9,000 rows
    hist = P.histogram_figure(A.score_histogram(big, "det"), threshold=0.0)
    roc = P.roc_figure({"far-set": A.curves(big, "det", "far-set")})
    assert len(hist.to_json()) < 30_000 and len(roc.to_json()) < 40_000
    assert len(roc.data[0].x) <= 400


def test_figures_set_up_unchecked_are_what_plotly_checks_and_builds(scores):
    """``figure_layout`` sets the shared layout without plotly's checks (for speed): each figure, rebuilt from its
    JSON by plotly's checking constructor, is accepted and comes out the same, template included."""
    import json

    import plotly.graph_objects as go

    table = pd.DataFrame({"near": [0.9, 0.7], "far": [0.99, 0.5]}, index=["energy", "msp"])
    events = [{"time": 10.0 + i, "stage": "extract", "cpu_rss": (500 + i) * 2**20} for i in range(5)]
    figures = [
        P.histogram_figure(A.score_histogram(scores, "det"), threshold=0.5, title="scores"),
        P.roc_figure({"near-set": A.curves(scores, "det", "near-set")}),
        P.pr_figure({"near-set": A.curves(scores, "det", "near-set")}),
        P.metrics_heatmap(table, "AUROC"),
        P.per_class_bar(per_class_at_threshold(scores, "det", 0.8, ["zero", "one", "two", "three"])),
        P.memory_figure(A.memory_timeline(events)),
        P.figure_layout(go.Figure(), None, xaxis_title="x"),
    ]
    for fig in figures:
        assert json.loads(go.Figure(fig.to_dict()).to_json()) == json.loads(fig.to_json())
        assert fig.layout.template.layout.to_plotly_json() == P.TEMPLATE.layout.to_plotly_json()
        assert fig.layout.hoverlabel.namelength == -1 and fig.layout.legend.font.size == 11


def test_compare_scatter_names_points_that_do_not_overlap_and_keeps_every_name_in_the_hover():
    means = pd.DataFrame(
        {"auroc_a": [0.98, 0.981, 0.90, 0.70, np.nan], "auroc_b": [0.97, 0.972, 0.91, 0.72, 0.8]},
        index=["mahalanobis", "vim", "knn", "msp", "odin"],
    )
    fig = P.compare_scatter(means, "t")
    points = fig.data[1]
    assert list(points.customdata) == list(means.index)  # the hover names every detector
    # vim lies 0.002 from mahalanobis: the higher (vim, x + y larger) is named, mahalanobis left to the hover;
    # a point without both values is not placed, so not named
    assert list(points.text) == ["", "vim", "knn", "msp", ""]
    spacing = P.LABEL_SPACING * (1.01 - 0.68)
    named = [(x, y) for x, y, t in zip(points.x, points.y, points.text) if t]
    assert all(np.hypot(a[0] - b[0], a[1] - b[1]) >= spacing for i, a in enumerate(named) for b in named[i + 1 :])
