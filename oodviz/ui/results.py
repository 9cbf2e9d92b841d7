"""A finished run: metrics table, score histograms, ROC/PR curves and per-class failure cases."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from oodviz import analysis, plots
from oodviz.results import (
    METRIC_NAMES,
    Results,
    best_detector,
    default_threshold,
    detectors_of,
    group_means,
    is_group_mean,
    load_results,
    ood_datasets_of,
    per_class_at_threshold,
)
from oodviz.runs.rundir import RunDir
from oodviz.thumbnails import thumbnails
from oodviz.ui.access import show_server_details

CONVENTION = (
    "OOD is the positive class and a higher score means more OOD. AUROC, AUPR-In (ID positive) and AUPR-Out "
    "(OOD positive): higher is better. FPR95 = the fraction of ID samples flagged as OOD at the threshold that "
    "catches 95% of the OOD samples: lower is better."
)
PER_CLASS_HEADINGS = {
    "class_name": "class name",
    "accuracy": "classifier accuracy",
    "false_alarms": "false alarms",
    "false_alarm_rate": "false-alarm rate",
    "mean_score": "mean score",
}
METRIC_COLUMNS = {
    "auroc": "AUROC",
    "aupr_in": "AUPR-In",
    "aupr_out": "AUPR-Out",
    "fpr95": "FPR95",
    "id_accuracy": "ID accuracy",
}


@st.cache_data(show_spinner=False, max_entries=8)
def _results(path: str, finished: float | None) -> Results:
    return load_results(path)  # cached per run and finish time


def metrics_tab(results: Results) -> None:
    metrics = results.metrics
    st.caption(CONVENTION)
    view = st.segmented_control(
        "Rows", ["near/far means", "every OOD dataset"], default="near/far means", key="metrics-rows"
    )
    if view == "every OOD dataset":
        shown = metrics[~is_group_mean(metrics)].rename(columns={"ood_dataset": "OOD dataset", **METRIC_COLUMNS})
        shown = shown[["detector", "OOD dataset", "group", *METRIC_COLUMNS.values()]]
    else:  # one row per detector: each metric for the near and the far group side by side
        wide = group_means(metrics, values=METRIC_NAMES)
        wide.columns = [f"{METRIC_COLUMNS[metric]} {group}" for metric, group in wide.columns]
        shown = wide.reset_index().assign(**{"ID accuracy": metrics.id_accuracy.iloc[0]})
    higher = [c for c in shown.columns if c.startswith(("AUROC", "AUPR"))]
    lower = [c for c in shown.columns if c.startswith("FPR95")]
    styled = (
        shown.style.format(dict.fromkeys(higher + lower + ["ID accuracy"], "{:.3f}"))
        .highlight_max(subset=higher, color="#c8e6c9")
        .highlight_min(subset=lower, color="#c8e6c9")
    )
    st.dataframe(styled, hide_index=True, use_container_width=True, height=min(38 + 35 * len(shown), 700))
    st.caption("Best value per column highlighted in green.")
    st.download_button("Download metrics.csv", metrics.to_csv(index=False), "metrics.csv", "text/csv")


def histogram_tab(results: Results, detector: str, colors: dict) -> None:
    scores = results.scores
    hist = analysis.score_histogram(scores, detector)
    default = default_threshold(scores, detector)
    low, high = float(hist["edges"][0]), float(hist["edges"][-1])
    threshold = st.slider(
        "Threshold (flag as OOD when score ≥ threshold)",
        low,
        high,
        min(max(default, low), high),
        step=(high - low) / 200 or 1.0,
        key=f"threshold-{detector}",
        help=f"Starts at {default:.4g}, the threshold that catches 95% of all OOD samples.",
    )
    label = "95% OOD recall" if threshold == default else "threshold"
    st.plotly_chart(
        plots.histogram_figure(
            hist, threshold=threshold, title=f"{detector} scores", threshold_label=label, colors=colors
        ),
        use_container_width=True,
    )
    counts = analysis.counts_at_threshold(scores, detector, threshold)
    c1, c2 = st.columns(2)
    ids, total = counts["id"], counts["total"]
    c1.metric(
        "False alarms (ID flagged as OOD)", f"{ids['false_alarms']:,} of {ids['n']:,} ({ids['false_alarm_rate']:.1%})"
    )
    c2.metric("Misses (OOD accepted as ID)", f"{total['missed']:,} of {total['n_ood']:,} ({total['miss_rate']:.1%})")
    table = analysis.counts_table(counts).rename(columns={"wrong": "count", "wrong_rate": "rate"})
    st.dataframe(table.style.format({"rate": "{:.1%}"}), hide_index=True, use_container_width=True)


def curves_tab(results: Results, detector: str, colors: dict) -> None:
    scores = results.scores
    mode = st.radio(
        "Overlay", ["OOD sets for this detector", "detectors for one OOD set"], horizontal=True, key="curves-mode"
    )
    if mode == "OOD sets for this detector":
        curves = {name: analysis.curves(scores, detector, name) for name in ood_datasets_of(scores)}
        title = f"{detector}: one curve per OOD set"
    else:
        dataset = st.selectbox("OOD set", ood_datasets_of(scores), key="curves-dataset")
        curves = {name: analysis.curves(scores, name, dataset) for name in detectors_of(scores)}
        colors, title = None, f"{dataset}: one curve per detector"
    c1, c2 = st.columns(2)
    c1.plotly_chart(plots.roc_figure(curves, title=f"ROC — {title}", colors=colors), use_container_width=True)
    c2.plotly_chart(
        plots.pr_figure(curves, title=f"PR (OOD positive) — {title}", colors=colors), use_container_width=True
    )


def _gallery(images, captions, columns=8) -> None:
    if not images:
        st.caption("No samples.")
        return
    cols = st.columns(columns)
    for i, (image, caption) in enumerate(zip(images, captions)):
        cols[i % columns].image(image, caption=caption, use_container_width=True)


def failures_tab(results: Results, detector: str, colors: dict) -> None:
    scores = results.scores
    threshold = default_threshold(scores, detector)
    class_names = results.class_names
    per_class = per_class_at_threshold(scores, detector, threshold, class_names)
    st.caption(
        f"At threshold {threshold:.4g}, which catches 95% of all OOD samples: how often each ID class is wrongly "
        "flagged. Select a row to filter the galleries to that class."
    )
    c1, c2 = st.columns([1, 1])
    table = per_class.rename(columns=PER_CLASS_HEADINGS)
    if (table["class name"] == table["class"].astype(str)).all():
        table = table.drop(columns="class name")  # digits: the name is the number
    selection = c1.dataframe(
        table.style.format({"classifier accuracy": "{:.1%}", "false-alarm rate": "{:.1%}", "mean score": "{:.4g}"}),
        hide_index=True,
        use_container_width=True,
        on_select="rerun",
        selection_mode="single-row",
        key=f"classes-{detector}",
    )
    c2.plotly_chart(plots.per_class_bar(per_class), use_container_width=True)
    rows = selection.selection.rows if selection else []
    id_class = int(per_class.iloc[rows[0]]["class"]) if rows else None
    ood_names = ood_datasets_of(scores)
    ood_filter = st.selectbox("OOD set for the second gallery", ["all OOD sets"] + ood_names, key="gallery-ood")
    id_rows, ood_rows = analysis.failure_cases(
        scores,
        detector,
        k=12,
        id_class=id_class,
        class_names=class_names,
        ood_dataset=None if ood_filter == "all OOD sets" else ood_filter,
    )
    which = f"class {id_rows.class_name.iloc[0]}" if id_class is not None and len(id_rows) else "all classes"
    st.markdown(f"**ID images most wrongly flagged as OOD** ({which}; true class → prediction · score)")
    _gallery(
        thumbnails(results, id_rows),
        [f"{r.class_name} → {r.predicted_name} · {r.score:.3g}" for r in id_rows.itertuples()],
    )
    st.markdown("**OOD images most confidently accepted as ID** (OOD set → the class the model gave · score)")
    _gallery(
        thumbnails(results, ood_rows),
        [f"{r.dataset} → {r.predicted_name} · {r.score:.3g}" for r in ood_rows.itertuples()],
    )


def run_details(results: Results) -> None:
    meta = results.meta or {}
    st.write({k: meta.get(k) for k in ("device", "device_name", "torch", "oodviz")})
    if meta.get("stages"):
        st.dataframe(pd.DataFrame(meta["stages"]).T, use_container_width=True)
    errors = {k: v for k, v in (results.detectors or {}).items() if isinstance(v, dict) and "error" in v}
    for name, info in errors.items():
        st.error(f"{name} failed: {info['error']}")
        if show_server_details():
            with st.expander(f"{name}: details"):
                st.code(info.get("traceback", ""))
    st.json(results.config, expanded=False)


def results_page(run: RunDir) -> None:
    status = run.read_status()
    results = _results(str(run.path), status.get("finished"))
    # not written yet, or every detector failed (then metrics.csv holds only its header)
    if results.metrics is None or results.scores is None or not len(results.metrics):
        st.warning("This run has no results yet.")
        return
    detectors = detectors_of(results.scores)
    colors = plots.color_map(ood_datasets_of(results.scores))
    tabs = st.tabs(["Metrics", "Score histograms", "ROC / PR", "Failure cases", "Run details"])
    with tabs[0]:
        metrics_tab(results)
    best = best_detector(results.metrics)["best_detector"] if len(results.metrics) else None
    for tab, draw in zip(tabs[1:4], (histogram_tab, curves_tab, failures_tab)):
        with tab:
            detector = st.selectbox(
                "Detector",
                detectors,
                index=detectors.index(best) if best in detectors else 0,
                key=f"detector-{draw.__name__}",
                format_func=lambda d: f"{d} (best mean AUROC)" if d == best else d,
            )
            draw(results, detector, colors)
    with tabs[4]:
        run_details(results)
