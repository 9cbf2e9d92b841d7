"""The results view in the URL, in a real browser (Debian's Chromium) on a copy of the default run: a tab and a
detector chosen and the threshold moved are written to the address bar, and a reload shows the same view. Screenshots
of the reloaded page in the light and the dark theme (the browser's colour scheme, which Streamlit follows)."""

import re
import shutil
from urllib.parse import parse_qs, urlparse

import pytest
from browser_app import DRAWN, app_url, runs_root, shoot  # noqa: F401  (fixtures of the app under test)
from helpers import chromium

pytestmark = chromium
#: Scroll the app's main area to put an element 70 px from its top (Streamlit's header bar covers the top)
SCROLL_TO_TOP = """e => {
  const main = document.querySelector('[data-testid=stMain]');
  main.scrollTop += e.getBoundingClientRect().top - main.getBoundingClientRect().top - 70;
}"""


@pytest.fixture(scope="module")
def run_copy(default_run, runs_root):  # noqa: F811
    shutil.copytree(default_run.path, runs_root / "url-copy")
    return runs_root / "url-copy"


def url_params(page) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlparse(page.url).query).items()}


def wait_for_param(page, name: str, value: str | None = None) -> str:
    """The URL's ``name`` once it is there (and equal to ``value`` where given)."""
    pattern = re.escape(name) + "=" + (re.escape(value) if value else "[^&]+")
    page.wait_for_url(re.compile(pattern), timeout=60_000)
    return url_params(page)[name]


def test_a_reload_shows_the_view_the_url_holds(page, app_url, run_copy, tmp_path):  # noqa: F811
    page.goto(f"{app_url}/?run={run_copy.name}")
    page.get_by_role("tab", name="Score histograms").click(timeout=120_000)
    assert wait_for_param(page, "tab") == "score-histograms"
    # the results' header, above the tabs: the detector every tab shows
    box = page.locator('[data-testid="stSelectbox"]').filter(has_text=re.compile(r"^Detector")).first
    box.click(timeout=60_000)
    page.keyboard.type("energy")
    page.get_by_role("option", name="energy", exact=True).click(timeout=30_000)
    assert wait_for_param(page, "detector") == "energy"
    page.locator(".js-plotly-plot").first.wait_for(timeout=60_000)
    slider = page.get_by_role("slider").first
    slider.focus()
    page.keyboard.press("PageUp")  # one key press, one change: no rerun under way while the value is read
    page.wait_for_function(DRAWN, timeout=120_000)
    threshold = float(wait_for_param(page, "threshold"))
    # the range input's own text of the value (the browser's step arithmetic: equal to about 1e-15; the AppTest tests
    # check that the page computes with the URL's number to the last bit)
    assert float(slider.input_value()) == pytest.approx(threshold, rel=1e-12)
    url = page.url
    assert urlparse(page.url).path == "/run"  # a link of the one-page app (/?run=...): the Run page's, view kept
    assert url_params(page) == {
        "run": run_copy.name,
        "tab": "score-histograms",
        "detector": "energy",
        "threshold": repr(threshold),
    }

    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        page.reload()
        page.get_by_role("tab", name="Score histograms", selected=True).wait_for(timeout=120_000)
        page.locator(".js-plotly-plot").first.wait_for(timeout=60_000)
        page.wait_for_function(DRAWN, timeout=120_000)
        assert page.url == url  # nothing rewritten: the view read back is the one written
        assert page.get_by_role("combobox", name="Detector", exact=True).input_value() == "energy"
        assert float(page.get_by_role("slider").first.input_value()) == pytest.approx(threshold, rel=1e-12)
        assert page.get_by_test_id("stSliderThumbValue").first.inner_text() == f"{threshold:.4g}"
        assert page.get_by_text("energy scores").count()  # the histogram's title: the detector drawn is energy
        assert not page.get_by_text("Not applied from the link").count()
        page.get_by_text("Detector", exact=True).evaluate(SCROLL_TO_TOP)  # the controls, tabs and histogram
        page.mouse.move(1, 1)
        if scheme == "light":
            shoot(page, tmp_path, "view-in-url")
        else:  # the docs show the light one
            page.screenshot(path=str(tmp_path / "view-in-url-dark.png"), timeout=90_000)

    # a link with values the run does not have: one note says which, the rest applies, the URL keeps what applied
    page.goto(f"{app_url}/?run={run_copy.name}&tab=score-histograms&detector=no_such-thing&threshold=1.5e")
    note = page.get_by_text("Not applied from the link")
    note.wait_for(timeout=120_000)
    assert note.inner_text() == (
        "Not applied from the link (the run's default is shown instead): detector 'no_such-thing' (not a detector of "
        "this run); threshold '1.5e' (not a number)."
    )
    page.get_by_role("tab", name="Score histograms", selected=True).wait_for(timeout=60_000)
    assert wait_for_param(page, "tab") == "score-histograms" and "detector=" not in page.url
    page.wait_for_function(DRAWN, timeout=120_000)
    page.mouse.move(1, 1)
    page.screenshot(path=str(tmp_path / "view-in-url-bad-link-dark.png"), timeout=90_000)
