"""The issue-15 views (oodviz/ui/explore.py) render a real run without errors, showing what the library computed."""

import shutil

import pandas as pd
from streamlit.testing.v1 import AppTest


def views(run_path: str):
    from oodviz.results import load_results
    from oodviz.ui import explore

    results = load_results(run_path)
    explore.teaching_panel("mahalanobis")
    explore.risk_coverage_view(results, ["msp", "knn"])
    explore.projection_view(results, "pca", color_by="knn")
    explore.report_download(results)


def test_the_views_render_a_real_run(default_run, tmp_path):
    from oodviz.analysis import ORACLE, risk_coverage_curves
    from oodviz.projection import project_run

    copy = default_run.path.parent / f"explore-{tmp_path.name}"
    shutil.copytree(default_run.path, copy)
    try:
        project_run(copy, "pca")
        app = AppTest.from_function(views, args=(str(copy),), default_timeout=120)
        app.run()
        assert not app.exception
        assert "\\Sigma^{-1}" in app.latex[0].value
        aurc = app.dataframe[0].value
        curves = risk_coverage_curves(pd.read_parquet(copy / "scores.parquet"))
        assert list(aurc.index) == ["msp", "knn", ORACLE]
        assert aurc.loc["knn", "AURC"] == curves["knn"]["aurc"]
        assert [b.label for b in app.button] == ["Build the HTML report"]
    finally:
        shutil.rmtree(copy)
