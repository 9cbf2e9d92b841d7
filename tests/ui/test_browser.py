"""The app in a real browser: Debian's Chromium driven by Playwright against `streamlit run app.py`.

Run the default, watch progress move, see the metrics table, a histogram, a ROC curve and a
failure gallery with images; cancel a run; reload mid-run and reattach. Screenshots of each page
go to the test's tmp dir, and to assets/screenshots/ with OODVIZ_UPDATE_SCREENSHOTS=1 (README).
"""

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import numpy as np
import pandas as pd
import pytest
from browser_app import app_url, runs_root, shoot  # noqa: F401  (fixtures of the app under test)
from helpers import chromium, oodviz_in_process
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import expect

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "assets" / "screenshots"

pytestmark = chromium
IDLE = "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')"  # no rerun under way


#: Scroll the app's main area (``stMain``) to put an element 70 px from its top (Streamlit's header bar covers the top)
SCROLL_TO_TOP = """e => {
  const main = document.querySelector('[data-testid=stMain]');
  main.scrollTop += e.getBoundingClientRect().top - main.getBoundingClientRect().top - 70;
}"""


def start_default(page, app_url):  # noqa: F811
    page.goto(app_url)
    page.get_by_role("button", name="Run the default").click(timeout=120_000)  # a cold server: slow first load
    page.wait_for_url(re.compile(r"\?run="), timeout=30_000)
    return page.url.split("run=")[1]


def progress_texts(page) -> str:
    return " ".join(page.locator('[data-testid="stProgress"]').all_inner_texts())


def test_run_the_default_watch_it_and_analyse_it(page, app_url, tmp_path):  # noqa: F811
    page.goto(app_url)
    page.get_by_role("button", name="Run the default").wait_for(timeout=120_000)  # a cold server: slow first load
    shoot(page, tmp_path, "landing")
    run_id = start_default(page, app_url)
    page.get_by_text(f"Run {run_id}").first.wait_for(timeout=30_000)
    page.get_by_text(  # the headline says what runs (waited on: a loaded browser draws it a moment later)
        re.compile(r"^digits-cnn · ID digits-test · OOD digits-heldout, .* · 20 detectors$")
    ).first.wait_for(timeout=30_000)
    seen = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not page.get_by_text("Best detector per column").count():
        text = progress_texts(page)
        if text:
            seen.add(text)
            if len(seen) == 3:
                shoot(page, tmp_path, "watch")
        time.sleep(0.3)
    assert len(seen) >= 2, f"the progress bar never moved: {seen}"  # progress moved while we watched
    stages = {int(k) for text in seen for k in re.findall(r"Stage (\d+) of 46", text)}
    assert len(stages) >= 2 and all(1 <= k <= 46 for k in stages), seen  # the whole run's stages, counted
    assert any(re.search(r"run ETA \d+:\d\d", text) for text in seen), seen
    page.get_by_text("Best detector per column").wait_for(timeout=300_000)  # a loaded machine: minutes
    table = page.locator('[data-testid="stDataFrame"]').first
    table.wait_for(state="visible", timeout=60_000)  # the grid is laid out after its caption on a loaded machine
    shoot(page, tmp_path, "metrics")

    page.get_by_role("tab", name="Score histograms").click()
    histogram = page.locator(".js-plotly-plot").first
    histogram.wait_for(timeout=30_000)
    assert histogram.locator("g.trace.bars").count() == 6  # ID + five OOD sets drawn; the sixth in the legend only
    assert histogram.locator("g.traces").count() == 7  # legend entries: every set
    assert page.get_by_text(re.compile(r"95% of every OOD set: ")).count()
    assert histogram.get_by_text(re.compile(r"^density")).count()
    shoot(page, tmp_path, "histogram")
    page.get_by_role("radio", name="count", exact=True).click()  # the density toggle: counts now
    histogram.get_by_text("samples", exact=True).wait_for(timeout=30_000)
    assert not histogram.get_by_text(re.compile(r"^density")).count()

    page.get_by_role("tab", name="ROC / PR").click()
    roc = page.locator(".js-plotly-plot").filter(has_text="ROC").first
    roc.wait_for(timeout=30_000)
    assert roc.get_by_text(re.compile(r"digits-heldout \(AUROC 0\.\d{3}\)")).count()
    shoot(page, tmp_path, "roc")

    page.get_by_role("tab", name="Failure cases").click()
    page.get_by_text("ID images flagged as OOD").wait_for(timeout=30_000)
    # Both galleries drawn, every image decoded by the browser as a real 64 px thumbnail. Read in the same
    # JavaScript call that waits: a rerun may swap an <img> for a fresh, not yet decoded one between two reads.
    widths = page.wait_for_function(
        "() => { const imgs = [...document.querySelectorAll('[data-testid=stImage] img')];"
        " return imgs.length >= 12 && imgs.every(i => i.complete && i.naturalWidth >= 64)"
        " && imgs.map(i => i.naturalWidth); }",
        timeout=30_000,
    ).json_value()
    assert len(widths) >= 12 and min(widths) >= 64
    shoot(page, tmp_path, "failures")
    # the slider (shared with the histogram) changes what the galleries show
    captions = page.locator('[data-testid="stImage"]').all_inner_texts()
    slider = page.get_by_role("slider").first
    slider.focus()
    page.keyboard.press("End")  # the highest threshold: one key press, so no rerun can drop the focus mid-way

    def shown() -> list[str]:
        return page.locator('[data-testid="stImage"]').all_inner_texts()

    deadline, settled = time.monotonic() + 30, []
    while time.monotonic() < deadline and len(settled) < 2:  # changed on two reads 1 s apart: not a redraw
        settled = [*settled, shown()] if shown() != captions else []
        time.sleep(1)
    assert len(settled) == 2 and settled[-1] != captions, "the galleries did not follow the threshold slider"


