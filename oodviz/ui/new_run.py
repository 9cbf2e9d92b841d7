"""The New run page (``/``, ``/?from=<run id>``): the bundled offline runs in one click, and the form in four steps —
model, data, detectors (with tuning), resources — with the estimate of the run's needs beside Start.

Every field reruns the page when it changes (no Streamlit form): the layers' pooling fields, the chosen detectors'
parameters and grids and every caption follow the fields as they are. Nothing is estimated or started before Estimate
or Start; the whole form is checked first (:func:`~oodviz.ui.form.form_problems`), each problem under its field.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, replace

import streamlit as st

from oodviz.columns import PENULTIMATE
from oodviz.config.catalog import backbone_names, choices, detector_names, known_split_size, param_fields
from oodviz.config.defaults import default_detector_params, defaults_reason
from oodviz.config.run import ConfigError, DatasetChoice, DetectorChoice, RunConfig, preset
from oodviz.config.splits import load_split
from oodviz.config.tuning import validation_warnings
from oodviz.models import format_bytes
from oodviz.params import ParamField
from oodviz.pipeline.probe import estimate_in_subprocess
from oodviz.runs.jobs import QueueFull, submit
from oodviz.runs.telemetry import device_facts
from oodviz.ui.access import AccessPolicy, PathRefused, run_path, shown_message
from oodviz.ui.fixes import (
    ESTIMATE_NEXT,
    RUN_ANYWAY,
    estimate_panel,
    form_key,
    from_run,
    prefilled,
    refuse_start,
    refused,
    start_blocked,
    store_estimate,
)
from oodviz.ui.form import (
    ALL_GPUS,
    FOLDER_PRESET,
    ID_PRESETS,
    OOD_CHOICES,
    OPENOOD_BACKBONES,
    OPENOOD_PRESETS,
    USER_MODEL,
    FormValues,
    config_from_form,
    form_problems,
    form_values_from_config,
    ood_label,
    openood_warnings,
    pooled_layers,
    pooling_from_fields,
    pooling_label,
    pooling_of,
    pooling_options,
    processes_of,
)
from oodviz.ui.form_tuning import (
    ID_VALIDATION_CHOICES,
    NO_VALIDATION,
    grid_text,
    layer_options,
    tuned_grids,
)
from oodviz.ui.navigation import open_run, page, runs_root

#: ``RunConfig.protocol`` -> how the form says it
PROTOCOL_LABELS = {"paper": "each paper's", "openood": "OpenOOD v1.5's"}
#: what the In-distribution box says of the OpenOOD presets
OPENOOD_HELP = (
    "OpenOOD v1.5 <benchmark>: OpenOOD's benchmark from the data root below, in OpenOOD's layout (its download "
    "script's): the ID train and test lists, the benchmark's own near- and far-OOD sets (not the OOD list below), "
    "OpenOOD's validation lists when tuning and its test preprocessing. Choose the benchmark's network as Backbone ("
    + ", ".join(
        f"{backbone} for {' and '.join(b for b, n in OPENOOD_BACKBONES.items() if n == backbone)}"
        for backbone in dict.fromkeys(OPENOOD_BACKBONES.values())
    )
    + ") and give its checkpoint file (resnet50: torchvision's IMAGENET1K_V1 weights). The results show the "
    "figures beside OpenOOD's leaderboard."
)
#: the characters a grid's one-line field shows whole at 1000 px (measured in the 300 px sidebar the form had)
GRID_FIELD_CHARS = 32


def _device_label(fact: dict) -> str:
    if fact["device"] == "cpu":
        return f"cpu — {fact['name']}"
    return f"{fact['device']} — {fact['name']} ({format_bytes(fact['free'])} free of {format_bytes(fact['total'])})"


@st.cache_data(ttl=30, show_spinner=False)
def _devices() -> list[dict]:
    return device_facts()


def _param_input(place, detector: str, field: ParamField, value, generation: str):
    """One widget for one detector parameter (see :func:`~oodviz.ui.form.param_fields`)."""
    # a zero-width space after each "_": a long name wraps after "lower_", not inside "percentil|e" (half a row)
    label = f"{detector}: " + field.name.replace("_", "_\u200b")
    key = f"param-{detector}-{field.name}-{generation}"
    if field.kind == "choice":
        options = list(field.choices)
        return place.selectbox(label, options, index=options.index(value) if value in options else 0, key=key)
    if field.kind == "bool":
        return place.checkbox(label, bool(value), key=key)
    number = int if field.kind == "int" else float
    return place.number_input(
        label,
        value=None if value is None else number(value),
        step=1 if number is int else None,
        format="%d" if number is int else "%g",
        placeholder="automatic",
        key=key,
        help="Blank: the detector chooses (see its docstring)." if field.optional else None,
    )


#: the longest choice of a detector parameter that a half row of the form shows whole at 1000 px (vra's
#: "per_unit", 8 characters, was cut there)
HALF_ROW_CHOICE_CHARS = 7


def _whole_row(field: ParamField) -> bool:
    """Whether a parameter's widget takes a row of its own: a switch, or a choice with a value longer than
    :data:`HALF_ROW_CHOICE_CHARS`."""
    if field.kind == "bool":
        return True
    return field.kind == "choice" and max(len(str(choice)) for choice in field.choices) > HALF_ROW_CHOICE_CHARS


def _detector_params(defaults: FormValues, detectors: list[str], generation: str) -> dict[str, dict]:
    """The editable parameters of each chosen detector (``detectors``), numbers and choices two to a row, switches and choices with a long
    value on a row of their own (a half row cuts "mahalanobis: normalize", mcd's "probabilities" and vra's
    "per_unit" at 1000 px);
    only the values that differ from the detector's defaults are returned (a blank optional number is its default,
    None)."""
    params = {}
    for name in dict.fromkeys(detectors):
        fields = param_fields(name)
        if not fields:
            continue
        chosen = {}
        whole = [field for field in fields if _whole_row(field)]
        boxes = [field for field in fields if field not in whole]
        rows = [boxes[start : start + 2] for start in range(0, len(boxes), 2)]
        for row in rows + [[field] for field in whole]:
            for col, field in zip([st] if _whole_row(row[0]) else st.columns(2), row):
                default = defaults.detector_params.get(name, {}).get(field.name, field.default)
                value = _param_input(col, name, field, default, generation)
                if value is None and not field.optional:
                    value = field.default
                if value != field.default:
                    chosen[field.name] = value
        if chosen:
            params[name] = chosen
    return params


def detectors_caption(backbone: str, detectors: list[str]) -> str:
    """Under the detector list: why the backbone's family has its default list (:func:`defaults_reason`) while the
    list is that default, else that it was edited and what the default is."""
    default = list(default_detector_params(backbone))
    if list(detectors) == default:
        return (
            f"{defaults_reason(backbone)} The list follows the backbone's family until you edit it; a run config "
            "without `detectors` gets this list."
        )
    return (
        f"Your list: {len(detectors)} of the {len(detector_names())} detectors. The {backbone} family's default is "
        f"{len(default)} ({', '.join(default)}); choose another backbone and this list stays as you made it."
    )


def _keys(generation: str) -> dict[str, str]:
    """Session keys of the form drawn for ``generation``: the backbone (outside the form, so that a change
    reruns the page), the detector list, and the backbone whose default detectors the list shows."""
    return {
        "backbone": f"backbone-{generation}",
        "detectors": f"detectors-{generation}",
        "defaults_of": f"detectors-defaults-of-{generation}",
    }


def _switch_default_detectors(generation: str, detectors_shown: list[str]) -> None:
    """On a change of backbone: when the detector list (and each family parameter) is still the default of the
    backbone it was made for, make it the new backbone's family default (:mod:`oodviz.config.defaults`); a list
    the user edited is kept."""
    state, keys = st.session_state, _keys(generation)
    old = default_detector_params(state[keys["defaults_of"]])
    new = default_detector_params(state[keys["backbone"]])
    state[keys["defaults_of"]] = state[keys["backbone"]]
    if list(state.get(keys["detectors"], detectors_shown)) == list(old):
        state[keys["detectors"]] = list(new)
    for name in set(old) | set(new):
        for field in param_fields(name):
            key = f"param-{name}-{field.name}-{generation}"
            before = old.get(name, {}).get(field.name, field.default)
            after = new.get(name, {}).get(field.name, field.default)
            if after != before and state.get(key, before) == before:
                state[key] = after


@st.cache_data(show_spinner="Counting the ID fit images…", max_entries=16)
def _count_images(choice_json: str, data_root: str) -> int | None:
    """How many images the ID fit dataset ``choice_json`` has (None when it cannot be read): read without torch
    where the catalog knows how (:func:`oodviz.config.catalog.known_split_size`: the bundled digits, the MNIST-style
    files), else counted by loading the set."""
    choice = json.loads(choice_json)
    known = known_split_size(choice["name"], choice["params"], data_root)
    if known is not None:
        return known

    try:
        return len(
            load_split(RunConfig(data_root=data_root, detectors=[]), DatasetChoice(**json.loads(choice_json)), False)
        )
    except Exception:  # a missing file or folder: the held-out field says it could not be counted
        return None


#: what the form's subsample fields take (:func:`oodviz.sampling.subsample_indices`), said beside them
SUBSAMPLE_CAPTION = (
    f"Subsample: at most this many images of each split (0 = all), drawn at random (seed {RunConfig.seed}) and "
    "stratified by class: each class keeps its share"
)
SUBSAMPLE_HELP = (
    "Each class of an ID split gets its share of the images (proportional to its size, rounded so the total is "
    "exact), drawn uniformly at random with the run's seed; the images keep the dataset's order. OOD sets have no "
    "classes: a uniform random sample. When tuning on part of the ID fit set, the fit takes its first images and "
    "validation its last ones. A class left without an image is a warning of the run; the run details say how "
    "each split was sampled."
)


def fit_set_size(values: FormValues) -> int | None:
    """The size of the form's whole ID fit set (no subsample), from paths the server allows (:func:`_count_images`,
    once per set and data root); None otherwise, and for an image folder unless the form tunes (a folder is walked
    to count it)."""
    if values.id_preset == FOLDER_PRESET and not values.tune:
        return None
    try:
        config = AccessPolicy.from_env().confine_config(config_from_form(replace(values, tune=False)))
    except PathRefused:
        return None
    fit = replace(config.id_fit, subsample=None, subsample_mode="first")
    if fit.name == "folder" and not str(fit.params.get("path", "")).strip():
        return None
    return _count_images(json.dumps(asdict(fit), sort_keys=True), config.data_root)


def _held_out_count(key: str, suggested: int) -> None:
    """Before the held-out count's widget (``key``) is drawn: while it still shows the count suggested last (a fifth
    of the ID fit set), it shows the one suggested now; a count typed stays as typed when the ID data changes."""
    state, last = st.session_state, f"{key}-suggested"
    if key in state and state[key] == state.get(last) and state[key] != suggested:
        state[key] = suggested
    state[last] = suggested


def _validation_section(defaults: FormValues, data: FormValues, slots: dict, generation: str) -> dict:
    """The "Validation (tuning)" fields (:mod:`oodviz.ui.form_tuning`): the switch, the ID validation split
    (held-out images of the ID fit set, counted from the form's ``data`` fields: :func:`fit_set_size`, or a
    folder), the OOD validation set; a placeholder under each for its errors, and one for its warnings
    (``<field>-warning``). Returns those fields and ``fit_size``."""
    st.markdown("#### Validation (tuning)")
    tune = st.checkbox(
        "Tune parameters on validation data",
        defaults.tune,
        help="Each detector tries every point of its grid (below) and keeps the one with the best AUROC on the ID "
        "validation images against the OOD validation set, then is fitted with it.",
    )
    st.caption(
        "The fields below are used only when this is ticked. An OpenOOD preset tunes on OpenOOD's own validation "
        "lists: leave them at none."
    )
    fit_size = fit_set_size(replace(data, tune=tune))
    id_val = st.selectbox(
        "ID validation",
        list(ID_VALIDATION_CHOICES),
        index=ID_VALIDATION_CHOICES.index(defaults.id_val),
        help="Held-out ID images the detectors are not fitted on (not the ID test set): the last images of the ID "
        "fit set (how many: below), or an image folder (its path: below).",
    )
    suggested = defaults.id_val_images or (fit_size // 5 if fit_size else 0)
    counted = f"of the {fit_size:,} ID fit images" if fit_size else "of the ID fit images"
    # keyed: a label that follows the count would otherwise make a new widget, back at the suggestion, at each change
    key = f"id-val-images-{generation}"
    _held_out_count(key, suggested)
    id_val_images = st.number_input(
        f"Held-out ID images ({counted})",
        min_value=0,
        value=suggested,
        key=key,
        help="The last N images of the ID fit set; the detectors are fitted on the images before them.",
    )
    slots["id_val"], slots["id_val-warning"] = st.empty(), st.empty()
    id_val_folder = st.text_input("ID validation folder (image folder only)", defaults.id_val_folder)
    slots["id_val_folder"] = st.empty()
    ood_sets = [NO_VALIDATION, *OOD_CHOICES]
    ood_val = st.selectbox(
        "OOD validation set",
        ood_sets,
        index=ood_sets.index(defaults.ood_val) if defaults.ood_val in ood_sets else 0,
        help="An OOD set that is not a test set: chosen on the data it is tested on, a detector looks better "
        "than it is.",
    )
    slots["ood_val"], slots["ood_val-warning"] = st.empty(), st.empty()
    return {
        "tune": tune,
        "id_val": id_val,
        "id_val_images": int(id_val_images),
        "id_val_folder": id_val_folder,
        "ood_val": ood_val,
        "fit_size": fit_size,
    }


def _grid_editor(defaults: FormValues, detectors: list[str], params: dict[str, dict], slots: dict) -> dict[str, str]:
    """ "Grids tried": per chosen detector with a default grid (:func:`~oodviz.pipeline.tuning.detector_grid`, less the
    parameters set by hand), its grid as text to edit (:func:`~oodviz.ui.form_tuning.parse_grid`); returns the
    grids that differ from the default, as typed."""
    chosen = RunConfig(detectors=[DetectorChoice(name, params.get(name, {})) for name in detectors])
    grids = tuned_grids(chosen)
    edited = {}
    with st.expander(f"Grids tried ({sum(bool(g) or n in defaults.detector_grids for n, g in grids.items())})"):
        st.caption(
            "When tuning: each detector's default grid, less the parameters set under the chosen detectors' parameters. Edit as "
            "parameter: value, value; parameter: value (blank: no tuning for that detector)."
        )
        for name, grid in grids.items():
            default = grid_text(grid)
            if not grid and name not in defaults.detector_grids:
                continue
            value = defaults.detector_grids.get(name, default)
            # a grid longer than the field is a text area: wrapped, every value in sight at 1000 px
            field = st.text_area if max(len(value), len(default)) > GRID_FIELD_CHARS else st.text_input
            typed = field(f"{name} grid", value, **({"height": "content"} if field is st.text_area else {}))
            if typed.strip() != default:
                edited[name] = typed.strip()
        untuned = [name for name, grid in grids.items() if not grid and name not in defaults.detector_grids]
        if untuned:
            st.caption(f"Nothing to tune: {', '.join(untuned)}.")
    slots["grids"] = st.empty()
    return edited


def _validation_warnings(values: FormValues, slots: dict) -> None:
    """Under the validation fields: the warnings of :func:`~oodviz.pipeline.tuning.validation_warnings` (a validation
    set that is also a test or fit set); under the ID preset, an OpenOOD preset's backbone that is not its
    benchmark's network (:func:`~oodviz.ui.form.openood_warnings`)."""
    for warning in validation_warnings(config_from_form(values)):
        field = "ood_val" if warning.startswith("the OOD validation") else "id_val"
        slots[f"{field}-warning"].warning(warning)
    for warning in openood_warnings(values):
        slots["id_preset-warning"].warning(warning)


