"""The issue-15 views in the app (AppTest on a copy of the default run): risk–coverage, the feature
space, the report download, the metrics table's selective-classification columns, the teaching panel (the
Detectors page)."""

import base64
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from oodviz.detectors import describe
from oodviz.figures import plots

APP = str(Path(__file__).resolve().parents[2] / "app.py")


@pytest.fixture(scope="module")
def runs_root(default_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("explore-runs")
    shutil.copytree(default_run.path, root / "r1")
    shutil.copytree(default_run.path.parent / ".features", root / ".features")  # the stores the projection reads
    return root


@pytest.fixture
def app(runs_root, monkeypatch):
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(runs_root))
    return AppTest.from_file(APP, default_timeout=120)


def open_tab(app, tab):
    app.query_params["run"] = "r1"
    app.run()
    app.session_state["results-tab"] = tab
    app.run()
    assert not app.exception
    return app


def brute_force_selective(scores: np.ndarray, wrong: np.ndarray) -> tuple[float, float]:
    """AURC = mean over samples of the error rate among the samples scoring at most theirs (ties accepted
    together), and the risk at the lowest such threshold that keeps at least 95% (float64, O(n^2))."""
    scores, wrong = scores.astype(np.float64), wrong.astype(np.float64)
    risks = np.array([wrong[scores <= s].mean() for s in scores])
    kept = np.array([(scores <= s).mean() for s in scores])
    at_95 = risks[kept >= 0.95][np.argmin(scores[kept >= 0.95])]
    return float(risks.mean()), float(at_95)


def id_test(runs_root) -> pd.DataFrame:
    scores = pd.read_parquet(runs_root / "r1" / "scores.parquet")
    return scores[scores.split == "id_test"]


def test_the_new_tabs_are_offered(app):
    open_tab(app, "Metrics")
    assert [t.label for t in app.tabs] == [
        "Metrics",
        "Score histograms",
        "ROC / PR",
        "Failure cases",
        "Risk–coverage",
        "Probe images",
        "Feature space",
        "Run details",
    ]  # no "Which layer?": the default run has one layer
    assert not [b for b in app.button if b.label == "Build the HTML report"]  # drawn only once its popover opens
    app.session_state["report-open"] = True
    app.run()
    assert not app.exception
    assert [b.label for b in app.button if b.label == "Build the HTML report"]


def test_the_risk_coverage_tab_shows_each_detectors_aurc_and_risk_at_95(app, runs_root):
    open_tab(app, "Risk–coverage")
    table = app.dataframe[0].value
    rows = id_test(runs_root)
    wrong = rows.prediction.to_numpy() != rows.label.to_numpy()
    assert 0 < wrong.sum() < len(rows)  # some errors: the curve is not flat
    detectors = list(pd.read_csv(runs_root / "r1" / "metrics.csv").detector.unique())
    oracle = "oracle (errors rejected first)"
    assert list(table.index) == [*detectors, oracle]
    assert (table.loc[oracle, "AURC"] <= table.loc[detectors, "AURC"]).all()  # no detector beats it
    for detector in detectors:
        expected_aurc, expected_risk = brute_force_selective(rows[detector].to_numpy(), wrong)
        assert table.loc[detector, "AURC"] == pytest.approx(expected_aurc, abs=1e-12)
        assert table.loc[detector, "risk at 95% coverage"] == pytest.approx(expected_risk, abs=1e-12)


def _styled_cells(dataframe, colour: str) -> set[str]:
    """The cells (``#T_<uuid>_row<r>_col<c>``) whose CSS in a styled ``st.dataframe`` holds ``colour``."""
    styles = dataframe.proto.arrow_data.styler.styles
    return {
        selector.strip()
        for block in styles.split("}")
        if colour in block
        for selector in block.split("{")[0].split(",")
    }


