"""An OpenOOD v1.5 benchmark run in a real browser (Debian's Chromium): the metrics view sets its figures beside the
published leaderboard's, cell for cell what ``oodviz bench`` printed for it; the form's OpenOOD preset says before
Start what it needs. Screenshots in the light and the dark theme (the browser's colour scheme, which Streamlit's
default theme follows)."""

import io
import re
from contextlib import redirect_stdout

import pytest
from browser_app import DRAWN, app_url, runs_root, shoot  # noqa: F401  (fixtures of the app under test)
from helpers import checkpoint, chromium, write_cifar10_root

from oodviz.cli import main
from oodviz.pipeline.openood import bench_table, summary_cells
from oodviz.runs.jobs import list_runs

pytestmark = chromium

#: msp, energy, mahalanobis and ash are on the leaderboard (MSP, EBO, MDS, ASH); entropy is not: its row shows "-"
DETECTORS = "msp,energy,mahalanobis,ash,entropy"
#: Scroll the app's main area to put an element just below Streamlit's header bar
SCROLL_TO_TOP = """e => {
  const main = document.querySelector('[data-testid=stMain]');
  main.scrollTop += e.getBoundingClientRect().top - main.getBoundingClientRect().top - 70;
}"""


@pytest.fixture(scope="module")
def bench_run(runs_root, tmp_path_factory):  # noqa: F811
    """One finished ``oodviz bench openood-v1.5 cifar10`` run in the app's runs root, over a small synthetic data
    root in OpenOOD's layout with a randomly initialised ResNet18_32x32 checkpoint, and what the command printed."""
    tmp = tmp_path_factory.mktemp("openood")
    root = tmp / "openood"
    write_cifar10_root(root)
    argv = [
        "bench",
        "openood-v1.5",
        "cifar10",
        "--data-root",
        str(root),
        "--checkpoint",
        checkpoint(tmp / "s0.ckpt", 0),
    ]
    argv += ["--detectors", DETECTORS, "--device", "cpu", "--batch-size", "64", "--runs-root", str(runs_root)]
    argv.append("--force")  # random weights on random images: the classifier check refuses them, rightly
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert main(argv) == 0
    (run,) = list_runs(runs_root)
    return {"run": run, "root": root, "printed": printed.getvalue()}


def board_rows(page) -> list[list[str]]:
    """The leaderboard table's cells, once it is drawn (the heading above it can be drawn first)."""
    rows = page.locator("table.oodviz-board tbody tr")
    rows.first.wait_for(timeout=120_000)
    return [row.locator("td").all_inner_texts() for row in rows.all()]


def test_an_openood_run_shows_the_clis_figures_beside_the_leaderboard(page, app_url, bench_run, tmp_path):  # noqa: F811
    run = bench_run["run"]
    table = bench_table([run.path], "cifar10")
    expected = summary_cells(table)
    page.goto(f"{app_url}/?run={run.run_id}")
    heading = page.get_by_role("heading", name="Beside the OpenOOD v1.5 leaderboard")
    heading.wait_for(timeout=180_000)  # a cold server: slow first load
    rows = board_rows(page)
    # the cells bench_table's figures make (summary_cells: what `oodviz bench` prints), detector by detector
    assert rows == expected.astype(str).values.tolist()
    assert [row[0] for row in rows] == ["msp", "mahalanobis", "energy", "ash", "entropy"]  # leaderboard order
    # ... and the figures themselves, read from bench_table's numbers
    msp = table[table.detector == "msp"].iloc[0]
    assert rows[0][:5] == [
        "msp",
        "MSP",
        f"{msp.near_auroc_ours:.2f}",  # one run: no std
        f"{msp.near_auroc_published:.2f} ± {msp.near_auroc_published_std:.2f}",
        f"{msp.near_auroc_ours - msp.near_auroc_published:+.2f}",
    ]
    entropy = table[table.detector == "entropy"].iloc[0]
    assert rows[4][1] == "-"  # no OpenOOD method
    for k, name in enumerate(("near_auroc", "far_auroc", "id_accuracy")):  # not on the leaderboard: "-"
        assert rows[4][2 + 3 * k : 5 + 3 * k] == [f"{entropy[f'{name}_ours']:.2f}", "-", "-"]
    # exactly what the command printed: "<ours> | <published> | <diff>" per figure, per detector
    printed = {line.split()[0]: line for line in bench_run["printed"].splitlines() if line.strip()}
    for row in rows:
        for k in range(3):
            assert " | ".join(row[2 + 3 * k : 5 + 3 * k]) in printed[row[0]]
    caption = page.locator('[data-testid="stCaptionContainer"]').filter(has_text="Published: the OpenOOD v1.5")
    said = caption.inner_text()
    assert "commit 28d3a40 of 2025-07-19" in said and "publishes no FPR@95" in said
    assert "Protocol paper" in said and "differ for ash" in said and "'-': no figure" in said
    page.wait_for_function(DRAWN, timeout=120_000)
    heading.evaluate(SCROLL_TO_TOP)
    page.mouse.move(1, 1)
    shoot(page, tmp_path, "openood-leaderboard")
    page.emulate_media(color_scheme="dark")
    page.reload()
    heading.wait_for(timeout=120_000)
    assert board_rows(page) == rows
    page.wait_for_function(DRAWN, timeout=120_000)
    heading.evaluate(SCROLL_TO_TOP)
    page.mouse.move(1, 1)
    page.screenshot(path=str(tmp_path / "openood-leaderboard-dark.png"), timeout=90_000)  # not the docs
    # "New run from this one": the New run page's form holds the run's choices, the preset of its benchmark
    page.get_by_role("button", name="New run from this one").click(timeout=60_000)
    page.wait_for_url(re.compile(rf"[?&]from={re.escape(run.run_id)}"), timeout=60_000)
    form = page.locator('[data-testid="stMain"]')
    form.get_by_role("button", name="Start run").wait_for(timeout=120_000)
    assert form.get_by_role("combobox", name="In-distribution").input_value() == "OpenOOD v1.5 cifar10"
    assert form.get_by_role("combobox", name="Backbone").input_value() == "openood-resnet18-32x32"