#: what the pooling fields' help says
POOLING_HELP = (
    "How the layer's output becomes one feature vector per image.\n\n"
    "- **model's own** (the default): what the model's own head reads — on a transformer's token layers the class "
    "token (cls) or the mean of the patch tokens (mean), on feature maps the average over positions (avg);\n"
    "- **avg** / **max**: the average / maximum over positions or tokens (a transformer's class token included);\n"
    "- **cls**: the class token; **mean**: the mean of the patch tokens (class and register tokens left out); "
    "offered on a transformer's token layers;\n"
    "- **none**: no pooling, the output flattened (D = C x H x W or tokens x D: it can be huge, the estimate says)."
)
#: said under the pooling fields when penultimate is among the layers
PENULTIMATE_POOLED = "penultimate: the classifier head's input, already pooled by the model (nothing to choose)."


def _pooling_fields(
    backbone: str, layers: list[str], default: str | dict | None, generation: str, slots: dict
) -> str | dict | None:
    """One pooling field per chosen layer that pools (:func:`~oodviz.ui.form.pooled_layers`), with the choices that
    apply there (:func:`~oodviz.ui.form.pooling_options`): "Pooling" for a run over one layer, "Pooling of <layer>"
    beside others, each with a placeholder for its problems (``pooling[<layer>]``), and one for the pooling's
    (``pooling``) under them. ``default``: the ``RunConfig.pooling`` they show. Returns the ``RunConfig.pooling``
    they make (:func:`~oodviz.ui.form.pooling_from_fields`)."""
    fields = pooled_layers(backbone, layers)
    chosen = {}
    for layer in fields:
        options, own = pooling_options(backbone, layer)
        value = pooling_of(default, layer)
        if value not in options:  # a run's config naming one that does not apply here: shown, its check says why
            options.append(value)
        chosen[layer] = st.selectbox(
            "Pooling" if len(layers) == 1 else f"Pooling of {layer}",
            options,
            index=options.index(value),
            format_func=lambda choice, own=own: pooling_label(choice, own),
            placeholder=pooling_label(None, own),  # a field cleared (its x) is None too: the model's own
            key=f"pooling-{backbone}-{layer}-{generation}",
            help=POOLING_HELP,
        )
        if len(layers) > 1:
            slots[f"pooling[{layer}]"] = st.empty()
    if PENULTIMATE in layers and PENULTIMATE not in fields:
        st.caption(PENULTIMATE_POOLED)
    slots["pooling"] = st.empty()
    return pooling_from_fields(layers, chosen)