def test_the_metrics_table_has_aurc_greyed_when_the_classifier_errs_too_rarely(app, runs_root):
    """AURC as computed here; the default run's classifier makes fewer than 20 errors on the ID test set, so the
    AURC column is grey in every row and highlights none; each AUROC column marks its strict best only (none when
    the best value as shown is tied)."""
    from oodviz.results.tables import MIN_CLASSIFIER_ERRORS

    open_tab(app, "Metrics")
    shown = app.dataframe[0].value.set_index("detector")
    rows = id_test(runs_root)
    wrong = rows.prediction.to_numpy() != rows.label.to_numpy()
    expected = {d: brute_force_selective(rows[d].to_numpy(), wrong)[0] for d in shown.index}
    assert shown["AURC"].to_dict() == pytest.approx(expected, abs=1e-12)
    assert wrong.sum() < MIN_CLASSIFIER_ERRORS
    uuid = app.dataframe[0].proto.arrow_data.styler.uuid
    columns = list(shown.reset_index().columns)
    green, grey = (_styled_cells(app.dataframe[0], colour) for colour in ("#c8e6c9", "#9e9e9e"))
    aurc = columns.index("AURC")
    assert {cell for cell in grey if cell.endswith(f"_col{aurc}")} == {
        f"#T_{uuid}_row{row}_col{aurc}" for row in range(len(shown))
    }
    assert not {cell for cell in green if cell.endswith(f"_col{aurc}")}
    for name in [c for c in columns if c.startswith("AUROC")]:
        as_shown = shown[name].round(3).to_numpy()
        at_best = np.flatnonzero(as_shown == as_shown.max())
        marked = {f"#T_{uuid}_row{row}_col{columns.index(name)}" for row in at_best} if len(at_best) == 1 else set()
        assert {cell for cell in green if cell.endswith(f"_col{columns.index(name)}")} == marked, name


def values(array) -> np.ndarray:
    """A plotly JSON array: a list, or ``{"dtype", "bdata"}`` (base64 of the raw values)."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"])
    return np.asarray(array)


def points_in(chart) -> int:
    figure = json.loads(chart.proto.spec)
    return sum(len(values(trace["x"])) for trace in figure["data"])


def set_colours(chart) -> dict:
    return {trace["name"]: trace["marker"].get("color") for trace in json.loads(chart.proto.spec)["data"]}


def test_the_feature_space_tab_projects_as_many_points_as_asked(app, runs_root, app_subprocesses_in_process):
    """Each set in the colour the other tabs give it (the ID set grey); the title counts the drawn points out of
    the run's ID test and OOD samples, not out of the t-SNE subsample."""
    open_tab(app, "Feature space")
    [compute] = [b for b in app.button if b.label == "Compute the PCA map"]
    compute.click().run()
    assert not app.exception and not app.error
    scores = pd.read_parquet(runs_root / "r1" / "scores.parquet")
    [chart] = app.get("plotly_chart")
    assert points_in(chart) == len(scores)  # PCA: every ID test and OOD sample
    figure = json.loads(chart.proto.spec)
    assert figure["layout"]["title"]["text"] == f"PCA of the features (all {len(scores):,} ID test and OOD samples)"
    [id_set] = scores[scores.split == "id_test"].dataset.unique()
    ood_sets = list(scores[scores.split == "ood"].dataset.unique())
    expected = {id_set: plots.ID_COLOR, **plots.color_map(ood_sets)}  # as the histogram and ROC tabs colour them
    assert set_colours(chart) == expected
    app.segmented_control(key="projection-method").set_value("tsne").run()
    app.number_input(key="projection-points").set_value(300).run()
    [b for b in app.button if b.label == "Compute the TSNE map"][0].click().run()
    assert not app.exception
    [chart] = app.get("plotly_chart")
    assert points_in(chart) == 300
    title = json.loads(chart.proto.spec)["layout"]["title"]["text"]
    assert title == f"TSNE of the features (300 of the run's {len(scores):,} ID test and OOD samples)"
    assert any(
        f"The map draws 300 of the run's {len(scores):,} ID test and OOD samples" in c.value for c in app.caption
    )
    assert set_colours(chart) == {name: expected[name] for name in set_colours(chart)}


def probe_page(run_path: str):
    from types import SimpleNamespace

    from oodviz.results.tables import load_results
    from oodviz.ui import explore

    explore.probe_tab(SimpleNamespace(results=load_results(run_path)))


def test_the_probe_tab_shows_readable_headers_the_verdicts_rule_and_telling_digits(
    default_run, tmp_path, monkeypatch, app_subprocesses_in_process
):
    """An uploaded image's table: readable headers, each score and threshold printed on the side of each other
    that the verdict (OOD when score >= threshold) says, and a caption naming the rule and its pooled threshold."""
    import streamlit

    from oodviz.data import load_dataset
    from oodviz.pipeline.scoring import score_images

    image, _, _ = load_dataset("digits-test", root="data")[0]
    image.save(tmp_path / "digit0.png")
    upload = SimpleNamespace(name="digit0.png", getvalue=(tmp_path / "digit0.png").read_bytes)
    monkeypatch.setattr(streamlit, "file_uploader", lambda *args, **kwargs: [upload])  # AppTest cannot upload
    app = AppTest.from_function(probe_page, args=(str(default_run.path),), default_timeout=120)
    app.run()
    assert not app.exception and not app.error
    shown = app.table[0].value
    assert list(shown.columns) == ["score", "ID percentile", "threshold", "verdict"]
    expected = score_images(default_run.path, [tmp_path / "digit0.png"]).table.set_index("detector")
    assert list(shown.index) == list(expected.index)
    for detector, row in shown.iterrows():
        score, threshold = float(row["score"]), float(row["threshold"])
        assert score == pytest.approx(expected.loc[detector, "score"], rel=1e-5, abs=1e-6)
        # the pooled threshold, as `oodviz score` uses (tests/pipeline/test_scoring.py checks it by brute force)
        assert threshold == pytest.approx(expected.loc[detector, "threshold"], rel=1e-5)
        assert row["verdict"] == ("OOD" if score >= threshold else "ID"), detector  # checkable by eye
    [rule] = [c.value for c in app.caption if "Verdict" in c.value]
    assert "Verdict: OOD when score ≥ threshold" in rule and "95% of the run's OOD samples, all OOD sets pooled" in rule


