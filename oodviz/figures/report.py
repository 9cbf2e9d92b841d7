"""A run as one self-contained HTML file to share (``oodviz report RUN -o report.html``).

The file needs no network and no oodviz to open: plotly.js is inlined once, every figure travels as its
Plotly JSON (drawn by ``Plotly.newPlot`` when the page loads; each figure's toolbar exports it as PNG),
and the failure galleries' thumbnails are PNG data URIs. With ``figure_files=True`` (``oodviz report
--figure-files``) each figure is also drawn by kaleido in the system's Chromium (:mod:`oodviz.figures.export`) and
offered below it as PNG and SVG downloads (data URIs: the file stays self-contained, and larger).

It reads like a result, in this order: the headline (the best detector by mean AUROC, the data, the classifier's
accuracy and the errors AURC rests on) and the run's warnings, the metrics table (near/far means, every OOD dataset folded), the AUROC
heatmap and the risk–coverage curves; per detector, what it does (its formula typeset by the inlined KaTeX, paper,
inputs and failure note: :func:`oodviz.detectors.describe`), the score histogram, the ROC and PR-Out curves
against every OOD dataset, the per-class false alarms and the two failure galleries (ID test samples most
confidently flagged as OOD, OOD samples most confidently accepted); then the run's details (environment, wall
time and peak memory per stage, sizes in B/KiB/MiB/GiB) and its config last, folded.

Convention, stated in the page: **OOD is the positive class; higher score = more OOD.**
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from oodviz import detectors
from oodviz.config.plan import config_shown, cut_paths
from oodviz.figures.export import figure_images
from oodviz.figures.plots import (
    CONVENTION,
    TEMPLATE,
    color_map,
    histogram_figure,
    per_class_bar,
    pr_figure,
    risk_coverage_figure,
    roc_figure,
)
from oodviz.figures.thumbnails import thumbnails
from oodviz.files import write_atomic
from oodviz.models import format_bytes
from oodviz.results.analysis import curves, failure_cases, risk_coverage_curves, score_histogram
from oodviz.results.tables import (
    METRIC_HEADINGS,
    METRIC_NAMES,
    SELECTIVE_FORMAT,
    SELECTIVE_HEADINGS,
    SELECTIVE_NAMES,
    Results,
    best_detector,
    classifier_errors,
    classifier_errors_note,
    default_threshold,
    detectors_of,
    group_means,
    is_group_mean,
    load_results,
    ood_datasets_of,
    per_class_at_threshold,
    sampling_table,
)

#: the class of every figure's ``<div>`` (one per figure; its JSON is in the ``<script>`` after it)
FIGURE_CLASS = "oodviz-figure"
#: the class of every formula's element: KaTeX typesets its ``data-tex`` when the page loads (its text, the LaTeX
#: source, stays where a script cannot run)
FORMULA_CLASS = "oodviz-formula"
#: KaTeX 0.16 (MIT), inlined: ``katex.min.js``, ``katex.min.css`` and its WOFF2 fonts (oodviz/katex/README.md)
KATEX_DIR = Path(__file__).resolve().parent.parent / "katex"  # oodviz/katex: the report's and the docs site's
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: .85em; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: right; } th { background: #f4f4f4; }
td:first-child, th:first-child { text-align: left; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: .8em; }
.row { display: flex; flex-wrap: wrap; gap: 1em; } .row > div { flex: 1 1 360px; min-width: 360px; }
.gallery { display: flex; flex-wrap: wrap; gap: 6px; }
.gallery figure { margin: 0; width: 96px; font-size: .7em; text-align: center; }
.gallery img { width: 96px; height: 96px; image-rendering: pixelated; border: 1px solid #ccc; }
.convention { background: #fff8e1; padding: .4em .8em; border-left: 4px solid #f0b400; }
.headline { font-size: 1.1em; }
.warning { background: #fdecea; padding: .4em .8em; border-left: 4px solid #c62828; }
details { margin: .6em 0; } summary { font-size: 1.15em; font-weight: 600; cursor: pointer; }
"""
DRAW_FIGURES = f"""
for (const div of document.querySelectorAll(".{FIGURE_CLASS}")) {{
  const spec = JSON.parse(div.nextElementSibling.textContent);
  Plotly.newPlot(div, spec.data, spec.layout, {{displaylogo: false, responsive: true}});
}}
for (const element of document.querySelectorAll(".{FORMULA_CLASS}")) {{
  katex.render(element.dataset.tex, element, {{throwOnError: false, displayMode: true}});
}}
"""