def render_form(defaults: FormValues, side) -> tuple[FormValues, str | None, dict]:
    """Draw the form's four steps where the page is, and Start, Estimate and the estimate in ``side``; returns its
    values, "estimate", "start" or None (neither pressed), and a placeholder under each field of
    :data:`~oodviz.ui.form.FORM_FIELDS` (``"form"``: beside Start) for what the checks say about it."""
    slots = {}
    # the form's key follows its defaults: another run's or a fix's values make new widgets that show them
    generation = hashlib.sha1(form_key(defaults).encode()).hexdigest()[:10]
    keys = _keys(generation)
    st.session_state.setdefault(keys["defaults_of"], defaults.backbone)
    st.subheader("1 · Model")
    # a new backbone offers its layers and its family's default detectors
    backbones = backbone_names() + [USER_MODEL]
    if defaults.backbone not in backbones:  # a run's timm:/hf: backbone that the list does not name, as it was typed
        backbones.append(defaults.backbone)
    backbone = st.selectbox(
        "Backbone",
        backbones,
        index=backbones.index(defaults.backbone),
        format_func=lambda b: "your own TorchScript file" if b == USER_MODEL else b,
        help="digits-cnn ships with oodviz and works offline. torchvision models need their weight file "
        "(or 'random' weights for a dry run). Type any timm model as timm:<model name> (pip install "
        "'oodviz[timm]'; a checkpoint file, or random weights) or a saved Hugging Face image classifier as "
        "hf:<directory> (pip install 'oodviz[hf]'), then press Enter.",
        key=keys["backbone"],
        on_change=_switch_default_detectors,
        args=(generation, defaults.detectors),
        accept_new_options=True,
    )
    backbone = backbone.strip()
    slots["backbone"] = st.empty()
    main_layers = defaults.layers if backbone == defaults.backbone else [PENULTIMATE]
    st.html(LAYER_CHIPS_STYLE)
    # Full width: layer names such as "penultimate" are cut short in a two-thirds column at 1000 px.
    layers = st.multiselect(
        "Layers",
        layer_options(backbone, main_layers),
        default=main_layers,
        key=f"layers-{backbone}-{generation}",
        help="The feature layer (penultimate: the classifier head's input). Several are extracted in one pass "
        "and compared in the results' Which layer? tab (a run over several layers has it); mahalanobis is also "
        "combined over them.",
    )
    slots["layers"] = st.empty()
    pooling = _pooling_fields(
        backbone, layers, defaults.pooling if backbone == defaults.backbone else None, generation, slots
    )
    weights = st.radio(
        "Weights", ["default", "random"], horizontal=True, index=["default", "random"].index(defaults.weights)
    )
    slots["weights"] = st.empty()
    checkpoint = st.text_input(
        "Checkpoint file (optional)",
        defaults.checkpoint,
        help="A TorchScript file (with 'your own TorchScript file'), or a state dict of the chosen architecture "
        "(for openood-resnet18-*: one of OpenOOD's checkpoints, e.g. results/cifar10_resnet18_32x32_base_e100_"
        "lr0.1_default/s0/best.ckpt of its download script).",
    )
    slots["checkpoint"] = st.empty()

    st.subheader("2 · Data")
    presets = list(ID_PRESETS) + list(OPENOOD_PRESETS) + [FOLDER_PRESET]
    id_preset = st.selectbox(
        "In-distribution",
        presets,
        index=presets.index(defaults.id_preset),
        help="digits (bundled): scikit-learn's 8 x 8 digits 0-7, offline (8 and 9 are the held-out OOD set). "
        "Fashion-MNIST, 8 classes: the classes fashion-cnn was trained on (Shirt and Ankle boot are the held-out "
        "OOD set). '(torchvision files)': the whole dataset, from torchvision's files under the data root. "
        "Image folders: your own, one subfolder per class.\n\n"
        f"{OPENOOD_HELP}",
    )
    slots["id_preset"], slots["id_preset-warning"] = st.empty(), st.empty()
    fit_folder = st.text_input("ID fit folder (image folders only)", defaults.fit_folder)
    slots["fit_folder"] = st.empty()
    test_folder = st.text_input("ID test folder (image folders only)", defaults.test_folder)
    slots["test_folder"] = st.empty()
    ood = st.multiselect(
        "OOD datasets",
        list(OOD_CHOICES),
        default=defaults.ood,
        help="Each set's group (near or far OOD) and source:\n\n"
        + "\n".join(f"- {ood_label(name)}" for name in OOD_CHOICES)
        + "\n\nNot with an OpenOOD preset: it runs its benchmark's own near and far sets (leave this empty).",
    )
    slots["ood"] = st.empty()
    ood_folder = st.text_input("Extra OOD image folder (optional)", defaults.ood_folder)
    slots["ood_folder"] = st.empty()
    data_root = st.text_input(
        "Data root (torchvision files, OpenOOD)",
        defaults.data_root,
        help="Where torchvision's dataset files are, and the folder in OpenOOD's layout the OpenOOD presets read "
        "(benchmark_imglist/, images_classic/, images_largescale/: what OpenOOD's download script fills).",
    )
    slots["data_root"] = st.empty()
    download = st.checkbox("Allow downloads", defaults.download, help="Off by default: oodviz works offline.")
    st.caption(SUBSAMPLE_CAPTION, help=SUBSAMPLE_HELP)
    s1, s2, s3 = st.columns(3)
    fit_subsample = s1.number_input("ID fit", min_value=0, value=defaults.fit_subsample)
    test_subsample = s2.number_input("ID test", min_value=0, value=defaults.test_subsample)
    ood_subsample = s3.number_input("OOD", min_value=0, value=defaults.ood_subsample, help="Per OOD set.")

    st.subheader("3 · Detectors")
    detectors = st.multiselect(
        "Detectors",
        detector_names(),
        default=None if keys["detectors"] in st.session_state else defaults.detectors,
        key=keys["detectors"],
        help="Higher score = more OOD for every detector. The Detectors page says what each one computes.",
    )
    slots["detectors"] = st.empty()
    st.caption(detectors_caption(backbone, detectors))
    st.page_link(page("detectors"), label="What each detector computes: the Detectors page")
    with st.expander(f"Parameters of the {len(detectors)} chosen detector(s)"):
        detector_params = _detector_params(defaults, detectors, generation)
    slots["detector_params"] = st.empty()  # under the expander: seen while it is closed
    protocol = st.radio(
        "Protocol",
        list(PROTOCOL_LABELS),
        index=list(PROTOCOL_LABELS).index(defaults.protocol) if defaults.protocol in PROTOCOL_LABELS else 0,
        format_func=PROTOCOL_LABELS.get,
        horizontal=True,
        help="Each paper's: every detector computes its paper's formula with oodviz's defaults. OpenOOD v1.5's: "
        "where OpenOOD's postprocessor computes a variant or takes other defaults (ash, for one, runs ASH-B), "
        "the detector computes OpenOOD's, as its leaderboard's figures were; a parameter set under Detector "
        "parameters is kept. The run records the protocol and each detector's parameters (Run details).",
    )
    slots["protocol"] = st.empty()

    data = replace(defaults, id_preset=id_preset, fit_folder=fit_folder, data_root=data_root, download=False)
    validation = _validation_section(defaults, data, slots, generation)
    detector_grids = _grid_editor(defaults, detectors, detector_params, slots)

    st.subheader("4 · Resources")
    facts = _devices()
    gpus = sum(f["device"].startswith("cuda") for f in facts)
    devices = ["auto"] + ([ALL_GPUS] if gpus > 1 else []) + [f["device"] for f in facts]
    labels = {
        "auto": "auto — first GPU if any, else CPU",
        ALL_GPUS: f"all {gpus} GPUs — one process each (torchrun)",
        **{f["device"]: _device_label(f) for f in facts},
    }
    device = st.selectbox(
        "Device",
        devices,
        index=devices.index(defaults.device) if defaults.device in devices else 0,
        format_func=labels.get,
    )
    slots["device"] = st.empty()
    r1, r2 = st.columns(2)
    batch_size = r1.number_input("Batch size", min_value=1, value=defaults.batch_size)
    precisions, feature_dtypes = choices("precisions"), choices("feature_dtypes")
    precision = r2.selectbox(
        "Precision",
        precisions,
        index=precisions.index(defaults.precision),
        help="bf16/fp16 autocast applies on GPUs only.",
    )
    slots["batch_size"], slots["precision"] = r1.empty(), r2.empty()
    feature_dtype = st.selectbox(
        "Features on disk",
        feature_dtypes,
        index=feature_dtypes.index(defaults.feature_dtype),
        format_func=lambda d: "float16 (half the disk)" if d == "float16" else d,
        help="float16 halves the size of the feature stores.",
    )
    slots["feature_dtype"] = st.empty()

    values = FormValues(
        backbone=backbone,
        weights=weights,
        checkpoint=checkpoint,
        layers=layers,
        pooling=pooling,
        id_preset=id_preset,
        fit_folder=fit_folder,
        test_folder=test_folder,
        ood=ood,
        ood_folder=ood_folder,
        detectors=detectors,
        detector_params=detector_params,
        detector_grids=detector_grids,
        device=device,
        batch_size=int(batch_size),
        precision=precision,
        feature_dtype=feature_dtype,
        fit_subsample=int(fit_subsample),
        test_subsample=int(test_subsample),
        ood_subsample=int(ood_subsample),
        data_root=data_root,
        download=download,
        protocol=protocol,
        **validation,
    )
    _validation_warnings(values, slots)
    side.subheader("Start")
    start_col, estimate_col = side.columns(2)
    start = start_col.button("Start run", type="primary", width="stretch", disabled=start_blocked(values))
    estimate = estimate_col.button("Estimate memory", width="stretch")
    slots["form"] = side.empty()
    estimate_panel(values, side)
    return values, "start" if start else "estimate" if estimate else None, slots