def test_a_score_next_to_its_threshold_prints_on_its_own_side():
    """odin's case: a float32 score one step under its threshold, equal to it at 4 and 6 digits."""
    from oodviz.ui.explore import probe_table

    threshold = np.float32(-0.1263)
    score = np.nextafter(threshold, np.float32(-1))
    assert f"{score:.6g}" == f"{threshold:.6g}"
    rows = pd.DataFrame(
        {
            "detector": ["odin", "msp"],
            "score": [float(score), -0.5],
            "id_percentile": [42.04, 1.0],
            "threshold": [float(threshold), -0.5],
            "verdict": ["ID", "OOD"],
        }
    )
    shown = probe_table(rows)
    assert list(shown.columns) == ["score", "ID percentile", "threshold", "verdict"] and shown.index.name == "detector"
    assert float(shown.loc["odin", "score"]) < float(shown.loc["odin", "threshold"])  # so the ID verdict reads right
    assert shown.loc["msp"].tolist() == ["-0.5", "1.0", "-0.5", "OOD"]  # equal: printed with 6 digits, no more
    assert shown.loc["odin", "ID percentile"] == "42.0"


DETECTORS_PAGE = "oodviz/ui/app_pages/detectors.py"  # as AppTest.switch_page takes it: from app.py's folder


def explained(app, detector: str) -> None:
    """The Detectors page shows what ``detector`` does, from its own module: the formula as inline math (KaTeX wraps
    it in a narrow column, no formula scrolls sideways), the score and each definition a line; when it fails."""
    about = describe(detector)
    *definitions, last = about["formula"].split(r",\quad ")
    formula = "  \n".join([*(f"${clause},$" for clause in definitions), f"${last}$"])
    assert formula in [m.value for m in app.main.markdown]
    assert f"**{detector}**: {about['summary']}" in [m.value for m in app.main.markdown]
    assert not app.main.latex
    assert any(about["fails_when"] in c.value for c in app.main.caption)


def test_the_detectors_page_explains_the_chosen_detector_from_its_module(app):
    """The New run page draws no detector's explanation (the detector classes are torch modules: a cold load of the
    form imports none), it links to the Detectors page; there the one chosen is explained, and the URL names it."""
    app.run()
    assert not app.exception and not app.latex
    assert not [s for s in app.selectbox if (s.key or "").startswith("teach-detector")]
    app.switch_page(DETECTORS_PAGE).run()
    assert not app.exception
    (chosen,) = [s for s in app.selectbox if s.label == "Detector"]
    assert len(describe("odin")["formula"].split(r",\quad ")) == 3  # three lines below
    chosen.select("odin").run()
    assert not app.exception
    explained(app, "odin")
    assert app.query_params["detector"] == "odin"
    # and the next choice too (a widget keyed by the URL lost every choice that changed the URL)
    (chosen,) = [s for s in app.selectbox if s.label == "Detector"]
    chosen.select("mahalanobis").run()
    assert not app.exception and app.query_params["detector"] == "mahalanobis"
    explained(app, "mahalanobis")


def test_the_detectors_page_explains_the_detector_its_url_names(app):
    """``/detectors?detector=<name>`` (a link) opens with that detector chosen and explained, no click needed."""
    app.run()
    app.query_params["detector"] = "knn"
    app.switch_page(DETECTORS_PAGE).run()
    assert not app.exception
    (chosen,) = [s for s in app.selectbox if s.label == "Detector"]
    assert chosen.value == "knn"
    explained(app, "knn")
    assert not [m for m in app.main.markdown if m.value.startswith("**odin**")]
    app.query_params["detector"] = "energy"  # a link naming another one, in the same session
    app.run()
    assert [s.value for s in app.selectbox if s.label == "Detector"] == ["energy"]
    explained(app, "energy")


