"""``oodviz report``: one self-contained HTML file with every figure, opened offline in Chromium."""

import html
import json
import re
import subprocess
import sys

import pandas as pd
import pytest
from helpers import chromium

from oodviz.detectors import describe
from oodviz.figures.report import FIGURE_CLASS, FORMULA_CLASS, report_html
from oodviz.models import format_bytes
from oodviz.results.tables import best_detector

pytestmark = pytest.mark.process  # `oodviz report` in a subprocess, on the default run

GALLERY = 3
PER_DETECTOR = ("histogram", "roc", "pr", "per-class")
EXTERNAL = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//", re.IGNORECASE)
FIGURE = re.compile(
    rf'<div class="{FIGURE_CLASS}" id="(figure-\d+)" data-name="([^"]+)"></div>'
    r'<script type="application/json">(.*?)</script>',
    re.DOTALL,
)


@pytest.fixture(scope="module")
def report(default_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "report.html"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "oodviz.cli",
            "report",
            str(default_run.path),
            "-o",
            str(out),
            "--gallery",
            str(GALLERY),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(default_run.path.parent),  # the run's relative data root, as where it was made
    )
    assert result.returncode == 0, result.stderr
    assert f"report: {out}" in result.stderr
    return out


def test_the_report_holds_every_figure_table_and_gallery_and_nothing_external(report, default_results):
    text = report.read_text()
    detectors = list(default_results.detectors)
    figures = FIGURE.findall(text)
    names = [name for _, name, _ in figures]
    assert names == ["auroc heatmap", "risk-coverage", *(list(PER_DETECTOR) * len(detectors))]
    for _, name, spec in figures:
        figure = json.loads(spec.replace("<\\/", "</"))
        assert figure["data"], name
    # every detector's section, its ROC with one curve per OOD dataset, the heatmap with every AUROC
    datasets = list(default_results.metrics.query("~ood_dataset.str.endswith('(mean)')").ood_dataset.unique())
    for detector in detectors:
        assert f"<summary>{detector}</summary>" in text
        assert html.escape(describe(detector)["fails_when"]) in text
    roc = json.loads(figures[2 + PER_DETECTOR.index("roc")][2].replace("<\\/", "</"))
    assert [t["name"].split(" (")[0] for t in roc["data"] if t.get("name")][: len(datasets)] == datasets
    heatmap = json.loads(figures[0][2].replace("<\\/", "</"))["data"][0]
    assert heatmap["y"] == detectors and heatmap["x"] == datasets
    # thumbnails inline: GALLERY per gallery, two galleries per detector
    assert len(re.findall(r'<img src="data:image/png;base64,[A-Za-z0-9+/=]+"', text)) == 2 * GALLERY * len(detectors)
    # run config and environment, metrics with the selective columns
    assert html.escape('"backbone": "digits-cnn"') in text and default_results.meta["torch"] in text
    assert "risk at 95% coverage" in text and "higher score = more OOD" in text
    # it reads like a result: the headline first, the run's details after the detectors, the config folded last
    best = best_detector(default_results.metrics)["best_detector"]
    headline = text.index('<p class="headline">Best detector by mean AUROC')
    assert headline < text.index("<h2>Metrics</h2>") < text.index("<h2>Detectors</h2>") < text.index("<h2>Run details")
    assert text.index("<h2>Run details") < text.index("<details><summary>Config</summary>")
    sampled = text.index("Data: how many images of each split the run used, and how they were sampled")
    assert text.index("<h2>Run details") < sampled < text.index("<td>all 362 (no subsample)</td>")  # id_test
    assert f"over the 6 OOD sets: {best} (AUROC" in text[headline:]
    peak = max(stage["peak_cpu_rss"] for stage in default_results.meta["stages"].values())
    assert f"<td>{format_bytes(peak)}</td>" in text and str(peak) not in text  # sizes in B/KiB/MiB/GiB
    # each detector's formula, for KaTeX to typeset on load; its fonts inline
    for detector in detectors:
        assert f'class="{FORMULA_CLASS}" data-tex="{html.escape(describe(detector)["formula"])}"' in text
    assert "url(fonts/" not in text and "url(data:font/woff2;base64," in text
    # offline: plotly.js inline, no script, style sheet or image fetched from anywhere
    assert not EXTERNAL.search(text)
    assert "Plotly.newPlot" in text and len(text) > 4_000_000  # plotly.js itself is ~4.8 MB