def katex_assets() -> tuple[str, str]:
    """``(css, js)`` of the inlined KaTeX: its stylesheet with each font as a WOFF2 data URI (the WOFF and TTF
    fallbacks dropped: every browser that runs the report reads WOFF2) and its script."""
    fonts = KATEX_DIR / "fonts"

    def woff2(match: re.Match) -> str:
        data = base64.b64encode((fonts / f"{match.group(1)}.woff2").read_bytes()).decode("ascii")
        return f'url(data:font/woff2;base64,{data}) format("woff2")'

    css = re.sub(
        r'url\(fonts/([\w-]+)\.woff2\) format\("woff2"\),url\(fonts/[\w-]+\.woff\) format\("woff"\),'
        r'url\(fonts/[\w-]+\.ttf\) format\("truetype"\)',
        woff2,
        (KATEX_DIR / "katex.min.css").read_text(encoding="utf-8"),
    )
    return css, (KATEX_DIR / "katex.min.js").read_text(encoding="utf-8")


def _script_json(value: str) -> str:
    """JSON text safe inside ``<script>``: no ``</`` (which would end the element)."""
    return value.replace("</", "<\\/")


class _Page:
    """The HTML body, built in order; figures get numbered ids."""

    def __init__(self):
        self.parts: list[str] = []
        self.n_figures = 0
        self.figures: list[tuple[int, go.Figure, str]] = []  # (place of its download links in parts, figure, name)

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def text(self, tag: str, value: str, **attributes) -> None:
        # class_ -> class, data_tex -> data-tex
        attrs = "".join(f' {k.rstrip("_").replace("_", "-")}="{html.escape(str(v))}"' for k, v in attributes.items())
        self.parts.append(f"<{tag}{attrs}>{html.escape(str(value))}</{tag}>")

    def figure(self, fig: go.Figure, name: str) -> None:
        self.n_figures += 1
        self.parts.append(
            f'<div class="{FIGURE_CLASS}" id="figure-{self.n_figures}" data-name="{html.escape(name)}"></div>'
            f'<script type="application/json">{_script_json(fig.to_json())}</script>'
        )
        self.figures.append((len(self.parts), fig, f"figure-{self.n_figures}-{name.replace(' ', '-')}"))
        self.parts.append("")  # its PNG and SVG download links, when asked for

    def add_figure_files(self) -> None:
        """Every figure drawn as PNG and SVG (one browser session) and linked below it as downloads."""

        images = figure_images([fig for _, fig, _ in self.figures])
        for (place, _, name), files in zip(self.figures, images, strict=True):
            links = [
                f'<a download="{html.escape(name)}.{fmt}" href="data:{mime};base64,'
                f'{base64.b64encode(files[fmt]).decode("ascii")}">{fmt.upper()}</a>'
                for fmt, mime in (("png", "image/png"), ("svg", "image/svg+xml"))
            ]
            self.parts[place] = f'<p class="figure-files">Download: {" · ".join(links)}</p>'

    def table(self, frame: pd.DataFrame, digits: int = 3) -> None:
        """``frame`` as an HTML table: numbers to ``digits`` decimals, a metric column as the app prints it
        (:data:`~oodviz.results.tables.SELECTIVE_FORMAT`: AURC and risk to three significant digits)."""
        selective = {
            c: lambda v: "–" if pd.isna(v) else SELECTIVE_FORMAT.format(v)
            for c in frame.columns
            if str(c).startswith(SELECTIVE_HEADINGS)
        }
        self.parts.append(
            frame.to_html(
                index=False, float_format=lambda v: f"{v:.{digits}f}", formatters=selective, border=0, na_rep="–"
            )
        )


