"""Render functions for the issue-15 views of a finished run, to be placed in the results page's tabs.

Each function draws one view of a :class:`oodviz.results.tables.Results`; everything it shows is computed by the
library (:mod:`oodviz.results.analysis`, :mod:`oodviz.results.tables`, :mod:`oodviz.figures.plots`, :mod:`oodviz.figures.report`,
:mod:`oodviz.detectors.teaching`). Work that runs the model or a long computation (scoring uploaded images,
a t-SNE map) runs in a subprocess (``python -m oodviz.cli score|project``), never in the server process.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import streamlit as st

from oodviz import detectors
from oodviz.columns import split_column
from oodviz.config.catalog import detector_names
from oodviz.detectors.teaching import formula_clauses
from oodviz.figures.export import kaleido_problem
from oodviz.figures.plots import risk_coverage_figure
from oodviz.figures.projection import available_methods, projection_path
from oodviz.figures.projection_map import (
    ANSWER_TILES,
    KEYS,
    MAP_POINTS,
    SPRITE_BUDGET,
    drawn_rows,
    hover_data,
    map_title,
    projection_figure,
    thumbnails_path,
)
from oodviz.figures.report import report_html
from oodviz.files import read_json_object
from oodviz.results.analysis import risk_coverage_curves
from oodviz.results.selection import selected_samples
from oodviz.results.tables import ID_SPLIT, OOD_SPLIT, Results, classifier_errors_note, detectors_of, read_table
from oodviz.ui.access import show_server_details, shown_message
from oodviz.ui.chart_selection import projection_selection_gallery
from oodviz.ui.figure_export import chart
from oodviz.ui.hover_thumbnail import hover_panel
from oodviz.ui.navigation import url_widget_key, url_written_key

SUBPROCESS_TIMEOUT_S = 600


def teaching_panel(detector: str) -> None:
    """What ``detector`` does: its formula, paper, inputs and when it fails (from its own module); a per-layer
    result column (``"knn@features.4"``, :mod:`oodviz.results.layers`) shows its detector's."""

    detector = split_column(detector)[0]
    try:
        about = detectors.describe(detector)
    except ValueError:  # a detector module without its teaching metadata yet: its one-line summary
        cls = detectors.detector_class(detector)
        st.markdown(f"**{detector}**: {cls.summary} ([paper]({cls.paper}))")
        return
    st.markdown(f"**{detector}**: {about['summary']}")
    # inline math, a clause a line: KaTeX wraps inline math at its = + -, so no formula scrolls sideways in a narrow column
    *definitions, last = formula_clauses(about["formula"])
    st.markdown("  \n".join([*(f"${clause},$" for clause in definitions), f"${last}$"]))
    st.markdown(f"{about['citation']} ([paper]({about['paper']}))  \nReads {about['reads']}.")
    st.caption(f"Fails when: {about['fails_when']}")


#: the Detectors page's query parameter: the detector it explains
DETECTOR_PARAM = "detector"


@st.cache_data(show_spinner="Reading the detectors' modules…")
def detectors_overview() -> pd.DataFrame:
    """One row per detector, from its own module (:func:`oodviz.detectors.describe`): its name, what it computes,
    what it reads and its paper (a detector without teaching metadata: its class's one-line summary and paper)."""
    rows = []
    for name in detector_names():
        try:
            about = detectors.describe(name)
        except ValueError:
            cls = detectors.detector_class(name)
            about = {"summary": cls.summary, "reads": "", "paper": cls.paper}
        rows.append(
            {"detector": name, "what it computes": about["summary"], "reads": about["reads"], "paper": about["paper"]}
        )
    return pd.DataFrame(rows)