#: The Layers multiselect's chips wrap a long name (ViT's "encoder.layers.encoder_layer_11") over lines instead
#: of cutting it with an ellipsis at 1000 px; scoped by the widget's key class, the other multiselects unchanged.
LAYER_CHIPS_STYLE = """<style>
[class*="st-key-layers-"] [data-tag] { height: auto; max-width: 100%; }
[class*="st-key-layers-"] [data-tag] > span[title] {
  white-space: normal; overflow-wrap: anywhere; text-overflow: clip; overflow: visible; max-width: none; }
</style>"""


@st.cache_data(show_spinner="Estimating the run's needs…", max_entries=32, ttl=30)
def memory_estimate(config_json: str, runs_root: str) -> tuple[dict, str, str | None]:
    """(estimate, description, refusal) for a config run under ``runs_root``: the refusal is the pre-flight
    table and fixes when the run is over the machine's limits (:mod:`oodviz.pipeline.preflight`), else None. It
    loads the model and runs one batch through it (the checkpoint's own code), so it runs in a subprocess with
    a timeout, never in the server's process; raises ConfigError when no run of the config can start (an unreadable
    checkpoint, a detector parameter the data rules out), ProbeError when the estimate fails. Cached 30 s: free memory
    moves."""
    return estimate_in_subprocess(config_json, runs_root=runs_root)