def _png_data_uri(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def auroc_heatmap(metrics: pd.DataFrame) -> go.Figure:
    """AUROC of each detector (rows, table order) against each OOD dataset (columns, run order)."""
    rows = metrics[~is_group_mean(metrics)]
    table = rows.pivot(index="detector", columns="ood_dataset", values="auroc")
    table = table.reindex(index=list(rows.detector.unique()), columns=list(rows.ood_dataset.unique()))
    fig = go.Figure(
        go.Heatmap(
            z=table.to_numpy(),
            x=list(table.columns),
            y=list(table.index),
            zmin=0.5,
            zmax=1.0,
            colorscale="Viridis",
            text=table.round(3).astype(str).to_numpy(),
            texttemplate="%{text}",
            hovertemplate="%{y} vs %{x}: AUROC %{z:.3f}<extra></extra>",
            colorbar={"title": "AUROC"},
        )
    )
    fig.update_layout(
        template=TEMPLATE,
        title={"text": "AUROC per detector and OOD dataset (OOD = positive)", "x": 0.01},
        height=max(300, 28 * len(table) + 120),
        margin={"l": 110, "r": 15, "t": 45, "b": 90},
        yaxis={"autorange": "reversed"},
    )
    return fig


def _headline(page: _Page, results: Results, shown) -> None:
    """The result in a few sentences: the best detector, the data it was measured on, the classifier; the run's
    warnings, each through ``shown`` (what the report may say about the server's paths)."""
    config, metrics, scores = results.config, results.metrics, results.scores
    best = best_detector(metrics)
    sets = ood_datasets_of(scores)
    errors, n_id = classifier_errors(scores)
    page.text(
        "p",
        f"Best detector by mean AUROC over the {len(sets)} OOD sets: {best['best_detector']} (AUROC "
        f"{best['best_auroc']:.3f}, FPR95 {best['best_fpr95']:.3f}), among {len(detectors_of(scores))} detectors. "
        f"ID test: {n_id:,} images of {config.get('id_test', {}).get('name', '?')}, the classifier "
        f"({config.get('backbone', '?')}) right on {n_id - errors:,} ({1 - errors / max(n_id, 1):.1%}). "
        f"OOD sets: {', '.join(sets)}.",
        class_="headline",
    )
    for event in results.events:  # what the run warned about (e.g. a model whose classes are not the ID labels)
        if event.get("event") == "warning":
            page.text("p", f"Warning: {shown(str(event.get('message', '')))}", class_="warning")


def _run_section(page: _Page, results: Results, paths: bool) -> None:
    """Where and how the run ran (environment, how each split was sampled, each stage's wall time and peak memory),
    then its config, folded (without ``paths``: each path entry cut to its last name, :func:`config_shown`)."""
    meta = results.meta or {}
    environment = {k: meta.get(k) for k in ("oodviz", "torch", "python", "device", "device_name") if k in meta}
    page.text("h2", "Run details")
    page.text("p", f"State: {results.state}. Run: {results.path.name}.")
    page.table(pd.DataFrame({"": list(environment), "value": [str(v) for v in environment.values()]}))
    sampled = sampling_table(meta)
    if len(sampled):
        page.text("p", "Data: how many images of each split the run used, and how they were sampled.")
        page.table(sampled)
    stages = meta.get("stages") or {}
    if stages:
        frame = pd.DataFrame.from_dict(stages, orient="index").rename_axis("stage").reset_index()
        shown = pd.DataFrame({"stage": frame["stage"]})
        if "wall_s" in frame.columns:
            shown["wall time"] = [f"{v:.2f} s" if pd.notna(v) else "–" for v in frame.wall_s]
        if "peak_cpu_rss" in frame.columns:
            shown["peak CPU memory"] = [format_bytes(v) if pd.notna(v) else "–" for v in frame.peak_cpu_rss]
        page.table(shown)
    page.add("<details><summary>Config</summary>")
    page.text("pre", json.dumps(config_shown(results.config, paths=paths), indent=2))
    page.add("</details>")


def _metrics_section(page: _Page, results: Results) -> None:
    metrics = results.metrics
    page.text("h2", "Metrics")
    page.text("p", "AUROC, AUPR and FPR95 per near/far group of OOD datasets (mean over the group's datasets).")
    wide = group_means(metrics, values=METRIC_NAMES)
    wide.columns = [f"{METRIC_HEADINGS[metric]} {group}" for metric, group in wide.columns]
    selective = [c for c in SELECTIVE_NAMES if c in metrics.columns]
    per_detector = metrics.groupby("detector", sort=False)[["id_accuracy", *selective]].first()
    page.table(wide.join(per_detector.rename(columns=METRIC_HEADINGS)).reset_index())
    if selective:
        page.text(
            "p",
            "AURC, risk at 95% coverage: the detector's score as a reject rule on the ID test set; risk = the "
            f"classifier's error rate among the samples it accepts (lower is better). "
            f"{classifier_errors_note(results.scores)[0]}",
        )
    page.add("<details><summary>Every OOD dataset</summary>")
    every = metrics[~is_group_mean(metrics)].drop(columns=["group"])
    page.table(every.rename(columns={"ood_dataset": "OOD dataset", **METRIC_HEADINGS}))
    page.add("</details>")
    page.figure(auroc_heatmap(metrics), "auroc heatmap")
    page.figure(risk_coverage_figure(risk_coverage_curves(results.scores)), "risk-coverage")


def _gallery(page: _Page, results: Results, rows: pd.DataFrame, title: str) -> None:
    page.text("h4", f"{title} ({len(rows)})")
    images = thumbnails(results, rows, size=64)
    items = []
    for image, row in zip(images, rows.itertuples(), strict=True):
        caption = (
            f"{row.dataset} #{row.index}: true {row.class_name}, predicted {row.predicted_name}, score {row.score:.4g}"
        )
        items.append(
            f'<figure><img src="{_png_data_uri(image)}" alt="{html.escape(caption)}" title="{html.escape(caption)}">'
            f"<figcaption>{html.escape(row.class_name)}→{html.escape(row.predicted_name)}<br>{row.score:.3g}"
            "</figcaption></figure>"
        )
    page.add(f'<div class="gallery">{"".join(items)}</div>')


def _detector_section(page: _Page, results: Results, detector: str, gallery_size: int, opened: bool) -> None:
    scores, names = results.scores, results.class_names
    threshold = default_threshold(scores, detector)
    colors = color_map(["ID", *ood_datasets_of(scores)])
    summary = results.metrics[(results.metrics.detector == detector) & ~is_group_mean(results.metrics)]
    page.add(f"<details{' open' if opened else ''}><summary>{html.escape(detector)}</summary>")
    page.text(
        "p",
        f"Mean AUROC {summary.auroc.mean():.3f}, mean FPR95 {summary.fpr95.mean():.3f} over "
        f"{len(summary)} OOD datasets. Threshold {threshold:.4g}: flags 95% of all OOD samples (score >= it).",
    )
    about = detectors.describe(detector)
    page.text("p", "What it does (higher = more OOD):")
    page.text("div", about["formula"], class_=FORMULA_CLASS, data_tex=about["formula"])
    citation = re.sub(r"\*([^*]+)\*", r"<i>\1</i>", html.escape(about["citation"]))  # its *title* in italics
    paper = html.escape(about["paper"])
    page.add(f'<p>{citation}, <a href="{paper}">{paper}</a>. Reads {html.escape(about["reads"])}. ')
    page.text("i", f"Fails when: {about['fails_when']}")
    page.add("</p>")
    by_label = {dataset: curves(scores, detector, dataset) for dataset in ood_datasets_of(scores)}
    page.add('<div class="row"><div>')
    page.figure(
        histogram_figure(score_histogram(scores, detector), threshold, title=f"{detector}: scores"), "histogram"
    )
    page.add("</div><div>")
    page.figure(roc_figure(by_label, title=f"{detector}: ROC (OOD = positive)", colors=colors), "roc")
    page.add("</div><div>")
    page.figure(pr_figure(by_label, title=f"{detector}: PR-Out (OOD = positive)", colors=colors), "pr")
    page.add("</div></div>")
    per_class = per_class_at_threshold(scores, detector, threshold, names)
    page.text("h4", "False alarms per ID class at that threshold (worst first)")
    page.figure(per_class_bar(per_class, title=f"{detector}: false-alarm rate per class"), "per-class")
    page.table(per_class)
    flagged, accepted = failure_cases(scores, detector, k=gallery_size, class_names=names)
    _gallery(page, results, flagged, "ID test samples most confidently flagged as OOD (false alarms)")
    _gallery(page, results, accepted, "OOD samples most confidently accepted as ID (misses)")
    page.add("</details>")


def report_html(run_dir, detectors=None, gallery_size: int = 8, figure_files: bool = False, paths: bool = True) -> str:
    """The report of the finished run ``run_dir`` as one HTML document (see the module docstring);
    ``detectors``: the detectors given a section (default: all, the first one opened); ``figure_files``:
    each figure also as PNG and SVG downloads (RuntimeError saying why when they cannot be drawn here);
    ``paths``: False for a report built for someone else (the app serving others): the config's paths and those the
    run's warnings name cut to their last names (:func:`~oodviz.config.plan.cut_paths`).
    ValueError for a run that is not finished; :class:`oodviz.results.tables.ResultsFileError` (a ValueError) naming the
    results file of a ``done`` run that is missing or cannot be read."""
    from plotly.offline import get_plotlyjs

    results = load_results(run_dir)
    results.check_results("scores.parquet", "metrics.csv")
    if not results.finished or results.metrics is None:
        raise ValueError(f"run {run_dir} is not finished (state {results.state!r}); a report needs its results")
    names = detectors_of(results.scores)
    chosen = names if detectors is None else list(detectors)
    unknown = [d for d in chosen if d not in names]
    if unknown:
        raise ValueError(f"no detector {', '.join(unknown)} in this run; it has: {', '.join(names)}")
    config = results.config
    title = f"oodviz report: {config.get('backbone', '?')} on {config.get('id_test', {}).get('name', '?')}"
    page = _Page()
    page.text("h1", title)
    _headline(page, results, (lambda text: text) if paths else cut_paths)
    page.text("p", CONVENTION + ". A sample is flagged as OOD when its score >= the threshold.", class_="convention")
    _metrics_section(page, results)
    page.text("h2", "Detectors")
    for position, detector in enumerate(chosen):
        _detector_section(page, results, detector, gallery_size, opened=position == 0)
    _run_section(page, results, paths)
    if figure_files:
        page.add_figure_files()
    katex_css, katex_js = katex_assets()
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style><style>{katex_css}</style><script>{get_plotlyjs()}</script>"
        f"<script>{katex_js}</script></head>\n<body>\n"
        + "\n".join(page.parts)
        + f"\n<script>{DRAW_FIGURES}</script>\n</body></html>\n"
    )


def write_report(run_dir, out, detectors=None, gallery_size: int = 8, figure_files: bool = False) -> Path:
    """Write :func:`report_html` of ``run_dir`` to ``out`` (atomically) and return its path."""
    out = Path(out)
    write_atomic(out, report_html(run_dir, detectors, gallery_size, figure_files).encode("utf-8"))
    return out