def running_worker_pid(run_dir: Path, timeout_s: float = 30) -> int:
    """The pid of ``run_dir``'s worker once its ``status.json`` says it runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = json.loads((run_dir / "status.json").read_text())
        except (OSError, ValueError):  # not written yet, or caught mid-replace
            status = {}
        if status.get("state") == "running" and status.get("worker_pid"):
            return int(status["worker_pid"])
        time.sleep(0.05)
    raise AssertionError(f"no running worker in {run_dir} after {timeout_s} s")


def test_reload_mid_run_reattaches_to_the_same_run(page, app_url, runs_root, tmp_path):  # noqa: F811
    run_id = start_default(page, app_url)
    # The worker is paused while the tabs reload and cancel: the run reuses the stores of the run before it and
    # finished in 14 s once in CI, before a loaded browser had clicked Cancel in the second tab.
    worker = running_worker_pid(runs_root / run_id)
    os.kill(worker, signal.SIGSTOP)
    try:
        page.get_by_text(f"Run {run_id}").first.wait_for(timeout=30_000)
        page.reload()
        assert page.url.endswith(f"run={run_id}")
        page.get_by_text(f"Run {run_id}").first.wait_for(timeout=30_000)
        other = page.context.new_page()
        other.goto(f"{app_url}/?run={run_id}")  # another tab, same run
        other.get_by_text(run_id).first.wait_for(timeout=30_000)
        # both tabs follow the live run: a cancel from the second shows in the reloaded first
        other.get_by_role("button", name="Cancel run").click(timeout=30_000)
    finally:
        os.kill(worker, signal.SIGCONT)
    page.get_by_text("The run was cancelled").wait_for(timeout=60_000)
    assert page.url.endswith(f"run={run_id}")
    other.close()


def test_cancel_a_run(page, app_url, runs_root, tmp_path):  # noqa: F811
    run_id = start_default(page, app_url)
    worker = running_worker_pid(runs_root / run_id)
    os.kill(worker, signal.SIGSTOP)  # paused until the click: a short run cannot finish first (the reload test)
    try:
        page.get_by_role("button", name="Cancel run").click(timeout=30_000)
    finally:
        os.kill(worker, signal.SIGCONT)
    page.get_by_text("The run was cancelled").wait_for(timeout=60_000)
    assert page.url.endswith(f"run={run_id}")
    shoot(page, tmp_path, "cancelled")


def _fashion_installed() -> bool:
    from oodviz.data import torchvision_sets

    return torchvision_sets.system_copy("fashion-mnist") is not None


@pytest.mark.skipif(
    not _fashion_installed(), reason="needs Debian's dataset-fashion-mnist (make test installs it as root)"
)
def test_fashion_mnist_results_pages_show_real_28x28_thumbnails(page, app_url, runs_root, tmp_path):  # noqa: F811
    """The Fashion-MNIST preset's quick example config, run by the CLI (in this process), analysed in the app (README
    screenshots)."""
    from oodviz.config.run import RunConfig

    config = RunConfig.load(REPO / "examples" / "fashion-mnist-quick.toml")
    config.data_root = str(tmp_path / "data")
    config.save(tmp_path / "quick.json")
    done = oodviz_in_process("run", tmp_path / "quick.json", "--out", runs_root / "fashion-quick")
    assert done.returncode == 0, done.stderr[-3000:]
    page.goto(f"{app_url}/?run=fashion-quick")
    page.get_by_text("Best detector per column").wait_for(timeout=60_000)
    # means view: no row per OOD set, and the near mean says which sets it averages
    assert page.get_by_text(re.compile(r"^near = mean over fashion-mnist-heldout")).count() == 1
    shoot(page, tmp_path, "fashion-metrics")
    page.get_by_role("tab", name="Score histograms").click()
    page.locator(".js-plotly-plot").first.wait_for(timeout=30_000)
    shoot(page, tmp_path, "fashion-histogram")
    page.get_by_role("tab", name="ROC / PR").click()
    roc = page.locator(".js-plotly-plot").filter(has_text="ROC").first
    roc.wait_for(timeout=30_000)
    assert roc.get_by_text(re.compile(r"fashion-mnist-heldout \(AUROC 0\.\d{3}\)")).count()
    shoot(page, tmp_path, "fashion-roc")
    page.get_by_role("tab", name="Failure cases").click()
    images = page.locator('[data-testid="stImage"] img')
    images.first.wait_for(timeout=30_000)
    assert images.count() >= 12
    assert page.get_by_text(re.compile(r"→ (Sneaker|Coat|T-shirt/top|Pullover|Sandal|Bag|Dress|Trouser)")).count()
    # the README shows the galleries: their heading at the top of the window (below the app's header bar), the
    # mouse off the images (a hovered image shows its fullscreen button)
    page.get_by_text("ID images flagged as OOD").first.evaluate(SCROLL_TO_TOP)
    page.mouse.move(1, 1)
    shoot(page, tmp_path, "fashion-failures")


def test_a_bad_form_shows_each_error_under_its_field_and_starts_nothing(page, app_url, runs_root, tmp_path):  # noqa: F811
    before = sorted(p.name for p in runs_root.iterdir())
    page.goto(app_url)
    form = page.locator('[data-testid="stMain"]')  # the New run page: the form in the main area
    form.get_by_text("In-distribution", exact=True).wait_for(timeout=120_000)
    form.locator('[data-testid="stSelectbox"]').filter(has_text="In-distribution").click(timeout=60_000)
    page.get_by_role("option", name="image folders (your own)").click()
    page.wait_for_function(IDLE, timeout=60_000)  # every field reruns the page: the rerun over before typing
    fit = form.get_by_label("ID fit folder (image folders only)")
    fit.fill(str(tmp_path / "no-such-folder"))
    test = form.get_by_label("ID test folder (image folders only)")
    test.fill(str(tmp_path))  # exists, holds no images
    test.press("Enter")  # a text field is sent when it is left or Enter is pressed
    page.wait_for_function(IDLE, timeout=60_000)
    form.get_by_role("button", name="Start run").click()
    missing = form.get_by_text(f"Image folder {tmp_path / 'no-such-folder'} does not exist")
    missing.wait_for(timeout=60_000)
    empty = form.get_by_text(re.compile(rf"No images found under {re.escape(str(tmp_path))}"))
    assert empty.count() == 1 and form.get_by_text("Fix first: 2 problem(s)").count() == 1
    # each error right under its own field: between that field and the next one
    top = {name: box.bounding_box()["y"] for name, box in (("fit", fit), ("test", test))}
    assert top["fit"] < missing.bounding_box()["y"] < top["test"] < empty.bounding_box()["y"]
    shoot(page, tmp_path, "form-errors")
    assert sorted(p.name for p in runs_root.iterdir()) == before and "run=" not in page.url


def test_probe_an_image_and_the_issue_15_views_of_the_default_run(page, app_url, runs_root, default_run, tmp_path):  # noqa: F811
    """Upload one PNG to "Probe images": each detector's score and verdict is shown, equal to `oodviz score`'s
    (``score_images``, in process) on the same file; then the risk–coverage, feature space and teaching views
    (README screenshots, 1000 px)."""
    from PIL import Image

    from oodviz.pipeline.scoring import score_images

    shutil.copytree(default_run.path, runs_root / "default-copy")
    shutil.copytree(default_run.path.parent / ".features", runs_root / ".features", dirs_exist_ok=True)
    probe = tmp_path / "probe.png"
    ramp = (np.arange(64, dtype=np.uint8).reshape(8, 8) * 4)[..., None].repeat(3, axis=2)
    Image.fromarray(ramp).save(probe)
    expected = score_images(default_run.path, [probe])
    assert not expected.not_loaded and not expected.unreadable
    scores = expected.table
    page.set_viewport_size({"width": 1000, "height": 1000})
    page.goto(f"{app_url}/?run=default-copy")
    page.get_by_role("tab", name="Probe images").click(timeout=60_000)
    page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(probe))
    table = page.locator('[data-testid="stTable"]')
    table.wait_for(timeout=120_000)
    rows = table.locator("tbody tr").all_inner_texts()
    assert len(rows) == len(scores)
    for row, expected_row in zip(rows, scores.itertuples()):
        cells = [cell.strip() for cell in row.split("\t")]
        assert cells[0] == expected_row.detector and cells[-1] == expected_row.verdict
        assert float(cells[1]) == pytest.approx(expected_row.score, rel=1e-3)
    assert page.get_by_text(f"predicted {scores.class_name.iloc[0]}").count()
    tabs = page.get_by_role("tablist").first
    show_tabs = "element => { element.style.scrollMarginTop = '80px'; element.scrollIntoView(); }"
    tabs.evaluate(show_tabs)  # the tabs at the top of the screenshot, below the page's header
    shoot(page, tmp_path, "probe")

    page.get_by_role("tab", name="Risk–coverage").click()
    page.locator(".js-plotly-plot").filter(has_text="coverage").first.wait_for(timeout=30_000)
    tabs.evaluate(show_tabs)
    shoot(page, tmp_path, "risk-coverage")

    page.get_by_role("tab", name="Feature space").click()
    page.get_by_role("button", name="Compute the PCA map").click(timeout=30_000)
    page.locator(".js-plotly-plot").filter(has_text="PCA of the features").wait_for(timeout=120_000)
    page.get_by_role("tab", name="Probe images").click()  # away and back: the stored map, without the button
    page.get_by_role("tab", name="Feature space").click()
    page.locator(".js-plotly-plot").filter(has_text="PCA of the features").wait_for(timeout=60_000)
    tabs.evaluate(show_tabs)
    shoot(page, tmp_path, "feature-space")

    page.get_by_role("tab", name="ROC / PR").click()
    # the tab is written into the URL by a rerun: a popover opened before that rerun ends may be drawn closed again
    page.wait_for_url(re.compile(r"[?&]tab=roc-pr"), timeout=60_000)
    page.wait_for_function(IDLE, timeout=120_000)
    about = page.get_by_role("button", name="What it does")
    formula = page.locator(".katex:visible").first  # the chosen detector's formula
    for attempt in range(3):  # a rerun still drawing may close it again: open it until the formula shows
        if not formula.count():
            about.click(timeout=30_000)
        try:
            formula.wait_for(timeout=20_000)
            break
        except PlaywrightTimeout:
            if attempt == 2:
                raise
    about.evaluate(show_tabs)
    shoot(page, tmp_path, "teaching")
    page.keyboard.press("Escape")  # the popover closed: a click elsewhere would only close it
    try:
        formula.wait_for(state="hidden", timeout=15_000)
    except PlaywrightTimeout:  # the key went elsewhere: its button closes it too
        about.click(timeout=30_000)
        formula.wait_for(state="hidden", timeout=30_000)

    # what each detector does: the Detectors page, a link of the top bar (was: an expander of the sidebar)
    page.locator('[data-testid="stTopNavLink"]').filter(has_text="Detectors").click(timeout=30_000)
    page.wait_for_url(re.compile(r"/detectors"), timeout=60_000)
    main = page.locator('[data-testid="stMain"]')
    main.locator(".katex").first.wait_for(timeout=30_000)  # the first detector's formula
    main.get_by_text("Fails when").evaluate("element => element.scrollIntoView({block: 'end'})")
    main.get_by_text("Fails when").wait_for(state="visible", timeout=30_000)
    assert page.locator('[data-testid="stException"]').count() == 0


#: Leaf elements whose text the browser cuts with an ellipsis (labels, chips, buttons, tabs).
CUT_TEXTS = """() => [...document.querySelectorAll('p, span, label, button, div')]
  .filter(e => e.children.length === 0 && e.textContent.trim() && e.scrollWidth > e.clientWidth + 1
               && getComputedStyle(e).textOverflow === 'ellipsis')
  .map(e => e.textContent.trim())"""


def cli_run(runs_root: Path, name: str, config: dict) -> Path:  # noqa: F811
    """A real run made by ``oodviz run CONFIG --out runs_root/name`` (the default data unless ``config`` says), the
    command's code in this process (the page is under test here, not the command's process)."""
    path = runs_root.parent / f"{name}.json"
    path.write_text(json.dumps(config))
    out = runs_root / name
    done = oodviz_in_process("run", path, "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def mean_auroc(run: Path, sets: list[str]) -> pd.Series:
    """Per detector, the mean AUROC over ``sets``: from the run's metrics.csv (the reference for the scatter)."""
    metrics = pd.read_csv(run / "metrics.csv")
    return metrics[metrics.ood_dataset.isin(sets)].groupby("detector").auroc.mean()


