"""The New run page's form (in the main area) in a real browser (Debian's Chromium): a small tuned run over two layers
of the bundled digits-cnn, set up and started from the form alone, shows the tuning choice and the "Which layer?" tab;
a pooling field per layer, with the choices that apply there, maps to the run's table; every field whole at 1000 and
1280 px."""

import json
import re
import time

import pytest
from browser_app import DRAWN, app_url, runs_root, shoot  # noqa: F401  (fixtures of the app under test)
from helpers import VIT_BLOCK_POOLINGS, chromium

from oodviz.detectors import available, describe
from oodviz.detectors.teaching import formula_clauses
from oodviz.ui.form_tuning import HELD_OUT

pytestmark = chromium


def choose(page, form, label: str, option: str) -> None:
    """Pick ``option`` in the selectbox or multiselect labelled ``label`` under ``form``, and wait for the rerun the
    change makes (every field reruns the page)."""
    box = form.locator('[data-testid="stSelectbox"], [data-testid="stMultiSelect"]').filter(has_text=label).first
    box.click(timeout=60_000)
    page.keyboard.type(option)  # filters the options
    page.get_by_role("option", name=option, exact=True).click(timeout=30_000)
    page.keyboard.press("Escape")
    page.get_by_role("listbox").wait_for(state="hidden", timeout=30_000)
    page.wait_for_function(DRAWN, timeout=120_000)


#: The New run page's main area, where the form is
MAIN = '[data-testid="stMain"]'