def form_defaults() -> FormValues:
    """The form's starting values: those a fix filled in for this page, else those of the run it starts from
    (``?from=<id>``: to run it again with changes), else the default."""
    filled = prefilled()
    if filled is not None:
        return filled
    asked = from_run()
    try:
        path = run_path(runs_root(), asked) if asked else None
    except PathRefused as refusal:
        st.error(f"The run in the URL cannot be read: {refusal}. The form shows the defaults.")
        return FormValues()
    if path is None:
        return FormValues()
    try:
        return form_values_from_config(RunConfig.load(path / "config.json"))
    except (ValueError, OSError) as error:
        st.error(f"Run {asked!r} cannot start this form: {shown_message(str(error))}. The form shows the defaults.")
        return FormValues()


def confined_config(config: RunConfig, place) -> RunConfig | None:
    """``config`` with its typed paths confined to the allowed data directories, or None after saying in ``place``
    which were refused (see :meth:`AccessPolicy.confine_config`)."""
    try:
        return AccessPolicy.from_env().confine_config(config)
    except PathRefused as refusal:
        place.error(f"Not allowed on this server: {refusal}")
        return None


def plain(text: str) -> str:
    """``text`` shown as typed in Streamlit's markdown: a path's ``_a_`` stays, not in italics."""
    return re.sub(r"([\\`*_{}\[\]<>#|~$])", r"\\\1", text)