def detectors_shown(report) -> list[str]:
    """The detector sections' names (the folded tables, "Every OOD dataset" and "Config", left out)."""
    names = re.findall(r"<details(?: open)?><summary>([^<]+)</summary>", report.read_text())
    return [name for name in names if name not in ("Every OOD dataset", "Config")]


def test_the_reports_metrics_print_aurc_to_three_significant_digits(report, default_run):
    """As the app's table does: the default run's AURC (about 1e-4, a handful of classifier errors) printed to three
    decimals read 0.000 for every detector, a perfect score."""
    metrics = pd.read_csv(default_run.path / "metrics.csv").drop_duplicates("detector").set_index("detector")
    assert metrics.aurc.between(1e-6, 5e-4).any()
    html = report.read_text()
    for detector, aurc in metrics.aurc.items():
        assert re.search(
            rf"<td>{re.escape(detector)}</td>(?:\s*<td>[^<]*</td>)*?\s*<td>{re.escape(f'{aurc:.3g}')}</td>", html
        )


def test_report_refuses_an_unknown_detector_and_an_unfinished_run(default_run, tmp_path):
    with pytest.raises(ValueError, match="no detector nonesuch in this run; it has: msp"):
        report_html(default_run.path, detectors=["nonesuch"])
    with pytest.raises(ValueError, match="is not finished"):
        report_html(tmp_path)


@chromium
def test_the_report_opens_offline_in_chromium_with_every_plot_drawn(report, page):
    requested = []

    def offline(route):
        url = route.request.url
        if url.startswith(("file:", "data:", "blob:")):
            route.continue_()
        else:
            requested.append(url)
            route.abort()

    page.route("**/*", offline)
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    # 9 MB of HTML that draws ~80 figures on load: wait for the drawing, not for the load event (slow on a busy CI)
    page.goto(report.as_uri(), wait_until="commit", timeout=120_000)
    n_figures = len(FIGURE.findall(report.read_text()))
    page.wait_for_function(
        f"document.querySelectorAll('.{FIGURE_CLASS}.js-plotly-plot .main-svg').length >= {n_figures}",
        timeout=240_000,
    )
    assert page.locator(f".{FIGURE_CLASS}.js-plotly-plot").count() == n_figures
    # data drawn, not empty axes: the heatmap, the risk-coverage lines, the first detector's bars and curves
    assert page.locator("#figure-1 .hm, #figure-1 image").count() >= 1
    assert page.locator("#figure-2 .scatterlayer .trace").count() >= 2
    assert page.locator("#figure-3 .barlayer .point").count() > 10
    assert page.locator("#figure-4 .scatterlayer .trace").count() >= 2
    images = page.locator("details[open] .gallery img")
    assert images.count() == 2 * GALLERY
    assert all(images.nth(i).evaluate("img => img.complete && img.naturalWidth === 64") for i in range(images.count()))
    formulas = page.locator(f".{FORMULA_CLASS}")  # typeset by the inlined KaTeX, none left as raw LaTeX
    assert (
        formulas.count() == len(detectors_shown(report))
        and page.locator(f".{FORMULA_CLASS} .katex").count() == formulas.count()
    )
    assert page.locator(".katex-error").count() == 0
    assert requested == [] and errors == []


def test_a_report_for_others_names_no_server_path(default_run, tmp_path):
    """``paths=False`` (the app serving others builds it so): the config's paths and the run's warnings cut to last
    names; the default keeps them, for the user on the server."""
    import shutil

    from oodviz.runs.rundir import RunDir

    run = tmp_path / "r-paths"
    shutil.copytree(default_run.path, run)
    config = json.loads((run / "config.json").read_text())
    config["data_root"] = "/srv/secret/data"
    (run / "config.json").write_text(json.dumps(config))
    RunDir(run).append_event({"event": "warning", "message": "id_test: /srv/secret/images/a.png unreadable, skipped"})
    mine, theirs = report_html(run), report_html(run, paths=False)
    assert "/srv/secret/data" in mine and "/srv/secret/images/a.png" in mine
    assert "/srv/secret" not in theirs
    assert (
        "Warning: id_test: .../a.png unreadable, skipped" in theirs
        and "&quot;data_root&quot;: &quot;.../data&quot;" in theirs
    )
