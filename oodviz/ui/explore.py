"""Render functions for the issue-15 views of a finished run, to be placed in the results page's tabs.

Each function draws one view of a :class:`oodviz.results.Results`; everything it shows is computed by the
library (:mod:`oodviz.analysis`, :mod:`oodviz.results`, :mod:`oodviz.plots_risk`, :mod:`oodviz.report`,
:mod:`oodviz.detectors.teaching`). Work that runs the model or a long computation (scoring uploaded images,
a t-SNE map) runs in a subprocess (``python -m oodviz.cli score|project``), never in the server process.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from oodviz.analysis import risk_coverage_curves
from oodviz.detectors import describe, detector_class
from oodviz.layers import split_column
from oodviz.plots_risk import risk_coverage_figure
from oodviz.projection import METHODS, projection_path
from oodviz.results import Results, detectors_of, read_table
from oodviz.runs.rundir import read_json_object
from oodviz.scoring import detectors_dir

SUBPROCESS_TIMEOUT_S = 600


def teaching_panel(detector: str) -> None:
    """What ``detector`` does: its formula, paper, inputs and when it fails (from its own module); a per-layer
    result column (``"knn@features.4"``, :mod:`oodviz.layers`) shows its detector's."""
    detector = split_column(detector)[0]
    try:
        about = describe(detector)
    except ValueError:  # a detector module without its teaching metadata yet: its one-line summary
        cls = detector_class(detector)
        st.markdown(f"**{detector}**: {cls.summary} ([paper]({cls.paper}))")
        return
    st.markdown(f"**{detector}**: {about['summary']}")
    st.latex(about["formula"])
    st.markdown(f"{about['citation']} ([paper]({about['paper']}))  \nReads {about['reads']}.")
    st.caption(f"Fails when: {about['fails_when']}")


def risk_coverage_view(results: Results, detectors=None) -> None:
    """Risk–coverage curves of the chosen detectors (default: all) on the ID test set, and their AURC table."""
    names = detectors or detectors_of(results.scores)
    curves = risk_coverage_curves(results.scores, names)
    st.plotly_chart(risk_coverage_figure(curves), width="stretch")
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
        "rate among those kept. Lower is better; the oracle rejects exactly the misclassified samples first."
    )


def _oodviz(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "oodviz.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def probe_view(results: Results, key: str = "probe") -> None:
    """Upload images; a subprocess scores them with the run's saved detectors (``oodviz score``)."""
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
        st.error(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "scoring failed")
        return
    for line in result.stderr.splitlines():
        if line.startswith("unreadable:"):
            st.warning(line)
    for file, rows in table.groupby("file", sort=False):
        left, right = st.columns([1, 4])
        left.image(images[file], caption=Path(file).name.split("-", 1)[1], width=96)
        first = rows.iloc[0]
        right.markdown(f"predicted **{first.class_name}** ({first.confidence:.1%})")
        shown = rows[["detector", "score", "id_percentile", "threshold", "verdict"]].set_index("detector")
        # a plain table: every detector's row in view at once, its text selectable and searchable in the page
        right.table(shown.style.format({"score": "{:.4g}", "id_percentile": "{:.1f}", "threshold": "{:.4g}"}))
    st.caption("Higher score = more OOD; id_percentile: share of the run's ID test scores at or below it.")


def stored_projection_matches(path: Path, method: str, max_points: int) -> bool:
    """Whether ``path`` holds the ``method`` map asked for: PCA projects every sample; a t-SNE map is
    reused only when it was made from the same ``max_points`` subsample size."""
    if not path.exists():
        return False
    if method != "tsne":
        return True
    info, _ = read_json_object(path.with_suffix(".json"))
    return info.get("max_points") == max_points


def projection_view(results: Results, method: str = "pca", color_by: str = "dataset", max_points: int = 2000) -> None:
    """The run's 2-D feature map (computed on request by ``oodviz project`` in a subprocess), coloured by
    ``color_by``: ``"dataset"``, ``"label"`` or a detector's score; t-SNE on ``max_points`` samples."""
    path = projection_path(results.path, method)
    if not stored_projection_matches(path, method, max_points):
        if st.button(f"Compute the {method.upper()} map", key=f"project-{method}"):
            with st.spinner("Projecting the features..."):
                result = _oodviz("project", str(results.path), "--method", method, "--max-points", str(max_points))
            if result.returncode:
                st.error(result.stderr.strip())
                return
        else:
            return
    frame = read_table(path)
    if frame is None:
        st.error(f"{path.name} cannot be read; compute it again")
        return
    if color_by not in ("dataset", "label"):
        frame = frame.merge(results.scores[["split", "dataset", "index", color_by]], on=["split", "dataset", "index"])
    fig = go.Figure()
    if color_by in ("dataset", "label"):
        for value, rows in frame.groupby(color_by, sort=False):
            fig.add_trace(go.Scattergl(x=rows.x, y=rows.y, mode="markers", name=str(value), marker={"size": 4}))
    else:
        fig.add_trace(
            go.Scattergl(
                x=frame.x,
                y=frame.y,
                mode="markers",
                marker={"size": 4, "color": frame[color_by], "colorscale": "Viridis", "colorbar": {"title": color_by}},
            )
        )
    fig.update_layout(
        template="plotly_white", height=500, title=f"{method.upper()} of the features ({len(frame):,} points)"
    )
    st.plotly_chart(fig, width="stretch")


def report_download(results: Results) -> None:
    """A button that builds the self-contained HTML report (:func:`oodviz.report.report_html`) and offers it."""
    from oodviz.report import report_html

    if st.button("Build the HTML report", key="build-report"):
        with st.spinner("Building the report..."):
            st.session_state[f"report-html:{results.path}"] = report_html(results.path)
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
        "Upload images: the run's model and every saved detector score them in a subprocess; the verdict uses "
        "each detector's threshold at 95% recall of the run's OOD sets."
    )
    probe_view(page.results)


def feature_space_tab(page) -> None:
    c1, c2, c3 = st.columns(3)
    method = c1.segmented_control("Projection", list(METHODS), default="pca", key="projection-method") or "pca"
    color_by = c2.selectbox(
        "Colour by", ["dataset", "label", *page.detectors], key="projection-color", help="label: the ID true class"
    )
    max_points = 2000
    if method == "tsne":
        max_points = int(
            c3.number_input("t-SNE points (seeded subsample)", 50, 20000, 2000, step=250, key="projection-points")
        )
    projection_view(page.results, method, color_by, max_points)