def handle_form(values: FormValues, action: str | None, slots: dict) -> None:
    """On Estimate or Start (or after a fix filled the form): check the whole form first
    (:func:`form_problems`) and show every problem under its field; only a form without problems is estimated
    (kept beside Start, :mod:`oodviz.ui.fixes`), and started when it fits or "Run anyway" is ticked (nothing is
    created before)."""
    if action is None and st.session_state.pop(ESTIMATE_NEXT, False):
        action = "estimate"
    if action is None:
        return
    problems = form_problems(values, AccessPolicy.from_env())
    for name, messages in problems.items():
        slots[name].error("\n\n".join(plain(m) for m in messages))
    if problems:
        count = sum(len(m) for m in problems.values())
        if "form" not in problems:
            slots["form"].error(f"Fix first: {count} problem(s), shown under their fields.")
        return
    config = AccessPolicy.from_env().confine_config(config_from_form(values))
    try:
        answer = memory_estimate(json.dumps(config.to_dict()), str(runs_root()))
    except ConfigError as error:  # the pre-flight's refusal (an unreadable checkpoint, knn's k above the fit rows)
        store_estimate(values, error=str(error))
        if action == "start":  # as a refusal of submit(): nothing is started
            slots["form"].error(str(error))
            return
    except Exception as error:  # a missing dataset or weight file: say what, keep the app running
        store_estimate(values, error=str(error))
    else:
        store_estimate(values, answer, classifier_problem=answer.estimate.get("classifier_problem"))
    if action == "start":
        if not refused(values) or st.session_state.get(RUN_ANYWAY):
            gpus = sum(f["device"].startswith("cuda") for f in device_facts())
            start_run(config, slots["form"], processes=processes_of(values, gpus))
            return
        refuse_start()
    st.rerun()  # the estimate is drawn beside Start, and Start off when over the limits