def test_compare_two_real_runs_and_nothing_cut_at_1000_px(page, app_url, runs_root, default_run, tmp_path):  # noqa: F811
    """Every result tab of the run in sight (eight: no "Which layer?" for a one-layer run) and no cut label at 1000 px; comparing two runs on other OOD sets says so
    above everything, two on the same data show the per-detector scatter of their mean AUROCs."""
    from oodviz.ui.history import runs_table
    from oodviz.ui.results import run_tabs

    a = runs_root / "cmp-a"
    shutil.copytree(default_run.path, a)
    same = cli_run(runs_root, "cmp-same", {"detectors": ["msp", "energy", "mahalanobis"], "batch_size": 64})
    other = cli_run(
        runs_root, "cmp-other", {"detectors": ["msp", "energy"], "ood": ["noise-gaussian", "photo-patches"]}
    )
    page.set_viewport_size({"width": 1000, "height": 1000})
    page.goto(f"{app_url}/?run=cmp-a")
    page.get_by_text("Best detector per column").wait_for(timeout=120_000)
    page.wait_for_function(IDLE, timeout=120_000)
    tabs = page.get_by_role("tablist").first
    tabs.wait_for(timeout=30_000)
    try:  # nothing scrolled out of sight, once the tab row has its final layout (1 px of rounding allowed)
        page.wait_for_function(
            "() => { const e = document.querySelector('[role=tablist]'); return e && e.scrollWidth <= e.clientWidth + 1; }",
            timeout=15_000,
        )
    except PlaywrightTimeout:
        shoot(page, tmp_path, "tabs-1000px-scrolled")
        raise AssertionError(f"the tab row scrolls: {tabs.evaluate('e => [e.scrollWidth, e.clientWidth]')}") from None
    page.wait_for_function(  # the header above the tabs drawn whole: every tab at its final place
        "() => new Set([...document.querySelectorAll('[role=tab]')].map(t => t.getBoundingClientRect().top)).size == 1",
        timeout=30_000,
    )
    boxes = page.evaluate(  # in one go: a line drawn above the tabs meanwhile moves them all, not some
        "() => [...document.querySelectorAll('[role=tab]')].map(t => { const r = t.getBoundingClientRect(); "
        "return {x: r.x, y: r.y, width: r.width, height: r.height}; })"
    )
    assert len(boxes) == len(run_tabs({})) == 8, boxes  # every tab of a one-layer run
    tops = [b["y"] for b in boxes]
    assert max(tops) - min(tops) < min(b["height"] for b in boxes) / 2, boxes  # on one line
    assert all(b["x"] >= 0 and b["x"] + b["width"] <= 1000 for b in boxes)  # in the window
    assert page.evaluate(CUT_TEXTS) == []
    shoot(page, tmp_path, "tabs-1000px")

    # the Runs page, a link of the top bar (was: the landing page's run list)
    page.locator('[data-testid="stTopNavLink"]').filter(has_text="Runs").click(timeout=30_000)
    page.wait_for_url(re.compile(r"/runs"), timeout=60_000)
    grid = page.locator('[data-testid="stDataFrame"]').first
    grid.wait_for(timeout=120_000)
    order = list(runs_table(runs_root).run)
    page.wait_for_function(IDLE, timeout=120_000)
    assert page.evaluate(CUT_TEXTS) == []  # the Runs page's filters, buttons and chips too
    buttons = page.locator('[data-testid^="stBaseButton"]:visible')  # a multiselect's arrow is "Open" too
    compare = buttons.filter(has_text=re.compile(r"^Compare$"))

    def pick(*names):  # the row markers of the run list (a canvas): one click each toggles a row
        grid.scroll_into_view_if_needed()
        box = grid.bounding_box()
        for name in names:
            page.mouse.click(box["x"] + 15, box["y"] + 35 + 35 * order.index(name) + 17)
            page.wait_for_timeout(300)
        page.wait_for_function(IDLE, timeout=60_000)

    def compared(*names) -> tuple[str, str]:  # two rows picked, Compare pressed: the Compare page's runs A and B
        pick(*names)
        compare.click(timeout=60_000)
        page.wait_for_url(re.compile(r"/compare\?"), timeout=60_000)
        params = {k: v[-1] for k, v in parse_qs(urlparse(page.url).query).items()}
        assert {params["a"], params["b"]} == set(names), page.url
        return params["a"], params["b"]

    assert compare.is_disabled()  # nothing selected
    compared("cmp-a", "cmp-other")
    warning = page.get_by_text("These runs are on different data")
    warning.wait_for(timeout=60_000)
    assert "the OOD sets differ" in warning.inner_text()
    scatter = page.locator(".js-plotly-plot").filter(has_text="Mean AUROC over")
    scatter.wait_for(timeout=60_000)
    assert warning.bounding_box()["y"] < scatter.bounding_box()["y"]  # said before anything is shown
    assert scatter.get_by_text("Mean AUROC over 2 shared OOD set(s)").count()  # the two sets both runs have
    assert page.evaluate(CUT_TEXTS) == []
    warning.evaluate("element => element.scrollIntoView({block: 'center'})")
    shoot(page, tmp_path, "compare-other-data")

    page.go_back()  # the Runs page again, nothing selected: Compare waits for two runs
    grid.wait_for(timeout=60_000)
    page.wait_for_function(IDLE, timeout=120_000)
    open_run = buttons.filter(has_text=re.compile(r"^Open$"))
    assert open_run.is_disabled() and compare.is_disabled()  # no row selected
    pick("cmp-a")
    # one run: it opens, but there is nothing to compare (waited for: the selection's rerun may still be under way)
    expect(open_run).to_be_enabled(timeout=60_000)
    expect(compare).to_be_disabled(timeout=60_000)
    pick("cmp-a")  # unselected
    first, second = compared("cmp-a", "cmp-same")
    scatter = page.locator(".js-plotly-plot").filter(has_text="Mean AUROC over 6 shared OOD set(s)")
    scatter.wait_for(timeout=60_000)
    assert not page.get_by_text("These runs are on different data").count()
    points = scatter.evaluate(
        "e => { const t = e.data[1]; return {x: Array.from(t.x), y: Array.from(t.y), text: Array.from(t.text)}; }"
    )
    sets = [name for name in pd.read_csv(same / "metrics.csv").ood_dataset.unique() if not name.endswith(" (mean)")]
    expected_a, expected_b = mean_auroc(runs_root / first, sets), mean_auroc(runs_root / second, sets)
    assert sorted(points["text"]) == ["energy", "mahalanobis", "msp"]  # the detectors both runs have
    for name, x, y in zip(points["text"], points["x"], points["y"]):
        assert x == pytest.approx(expected_a[name], abs=1e-9) and y == pytest.approx(expected_b[name], abs=1e-9)
    page.get_by_text(re.compile(r"^Compare cmp-")).evaluate("element => element.scrollIntoView()")
    assert page.locator('[data-testid="stException"]').count() == 0
    shoot(page, tmp_path, "compare")
    assert other.is_dir()