def detectors_page() -> None:
    """The Detectors page: what the chosen detector computes (:func:`teaching_panel`; the detector in the URL,
    ``?detector=<name>``, so a link opens it), and every detector in one table beside it."""
    st.title("Detectors")
    names = detector_names()
    asked = st.query_params.get(DETECTOR_PARAM)
    st.caption(
        f"The {len(names)} detectors of oodviz: each one's formula, paper, what it reads and when it fails. Higher "
        "score = more OOD for every detector."
    )
    chosen = st.selectbox("Detector", names, key=url_widget_key("teach-detector", asked, names, names[0]))
    if chosen != asked:
        st.query_params[DETECTOR_PARAM] = chosen
    st.session_state[url_written_key("teach-detector")] = chosen
    teaching_panel(chosen)
    st.subheader("Every detector")
    st.dataframe(
        detectors_overview(),
        hide_index=True,
        width="stretch",
        height=38 + 35 * len(names),
        column_config={"paper": st.column_config.LinkColumn("paper", display_text="paper")},
    )


def risk_coverage_view(results: Results, detectors=None) -> None:
    """Risk–coverage curves of the chosen detectors (default: all) on the ID test set, and their AURC table."""
    names = detectors or detectors_of(results.scores)
    curves = risk_coverage_curves(results.scores, names)
    chart(risk_coverage_figure(curves), "risk-coverage", width="stretch")
    table = pd.DataFrame(
        {
            "AURC": [c["aurc"] for c in curves.values()],
            "risk at 95% coverage": [c["risk_at_95_coverage"] for c in curves.values()],
        },
        index=list(curves),
    )
    st.dataframe(table.style.format("{:.3g}"), width="stretch")  # AURCs of good detectors are ~1e-4
    st.caption(
        "Each detector's score rejects the most OOD-looking ID test samples first; risk is the classifier's error "
        "rate among those kept. Lower is better; the oracle rejects exactly the misclassified samples first. "
        + classifier_errors_note(results.scores)[0]
    )


