"""A finished run: metrics table and heatmap, score histograms, ROC/PR curves, per-class failure cases.

The tabs are :data:`RESULT_TABS`, a list of ``(label, draw function)``: a new view is one more entry. Only the open
tab is computed (``st.tabs(on_change="rerun")``), and the whole results area is one fragment: a click in it reruns
it, not the page around it. The detector and the threshold are chosen once, in a header above the tabs that every tab
shares and that stays the same whichever tab is open (the tab bar never moves). Each run keeps its own tab, detector
and threshold, and they are in the URL
(:mod:`oodviz.ui.view_url`): a reload or a link shows the same view. Tables and figures are cached per run and
parameters.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from html import escape

import numpy as np
import pandas as pd
import streamlit as st

from oodviz.config.plan import config_shown
from oodviz.figures import plots
from oodviz.figures.thumbnails import prefetch_datasets, thumbnails
from oodviz.models import format_bytes
from oodviz.results import analysis
from oodviz.results.leaderboard import leaderboard_arch, run_benchmark
from oodviz.results.tables import (
    METRIC_HEADINGS,
    METRIC_NAMES,
    SELECTIVE_HEADINGS,
    Results,
    ResultsFileError,
    best_detector,
    classifier_errors_note,
    default_threshold,
    detectors_of,
    group_means,
    is_group_mean,
    load_results,
    metric_format,
    ood_datasets_of,
    per_class_at_threshold,
    sampling_table,
)
from oodviz.runs.rundir import RunDir
from oodviz.ui.access import show_server_details
from oodviz.ui.chart_selection import histogram_selection_gallery, image_grid, roc_chart
from oodviz.ui.explore import feature_space_tab, probe_tab, report_download, risk_coverage_tab, teaching_panel
from oodviz.ui.figure_export import chart
from oodviz.ui.layers import layers_tab
from oodviz.ui.tuning import tuning_panel, validation_warning
from oodviz.ui.view_url import EVERY_SET, POOLED, VIEW_PARAMS, View, read_view, view_params

CONVENTION = (
    "OOD is the positive class and a higher score means more OOD. AUROC, AUPR-In (ID positive) and AUPR-Out "
    "(OOD positive): higher is better. FPR95 = the fraction of ID samples flagged as OOD at the threshold that "
    "catches 95% of that OOD set: lower is better. AURC and risk at 95% coverage (the classifier's error rate "
    "when the score rejects ID test samples, see Risk–coverage): lower is better."
)
PER_CLASS_HEADINGS = {
    "class_name": "class name",
    "accuracy": "classifier accuracy",
    "false_alarms": "false alarms",
    "false_alarm_rate": "false-alarm rate",
    "mean_score": "mean score",
}
#: metrics where a lower value is better (highlighted with the minimum); the others: higher is better
LOWER_IS_BETTER = ("FPR95", "AURC", "risk at 95% coverage")
GALLERY_SIZE = 12
BEST = "background-color: #c8e6c9; color: #1b5e20"  # dark text: legible in the dark theme too
#: AURC and risk columns that rest on too few classifier errors to rank detectors (MIN_CLASSIFIER_ERRORS)
UNRANKED = "color: #9e9e9e"
KEPT = "results-kept"
#: The open tab's widget key (Streamlit's own state while the results are shown; each run's tab is kept in KEPT)
TAB_KEY = "results-tab"
#: The view parameters this session last wrote to the URL, and for which run: a URL that differs was opened as a
#: link (or reloaded), and its view is applied
URL_WRITTEN = "results-url"


@dataclass
class Page:
    """What every tab of one run's results reads: the results, its detectors (best first in the
    picker), its OOD sets in the config's order and their colours (found once per page, not at every click in
    the results fragment), and the shared choices (``detector``, ``threshold`` and the
    ``basis`` it was chosen on) once the controls above the tabs are drawn."""

    run: RunDir
    finished: float | None
    results: Results
    detectors: list[str]
    best: str | None
    sets: list[str]
    colors: dict
    detector: str | None = None
    threshold: float | None = None
    basis: str | None = None
    basis_threshold: float | None = None


@st.cache_data(show_spinner=False, max_entries=8)
def _results(path: str, finished: float | None) -> Results:
    return load_results(path)  # cached per run and finish time


@st.cache_data(show_spinner=False, max_entries=64)
def _threshold(path: str, finished: float | None, detector: str, basis: str) -> float:
    """The threshold ``basis`` names: the highest that catches 95% of one OOD set (its name), of every OOD set
    (:data:`EVERY_SET`: the lowest of the sets' own, each cached, so that each set has at least 95% recall), or
    of the OOD sets pooled (:data:`POOLED`: dominated by the largest sets)."""
    scores = _results(path, finished).scores
    if basis == EVERY_SET:
        return min(_threshold(path, finished, detector, name) for name in ood_datasets_of(scores))
    return default_threshold(scores, detector, None if basis == POOLED else basis)


@st.cache_data(show_spinner=False, max_entries=64)
def _histogram(path: str, finished: float | None, detector: str) -> dict:
    return analysis.score_histogram(_results(path, finished).scores, detector)


@st.cache_data(show_spinner=False, max_entries=64)
def _curves(path: str, finished: float | None, detector: str, dataset: str, points: int) -> dict:
    return analysis.curves(_results(path, finished).scores, detector, dataset, max_points=points)


def curve_points(lines: int) -> int:
    """Points per curve for a chart of ``lines`` curves: 200 (finer than the eye sees at this size), fewer
    when there are many, so a chart stays under 50 KiB (about 1,600 points in all, at least 50 a line)."""
    return min(200, max(50, 1600 // max(lines, 1)))


@st.cache_resource(show_spinner=False, max_entries=32)
def _failures(path: str, finished: float | None, detector: str, id_class, ood_dataset) -> tuple:
    """Every ID sample by score (highest first) and every OOD sample by score (lowest first). Kept as
    :func:`st.cache_resource` (the tables themselves, never changed by the page): a slider step copies no table."""
    results = _results(path, finished)
    scores = results.scores
    return analysis.failure_cases(
        scores, detector, k=len(scores), id_class=id_class, ood_dataset=ood_dataset, class_names=results.class_names
    )


def kept(page: Page, key: str, default):
    """The last value of a shared control of ``page``'s run (kept while a tab without it is open, and while another
    run is shown), else ``default``. Each run keeps its own: a threshold chosen on one run never applies to another."""
    return st.session_state.get(KEPT, {}).get(page.run.run_id, {}).get(key, default)


def keep(page: Page, key: str, value) -> None:
    st.session_state.setdefault(KEPT, {}).setdefault(page.run.run_id, {})[key] = value


def control_key(page: Page, name: str) -> str:
    """The widget key of the shared control ``name`` on ``page``'s run: another run's page draws other widgets (a
    widget keeps its value under its key, so one key for every run would carry one run's choice into the next)."""
    return f"{name}:{page.run.run_id}"


def shared_controls(page: Page) -> None:
    """The header every tab shares, above the tabs: the detector (what it does, in a popover beside it), where the
    threshold starts and the threshold, and the HTML report in a popover; sets them on ``page``."""
    c1, c2, about_column, report_column = st.columns([3, 3, 1.3, 1.3], vertical_alignment="bottom")
    report = report_column.popover(
        "HTML report",
        width="stretch",
        help="One self-contained file with this run's results, to share.",
        key="report-open",
        on_change="rerun",
    )
    if report.open:  # drawn only once opened (kaleido's check for the figure files is made then)
        with report:
            report_download(page.results)
    chosen = kept(page, "detector", page.best)
    page.detector = c1.selectbox(
        "Detector",
        page.detectors,
        index=page.detectors.index(chosen) if chosen in page.detectors else 0,
        key=control_key(page, "shared-detector"),
        format_func=lambda d: f"{d} (best mean AUROC)" if d == page.best else d,
    )
    keep(page, "detector", page.detector)
    # beside the detector (a row of its own moved the tabs down); drawn only once opened (the detector classes, torch
    # modules, are imported then)
    about = about_column.popover(
        "What it does",
        width="stretch",
        help=f"What {page.detector} computes: its formula, paper, inputs and when it fails.",
        key=f"teaching-{page.detector}",
        on_change="rerun",
    )
    if about.open:
        with about:
            teaching_panel(page.detector)
    bases = [EVERY_SET, *page.sets, POOLED]
    basis = kept(page, "basis", EVERY_SET)
    page.basis = c2.selectbox(
        "Start the threshold at",
        bases,
        index=bases.index(basis) if basis in bases else 0,
        key=control_key(page, "shared-basis"),
        format_func=lambda b: b if b in (EVERY_SET, POOLED) else f"95% of {b}",
        help="The highest threshold that catches 95% of that OOD set. 'Every OOD set' takes the lowest of those, "
        "so that no set is caught less than 95%; 'pooled' counts all OOD samples together, so the largest sets "
        "dominate and a small hard set may be caught far less.",
    )
    keep(page, "basis", page.basis)
    page.basis_threshold = _threshold(str(page.run.path), page.finished, page.detector, page.basis)
    low, high = threshold_range(page, page.detector, page.basis)
    name = threshold_name(page.detector, page.basis)
    page.threshold = st.slider(
        "Threshold (flag as OOD when score ≥ threshold)",
        low,
        high,
        float(kept(page, name, page.basis_threshold)),
        step=(high - low) / 200 or 1.0,
        key=control_key(page, name),
        format="%.4g",
    )
    keep(page, name, page.threshold)
    if page.threshold != page.basis_threshold:  # from the slider or a link: the notes below are about the start
        start = page.basis if page.basis in (EVERY_SET, POOLED) else f"95% of {page.basis}"
        st.caption(
            f"The threshold is **{page.threshold:.4g}**, moved from {page.basis_threshold:.4g} where "
            f"'{start}' starts it."
        )
    if page.basis == EVERY_SET:
        st.caption(every_set_note(page))


def threshold_name(detector: str, basis: str) -> str:
    """The name the threshold chosen for ``detector`` from ``basis`` is kept under (and its slider's key)."""
    return f"threshold-{detector}-{basis}"


def threshold_range(page: Page, detector: str, basis: str) -> tuple[float, float]:
    """The threshold slider's range for ``detector``: its scores' histogram, widened to the threshold ``basis``
    names where that lies outside."""
    at = _threshold(str(page.run.path), page.finished, detector, basis)
    edges = _histogram(str(page.run.path), page.finished, detector)["edges"]
    return min(float(edges[0]), at), max(float(edges[-1]), at)


def every_set_note(page: Page) -> str:
    """Which OOD set decides the :data:`EVERY_SET` threshold (the set that needs the lowest one) and the share of
    the ID test images flagged as OOD there: one hard set can make that share large."""
    return _every_set_note(str(page.run.path), page.finished, page.detector)


@st.cache_data(show_spinner=False, max_entries=64)
def _every_set_note(path: str, finished: float | None, detector: str) -> str:
    scores = _results(path, finished).scores
    per_set = {name: _threshold(path, finished, detector, name) for name in ood_datasets_of(scores)}
    hardest = min(per_set, key=per_set.get)
    counts = analysis.counts_at_threshold(scores, detector, per_set[hardest])
    return (
        f"'{EVERY_SET}' is decided by **{hardest}**, the set that needs the lowest threshold "
        f"({per_set[hardest]:.4g}); there {counts['id']['false_alarm_rate']:.1%} of the ID test images are flagged "
        "as OOD. Start at 95% of another set to see its own trade-off."
    )


def threshold_label(page: Page) -> str:
    basis = page.basis if page.basis in (EVERY_SET, POOLED) else f"95% of {page.basis}"
    return basis if page.threshold == page.basis_threshold else "threshold"


# -- metrics --------------------------------------------------------------------------------------
def as_shown(values: pd.Series) -> pd.Series:
    """A metrics column's values as the table prints them (:func:`~oodviz.results.tables.metric_format`)."""
    shown = metric_format(values.name)
    return values.map(lambda value: float(shown.format(value)))


def best_marks(values: pd.Series, lower_is_better: bool) -> pd.Series:
    """:data:`BEST` on the one value that, as the table prints it (:func:`as_shown`), is strictly better than every
    other value shown, else ``""``: a tie at the top (1.000 and 1.000, whatever their hidden fourth decimals) or a
    column of equal values has no best to point at, and marks nothing."""
    shown = as_shown(values)
    at_best = shown.eq(shown.min() if lower_is_better else shown.max())
    if at_best.sum() != 1:
        return pd.Series("", index=values.index)
    return at_best.map({True: BEST, False: ""})


def metric_marks(values: pd.Series, ranked: bool) -> pd.Series:
    """The styles of one metrics column (named by its metric, e.g. ``"AURC"`` or ``"AUROC near"``): its strict best
    (:func:`best_marks`), or, for an AURC or risk column when the classifier made too few errors to rank by
    (``ranked`` False, :func:`oodviz.results.tables.classifier_errors_note`), every cell :data:`UNRANKED`."""
    if values.name.startswith(SELECTIVE_HEADINGS) and not ranked:
        return pd.Series(UNRANKED, index=values.index)
    return best_marks(values, values.name.startswith(LOWER_IS_BETTER))


def best_per_dataset(shown: pd.DataFrame, ranked: bool) -> pd.DataFrame:
    """Styles marking the best AUROC/AUPR (highest) and FPR95/AURC/risk (lowest) among the detectors of each OOD
    dataset (:func:`metric_marks`): values are compared only with values of the same set."""
    styles = pd.DataFrame("", index=shown.index, columns=shown.columns)
    for _, rows in shown.groupby("OOD dataset", sort=False):
        for column in ("AUROC", "AUPR-In", "AUPR-Out", *LOWER_IS_BETTER):
            styles.loc[rows.index, column] = metric_marks(rows[column], ranked)
    return styles


def metrics_tab(page: Page) -> None:
    metrics = page.results.metrics
    per_set = metrics[~is_group_mean(metrics)]
    errors_note, ranked = classifier_errors_note(page.results.scores)
    st.caption(CONVENTION)
    groups = per_set.drop_duplicates("ood_dataset").groupby("group", sort=False)["ood_dataset"].apply(list)
    st.caption(" · ".join(f"**{group}** = mean over {', '.join(names)}" for group, names in groups.items()))
    view = st.segmented_control(
        "Rows", ["near/far means", "every OOD dataset"], default="near/far means", key="metrics-rows"
    )
    if view == "every OOD dataset":
        shown = per_set.rename(columns={"ood_dataset": "OOD dataset", **METRIC_HEADINGS}).reset_index(drop=True)
        shown = shown[["detector", "OOD dataset", "group", *METRIC_HEADINGS.values()]]
        styled = shown.style.apply(best_per_dataset, axis=None, ranked=ranked)
        note = "A strict best detector per OOD dataset highlighted in green (values compared within one set only)."
    else:  # one row per detector: each metric for the near and the far group side by side
        wide = group_means(metrics, values=METRIC_NAMES)
        wide.columns = [f"{METRIC_HEADINGS[metric]} {group}" for metric, group in wide.columns]
        selective = metrics.drop_duplicates("detector").set_index("detector")[["aurc", "risk_at_95_coverage"]]
        shown = wide.join(selective.rename(columns=METRIC_HEADINGS)).reset_index()
        shown = shown.assign(**{"ID accuracy": metrics.id_accuracy.iloc[0]})
        marked = [c for c in shown.columns if c.startswith(("AUROC", "AUPR", *LOWER_IS_BETTER))]
        styled = shown.style.apply(metric_marks, subset=marked, ranked=ranked)
        note = (
            "A strict best detector per column highlighted in green (each column is one metric on one group of sets)."
        )
    numbers = [c for c in shown.columns if c.startswith(tuple(METRIC_HEADINGS.values()))]
    styled = styled.format({c: metric_format(c) for c in numbers}, na_rep="n/a")
    st.dataframe(styled, hide_index=True, width="stretch", height=min(38 + 35 * len(shown), 700))
    greyed = "" if ranked else " Their columns are greyed and never highlighted."
    st.caption(f"{note} No mark where the best value is tied. {errors_note}{greyed}")
    st.download_button("Download metrics.csv", metrics.to_csv(index=False), "metrics.csv", "text/csv")
    if run_benchmark(page.results.config) is not None:
        leaderboard_section(page)
    metric = st.segmented_control("Heatmap", ["AUROC", "FPR95"], default="AUROC", key="heatmap-metric") or "AUROC"
    column = {"AUROC": "auroc", "FPR95": "fpr95"}[metric]
    grid = per_set.pivot(index="detector", columns="ood_dataset", values=column)
    grid = grid.loc[list(dict.fromkeys(per_set.detector)), list(dict.fromkeys(per_set.ood_dataset))]
    chart(
        plots.metrics_heatmap(grid, metric, higher_is_better=metric == "AUROC"),
        width="stretch",
        key=f"heatmap-{metric}",
    )


#: the leaderboard table's parts of each figure (:data:`~oodviz.pipeline.openood.SUMMARY_PARTS`), as headed
LEADERBOARD_PARTS = {"ours": "ours", "published": "published", "diff": "diff"}
#: the leaderboard table's look: the app's font and colours (light or dark theme), a rule under each row, the
#: figures right-aligned in tabular digits, each figure's three columns set apart by a rule on their left
LEADERBOARD_STYLE = """<style>
.oodviz-board { border-collapse: collapse; width: 100%; font-size: 0.9rem; font-variant-numeric: tabular-nums; }
.oodviz-board th, .oodviz-board td {
  padding: 0.3rem 0.6rem; border-bottom: 1px solid rgba(128, 128, 128, 0.3); text-align: right; white-space: nowrap; }
.oodviz-board th { font-weight: 600; }
.oodviz-board .name { text-align: left; }
.oodviz-board .first { border-left: 1px solid rgba(128, 128, 128, 0.3); }
.oodviz-board th[colspan] { text-align: center; }
</style>"""


def leaderboard_html(cells: pd.DataFrame, headings: dict[str, str]) -> str:
    """The cells of :func:`~oodviz.pipeline.openood.summary_cells` as an HTML table: the detector and OpenOOD's
    method, then per figure (``headings``: name -> heading) a heading over its three columns, ours, published and
    the difference; every cell escaped."""
    top = '<th class="name" rowspan="2">detector</th><th class="name" rowspan="2">OpenOOD method</th>'
    top += "".join(f'<th class="first" colspan="{len(LEADERBOARD_PARTS)}">{escape(h)}</th>' for h in headings.values())
    parts = "".join(
        f"<th{' class=first' if i == 0 else ''}>{escape(label)}</th>"
        for i, label in enumerate(LEADERBOARD_PARTS.values())
    )
    rows = []
    for entry in cells.to_dict("records"):
        row = f'<td class="name">{escape(entry["detector"])}</td><td class="name">{escape(entry["method"])}</td>'
        for name in headings:
            row += "".join(
                f"<td{' class=first' if i == 0 else ''}>{escape(entry[f'{name}_{part}'])}</td>"
                for i, part in enumerate(LEADERBOARD_PARTS)
            )
        rows.append(f"<tr>{row}</tr>")
    head = f"<thead><tr>{top}</tr><tr>{parts * len(headings)}</tr></thead>"
    return f'<table class="oodviz-board">{head}<tbody>{"".join(rows)}</tbody></table>'


@st.cache_data(show_spinner=False, max_entries=8)
def _bench_table(path: str, finished: float | None, benchmark: str, arch: str | None) -> pd.DataFrame:
    from oodviz.pipeline.openood import bench_table  # its data module imports torch: only for a benchmark's run

    return bench_table([path], benchmark, arch)  # as ``oodviz bench`` prints it, cached per run and finish time


def leaderboard_section(page: Page) -> None:
    """A run of an OpenOOD v1.5 benchmark (:func:`~oodviz.pipeline.openood.run_benchmark`) beside the published
    leaderboard: per detector that ran, its near/far AUROC and ID accuracy, the published figure and the difference,
    the cells ``oodviz bench`` prints (:func:`~oodviz.pipeline.openood.summary_cells`), and what to know when reading
    them (:func:`~oodviz.pipeline.openood.comparison_notes`)."""
    from oodviz.pipeline.openood import SUMMARY_METRICS, comparison_notes, summary_cells

    config = page.results.config
    benchmark = run_benchmark(config)
    st.subheader("Beside the OpenOOD v1.5 leaderboard", anchor="leaderboard")
    try:
        arch = leaderboard_arch(benchmark, config.get("backbone"))
        table = _bench_table(str(page.run.path), page.finished, benchmark, arch)
        notes = comparison_notes(config, table)
    except ValueError as error:  # an unknown benchmark in a hand-made config, a run without metrics
        st.info(f"This run cannot be set beside the leaderboard: {error}")
        return
    st.html(LEADERBOARD_STYLE + leaderboard_html(summary_cells(table), SUMMARY_METRICS))
    st.caption("\n".join(f"- {note}" for note in notes))
    st.download_button(
        "Download the comparison (CSV)",
        table.to_csv(index=False),
        f"openood-{benchmark}.csv",
        "text/csv",
        help="Every figure (FPR@95 too) and every leaderboard method of this model, as oodviz bench --csv writes it.",
    )


# -- histogram ------------------------------------------------------------------------------------
def histogram_tab(page: Page) -> None:
    scores = page.results.scores
    hist = _histogram(str(page.run.path), page.finished, page.detector)
    mode = (
        st.segmented_control("Heights", list(plots.HISTOGRAM_MODES), default="density", key="histogram-mode")
        or "density"
    )
    event = chart(
        plots.histogram_figure(
            hist,
            threshold=page.threshold,
            title=f"{page.detector} scores",
            threshold_label=threshold_label(page),
            colors=page.colors,
            mode=mode,
        ),
        width="stretch",
        on_select="rerun",
        selection_mode=("box", "lasso"),
        key=f"histogram-{page.detector}-{mode}",
    )
    hidden = plots.hidden_at_first(list(hist["counts"]))
    if hidden:
        st.caption(
            f"Not drawn at first: {', '.join(hidden)}; click a name in the legend to draw or hide a set. A box or "
            "lasso shows the images of the sets drawn under it."
        )
    histogram_selection_gallery(page.results, page.detector, event, hist)
    counts = analysis.counts_at_threshold(scores, page.detector, page.threshold)
    c1, c2 = st.columns(2)
    ids, total = counts["id"], counts["total"]
    c1.metric(
        f"False alarms: ID flagged as OOD, of {ids['n']:,}", f"{ids['false_alarms']:,} ({ids['false_alarm_rate']:.1%})"
    )
    worst = max(counts["ood"].items(), key=lambda item: item[1]["miss_rate"])
    c2.metric(
        f"Misses: OOD accepted as ID, of {total['n_ood']:,}",
        f"{total['missed']:,} ({total['miss_rate']:.1%})",
        help=f"Worst OOD set: {worst[0]}, {worst[1]['miss_rate']:.1%} missed.",
    )
    table = analysis.counts_table(counts).rename(columns={"wrong": "count", "wrong_rate": "rate"})
    st.dataframe(table.style.format({"n": "{:,}", "count": "{:,}", "rate": "{:.1%}"}), hide_index=True, width="stretch")


# -- curves ---------------------------------------------------------------------------------------
def curves_tab(page: Page) -> None:
    scores = page.results.scores
    path = str(page.run.path)
    mode = st.radio(
        "Overlay", ["OOD sets for this detector", "detectors for one OOD set"], horizontal=True, key="curves-mode"
    )
    colors = page.colors
    if mode == "OOD sets for this detector":
        sets = page.sets
        curves = {name: _curves(path, page.finished, page.detector, name, curve_points(len(sets))) for name in sets}
        title = f"{page.detector}: one curve per OOD set"
    else:
        dataset = st.selectbox("OOD set", page.sets, key="curves-dataset")
        names = detectors_of(scores)
        curves = {name: _curves(path, page.finished, name, dataset, curve_points(len(names))) for name in names}
        colors, title = None, f"{dataset}: one curve per detector"
    one_set = None if mode == "OOD sets for this detector" else dataset
    roc_chart(page.results, page.detector, curves, title, colors, one_set, key=f"roc-{page.detector}-{one_set}")
    chart(
        plots.pr_figure(curves, title=f"PR (OOD positive) — {title}", colors=colors),
        key=f"pr-{page.detector}-{one_set}",
        width="stretch",
    )


# -- failure cases --------------------------------------------------------------------------------
def gallery_rows(ranked: pd.DataFrame, wrong: int, nearest: bool, k: int = GALLERY_SIZE) -> pd.DataFrame:
    """Of the ``wrong`` first rows of ``ranked`` (worst first: the rows wrong at the threshold come first), the
    ``k`` nearest the threshold (closest first) or the ``k`` most extreme."""
    wrong_rows = ranked.iloc[:wrong]
    return wrong_rows.iloc[::-1].head(k) if nearest else wrong_rows.head(k)


def failures_tab(page: Page) -> None:
    results, threshold = page.results, page.threshold
    per_class = per_class_at_threshold(results.scores, page.detector, threshold, results.class_names)
    st.caption(
        f"At threshold {threshold:.4g}: how often each ID class is wrongly flagged as OOD. Select a row to "
        "filter the first gallery to that class."
    )
    first = ["class", "class_name", "false_alarm_rate", "false_alarms", "n"]  # what the page is about first
    table = per_class[first + [c for c in per_class.columns if c not in first]].rename(columns=PER_CLASS_HEADINGS)
    if (table["class name"] == table["class"].astype(str)).all():
        table = table.drop(columns="class name")  # digits: the name is the number
    # full width, every column whole at 1000 px (half a row cut "false a..."); the bar chart under it
    selection = st.dataframe(
        table.style.format(
            {
                "n": "{:,}",
                "false alarms": "{:,}",
                "classifier accuracy": "{:.1%}",
                "false-alarm rate": "{:.1%}",
                "mean score": "{:.4g}",
            }
        ),
        hide_index=True,
        width="stretch",
        height=min(38 + 35 * len(table), 390),
        on_select="rerun",
        selection_mode="single-row",
        key=f"classes-{page.detector}",
    )
    st.plotly_chart(plots.per_class_bar(per_class, color=page.colors[plots.ID_KEY]), width="stretch")
    rows = selection.selection.rows if selection else []
    id_class = int(per_class.iloc[rows[0]]["class"]) if rows else None
    g1, g2 = st.columns(2)
    ood_filter = g1.selectbox("OOD set for the second gallery", ["all OOD sets", *page.sets])
    order = g2.radio("Show", ["nearest the threshold", "most extreme"], horizontal=True, key="gallery-order")
    nearest = order == "nearest the threshold"
    ranked_id, ranked_ood = _failures(
        str(page.run.path),
        page.finished,
        page.detector,
        id_class,
        None if ood_filter == "all OOD sets" else ood_filter,
    )
    # ranked by score, the rows wrong at the threshold are a prefix: ID scores >= it, OOD scores below it
    n_flagged = int(np.count_nonzero(ranked_id.score.to_numpy() >= threshold))
    n_accepted = int(np.count_nonzero(ranked_ood.score.to_numpy() < threshold))
    flagged = gallery_rows(ranked_id, n_flagged, nearest)
    accepted = gallery_rows(ranked_ood, n_accepted, nearest)
    which = f"class {ranked_id.class_name.iloc[0]}" if id_class is not None and len(ranked_id) else "all classes"
    st.markdown(
        f"**ID images flagged as OOD** at this threshold ({which}): {n_flagged:,} of {len(ranked_id):,}; "
        f"the {min(GALLERY_SIZE, n_flagged)} {order} (true class → prediction · score)"
    )
    image_grid(
        thumbnails(results, flagged),
        [f"{r.class_name} → {r.predicted_name} · {r.score:.3g}" for r in flagged.itertuples()],
        "None at this threshold.",
    )
    st.markdown(
        f"**OOD images accepted as ID** at this threshold: {n_accepted:,} of {len(ranked_ood):,}; "
        f"the {min(GALLERY_SIZE, n_accepted)} {order} (OOD set → the class the model gave · score)"
    )
    image_grid(
        thumbnails(results, accepted),
        [f"{r.dataset} → {r.predicted_name} · {r.score:.3g}" for r in accepted.itertuples()],
        "None at this threshold.",
    )


# -- run details ----------------------------------------------------------------------------------
def run_details(page: Page) -> None:
    results = page.results
    meta = results.meta or {}
    facts = {"device": "device", "device_name": "device name", "torch": "torch", "oodviz": "oodviz"}
    st.markdown("**Where it ran**")
    st.dataframe(
        pd.DataFrame([{"what": label, "value": str(meta[key])} for key, label in facts.items() if meta.get(key)]),
        hide_index=True,
    )
    sampled = sampling_table(meta)
    if len(sampled):
        st.markdown("**Data**: how many images of each split the run used, and how they were sampled")
        st.dataframe(sampled, hide_index=True, width="stretch")
    if meta.get("stages"):
        stages = pd.DataFrame(meta["stages"]).T
        shown = pd.DataFrame({"stage": stages.index})
        if "wall_s" in stages:
            shown["seconds"] = stages["wall_s"].astype(float).round(2).to_numpy()
        if "peak_cpu_rss" in stages:
            shown["peak CPU RSS"] = [format_bytes(v) for v in stages["peak_cpu_rss"]]
        if "error" in stages:
            shown["error"] = stages["error"].fillna("").to_numpy()
        st.markdown(f"**Stages** ({len(shown)})")
        # every stage in view (a 30-stage run's table scrolled inside a 10-row box)
        st.dataframe(shown, hide_index=True, width="stretch", height=min(38 + 35 * len(shown), 1200))
    tuning_panel(results)
    st.markdown("**Config** (the run's `config.json`" + ("" if show_server_details() else ", server paths cut") + ")")
    st.json(config_shown(results.config, paths=show_server_details()), expanded=False)


def detector_failures(results) -> None:
    """Each detector that failed, with its error, above the tabs: the other detectors' results are shown."""
    errors = {k: v for k, v in (results.detectors or {}).items() if isinstance(v, dict) and "error" in v}
    for name, info in errors.items():
        st.error(f"{name} failed: {info['error']}")
        if show_server_details():
            with st.expander(f"{name}: details"):
                st.code(info.get("traceback", ""))


#: The result tabs: label and draw function (takes the :class:`Page`, its detector and threshold set by the header).
RESULT_TABS: list[tuple[str, Callable[[Page], None]]] = [
    ("Metrics", metrics_tab),
    ("Score histograms", histogram_tab),
    ("ROC / PR", curves_tab),
    ("Failure cases", failures_tab),
    ("Risk–coverage", risk_coverage_tab),
    ("Probe images", probe_tab),
    ("Feature space", feature_space_tab),
    ("Which layer?", layers_tab),
    ("Run details", run_details),
]


def run_tabs(config: dict) -> list[tuple[str, Callable[[Page], None]]]:
    """The tabs of :data:`RESULT_TABS` that a run with this ``config`` (``config.json``) has something for:
    "Which layer?" only for a run over several layers (eight tabs fit one line of a 1000 px window)."""
    several_layers = bool((config or {}).get("layers"))
    return [tab for tab in RESULT_TABS if tab[1] is not layers_tab or several_layers]


def results_page(run: RunDir) -> None:
    status = run.read_status()
    finished = status.get("finished")
    results = _results(str(run.path), finished)
    try:
        results.check_results("scores.parquet", "metrics.csv")
    except ResultsFileError as error:  # the file's name only: the page shows no server path to others
        st.error(
            f"This run's results cannot be shown: {error.path.name} {error.problem}. Run its config again for new "
            "results (New run from this one holds its choices: press Start run there)."
        )
        return
    # not written yet, or every detector failed (then metrics.csv holds only its header)
    if results.metrics is None or results.scores is None or not len(results.metrics):
        st.warning("This run has no results yet.")
        return
    best = best_detector(results.metrics)["best_detector"]
    sets = ood_datasets_of(results.scores)
    # the ID set's grey follows the browser's theme: legible on white and on near-black
    colors = plots.color_map([plots.ID_KEY, *sets], id_colour=plots.id_color(st.context.theme.type))
    page = Page(run, finished, results, detectors_of(results.scores), best, sets, colors)
    detector_failures(results)
    validation_warning(results)
    results_area(page)
    if f"prefetched-{run.run_id}" not in st.session_state:
        st.session_state[f"prefetched-{run.run_id}"] = prefetch(results)


def prefetch(results: Results) -> bool:
    """What only some tabs need, loaded in background threads while the user reads the first one: the galleries'
    datasets (seconds for Fashion-MNIST's) and scikit-learn (the ROC / PR curves; a third of the app's import
    time, kept out of the first load). True when a thread was started."""
    started = prefetch_datasets(results) is not None
    if "sklearn.metrics" not in sys.modules:
        threading.Thread(target=importlib.import_module, args=("sklearn.metrics",), daemon=True).start()
        started = True
    return started


# -- the view in the URL --------------------------------------------------------------------------
def default_view(page: Page, labels: list[str]) -> View:
    """The view a run opens on: its first tab, its best detector, the threshold at 95% of every OOD set."""
    return View(labels[0], page.best or page.detectors[0])


def kept_view(page: Page, labels: list[str]) -> View:
    """The view of ``page``'s run as this session keeps it (:func:`kept`; the threshold ``None`` at its basis')."""
    default = default_view(page, labels)
    detector, basis = kept(page, "detector", default.detector), kept(page, "basis", default.basis)
    threshold = kept(page, threshold_name(detector, basis), None)
    if threshold is not None and threshold == _threshold(str(page.run.path), page.finished, detector, basis):
        threshold = None
    return View(kept(page, "tab", default.tab), detector, basis, threshold)


def apply_view(page: Page, view: View) -> None:
    """Make ``view`` the run's kept view, and set the tabs and the shared controls to it (their widget states, so
    that a browser showing other values is told; the thresholds kept for other detectors and bases dropped)."""
    name = threshold_name(view.detector, view.basis)
    chosen = {"tab": view.tab, "detector": view.detector, "basis": view.basis}
    if view.threshold is not None:
        chosen[name] = view.threshold
    st.session_state.setdefault(KEPT, {})[page.run.run_id] = chosen
    for key in list(st.session_state):
        if key.startswith("threshold-") and key.endswith(f":{page.run.run_id}"):
            del st.session_state[key]
    st.session_state[TAB_KEY] = view.tab
    st.session_state[control_key(page, "shared-detector")] = view.detector
    st.session_state[control_key(page, "shared-basis")] = view.basis
    at = _threshold(str(page.run.path), page.finished, view.detector, view.basis)
    st.session_state[control_key(page, name)] = at if view.threshold is None else view.threshold


def view_from_url(page: Page, labels: list[str]) -> list[str]:
    """Apply the view the URL names, when it is not the one this session last wrote there (a link opened, a page
    reloaded); returns the notes on values dropped (:func:`~oodviz.ui.view_url.read_view`). Also gives the tabs
    the run's kept tab when they have none, or when this session showed another run last."""
    written = st.session_state.get(URL_WRITTEN)
    same_run = written is not None and written["run"] == page.run.run_id
    if TAB_KEY not in st.session_state or (written is not None and not same_run):
        st.session_state[TAB_KEY] = kept(page, "tab", labels[0])
    params = {name: st.query_params[name] for name in VIEW_PARAMS if name in st.query_params}
    if not params or (same_run and params == written["params"]):
        return []
    view, notes = read_view(
        params,
        labels,
        page.detectors,
        page.sets,
        default_view(page, labels),
        lambda detector, basis: threshold_range(page, detector, basis),
    )
    apply_view(page, view)
    return notes


def view_to_url(page: Page, labels: list[str]) -> None:
    """Write the run's view to the URL's view parameters (only those off the run's defaults; ``run``, ``token`` and
    any other parameter left as they are), so that a reload or the link shows it again."""
    params = view_params(kept_view(page, labels), default_view(page, labels))
    for name in VIEW_PARAMS:
        if name not in params:
            if name in st.query_params:
                del st.query_params[name]
        elif st.query_params.get(name) != params[name]:
            st.query_params[name] = params[name]
    st.session_state[URL_WRITTEN] = {"run": page.run.run_id, "params": params}


@st.fragment
def results_area(page: Page) -> None:
    """The shared controls and the tabs; only the open tab is drawn. The view comes from the
    URL where a link names one, and goes back to it."""
    shown = run_tabs(page.results.config)
    labels = [label for label, _ in shown]
    notes = view_from_url(page, labels)
    if notes:
        st.info("Not applied from the link (the run's default is shown instead): " + "; ".join(notes) + ".")
    shared_controls(page)
    tabs = st.tabs(labels, key=TAB_KEY, on_change="rerun")
    for tab, (label, draw) in zip(tabs, shown):
        if not tab.open:
            continue
        keep(page, "tab", label)
        with tab:
            draw(page)
    view_to_url(page, labels)
