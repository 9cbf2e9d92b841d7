"""The five pages under the top bar, in a real browser (Debian's Chromium) on copies of the default run: the Run
page's tab bar stays where it is whichever tab is open (the results' header is drawn above the tabs for every tab),
and each page — New run, Runs, Run, Compare (two runs), Detectors — loads whole, with its title and no exception, in
the light and the dark theme (the browser's colour scheme, which Streamlit follows). Screenshots ``page-<name>-<theme>``
of each."""

import re
import shutil

import pytest
from browser_app import DRAWN, app_url, runs_root, shoot  # noqa: F401  (fixtures of the app under test)
from helpers import chromium
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from oodviz.ui.history import write_label

pytestmark = chromium

#: Tabs of a one-layer run whose content differs most in height (a table, charts, galleries, text)
TABS = ["Metrics", "Score histograms", "ROC / PR", "Failure cases", "Run details"]


@pytest.fixture(scope="module")
def two_runs(default_run, runs_root):  # noqa: F811
    """Two finished copies of the default run in the app's runs root (the second named and tagged), their ids."""
    shutil.copytree(default_run.path.parent / ".features", runs_root / ".features", dirs_exist_ok=True)
    for name in ("pages-a", "pages-b"):
        shutil.copytree(default_run.path, runs_root / name)
    write_label(runs_root / "pages-b", "the default again", "A second copy, to compare. #copy")
    return "pages-a", "pages-b"


def tab_bar_top(page) -> float:
    """The tab bar's top in the page (the main area's scroll added back: the same place whatever is scrolled)."""
    return page.evaluate(
        "() => document.querySelector('[role=tablist]').getBoundingClientRect().top"
        " + document.querySelector('[data-testid=stMain]').scrollTop"
    )


def test_the_tab_bar_stays_put_whichever_tab_is_open(page, app_url, two_runs, tmp_path):  # noqa: F811
    """The detector, threshold start and threshold are drawn above the tabs for every tab: opening another tab
    moves nothing above them (before, only the tabs that used them drew them, and the tab bar jumped)."""
    page.goto(f"{app_url}/run?run={two_runs[0]}")
    page.get_by_text("Best detector per column").wait_for(timeout=120_000)
    page.wait_for_function(DRAWN, timeout=120_000)
    tabs = page.locator('[role="tablist"]').first
    first = tabs.bounding_box()
    tops = {}
    for name in [*TABS[1:], TABS[0]]:  # every tab, back to the first
        for attempt in range(3):  # a click landing while the last one's rerun is drawn can be dropped: click again
            page.get_by_role("tab", name=name).click(timeout=60_000)
            try:
                page.get_by_role("tab", name=name, selected=True).wait_for(timeout=20_000)
                break
            except PlaywrightTimeout:
                if attempt == 2:
                    raise
        page.wait_for_function(DRAWN, timeout=120_000)
        box = tabs.bounding_box()
        assert page.evaluate("() => document.querySelector('[data-testid=stMain]').scrollTop") == 0, name
        tops[name] = box["y"]
        assert box["x"] == first["x"] and box["width"] == first["width"], (name, box, first)
    assert set(tops.values()) == {first["y"]}, (first["y"], tops)
    assert tab_bar_top(page) == first["y"]
    assert page.locator('[data-testid="stException"]').count() == 0