def views(run_path: str):
    from oodviz.results.tables import load_results
    from oodviz.ui import explore

    results = load_results(run_path)
    explore.teaching_panel("mahalanobis")
    explore.risk_coverage_view(results, ["msp", "knn"])
    explore.projection_view(results, "pca", color_by="knn")
    explore.report_download(results)


def test_the_views_render_a_real_run(default_run, tmp_path):
    from oodviz.figures.export import kaleido_problem
    from oodviz.figures.projection import project_run
    from oodviz.results.analysis import ORACLE, risk_coverage_curves

    copy = default_run.path.parent / f"explore-{tmp_path.parent.name}-{tmp_path.name}"  # one name per xdist worker too
    shutil.copytree(default_run.path, copy)
    try:
        project_run(copy, "pca")
        app = AppTest.from_function(views, args=(str(copy),), default_timeout=120)
        app.run()
        assert not app.exception
        assert [m.value for m in app.markdown if "\\Sigma^{-1}" in m.value] == [
            f"${describe('mahalanobis')['formula']}$"
        ]
        aurc = app.dataframe[0].value
        curves = risk_coverage_curves(pd.read_parquet(copy / "scores.parquet"))
        assert list(aurc.index) == ["msp", "knn", ORACLE]
        assert aurc.loc["knn", "AURC"] == curves["knn"]["aurc"]
        exports = ["Export PNG / SVG"] * 2 if kaleido_problem() is None else []  # offered only where it works
        assert [b.label for b in app.button] == [*exports, "Build the HTML report"]
    finally:
        shutil.rmtree(copy)


def test_a_box_on_the_histogram_shows_the_images_in_that_score_range_per_set(app, runs_root):
    open_tab(app, "Score histograms")
    detector = app.selectbox(key="shared-detector:r1").value
    scores = pd.read_parquet(runs_root / "r1" / "scores.parquet")
    low, high = np.quantile(scores[detector], [0.45, 0.55])
    selection = {"points": [], "point_indices": [], "box": [{"x": [high, low], "y": [0, 1]}], "lasso": []}
    app.session_state[f"histogram-{detector}-density"] = {"selection": selection}
    app.run()
    assert not app.exception
    inside = scores[(scores[detector] >= low) & (scores[detector] <= high)]
    counts = {
        c.value.split(":")[0]: int(c.value.split(": ")[1].split(" ")[0].replace(",", ""))
        for c in app.caption
        if " in range; the " in c.value
    }
    assert counts == inside.groupby("dataset").size().to_dict()
    captions = [caption for element in app.get("image") for caption in element.captions]
    expected = sum(min(12, n) for n in counts.values())
    assert len(captions) == expected
    first = inside[inside.dataset == next(iter(counts))].sort_values(detector, kind="stable")[detector].head(12)
    assert [c.rsplit("· ", 1)[1] for c in captions[: len(first)]] == [f"{v:.4g}" for v in first]


def test_a_set_hidden_at_first_is_named_and_a_box_shows_only_the_sets_drawn_under_it(app, runs_root):
    """The default run has seven sets, six drawn at first: the page names the hidden one. A box whose points lie on
    the ID trace and the first OOD set's (what plotly sends when the others are hidden) shows the images of those
    two sets only (it showed every set's, hidden ones included)."""
    from oodviz.results.analysis import score_histogram

    open_tab(app, "Score histograms")
    detector = app.selectbox(key="shared-detector:r1").value
    scores = pd.read_parquet(runs_root / "r1" / "scores.parquet")
    labels = list(score_histogram(scores, detector)["counts"])
    assert len(labels) == 7
    [hidden] = [c.value for c in app.caption if c.value.startswith("Not drawn at first")]
    assert hidden.startswith(f"Not drawn at first: {labels[6]};")
    low, high = np.quantile(scores[detector], [0.3, 0.7])
    points = [{"curve_number": 0, "x": low, "y": 1.0}, {"curve_number": 1, "x": high, "y": 1.0}]
    selection = {"points": points, "point_indices": [0, 0], "box": [{"x": [low, high], "y": [0, 1]}], "lasso": []}
    app.session_state[f"histogram-{detector}-density"] = {"selection": selection}
    app.run()
    assert not app.exception
    first_ood = labels[1]
    inside = scores[(scores[detector] >= low) & (scores[detector] <= high)]
    expected = inside[(inside.split == "id_test") | (inside.dataset == first_ood)].groupby("dataset").size()
    counts = {
        c.value.split(":")[0]: int(c.value.split(": ")[1].split(" ")[0].replace(",", ""))
        for c in app.caption
        if " in range; the " in c.value
    }
    assert counts == expected.to_dict() and len(counts) == 2