def _oodviz(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "oodviz.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def digits_apart(score: float, threshold: float, least: int = 6) -> int:
    """The fewest significant digits, at least ``least``, at which ``score`` and ``threshold`` print differently
    (``least`` when they are equal; 17 tell any two floats apart)."""
    return next((digits for digits in range(least, 18) if f"{score:.{digits}g}" != f"{threshold:.{digits}g}"), least)


def probe_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One image's rows of ``oodviz score``'s table as the page shows them, a row per detector: the score and
    its threshold with :func:`digits_apart` significant digits (a score just under its threshold does not print
    equal to it, so the verdict's ``score >= threshold`` can be checked by eye), the ID percentile to 0.1."""
    digits = [digits_apart(score, threshold) for score, threshold in zip(rows.score, rows.threshold, strict=True)]
    return pd.DataFrame(
        {
            "score": [f"{score:.{d}g}" for score, d in zip(rows.score, digits, strict=True)],
            "ID percentile": [f"{percentile:.1f}" for percentile in rows.id_percentile],
            "threshold": [f"{threshold:.{d}g}" for threshold, d in zip(rows.threshold, digits, strict=True)],
            "verdict": rows.verdict.to_numpy(),
        },
        index=pd.Index(rows.detector.to_numpy(), name="detector"),
    )


def probe_view(results: Results, key: str = "probe") -> None:
    """Upload images; a subprocess scores them with the run's saved detectors (``oodviz score``)."""
    from oodviz.pipeline.scoring import detectors_dir  # torch: only when the probe tab is open

    if not detectors_dir(results.path).is_dir():
        st.info(
            "This run has no saved detectors (made before oodviz saved them); run its config again to probe images."
        )
        return
    uploads = st.file_uploader(
        "Images to score", type=["png", "jpg", "jpeg", "bmp", "gif", "webp"], accept_multiple_files=True, key=key
    )
    if not uploads:
        return
    with tempfile.TemporaryDirectory(prefix="oodviz-probe-") as folder:
        files = []
        for number, upload in enumerate(uploads):
            path = Path(folder) / f"{number:03d}-{Path(upload.name).name}"
            path.write_bytes(upload.getvalue())
            files.append(str(path))
        with st.spinner(f"Scoring {len(files)} image(s) with the run's model and detectors..."):
            result = _oodviz("score", str(results.path), *files, "--out", str(Path(folder) / "scores.csv"))
        table = read_table(Path(folder) / "scores.csv")
        images = {f: Path(f).read_bytes() for f in files}
    if result.returncode == 2 or table is None:
        st.error(shown_message(result.stderr.strip().splitlines()[-1]) if result.stderr.strip() else "scoring failed")
        return
    for line in result.stderr.splitlines():
        if line.startswith(("unreadable:", "not loaded:")):
            st.warning(shown_message(line))
    for file, rows in table.groupby("file", sort=False):
        left, right = st.columns([1, 4])
        left.image(images[file], caption=Path(file).name.split("-", 1)[1], width=96)
        first = rows.iloc[0]
        right.markdown(f"predicted **{first.class_name}** ({first.confidence:.1%})")
        # a plain table: every detector's row in view at once, its text selectable and searchable in the page
        right.table(probe_table(rows))
    st.caption(
        "ID percentile: share of the run's ID test scores at or below the score. Score and threshold have as many "
        "digits as it takes to tell them apart."
    )


def stored_projection_matches(path: Path, method: str, max_points: int) -> bool:
    """Whether ``path`` holds the ``method`` map asked for, with its hover thumbnails: PCA projects every
    sample; a t-SNE or UMAP map is reused only when it was made from the same ``max_points`` subsample size."""
    if not path.exists() or not thumbnails_path(path.parent, method, ".webp").exists():
        return False
    if method == "pca":
        return True
    info, _ = read_json_object(path.with_suffix(".json"))
    return info.get("max_points") == max_points


def projection_view(
    results: Results,
    method: str = "pca",
    color_by: str = "dataset",
    max_points: int = 2000,
    detector=None,
    colors: dict | None = None,
) -> None:
    """The run's 2-D feature map (computed on request by ``oodviz project`` in a subprocess), coloured by
    ``color_by``: ``"dataset"`` (each set in its colour of ``colors``, the page's
    :func:`~oodviz.figures.plots.color_map`), ``"label"`` or a detector's score; t-SNE or UMAP on ``max_points`` samples.
    At most :data:`~oodviz.figures.projection_map.MAP_POINTS` points are drawn (a seeded subsample). Hovering a point
    shows its set, index, true class, prediction and thumbnail (:mod:`oodviz.ui.hover_thumbnail`: from the
    sprite sent with the map, or asked for on demand); selecting
    points shows their images with ``detector``'s score (default: the ``color_by`` detector, else the run's
    first)."""
    path = projection_path(results.path, method)
    if not stored_projection_matches(path, method, max_points):
        if st.button(f"Compute the {method.upper()} map", key=f"project-{method}"):
            # t-SNE and UMAP fit every point's neighbours: a minute for 2,000 points on two cores, not seconds
            slow = "" if method == "pca" else f" ({method.upper()} of {max_points:,} points: up to minutes)"
            with st.spinner(f"Projecting the features...{slow}"):
                result = _oodviz("project", str(results.path), "--method", method, "--max-points", str(max_points))
            if result.returncode:
                st.error(shown_message(result.stderr.strip()))
                return
        else:
            return
    frame = read_table(path)
    if frame is None:
        st.error(f"{path.name} cannot be read; compute it again")
        return
    if color_by not in ("dataset", "label"):
        frame = frame.merge(results.scores[[*KEYS, color_by]], on=KEYS).reset_index(drop=True)
    drawn = frame.iloc[drawn_rows(len(frame))].reset_index(drop=True)
    samples = int(results.scores.split.isin((ID_SPLIT, OOD_SPLIT)).sum())  # PCA projects all, t-SNE a subsample
    meta = f"oodviz-projection-{method}-{color_by}"
    event = chart(
        projection_figure(drawn, color_by, map_title(method, len(drawn), samples), meta, colors),
        meta,
        width="stretch",
        on_select="rerun",
        selection_mode=("points", "box", "lasso"),
    )
    keys = read_table(thumbnails_path(results.path, method, ".parquet"))
    sprite = thumbnails_path(results.path, method, ".webp")
    sprite_bytes = sprite.read_bytes() if keys is not None and sprite.exists() else None
    data = hover_data(drawn, results.class_names, keys, sprite_bytes, run=str(results.path))
    hover_panel(data, meta, key=f"{meta}-hover", config=results.config, drawn_keys=drawn[KEYS])
    shown = f"all {samples:,} ID test and OOD samples"
    if len(drawn) < samples:
        shown = f"{len(drawn):,} of the run's {samples:,} ID test and OOD samples (a uniform subsample, seed 0)"
    thumbs = len(keys) if keys is not None else 0
    st.caption(
        f"The map draws {shown}. Hovering a point shows its set, index, true class, prediction and thumbnail: "
        f"at once for {thumbs:,} of them (sent with the map, the first of the same seeded order, as many as fit "
        f"in {SPRITE_BUDGET // 1024} KiB), a moment later for any other (asked for when the mouse rests on it, "
        f"with its {ANSWER_TILES - 1} nearest neighbours)."
    )
    shown_by = detector or (color_by if color_by not in ("dataset", "label") else detectors_of(results.scores)[0])
    projection_selection_gallery(results, selected_samples(drawn, (event or {}).get("selection")), shown_by)


def report_download(results: Results) -> None:
    """A button that builds the self-contained HTML report (:func:`oodviz.figures.report.report_html`) and offers it;
    with each figure also as PNG and SVG downloads when ticked (offered where kaleido and Chromium are)."""

    with_files = kaleido_problem() is None and st.checkbox(
        "with each figure as PNG and SVG", key="report-figure-files", help="Drawn by kaleido in Chromium: slower"
    )
    if st.button("Build the HTML report", key="build-report"):
        with st.spinner("Building the report..."):
            try:
                st.session_state[f"report-html:{results.path}"] = report_html(
                    results.path, figure_files=with_files, paths=show_server_details()
                )
            except RuntimeError as error:  # kaleido could not draw the figures: say why, build none
                st.error(f"The figures could not be drawn as files: {shown_message(str(error))}")
    if f"report-html:{results.path}" in st.session_state:
        st.download_button(
            "Download report.html",
            st.session_state[f"report-html:{results.path}"],
            f"{results.path.name}-report.html",
            "text/html",
        )


# -- tabs of the results page (each takes its :class:`oodviz.ui.results.Page`) ----------------------
def risk_coverage_tab(page) -> None:
    risk_coverage_view(page.results)


def probe_tab(page) -> None:
    st.caption(
        "Upload images: the run's model and every saved detector score them in a subprocess. Verdict: OOD when "
        "score ≥ threshold (higher score = more OOD), else ID. Each detector's threshold is the highest that flags "
        "95% of the run's OOD samples, all OOD sets pooled (per_class.csv's), not the threshold of the Score "
        "histograms and Failure cases tabs (by default 95% of every OOD set)."
    )
    probe_view(page.results)


def feature_space_tab(page) -> None:
    c1, c2, c3 = st.columns(3)
    methods = available_methods()
    method = c1.segmented_control("Projection", methods, default="pca", key="projection-method") or "pca"
    color_by = c2.selectbox(
        "Colour by", ["dataset", "label", *page.detectors], key="projection-color", help="label: the ID true class"
    )
    max_points = 2000
    if method != "pca":
        max_points = int(
            c3.number_input(
                f"{method} points (seeded subsample)", 50, MAP_POINTS, 2000, step=250, key="projection-points"
            )
        )
    if "umap" not in methods:
        c3.caption("UMAP: pip install 'oodviz[umap]'")
    detector = color_by if color_by in page.detectors else page.best
    projection_view(page.results, method, color_by, max_points, detector=detector, colors=page.colors)