#: page -> (its path and query, the text its title is, what shows once its content is drawn)
PAGES = {
    "new-run": ("/", "New run", lambda page: page.get_by_role("button", name="Start run")),
    "runs": ("/runs", "Runs", lambda page: page.locator('[data-testid="stDataFrame"]').first),
    "run": (
        "/run?run=pages-a",
        "Run",
        lambda page: page.get_by_text("Best detector per column"),
    ),
    "compare": (
        "/compare?a=pages-a&b=pages-b",
        "Compare",
        lambda page: page.locator(".js-plotly-plot").filter(has_text="Mean AUROC over 6 shared OOD set(s)"),
    ),
    "detectors": ("/detectors?detector=mahalanobis", "Detectors", lambda page: page.locator(".katex").first),
}


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_each_page_loads_with_its_title_and_no_exception(page, app_url, two_runs, tmp_path, scheme):  # noqa: F811
    page.emulate_media(color_scheme=scheme)
    for name, (path, title, drawn) in PAGES.items():
        page.goto(f"{app_url}{path}")
        drawn(page).wait_for(timeout=120_000)
        page.wait_for_function(DRAWN, timeout=120_000)
        # the page's link in the top bar is the current one, and its title heads the page (the Run page: its picker)
        current = page.locator('[data-testid="stTopNavLink"][aria-current="page"]')
        assert current.count() == 1 and current.inner_text().strip().endswith(title), (name, current.all_inner_texts())
        if name == "run":
            heading = page.get_by_role("combobox", name="Run", exact=True)
            assert heading.input_value().startswith("pages-a")
        else:
            heading = page.get_by_role("heading", name=title, exact=True)
            assert heading.count() == 1, name
        assert page.locator('[data-testid="stException"]').count() == 0, name
        assert not page.get_by_text("Something went wrong").count(), name
        if name == "compare":
            assert page.get_by_text(re.compile(r"^Compare pages-a \(A\) with pages-b \(B\)$")).count() == 1
        page.mouse.move(1, 1)
        shoot(page, tmp_path, f"page-{name}-{scheme}")


#: Whether the Detectors page explains the detector given (its name in bold, first)
EXPLAINED = "name => document.querySelector('[data-testid=stMain] strong')?.innerText === name"


def pick(page, label: str, option: str) -> None:
    """Choose ``option`` in the selectbox labelled ``label`` and wait for the rerun that draws it."""
    page.locator('[data-testid="stSelectbox"]').filter(has_text=re.compile(f"^{label}")).first.click(timeout=60_000)
    page.keyboard.type(option.split(" ")[0])  # filters the options (a long list shows only its first ones)
    page.get_by_role("option", name=option, exact=True).click(timeout=30_000)
    page.get_by_role("listbox").wait_for(state="hidden", timeout=30_000)
    page.wait_for_function(DRAWN, timeout=120_000)


def test_every_pick_on_the_detectors_and_compare_pages_is_kept(page, app_url, two_runs, tmp_path):  # noqa: F811
    """The pickers whose value is in the URL keep each pick, from a page opened without one too (their widgets were
    keyed by the URL's value, which the page rewrites after each pick: every other pick was lost, the page showing the
    value before it)."""
    page.goto(f"{app_url}/detectors")  # no detector in the URL
    explained = page.locator('[data-testid="stMain"] strong').first
    explained.wait_for(timeout=120_000)
    page.wait_for_function(DRAWN, timeout=120_000)
    for name in ("odin", "knn", "energy"):
        pick(page, "Detector", name)
        page.wait_for_url(re.compile(rf"[?&]detector={name}(&|$)"), timeout=30_000)
        page.wait_for_function(EXPLAINED, arg=name, timeout=30_000)  # drawn after the URL is written
        page.wait_for_function(DRAWN, timeout=120_000)
        page.wait_for_timeout(1000)  # and still so a moment later: no rerun drew the detector before again
        assert explained.inner_text() == name
        assert page.get_by_role("combobox", name="Detector").input_value() == name
    page.go_back()  # the browser's back button: the detector before, from the URL
    page.wait_for_url(re.compile(r"[?&]detector=knn(&|$)"), timeout=30_000)
    page.wait_for_function(EXPLAINED, arg="knn", timeout=30_000)

    page.goto(f"{app_url}/compare")  # no runs in the URL: the two newest
    page.get_by_text(re.compile(r"^Compare pages-")).wait_for(timeout=120_000)
    page.wait_for_function(DRAWN, timeout=120_000)
    for a, b in (("pages-b", "pages-a"), ("pages-a", "pages-b")):
        pick(page, "Run A", a if a == "pages-a" else "pages-b · the default again")
        pick(page, "Run B", b if b == "pages-a" else "pages-b · the default again")
        page.wait_for_url(re.compile(rf"\?a={a}&b={b}$"), timeout=30_000)
        page.get_by_text(f"Compare {a} (A) with {b} (B)", exact=True).wait_for(timeout=60_000)
    assert page.locator('[data-testid="stException"]').count() == 0