def test_a_tuned_two_layer_run_from_the_form(page, app_url, runs_root, tmp_path):  # noqa: F811
    page.goto(app_url)
    form = page.locator(MAIN)
    detectors = form.locator('[data-testid="stMultiSelect"]').filter(has_text="Detectors").first
    detectors.wait_for(timeout=120_000)  # a cold server: slow first load
    detectors.get_by_role("button", name="Clear all").click()  # few detectors: a cheap run
    for name in ("energy", "mahalanobis"):
        choose(page, form, "Detectors", name)
    choose(page, form, "Layers", "features.3")  # besides the preselected penultimate layer
    form.get_by_text("Tune parameters on validation data").click()
    choose(page, form, "ID validation", HELD_OUT)
    choose(page, form, "OOD validation set", "noise-uniform")  # also a test set: warned, allowed
    form.get_by_role("button", name="Start run").click()
    page.wait_for_url(re.compile(r"\?run="), timeout=120_000)
    run_id = page.url.split("run=")[1]
    config = json.loads((runs_root / run_id / "config.json").read_text())
    assert config["layers"] == ["penultimate", "features.3"]
    assert config["id_val"]["subsample_mode"] == "last" and config["ood_val"]["name"] == "noise-uniform"
    assert [d["name"] for d in config["detectors"]] == ["energy", "mahalanobis"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not page.get_by_role("tab", name="Which layer?").count():
        time.sleep(1)
    page.get_by_text("the OOD validation set noise-uniform is also the OOD test set noise-uniform").first.wait_for(
        timeout=60_000
    )
    page.get_by_role("tab", name="Which layer?").click()
    page.get_by_text("Each detector that reads features was fitted and scored at every layer").wait_for(timeout=60_000)
    ranking = page.locator(".js-plotly-plot").filter(has_text="features.3").filter(has_text="combined")
    ranking.first.wait_for(timeout=60_000)  # each layer and the combined mahalanobis, ranked
    shoot(page, tmp_path, "form-which-layer")
    page.get_by_role("tab", name="Run details").click()
    page.get_by_text("Tuned on validation data").wait_for(timeout=60_000)
    tuning = json.loads((runs_root / run_id / "detectors.json").read_text())["energy"]["tuning"]
    chosen = ", ".join(f"{key}={value}" for key, value in tuning["chosen"].items())
    page.get_by_text(f"energy: {chosen} (every grid point)").wait_for(timeout=30_000)  # the choice tuning made
    shoot(page, tmp_path, "form-tuning")


#: Elements of the main area (the form) whose text is clipped (an ellipsis or cut off: wider than their box, overflow hidden),
#: formulas aside (KaTeX scrolls), and text fields whose value is wider than the field.
CLIPPED = """() => [
  ...[...document.querySelectorAll('[data-testid=stMain] *')]
    .filter(e => e.textContent.trim() && e.scrollWidth > e.clientWidth + 1 && !e.closest('.katex')
                 && ['hidden', 'clip'].includes(getComputedStyle(e).overflowX))
    .map(e => e.textContent.trim()),
  ...[...document.querySelectorAll('[data-testid=stMain] input[type=text], [data-testid=stMain] textarea')]
    .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.value)]"""


#: Formulas of the main area wider than the text around them (they would scroll sideways): [width, container width].
WIDE_FORMULAS = """() => [...document.querySelectorAll('[data-testid=stMain] .katex')]
  .map(k => [Math.max(k.scrollWidth, k.getBoundingClientRect().width),
              k.closest('[data-testid=stMarkdownContainer]').clientWidth])
  .filter(([width, room]) => width > room + 1)"""


@pytest.mark.parametrize("width", [1000, 1280])
def test_every_field_of_the_form_is_whole_at_1000px(page, app_url, tmp_path, width):  # noqa: F811
    """The whole form in the main area at 1000 and 1280 px, detector parameters and tuning grids open: no label,
    switch or grid cut, and so is a ViT layer's long name in its Layers chip; the longest formulas of the Detectors
    page wrap within the page."""
    page.set_viewport_size({"width": width, "height": 1000})
    page.goto(app_url)
    form = page.locator(MAIN)
    form.get_by_role("button", name="Start run").wait_for(timeout=120_000)
    form.get_by_text("Tune parameters on validation data").click()
    page.wait_for_function(DRAWN, timeout=120_000)
    for expander in ("Parameters of the", "Grids tried"):
        form.locator("summary").filter(has_text=expander).click()
    form.get_by_text("mahalanobis: normalize").wait_for(timeout=30_000)
    form.get_by_text("odin grid").wait_for(timeout=30_000)
    clipped = page.evaluate(CLIPPED)
    if clipped:
        shoot(page, tmp_path, f"form-clipped-{width}px")
    assert clipped == []
    choose(page, form, "Backbone", "vit_b_16")
    form.locator('[class*="st-key-layers-vit_b_16-"]').wait_for(timeout=60_000)  # the form redrawn for ViT
    page.wait_for_function(DRAWN, timeout=120_000)  # the whole form redrawn (Layers is above it)
    choose(page, form, "Layers", "encoder.layers.encoder_layer_11")  # a long name: its chip wraps, uncut
    form.locator('[data-tag] [title="encoder.layers.encoder_layer_11"]').wait_for(timeout=30_000)
    clipped = page.evaluate(CLIPPED)
    if clipped:
        shoot(page, tmp_path, f"layers-clipped-{width}px")
    assert clipped == []
    # what each detector does: the Detectors page (was: an expander under the form)
    form.get_by_role("link", name="What each detector computes: the Detectors page").click(timeout=30_000)
    page.wait_for_url(re.compile(r"/detectors"), timeout=60_000)
    longest = sorted(available(), key=lambda name: max(map(len, formula_clauses(describe(name)["formula"]))))
    for name in longest[-4:]:  # the longest clauses: each wrapped within the page, no sideways scrollbar
        choose(page, form, "Detector", name)
        form.locator("strong").filter(has_text=re.compile(f"^{name}$")).wait_for(timeout=30_000)
        wide = page.evaluate(WIDE_FORMULAS)
        if wide:
            shoot(page, tmp_path, f"formula-{name}-{width}px")
        assert wide == [], name
    assert page.locator('[data-testid="stException"]').count() == 0


def test_a_timm_model_typed_as_the_backbone_is_loaded_and_estimated(page, app_url, tmp_path):  # noqa: F811
    """A timm model the list does not name, typed into the Backbone box: the form takes it, and the estimate is of
    that model (its 512 features: resnet10t's, not the bundled digits-cnn's 64)."""
    page.goto(app_url)
    form = page.locator(MAIN)
    form.get_by_role("button", name="Start run").wait_for(timeout=120_000)
    box = form.locator('[data-testid="stSelectbox"]').filter(has_text="Backbone").first
    box.click(timeout=60_000)
    page.keyboard.type("timm:resnet10t")
    page.get_by_role("option", name="Add: timm:resnet10t").click(timeout=30_000)  # a name the list does not hold
    page.get_by_role("listbox").wait_for(state="hidden", timeout=30_000)
    form.locator('[class*="st-key-layers-timm"]').wait_for(timeout=60_000)  # the form redrawn for the model
    page.wait_for_function(DRAWN, timeout=120_000)  # the whole form redrawn (Layers is above it)
    form.locator('[data-testid="stRadio"]').filter(has_text="Weights").get_by_text("random").click()
    form.get_by_role("button", name="Estimate memory").click()
    # the bundled digits' 1,081 ID fit images by resnet10t's 512 features (digits-cnn has 64)
    form.locator("summary").filter(has_text="How the estimate was made").click(timeout=180_000)
    estimate = form.locator('[data-testid="stCode"]').filter(has_text="id_fit: 1,081 x 512")
    estimate.first.wait_for(timeout=180_000)
    shoot(page, tmp_path, "form-typed-timm-backbone")


def add_layer(page, form, layer: str) -> None:
    """Pick ``layer`` in Layers, clicking its text box (the box's middle may be a chip of a long name already
    chosen), and wait for the rerun that draws the layer's pooling field."""
    box = form.locator('[data-testid="stMultiSelect"]').filter(has_text="Layers").first
    box.get_by_role("combobox").click(timeout=60_000)
    page.keyboard.type(layer)
    page.get_by_role("option", name=layer, exact=True).click(timeout=30_000)
    page.keyboard.press("Escape")
    page.get_by_role("listbox").wait_for(state="hidden", timeout=30_000)
    form.locator('[data-testid="stSelectbox"]').filter(has_text=f"Pooling of {layer}").wait_for(timeout=60_000)


def test_a_pooling_field_per_layer_maps_to_the_runs_table(page, app_url, runs_root, tmp_path):  # noqa: F811
    """digits-cnn over three layers: penultimate gets no field (a caption says why), each other layer its own with
    the model's own first; a choice made before (the protocol) survives the reruns a change of layers makes; the run started holds the table of the fields that name a pooling."""
    page.goto(app_url)
    form = page.locator(MAIN)
    form.get_by_role("button", name="Start run").wait_for(timeout=120_000)
    detectors = form.locator('[data-testid="stMultiSelect"]').filter(has_text="Detectors").first
    detectors.get_by_role("button", name="Clear all").click()
    choose(page, form, "Detectors", "msp")  # a cheap run
    protocol = form.locator('[data-testid="stRadio"]').filter(has_text="Protocol")
    protocol.get_by_text("OpenOOD v1.5's").click()
    page.wait_for_function(DRAWN, timeout=120_000)
    for layer in ("features.0", "features.3"):
        add_layer(page, form, layer)
    field = form.locator('[data-testid="stSelectbox"]').filter(has_text="Pooling of features.3")
    assert field.get_by_role("combobox").input_value() == "model's own (avg)"
    form.get_by_text("penultimate: the classifier head's input, already pooled").wait_for(timeout=30_000)
    assert protocol.get_by_role("radio", name="OpenOOD v1.5's").is_checked()  # kept across the reruns
    choose(page, form, "Pooling of features.3", "max")
    form.get_by_role("button", name="Start run").click()
    page.wait_for_url(re.compile(r"\?run="), timeout=120_000)
    config = json.loads((runs_root / page.url.split("run=")[1] / "config.json").read_text())
    assert config["layers"] == ["penultimate", "features.0", "features.3"]
    assert config["pooling"] == {"features.3": "max"} and config["protocol"] == "openood"


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_a_vits_token_layer_offers_its_class_token_and_a_map_does_not(page, app_url, tmp_path, scheme):  # noqa: F811
    """ViT-B/16 with an encoder block and the patch embedding beside penultimate: the block's field says the model's
    own is its class token and offers cls and mean, the patch embedding's (a map, before the class token) its average
    and neither; a field cleared is unset too. Screenshots of the form, and of the block's choices open, in the light
    and the dark theme (the light form for the docs)."""
    page.set_viewport_size({"width": 1000, "height": 1000})
    page.emulate_media(color_scheme=scheme)
    page.goto(app_url)
    form = page.locator(MAIN)
    form.get_by_role("button", name="Start run").wait_for(timeout=120_000)
    choose(page, form, "Backbone", "vit_b_16")
    form.locator('[class*="st-key-layers-vit_b_16-"]').wait_for(timeout=60_000)
    page.wait_for_function(DRAWN, timeout=120_000)  # the whole form redrawn (Layers is above it)
    block = "encoder.layers.encoder_layer_5"
    boxes = form.locator('[data-testid="stSelectbox"]')
    token, patches = boxes.filter(has_text=f"Pooling of {block}"), boxes.filter(has_text="Pooling of conv_proj")
    for layer in (block, "conv_proj"):
        add_layer(page, form, layer)
    assert token.get_by_role("combobox").input_value() == "model's own (cls)"
    assert patches.get_by_role("combobox").input_value() == "model's own (avg)"
    page.wait_for_function(DRAWN, timeout=120_000)
    page.evaluate("document.activeElement && document.activeElement.blur()")  # no focus ring on Layers
    form.get_by_role("heading", name="1 · Model").evaluate("e => e.scrollIntoView()")
    page.mouse.move(1, 1)
    if scheme == "light":  # the docs' (the run form page), with OODVIZ_UPDATE_SCREENSHOTS
        shoot(page, tmp_path, "form-pooling-per-layer")
    else:
        page.screenshot(path=str(tmp_path / "form-pooling-per-layer-dark.png"), timeout=90_000)
    token.get_by_role("combobox").click()
    page.get_by_role("option").first.wait_for(timeout=30_000)
    options = [o.inner_text() for o in page.get_by_role("option").all()]
    assert options == VIT_BLOCK_POOLINGS
    page.screenshot(path=str(tmp_path / f"form-pooling-choices-{scheme}.png"), timeout=90_000)
    page.keyboard.press("Escape")
    page.get_by_role("listbox").wait_for(state="hidden", timeout=30_000)
    patches.get_by_role("combobox").click()
    page.get_by_role("option").first.wait_for(timeout=30_000)
    assert [o.inner_text() for o in page.get_by_role("option").all()] == [
        "model's own (avg)",
        "avg",
        "max",
        "none (flattened)",
    ]
    page.keyboard.press("Escape")
    page.get_by_role("listbox").wait_for(state="hidden", timeout=30_000)
    # the fields' labels and values whole at 1000 px (the whole form: test_every_field_of_the_form_is_whole_at_1000px)
    clipped = [text for text in page.evaluate(CLIPPED) if "Pooling" in text or "own" in text or "encoder" in text]
    assert clipped == []
    if token.get_by_role("button", name="Clear value").count():  # Streamlit offers to clear a field: unset, too
        token.get_by_role("button", name="Clear value").click()
        page.wait_for_function(DRAWN, timeout=120_000)
        assert token.get_by_role("combobox").get_attribute("placeholder") == "model's own (cls)"
        assert page.locator('[data-testid="stException"]').count() == 0
