"""From a chart to its images, in a real browser (Debian's Chromium) on a copy of the default run: a box dragged
over the score histogram, a click on a ROC point and a box over a stretch of a ROC curve, a hovered point and a
box on the feature-space map, each checked against the run's scores.parquet (and projection files) or sklearn; a
hovered point outside the sprite gets its thumbnail from the server, only the answer's fragment rerunning."""

import re
import shutil

import numpy as np
import pandas as pd
import pytest
from browser_app import app_url, runs_root, shoot  # noqa: F401  (fixtures of the app under test)
from helpers import chromium

from oodviz.figures.plots import hidden_at_first
from oodviz.results.analysis import score_histogram

pytestmark = chromium

#: the 4 significant digits of a gallery caption's score ("true class → prediction · score")
CAPTION_SCORE = re.compile(r"· (-?[\d.]+(?:e[-+]?\d+)?)$")


@pytest.fixture(scope="module")
def run_copy(default_run, runs_root):  # noqa: F811
    shutil.copytree(default_run.path, runs_root / "selection-copy")
    shutil.copytree(default_run.path.parent / ".features", runs_root / ".features", dirs_exist_ok=True)
    return runs_root / "selection-copy"


def drag(page, box: dict, start: float, stop: float, top: float = 0.02, bottom: float = 0.98) -> None:
    """Drag the mouse over the plot area ``box`` from fraction ``start`` to ``stop`` of its width."""
    x0, x1 = box["x"] + box["width"] * start, box["x"] + box["width"] * stop
    y0, y1 = box["y"] + box["height"] * top, box["y"] + box["height"] * bottom
    page.mouse.move(x0, y0)
    page.mouse.down()
    page.mouse.move((x0 + x1) / 2, (y0 + y1) / 2, steps=5)
    page.mouse.move(x1, y1, steps=5)
    page.mouse.up()


def paragraph(page, pattern: str):
    """The markdown paragraph whose text starts with ``pattern`` (a bold start is an element of its own)."""
    return page.locator('[data-testid="stMarkdownContainer"] p').filter(has_text=re.compile(pattern)).first


def gallery_captions(page) -> list[str]:
    """The captions of every image shown, read once every image is decoded (a rerun may swap them)."""
    return page.wait_for_function(
        "() => { const imgs = [...document.querySelectorAll('[data-testid=stImage]')];"
        " return imgs.length > 0 && imgs.every(e => { const i = e.querySelector('img'); return i && i.complete"
        " && i.naturalWidth > 0; }) && imgs.map(e => e.innerText.trim()); }",
        timeout=60_000,
    ).json_value()


def test_a_box_on_the_histogram_shows_the_images_whose_scores_lie_in_it(page, app_url, run_copy, tmp_path):  # noqa: F811
    scores = pd.read_parquet(run_copy / "scores.parquet")
    page.goto(f"{app_url}/run?run={run_copy.name}")
    page.get_by_role("tab", name="Score histograms").click(timeout=120_000)
    histogram = page.locator(".js-plotly-plot").first
    histogram.wait_for(timeout=60_000)
    hint = page.get_by_text("Drag a box (or a lasso) over the histogram")
    hint.wait_for(timeout=60_000)
    assert page.locator('[data-testid="stImage"]').count() == 0  # no gallery before a selection
    area = histogram.locator(".nsewdrag").first.bounding_box()
    drag(page, area, 0.40, 0.65)
    heading = paragraph(page, r"^Images with a \w+ score in \[")
    heading.wait_for(timeout=60_000)
    detector, low, high, total = re.match(
        r"^Images with a (\w+) score in \[(\S+), (\S+)\]: ([\d,]+)", heading.inner_text()
    ).groups()
    low, high, total = float(low), float(high), int(total.replace(",", ""))
    # the range is the dragged one: 40% to 65% of the axis, give or take a few pixels
    axis = histogram.evaluate("gd => gd._fullLayout.xaxis.range")
    span = axis[1] - axis[0]
    assert low == pytest.approx(axis[0] + 0.40 * span, abs=0.02 * span)
    assert high == pytest.approx(axis[0] + 0.65 * span, abs=0.02 * span)
    # every drawn set's count in range is scores.parquet's (the range printed to 6 digits: a sample on an edge may
    # move); a set hidden at first has no bars under the box, and none of its images are shown
    hidden = hidden_at_first(list(score_histogram(scores, detector)["counts"]))
    assert hidden and page.get_by_text(f"Not drawn at first: {', '.join(hidden)};").count() == 1
    drawn = scores[~scores.dataset.isin(hidden)]
    values = drawn[detector].to_numpy(dtype=np.float64)
    edge = 1e-5 * max(abs(low), abs(high), 1.0)
    inside = drawn[(values >= low - edge) & (values <= high + edge)]
    surely = drawn[(values >= low + edge) & (values <= high - edge)]
    assert len(surely) <= total <= len(inside) and total > 0
    for dataset in inside.dataset.unique():
        shown = page.get_by_text(re.compile(rf"^{re.escape(dataset)}: [\d,]+ in range"))
        count = int(re.match(r".*: ([\d,]+) in range", shown.inner_text()).group(1).replace(",", ""))
        assert (surely.dataset == dataset).sum() <= count <= (inside.dataset == dataset).sum(), dataset
    captions = gallery_captions(page)
    assert len(captions) >= 12
    for caption in captions:  # each image's score lies in the range and is a score of the set it names
        score = float(CAPTION_SCORE.search(caption).group(1))
        assert low - 1e-3 * abs(low) - edge <= score <= high + 1e-3 * abs(high) + edge, caption
        truth = caption.split(" → ")[0]
        rows = scores[scores.dataset == truth] if truth in set(scores.dataset) else scores[scores.split == "id_test"]
        assert np.isclose(rows[detector].to_numpy(dtype=np.float64), score, rtol=1e-3).any(), caption
    shoot(page, tmp_path, "histogram-selection")