def start_run(config: RunConfig, place, processes: int = 1) -> None:
    """Submit ``config`` (on ``processes`` processes: "all N GPUs") and open its Run page; a refusal (an invalid
    config, a full queue) is shown in ``place``."""
    try:
        run = submit(config, runs_root(), nproc_per_node=processes)
    except (ConfigError, QueueFull) as error:
        place.error(str(error))
        return
    open_run(run.run_id)


def landing(values: FormValues) -> None:
    """What the app is for, and the two bundled runs in one click each."""
    chosen, known = len(RunConfig().detectors), len(detector_names())
    st.markdown(
        "Which inputs would your classifier wrongly trust, and which out-of-distribution detector catches them? "
        "Choose a model, data and detectors below — or start with the bundled offline default: "
        "**digits-cnn** on scikit-learn's 8x8 digits (classes 0–7) against held-out digits 8 and 9, inverted and "
        f"rotated digits, photo patches and noise, with the {chosen} detectors of the CNN defaults (of the {known} "
        "oodviz has). **Fashion-MNIST** runs **fashion-cnn** on the real 28x28 Fashion-MNIST (8 classes) against its "
        "held-out Shirt and Ankle boot, inverted and rotated images, digits, photo patches and noise; it reads "
        "Debian's `dataset-fashion-mnist`, the files in the form's data root, or downloads them where the form "
        "allows downloads."
    )
    buttons = st.container(horizontal=True)  # each button as wide as its label: none is cut
    if buttons.button("Run the default", type="primary"):
        start_run(config_from_form(FormValues()), st)
    if buttons.button("Run Fashion-MNIST"):
        config = preset("fashion-mnist")
        config.data_root, config.download = values.data_root.strip() or "data", bool(values.download)
        config = confined_config(config, st)
        if config is not None:
            start_run(config, st)


def new_run_page() -> None:
    st.title("New run")
    defaults = form_defaults()
    if from_run():
        st.caption(f"Starting from the choices of run `{from_run()}`: change what you like and press Start run.")
    intro = st.container()
    form_column, side_column = st.columns(2, gap="large")  # the needs table's columns whole beside the form
    side = side_column.container(key="start-panel")  # kept in sight while the form scrolls (main.PAGE_STYLE)
    with form_column:
        values, action, slots = render_form(defaults, side)
    with intro:
        landing(values)
    handle_form(values, action, slots)


__all__ = ["memory_estimate", "new_run_page", "render_form"]
