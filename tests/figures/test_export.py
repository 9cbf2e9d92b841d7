"""Figures exported as PNG and SVG by kaleido 1.x in Debian's Chromium (skipped without either)."""

import base64
import io
import re
import xml.etree.ElementTree as ElementTree

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from oodviz.figures.export import figure_images, kaleido_problem
from oodviz.figures.plots import roc_figure
from oodviz.results.analysis import curves

pytestmark = [
    pytest.mark.skipif(kaleido_problem() is not None, reason=f"{kaleido_problem()}"),
    pytest.mark.browser,
]  # kaleido drives Chromium

RED = "#d62728"


def roc_of_two_sets():
    rng = np.random.default_rng(0)
    scores = pd.DataFrame(
        {
            "split": ["id_test"] * 200 + ["ood"] * 100,
            "dataset": ["id"] * 200 + ["far"] * 100,
            "index": np.arange(300),
            "label": [0] * 200 + [-1] * 100,
            "prediction": 0,
            "msp": np.concatenate([rng.normal(0, 1, 200), rng.normal(2, 1, 100)]),
        }
    )
    return roc_figure({"far": curves(scores, "msp", "far")}, colors={"far": RED})


def test_a_roc_figure_exports_as_a_png_of_the_asked_size_with_its_curve_drawn_and_as_an_svg():
    fig = roc_of_two_sets()
    files = figure_images([fig], width=500, height=400, scale=2)[0]
    image = Image.open(io.BytesIO(files["png"]))
    assert image.format == "PNG" and image.size == (1000, 800)  # width x height x scale
    pixels = np.asarray(image.convert("RGB")).astype(int)
    assert (pixels[5, 5] == 255).all() and (pixels[-5, -5] == 255).all()  # a white page around the plot
    red = np.abs(pixels - np.array([0xD6, 0x27, 0x28])).sum(axis=2) < 40
    assert red.sum() > 500  # the curve, in its colour (a 2 px line across the plot at scale 2)
    rows, cols = np.nonzero(red)
    # the ROC rises from bottom-left to top-right: its red pixels on the left lie lower than those on the right
    left, right = rows[cols < np.percentile(cols, 20)].mean(), rows[cols > np.percentile(cols, 80)].mean()
    assert left > right
    svg = ElementTree.fromstring(files["svg"])
    assert svg.tag.endswith("svg") and (svg.get("width"), svg.get("height")) == ("1000", "800")  # scaled too
    assert re.search(rb"stroke: ?rgb\(214, ?39, ?40\)", files["svg"])  # the same curve as a vector path


def test_the_report_offers_each_figure_as_png_and_svg(default_run, tmp_path):
    from oodviz.figures.report import FIGURE_CLASS, write_report

    out = write_report(default_run.path, tmp_path / "r.html", detectors=["msp"], gallery_size=2, figure_files=True)
    text = out.read_text()
    figures = text.count(f'class="{FIGURE_CLASS}"')
    pngs = re.findall(r'<a download="(figure-\d+-[\w-]+)\.png" href="data:image/png;base64,([^"]+)"', text)
    svgs = re.findall(r'<a download="(figure-\d+-[\w-]+)\.svg" href="data:image/svg\+xml;base64,', text)
    assert figures >= 5 and len(pngs) == figures and [n for n, _ in pngs] == svgs
    histogram = next(data for name, data in pngs if name.endswith("histogram"))
    assert Image.open(io.BytesIO(base64.b64decode(histogram))).size[0] >= 400