def choose(page, form, label: str, option: str) -> None:
    """Pick ``option`` in the selectbox labelled ``label`` under ``form``, and wait for the rerun the change makes
    (every field reruns the page)."""
    box = form.locator('[data-testid="stSelectbox"]').filter(has_text=label).first
    box.click(timeout=60_000)
    page.keyboard.type(option)  # filters the options
    page.get_by_role("option", name=option, exact=True).click(timeout=30_000)
    page.get_by_role("listbox").wait_for(state="hidden", timeout=30_000)
    page.wait_for_function(DRAWN, timeout=120_000)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_openood_preset_says_what_it_runs_and_what_is_missing_before_start(
    page,
    app_url,  # noqa: F811
    runs_root,  # noqa: F811
    bench_run,
    tmp_path,
    scheme,
):
    """The OpenOOD preset on a fresh form, with the default OOD list still chosen and a data root that is not in
    OpenOOD's layout: Start shows both under their fields (the benchmark's own sets named) and starts nothing."""
    before = sorted(p.name for p in runs_root.iterdir())
    page.emulate_media(color_scheme=scheme)
    page.goto(app_url)
    form = page.locator('[data-testid="stMain"]')  # the New run page: the form in the main area
    form.get_by_role("button", name="Start run").wait_for(timeout=120_000)
    choose(page, form, "Backbone", "openood-resnet18-32x32")
    form.locator('[class*="st-key-layers-openood-resnet18-32x32-"]').wait_for(timeout=60_000)  # redrawn for it
    page.wait_for_function(DRAWN, timeout=120_000)  # the whole form redrawn (Layers is above it)
    choose(page, form, "In-distribution", "OpenOOD v1.5 cifar10")
    form.get_by_role("textbox", name="Checkpoint file (optional)").fill(
        str(bench_run["run"].read_config()["checkpoint"])
    )
    empty = tmp_path / "not-openood"
    empty.mkdir()
    form.get_by_role("textbox", name="Data root (torchvision files, OpenOOD)").fill(str(empty))
    page.keyboard.press("Enter")  # a text field is sent when it is left or Enter is pressed: the page reruns
    page.wait_for_function(DRAWN, timeout=120_000)
    form.get_by_role("button", name="Start run").click()
    ood = form.get_by_text(re.compile(r"^OpenOOD v1.5 cifar10 runs its benchmark's own OOD sets"))
    ood.wait_for(timeout=120_000)
    assert "(near cifar100, tin; far mnist, svhn, texture, places365)" in ood.inner_text()
    root = form.get_by_text(re.compile(r"^OpenOOD benchmark cifar10: no list folder benchmark_imglist/cifar10/"))
    assert root.count() == 1 and "download.py --contents datasets --datasets cifar-10" in root.inner_text()
    assert form.get_by_text("Fix first: 2 problem(s)").count() == 1
    # each under its own field: the OOD list's problem above the data root field, the data root's below it
    field = form.get_by_role("textbox", name="Data root (torchvision files, OpenOOD)")
    assert ood.bounding_box()["y"] < field.bounding_box()["y"] < root.bounding_box()["y"]
    page.wait_for_function(DRAWN, timeout=120_000)
    form.get_by_text("In-distribution", exact=True).evaluate("e => e.scrollIntoView()")
    page.mouse.move(1, 1)
    if scheme == "dark":  # the docs show the light one
        page.screenshot(path=str(tmp_path / "openood-form-dark.png"), timeout=90_000)
    else:
        shoot(page, tmp_path, "openood-form")
    assert sorted(p.name for p in runs_root.iterdir()) == before and "run=" not in page.url