def test_a_click_on_a_roc_point_shows_the_images_wrong_at_its_threshold(page, app_url, run_copy, tmp_path):  # noqa: F811
    scores = pd.read_parquet(run_copy / "scores.parquet")
    page.goto(f"{app_url}/run?run={run_copy.name}")
    page.get_by_role("tab", name="ROC / PR").click(timeout=120_000)
    roc = page.locator(".js-plotly-plot").filter(has_text="ROC").first
    roc.wait_for(timeout=60_000)
    points = roc.locator("g.trace.scatter").first.locator("path.point")
    points.first.wait_for(timeout=60_000)
    points.nth(points.count() // 3).click(force=True)
    heading = paragraph(page, r"^\w+ at threshold ")
    heading.wait_for(timeout=60_000)
    detector, threshold, ood_set, flagged, n_id, missed, n_ood = re.match(
        r"^(\w+) at threshold (\S+) \(ID vs (\S+)\): ([\d,]+) of ([\d,]+) ID .* ([\d,]+) of ([\d,]+) \S+ images accepted",
        heading.inner_text(),
    ).groups()
    threshold = float(threshold)
    ids = scores.loc[scores.split == "id_test", detector].to_numpy(dtype=np.float64)
    ood = scores.loc[scores.dataset == ood_set, detector].to_numpy(dtype=np.float32)  # the ROC's own float32 scores
    assert int(n_id.replace(",", "")) == len(ids) and int(n_ood.replace(",", "")) == len(ood)
    # the threshold is printed to 9 digits: a float32 score round-trips, so the counts are exact
    threshold32 = np.float32(threshold)
    assert int(flagged.replace(",", "")) == int((ids.astype(np.float32) >= threshold32).sum())
    assert int(missed.replace(",", "")) == int((ood < threshold32).sum())
    captions = gallery_captions(page)
    assert captions
    for caption in captions:
        truth, score = caption.split(" → ")[0], float(CAPTION_SCORE.search(caption).group(1))
        assert (score < threshold * (1 + 1e-3)) if truth == ood_set else (score >= threshold * (1 - 1e-3)), caption
    shoot(page, tmp_path, "roc-selection")


def test_a_box_over_a_stretch_of_a_roc_curve_shows_the_images_between_its_thresholds(page, app_url, run_copy):  # noqa: F811
    from sklearn.metrics import roc_curve

    scores = pd.read_parquet(run_copy / "scores.parquet")
    page.goto(f"{app_url}/run?run={run_copy.name}")
    page.get_by_role("tab", name="ROC / PR").click(timeout=120_000)
    roc = page.locator(".js-plotly-plot").filter(has_text="ROC").first
    roc.locator("g.trace.scatter path.point").first.wait_for(timeout=60_000)
    roc.scroll_into_view_if_needed()
    area = roc.locator(".nsewdrag").first.bounding_box()
    # every drawn point in page pixels: [trace, fpr, tpr, px, py] (curves carry customdata, the chance line not)
    drawn = roc.evaluate(
        "gd => { const L = gd._fullLayout, r = gd.getBoundingClientRect(); return gd._fullData.flatMap((t, k) =>"
        " Array.from(t.x, (x, i) => [k, t.customdata ? 1 : 0, x, t.y[i], r.left + L._size.l + L.xaxis.l2p(x),"
        " r.top + L._size.t + L.yaxis.l2p(t.y[i])])); }"
    )
    points = pd.DataFrame(drawn, columns=["trace", "curve", "fpr", "tpr", "px", "py"])
    names = roc.evaluate("gd => gd._fullData.map(t => t.name)")

    def box_around(trace: int, first: int, count: int, pad: float = 4.0):
        mine = points[points.trace == trace].iloc[first : first + count]
        x0, x1, y0, y1 = mine.px.min() - pad, mine.px.max() + pad, mine.py.min() - pad, mine.py.max() + pad
        inside = points[points.px.between(x0, x1) & points.py.between(y0, y1)]
        return (x0, x1, y0, y1), inside

    def in_plot(box) -> bool:  # a drag that starts on an axis does not select
        return area["x"] + 2 < box[0] and box[1] < area["x"] + area["width"] - 2 and area["y"] + 2 < box[2]

    # a stretch of 3 to 6 points of one curve, away from every other trace's points (the box selects only it)
    chosen = next(
        (trace, box, inside)
        for trace in sorted(points[points.curve == 1].trace.unique())
        for count in (6, 5, 4, 3)
        for first in range(1, int((points.trace == trace).sum()) - count)
        for box, inside in [box_around(trace, first, count)]
        if set(inside.trace) == {trace} and inside.tpr.nunique() > 1 and box[1] - box[0] > 8 and in_plot(box)
    )
    trace, (x0, x1, y0, y1), inside = chosen
    ood_set = names[trace].split(" (")[0]
    roc.locator('[data-title="Box Select"]').click(force=True)
    page.mouse.move(x0, y0)
    page.mouse.down()
    page.mouse.move((x0 + x1) / 2, (y0 + y1) / 2, steps=5)
    page.mouse.move(x1, y1, steps=5)
    page.mouse.up()
    heading = paragraph(page, r"^Images with a \w+ score in \[")
    heading.wait_for(timeout=60_000)
    detector, low, high, total = re.match(
        r"^Images with a (\w+) score in \[(\S+), (\S+)\]: ([\d,]+)", heading.inner_text()
    ).groups()
    # the reference: sklearn's ROC of the same scores; the box's points are its (fpr, tpr) points, their
    # thresholds' lowest and highest the range
    values = scores[detector].to_numpy(dtype=np.float64)
    is_id, is_set = (scores.split == "id_test").to_numpy(), (scores.dataset == ood_set).to_numpy()
    fpr, tpr, thresholds = roc_curve(is_set[is_id | is_set], values[is_id | is_set], drop_intermediate=True)
    picked = [
        t
        for f, p, t in zip(fpr.astype(np.float32), tpr.astype(np.float32), thresholds)
        if np.isfinite(t) and ((inside.fpr == f) & (inside.tpr == p)).any()
    ]
    assert len(picked) == len(inside) >= 3
    expected_low, expected_high = min(picked), max(picked)
    assert float(low) == pytest.approx(expected_low, rel=1e-5) and float(high) == pytest.approx(expected_high, rel=1e-5)
    in_range = (values >= expected_low) & (values <= expected_high)
    counts = {"digits-test": int((in_range & is_id).sum()), ood_set: int((in_range & is_set).sum())}
    assert int(total.replace(",", "")) == sum(counts.values()) > 0
    for dataset, count in counts.items():
        if count:
            shown = page.get_by_text(re.compile(rf"^{re.escape(dataset)}: [\d,]+ in range")).inner_text()
            assert int(re.match(r".*: ([\d,]+) in range", shown).group(1).replace(",", "")) == count, dataset
    captions = gallery_captions(page)
    assert len(captions) == sum(min(12, c) for c in counts.values())
    for caption in captions:  # each image's score in the range, of the ID test set or of the curve's OOD set
        score = float(CAPTION_SCORE.search(caption).group(1))
        assert expected_low * (1 - 1e-3) - 1e-9 <= score <= expected_high * (1 + 1e-3) + 1e-9, caption
        truth = caption.split(" → ")[0]
        assert truth == ood_set or truth in {str(c) for c in range(8)}, caption


def isolated_digit(frame: pd.DataFrame, unit: np.ndarray, rows: np.ndarray) -> pd.Series:
    """The ID test digit among the map's ``rows`` farthest from any other point (``unit``: each point's place in
    pixels): the mouse on it hovers it and no other point."""
    candidates = [r for r in rows if frame.dataset.iloc[r] == "digits-test"]
    gaps = [np.sort(np.hypot(*(unit - unit[r]).T))[1] for r in candidates]
    return frame.iloc[candidates[int(np.argmax(gaps))]]


def hover(page, chart, row: pd.Series) -> None:
    where = chart.evaluate(
        "(gd, p) => { const L = gd._fullLayout, r = gd.getBoundingClientRect();"
        " return [r.left + L._size.l + L.xaxis.l2p(p[0]), r.top + L._size.t + L.yaxis.l2p(p[1])]; }",
        [float(row.x), float(row.y)],
    )
    page.mouse.move(where[0] - 3, where[1] - 3)
    page.mouse.move(*where, steps=3)


def test_the_feature_map_shows_a_hovered_points_thumbnail_and_the_images_of_a_box(page, app_url, run_copy, tmp_path):  # noqa: F811
    import base64
    import io
    import json

    from PIL import Image
    from sklearn.datasets import load_digits

    from oodviz.data import digits_split
    from oodviz.figures.projection_map import KEYS, THUMBNAIL_SIZE
    from oodviz.figures.thumbnails import thumbnails

    received = []  # each websocket message from the server
    page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: received.append(payload)))
    page.goto(f"{app_url}/run?run={run_copy.name}")
    page.get_by_role("tab", name="Feature space").click(timeout=120_000)
    page.get_by_role("button", name="Compute the PCA map").click(timeout=60_000)
    chart = page.locator(".js-plotly-plot").filter(has_text="PCA of the features")
    chart.wait_for(timeout=120_000)
    frame = pd.read_parquet(run_copy / "projection-pca.parquet")
    keys = pd.read_parquet(run_copy / "projection-pca-thumbnails.parquet")
    page.get_by_text("Select points on the map").wait_for(timeout=60_000)
    chart.scroll_into_view_if_needed()  # the mouse reaches only what is in view
    area = chart.locator(".nsewdrag").first.bounding_box()
    # the most isolated ID test digit that has a thumbnail in the sprite
    ranges = chart.evaluate("gd => [gd._fullLayout.xaxis.range, gd._fullLayout.yaxis.range]")
    (x0, x1), (y0, y1) = ranges
    unit = np.c_[(frame.x - x0) / (x1 - x0) * area["width"], (frame.y - y0) / (y1 - y0) * area["height"]]
    in_sprite = frame.assign(row=np.arange(len(frame))).merge(keys).row.to_numpy()
    assert len(frame) <= 15_000 and len(in_sprite) < len(frame)  # every point drawn, some outside the sprite
    row = isolated_digit(frame, unit, in_sprite)
    hover(page, chart, row)
    panel = page.locator(".oodviz-hover-thumbnail")
    panel.wait_for(state="visible", timeout=30_000)
    named = re.match(r"^(\S+) #(\d+) · true (\S+) · predicted (\S+)$", panel.inner_text().strip())
    assert named, panel.inner_text()
    assert (named.group(1), int(named.group(2))) == (row.dataset, int(row["index"]))
    assert (named.group(3), named.group(4)) == (str(row.label), str(row.prediction))  # digits: the name is the digit
    # the thumbnail shown is that digit's image: sklearn's 8x8 pixels, in blocks (through a lossy WebP sprite)
    source = panel.locator("img").get_attribute("src")
    assert source.startswith("data:image/png;base64,")
    shown = np.asarray(Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))).convert("L"), float)
    digit = load_digits().images[digits_split("test")[2][int(row["index"])]]
    reference = np.kron(digit, np.ones((shown.shape[0] // 8, shown.shape[1] // 8)))
    assert np.corrcoef(shown.ravel(), reference.ravel())[0, 1] > 0.95
    shoot(page, tmp_path, "feature-space-hover")
    # a digit outside the sprite: once the mouse rests on it the server sends its thumbnail (lossless), which the
    # page decodes to the pixels of oodviz.figures.thumbnails' image of that sample and of sklearn's digit
    page.mouse.move(area["x"] + 2, area["y"] + area["height"] + 60)
    panel.wait_for(state="hidden", timeout=30_000)
    row = isolated_digit(frame, unit, np.setdiff1d(np.arange(len(frame)), in_sprite))
    before = len(received)
    hover(page, chart, row)
    panel.wait_for(state="visible", timeout=30_000)
    page.wait_for_function(
        "() => { const p = document.querySelector('.oodviz-hover-thumbnail'), i = p && p.querySelector('img');"
        " return p.dataset.source === 'server' && i.complete && i.naturalWidth > 0 && i.style.display !== 'none'; }",
        timeout=60_000,
    )
    assert panel.get_attribute("data-row") == str(frame.index.get_loc(row.name)) and not panel.get_attribute(
        "data-tile"
    )
    named = re.match(r"^(\S+) #(\d+) · true (\S+) · predicted (\S+)$", panel.inner_text().strip())
    assert named and (named.group(1), int(named.group(2))) == (row.dataset, int(row["index"])), panel.inner_text()
    rgba = panel.locator("img").evaluate(
        "img => { const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;"
        " const g = c.getContext('2d'); g.drawImage(img, 0, 0);"
        " return [c.width, c.height, Array.from(g.getImageData(0, 0, c.width, c.height).data)]; }"
    )
    width, height, pixels = rgba
    decoded = np.array(pixels, dtype=np.uint8).reshape(height, width, 4)[..., :3]
    config = json.loads((run_copy / "config.json").read_text())
    [expected] = thumbnails(config, pd.DataFrame([row[KEYS]]), size=THUMBNAIL_SIZE)
    np.testing.assert_array_equal(decoded, np.asarray(expected.convert("RGB")))
    digit = np.round(load_digits().images[digits_split("test")[2][int(row["index"])]] * 255 / 16)
    np.testing.assert_array_equal(decoded[..., 0], np.kron(digit, np.ones((4, 4))))
    # only the answer's fragment reran: a few KiB came, and not the map (its title is in its spec)
    answered = received[before:]
    size = sum(len(m) for m in answered)
    assert 0 < size < 16 * 1024, size
    assert not any(b"PCA of the features" in (m if isinstance(m, bytes) else m.encode()) for m in answered)
    page.mouse.move(area["x"] + 2, area["y"] + area["height"] + 60)  # off the plot: the panel goes
    panel.wait_for(state="hidden", timeout=30_000)
    before = len(received)  # hovered again: the page has it, nothing is asked for
    hover(page, chart, row)
    panel.wait_for(state="visible", timeout=30_000)
    assert panel.get_attribute("data-source") == "server" and panel.locator("img").is_visible()
    page.wait_for_timeout(1000)  # more than the panel waits before it asks
    assert len(received) == before
    page.mouse.move(area["x"] + 2, area["y"] + area["height"] + 60)
    panel.wait_for(state="hidden", timeout=30_000)
    chart.locator('[data-title="Box Select"]').click(force=True)  # a box, not the map's default lasso
    drag(page, area, 0.3, 0.7, top=0.3, bottom=0.7)
    heading = paragraph(page, r"^[\d,]+ selected point\(s\)")
    heading.wait_for(timeout=60_000)
    selected = int(heading.inner_text().split(" ")[0].replace(",", ""))

    def inside(margin: float) -> int:
        xs, ys = (frame.x - x0) / (x1 - x0), (frame.y - y0) / (y1 - y0)  # y axis: 0 at the bottom
        return int(((xs >= 0.3 + margin) & (xs <= 0.7 - margin) & (ys >= 0.3 + margin) & (ys <= 0.7 - margin)).sum())

    assert 0 < inside(0.01) <= selected <= inside(-0.01)  # the points in the box, give or take its edge pixels
    assert gallery_captions(page)
    shoot(page, tmp_path, "projection-selection")


def test_a_figure_downloads_as_png_and_svg_where_kaleido_works(page, app_url, run_copy, tmp_path):  # noqa: F811
    import io
    import xml.etree.ElementTree as ElementTree

    from PIL import Image

    from oodviz.figures.export import kaleido_problem

    if kaleido_problem() is not None:
        pytest.skip(kaleido_problem())
    page.goto(f"{app_url}/run?run={run_copy.name}")
    page.get_by_role("tab", name="Risk–coverage").click(timeout=120_000)
    chart = page.locator(".js-plotly-plot").filter(has_text="coverage").first
    chart.wait_for(timeout=60_000)
    page.get_by_role("button", name="Export PNG / SVG").click()
    with page.expect_download(timeout=120_000) as png:
        page.get_by_role("button", name="Download PNG").click(timeout=120_000)
    image = Image.open(io.BytesIO(png.value.path().read_bytes()))
    assert png.value.suggested_filename == "risk-coverage.png" and image.format == "PNG"
    layout = chart.evaluate("gd => [gd.layout.width || 900, gd.layout.height]")
    assert image.size[1] == layout[1]  # the figure's own height; its width the layout's or 900 px
    pixels = np.asarray(image.convert("L"))
    assert pixels.min() < 100 and (pixels > 250).mean() > 0.5  # dark lines and text on a white page
    with page.expect_download(timeout=60_000) as svg:
        page.get_by_role("button", name="Download SVG").click()
    assert ElementTree.parse(svg.value.path()).getroot().tag.endswith("svg")
