"""What the New run form offers and how its values become a RunConfig (no streamlit here: unit-testable)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from oodviz.columns import PENULTIMATE
from oodviz.config.catalog import choices, dataset_group_and_source, layer_default_pooling
from oodviz.config.run import DEFAULT_OOD, DatasetChoice, DetectorChoice, RunConfig
from oodviz.problems import Fix, Problem, pooled
from oodviz.results.leaderboard import BENCHMARKS, leaderboard_arch
from oodviz.ui.access import PathRefused
from oodviz.ui.form_tuning import (
    HELD_OUT,
    NO_VALIDATION,
    VALIDATION_FOLDER,
    form_layers,
    form_validation,
    grid_of,
    grid_text,
    held_out_problems,
    layer_settings,
    parse_grid,
    validation_choices,
)

#: ID presets: label -> (fit split, test split). Torchvision sets use their train/test splits.
ID_PRESETS: dict[str, tuple[DatasetChoice, DatasetChoice]] = {
    "digits (bundled, 8x8)": (DatasetChoice("digits-train"), DatasetChoice("digits-test")),
    "Fashion-MNIST, 8 classes": (
        DatasetChoice("fashion-mnist-id", {"split": "train"}),
        DatasetChoice("fashion-mnist-id", {"split": "test"}),
    ),
    **{
        f"{name} (torchvision files)": (DatasetChoice(name, {"split": "train"}), DatasetChoice(name, {"split": "test"}))
        for name in ("mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100")
    },
}
FOLDER_PRESET = "image folders (your own)"
#: OpenOOD v1.5's benchmarks as ID presets: label -> benchmark. Each runs the benchmark's lists under the data root
#: (OpenOOD's layout) as :func:`oodviz.pipeline.openood.benchmark_config` makes them: ID train/test, its own near and
#: far OOD sets, OpenOOD's validation lists when tuning, OpenOOD's test preprocessing; the form's backbone, weights,
#: checkpoint, detectors and resources.
OPENOOD_PRESETS: dict[str, str] = {f"OpenOOD v1.5 {name}": name for name in BENCHMARKS}
#: the network each benchmark's leaderboard figures are of (:data:`oodviz.models.OPENOOD_NETWORKS`, which imports
#: torch: named here for the form's help and warning)
OPENOOD_BACKBONES = {
    "cifar10": "openood-resnet18-32x32",
    "cifar100": "openood-resnet18-32x32",
    "imagenet200": "openood-resnet18-224x224",
    "imagenet": "resnet50",
}
#: Side of the ID preset's images; the generated OOD sets (photo patches, noise) are made that size.
PRESET_IMAGE_SIZE = {
    "Fashion-MNIST, 8 classes": 28,
    **{f"{name} (torchvision files)": 28 for name in ("mnist", "fashion-mnist", "kmnist")},
    **{f"{name} (torchvision files)": 32 for name in ("cifar10", "cifar100")},
}
GENERATED_OOD = ("photo-patches", "noise-gaussian", "noise-uniform")
TORCHVISION_OOD = ("mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100", "svhn", "dtd")

#: Datasets offered as OOD sets (the registry's OOD sources plus the ID-capable torchvision sets).
OOD_CHOICES = (
    *DEFAULT_OOD,
    "fashion-mnist-heldout",
    "fashion-mnist-inverted",
    "fashion-mnist-rotated",
    "digits-28",
    "mnist",
    "fashion-mnist",
    "kmnist",
    "cifar10",
    "cifar100",
    "svhn",
    "dtd",
)


def ood_label(name: str) -> str:

    group, source = dataset_group_and_source(name)
    return f"{name} ({group or 'far'}, {source})"


@dataclass
class FormValues:
    """The New run form's values, as the widgets give them."""

    backbone: str = "digits-cnn"
    weights: str = "default"
    checkpoint: str = ""
    #: the feature layers: one (``"penultimate"``: the default) or several (a run over several layers)
    layers: list[str] = field(default_factory=lambda: [PENULTIMATE])
    #: ``RunConfig.pooling``: None (the model's own), a pooling, or a table layer -> pooling
    #: (:func:`pooling_from_fields` makes it from the form's pooling fields)
    pooling: str | dict | None = None
    id_preset: str = "digits (bundled, 8x8)"
    fit_folder: str = ""
    test_folder: str = ""
    ood: list[str] = field(default_factory=lambda: [RunConfig().to_dict()["ood"][i]["name"] for i in range(6)])
    ood_folder: str = ""
    detectors: list[str] = field(default_factory=lambda: [d.name for d in RunConfig().detectors])
    detector_params: dict[str, dict] = field(default_factory=dict)
    #: detector -> its grid as typed (:func:`~oodviz.ui.form_tuning.parse_grid`), for the grids edited only
    detector_grids: dict[str, str] = field(default_factory=dict)
    device: str = "auto"
    batch_size: int = 256
    precision: str = "fp32"
    feature_dtype: str = "float32"
    fit_subsample: int = 0  # 0 = all
    test_subsample: int = 0
    ood_subsample: int = 0
    data_root: str = "data"
    download: bool = False
    #: tuning on validation data (:mod:`oodviz.ui.form_tuning`)
    tune: bool = False
    id_val: str = NO_VALIDATION
    id_val_images: int = 0
    id_val_folder: str = ""
    ood_val: str = NO_VALIDATION
    #: the ID fit set's size as the form counted it (None: not counted), for the held-out validation images
    fit_size: int | None = None
    #: ``RunConfig.protocol``: ``"paper"`` (each detector's paper) or ``"openood"`` (OpenOOD v1.5's variants)
    protocol: str = "paper"


def form_values_from_config(config: RunConfig) -> FormValues:
    """The form values that describe ``config`` (the inverse of :func:`config_from_form` for the
    configs the form can make), so that the form starts from a run's choices."""
    id_preset, fit_folder, test_folder = FOLDER_PRESET, "", ""
    benchmark = config.id_fit.params.get("benchmark") if config.id_fit.name == "openood" else None
    openood = next((label for label, name in OPENOOD_PRESETS.items() if name == benchmark), None)
    for label, (fit, test) in ID_PRESETS.items():
        if (fit.name, fit.params, test.name, test.params) == (
            config.id_fit.name,
            config.id_fit.params,
            config.id_test.name,
            config.id_test.params,
        ):
            id_preset = label
    if openood is not None:
        id_preset = openood
    elif id_preset == FOLDER_PRESET:
        fit_folder, test_folder = config.id_fit.params.get("path", ""), config.id_test.params.get("path", "")
    ood = [c.name for c in config.ood if c.name in OOD_CHOICES]
    folders = [c.params.get("path", "") for c in config.ood if c.name == "folder"]
    subsamples = [c.subsample for c in config.ood if c.subsample]
    validation = form_validation(config)
    if openood is not None:  # OpenOOD's validation lists, which the preset names itself
        validation.update(id_val=NO_VALIDATION, id_val_images=0, ood_val=NO_VALIDATION)
    return FormValues(
        backbone=config.backbone,
        weights=config.weights,
        checkpoint=config.checkpoint or "",
        layers=form_layers(config),
        pooling=dict(config.pooling) if isinstance(config.pooling, dict) else config.pooling,
        id_preset=id_preset,
        fit_folder=fit_folder,
        test_folder=test_folder,
        ood=ood,
        ood_folder=folders[0] if folders else "",
        detectors=[d.name for d in config.detectors],
        detector_params={d.name: dict(d.params) for d in config.detectors if d.params},
        detector_grids={d.name: grid_text(d.grid) for d in config.detectors if d.grid is not None},
        device=config.device,
        batch_size=config.batch_size,
        precision=config.precision,
        feature_dtype=config.feature_dtype,
        fit_subsample=config.id_fit.subsample or 0,
        test_subsample=config.id_test.subsample or 0,
        ood_subsample=subsamples[0] if subsamples else 0,
        data_root=config.data_root,
        download=config.download,
        protocol=config.protocol,
        **validation,
    )


#: the form's backbone choice "your own TorchScript file": its only layer, "penultimate", is the model's output
USER_MODEL = "torchscript"


def pooled_layers(backbone: str, layers: list[str]) -> list[str]:
    """The form's layers that get a pooling field: all but ``penultimate``, the classifier head's input (already
    pooled by the model: no pooling changes it), which has one only for a TorchScript file (its features are what
    the model returns, possibly a map)."""
    return [layer for layer in layers if layer != PENULTIMATE or backbone == USER_MODEL]


def pooling_options(backbone: str, layer: str) -> tuple[list[str | None], str | None]:
    """``(choices, own)`` of ``layer``'s pooling field: ``own`` is what leaving it unset gives there
    (:func:`oodviz.config.catalog.layer_default_pooling`: ``"cls"`` or ``"mean"`` on a layer holding a transformer's
    token sequence, ``"avg"`` elsewhere; None where the catalog does not know the model); the choices are None (the
    model's own) and the poolings, ``cls`` and ``mean`` only where they apply (on a layer whose kind is unknown, all:
    the config's check refuses what does not apply)."""
    own = "avg" if backbone == USER_MODEL else layer_default_pooling(backbone, layer)
    token = choices("token_poolings")
    usable = [p for p in choices("poolings") if own is None or own in token or p not in token]
    return [None, *usable], own


#: how a pooling field shows the poolings whose name alone says little
POOLING_WORDS = {"cls": "cls (the class token)", "mean": "mean (of the patch tokens)", "none": "none (flattened)"}


def pooling_label(choice: str | None, own: str | None) -> str:
    """How a pooling field shows ``choice``: None as "model's own (cls)" (what it gives there, when known), the token
    poolings and ``none`` with what they do (:data:`POOLING_WORDS`)."""
    if choice is not None:
        return POOLING_WORDS.get(choice, choice)
    return f"model's own ({own})" if own else "model's own"


def pooling_of(pooling: str | dict | None, layer: str) -> str | None:
    """The pooling ``RunConfig.pooling`` (or ``FormValues.pooling``) gives ``layer``: a name, its entry in a table,
    or None (the model's own)."""
    return pooling.get(layer) if isinstance(pooling, dict) else pooling


def pooling_from_fields(layers: list[str], chosen: dict[str, str | None]) -> str | dict | None:
    """``RunConfig.pooling`` from the form's pooling fields (``chosen``: layer -> its field's value, None the model's
    own, for the layers of ``layers`` that have a field): None when every field says the model's own; the one field's
    value for a run over one layer; else a table of the layers whose field names a pooling (a layer it does not name
    takes the model's own)."""
    named = {layer: how for layer, how in chosen.items() if how is not None and layer in layers}
    if not named:
        return None
    if len(layers) == 1:
        return named[layers[0]]
    return named


def _subsample(n: int) -> int | None:
    return int(n) if n and n > 0 else None


#: the device choice "every visible GPU, one process each" (offered when more than one GPU is visible)
ALL_GPUS = "all GPUs"


def processes_of(values: FormValues, gpu_count: int) -> int:
    """How many processes the run starts: one per visible GPU for :data:`ALL_GPUS`, else one."""
    return max(gpu_count, 1) if values.device == ALL_GPUS else 1


def openood_config(values: FormValues) -> RunConfig | None:
    """For an OpenOOD preset (:data:`OPENOOD_PRESETS`), the run of its benchmark over the form's data root,
    checkpoint and weights, tuned on OpenOOD's validation lists when the form tunes
    (:func:`oodviz.pipeline.openood.benchmark_config`: the data, the preprocessing); None for another preset."""
    benchmark = OPENOOD_PRESETS.get(values.id_preset)
    if benchmark is None:
        return None
    from oodviz.pipeline.openood import benchmark_config  # its data module imports torch: only for these presets

    data_root = values.data_root.strip() or "data"
    checkpoint = values.checkpoint.strip() or None
    return benchmark_config(benchmark, data_root, checkpoint, weights=values.weights, tune=bool(values.tune))


def config_from_form(values: FormValues) -> RunConfig:
    """The RunConfig the form describes (not validated: call ``problems()`` on it). An OpenOOD preset takes its
    benchmark's data, preprocessing and validation lists (:func:`openood_config`); the OOD list, the extra OOD
    folder and the validation fields are not used then (:func:`form_problems` asks for them empty)."""
    bench = openood_config(values)
    if values.id_preset == FOLDER_PRESET:
        fit = DatasetChoice("folder", {"path": values.fit_folder.strip()})
        test = DatasetChoice("folder", {"path": values.test_folder.strip()})
    elif bench is not None:
        fit, test = bench.id_fit, bench.id_test
    else:
        fit, test = (DatasetChoice(c.name, dict(c.params)) for c in ID_PRESETS[values.id_preset])
    fit.subsample = _subsample(values.fit_subsample)
    test.subsample = _subsample(values.test_subsample)
    size = PRESET_IMAGE_SIZE.get(values.id_preset)

    def ood_choice(name: str) -> DatasetChoice:
        params = (
            {"split": "test"} if name in TORCHVISION_OOD else {"size": size} if size and name in GENERATED_OOD else {}
        )
        return DatasetChoice(name, params)

    if bench is not None:
        ood = [replace(choice, subsample=_subsample(values.ood_subsample)) for choice in bench.ood]
        id_val, ood_val = bench.id_val, bench.ood_val
    else:
        ood = [replace(ood_choice(name), subsample=_subsample(values.ood_subsample)) for name in values.ood]
        id_val, ood_val = validation_choices(values, fit, ood_choice)
    if values.ood_folder.strip() and bench is None:
        ood.append(
            DatasetChoice(
                "folder", {"path": values.ood_folder.strip()}, subsample=_subsample(values.ood_subsample), group="far"
            )
        )
    detectors = [
        DetectorChoice(name, dict(values.detector_params.get(name, {})), grid_of(values, name))
        for name in values.detectors
    ]
    layer, layers = layer_settings(values.layers)
    return RunConfig(
        backbone="torchscript" if values.backbone == "torchscript" else values.backbone,
        weights=values.weights,
        checkpoint=values.checkpoint.strip() or None,
        layer=layer,
        layers=layers,
        pooling=dict(values.pooling) if isinstance(values.pooling, dict) else values.pooling,
        id_fit=fit,
        id_test=test,
        ood=ood,
        detectors=detectors,
        device="cuda" if values.device == ALL_GPUS else values.device,
        batch_size=int(values.batch_size),
        precision=values.precision,
        feature_dtype=values.feature_dtype,
        data_root=values.data_root.strip() or "data",
        download=bool(values.download),
        id_val=id_val,
        ood_val=ood_val,
        preprocessing=None if bench is None else bench.preprocessing,
        protocol=values.protocol,
    )


#: The form's fields that can carry an error, in the order they are drawn; ``"form"``: the rest (beside Start). Besides
#: these, ``"pooling[<layer>]"`` under each layer's pooling field (:func:`pooled_layers`, a form over several layers)
#: for a table's entry.
FORM_FIELDS = (
    "backbone",
    "weights",
    "checkpoint",
    "layers",
    "pooling",
    "id_preset",
    "fit_folder",
    "test_folder",
    "ood",
    "ood_folder",
    "data_root",
    "detectors",
    "detector_params",
    "protocol",
    "id_val",
    "id_val_folder",
    "ood_val",
    "grids",
    "device",
    "batch_size",
    "precision",
    "feature_dtype",
    "form",
)
#: The config's fields (:attr:`~oodviz.problems.Problem.field`, its first part) -> the form field that sets them.
_CONFIG_FIELDS = {
    "backbone": "backbone",
    "weights": "weights",
    "checkpoint": "checkpoint",
    "layer": "layers",
    "layers": "layers",
    "pooling": "pooling",
    "ood": "ood",
    "detectors": "detectors",
    "device": "device",
    "batch_size": "batch_size",
    "precision": "precision",
    "feature_dtype": "feature_dtype",
    "ood_val": "ood_val",
    "protocol": "protocol",
    "preprocessing": "id_preset",
    "data_root": "data_root",  # an OpenOOD data root's problems (oodviz.data.openood.LayoutProblem)
}
#: :meth:`AccessPolicy.confine_config`'s labels of refused paths -> the field typed
_REFUSED_LABELS = {
    "ID fit folder": "fit_folder",
    "ID test folder": "test_folder",
    "OOD folder": "ood_folder",
    "ID validation folder": "id_val_folder",
    "checkpoint": "checkpoint",
    "data root": "data_root",
}


def problem_field(problem: Problem, values: FormValues) -> str:
    """The form field a problem of :meth:`RunConfig.problems` is about (see :data:`FORM_FIELDS`), from the config
    field it names (:attr:`~oodviz.problems.Problem.field`): the ID splits go under their folders or the ID preset,
    an OOD set beyond the form's list under the OOD folder, a detector's grid under the grids and its parameters
    under "Detector parameters"; the rest beside Start."""
    path = problem.field
    head = path.split("[")[0].split(".")[0]
    if head in ("id_fit", "id_test"):
        if values.id_preset != FOLDER_PRESET:
            return "id_preset"
        return "fit_folder" if head == "id_fit" else "test_folder"
    if head == "id_val":
        return "id_val_folder" if values.id_val == VALIDATION_FOLDER else "id_val"
    if head == "detectors" and "[" in path:
        return "grids" if path.endswith(".grid") else "detector_params"
    if head == "ood" and "[" in path:
        index = int(path[len("ood[") : path.index("]")])
        return "ood_folder" if index >= len(values.ood) else "ood"
    if head == "pooling" and path.startswith("pooling[") and path.endswith("]"):  # a table's entry: under its field
        layer = path[len("pooling[") : -1]  # (one layer has one field, "Pooling", whose problems are "pooling")
        fields = pooled_layers(values.backbone, values.layers) if len(values.layers) > 1 else []
        return path if layer in fields else "pooling"
    return _CONFIG_FIELDS.get(head, "form")


def folder_problem(path: str) -> str | None:
    """Why image folder ``path`` cannot be read as a dataset (missing, a file, no images, empty class
    folders), or None; the same check the run's worker does when it opens the folder."""
    from oodviz.data.folders import FolderSource

    try:
        FolderSource(path)
    except ValueError as error:
        return str(error)
    return None


def form_problems(values: FormValues, policy=None) -> dict[str, list[str]]:
    """Every problem of the form, keyed by the field it is about (:data:`FORM_FIELDS`): the typed paths
    refused by ``policy`` (an :class:`~oodviz.ui.access.AccessPolicy`), each image folder that cannot be
    read, and :meth:`RunConfig.problems` of the config the form makes. Empty when the run can start."""

    found: dict[str, list[str]] = {}
    config = config_from_form(values)
    if policy is not None:
        try:
            config = policy.confine_config(config)
        except PathRefused as refusal:
            for label, why in refusal.refused or (("", str(refusal)),):
                found.setdefault(_REFUSED_LABELS.get(label, "form"), []).append(why)
            return found  # the other checks would read paths the server does not allow
    folders = []
    if values.id_preset == FOLDER_PRESET:
        folders += [("fit_folder", config.id_fit), ("test_folder", config.id_test)]
    folders += [("ood_folder", choice) for choice in config.ood if choice.name == "folder"]
    if values.tune and values.id_val == VALIDATION_FOLDER:
        folders.append(("id_val_folder", config.id_val))
    for name, choice in folders:
        problem = folder_problem(choice.params.get("path", ""))
        if problem:
            found.setdefault(name, []).append(problem)
    for problem in config.problems():
        name = problem_field(problem, values)
        if name in found and name.endswith("_folder"):
            continue  # the folder's own message says it better
        found.setdefault(name, []).append(problem.detail)
    for name, messages in openood_problems(values, config).items():
        found.setdefault(name, []).extend(messages)
    for name in values.detectors if values.tune else []:
        for problem in parse_grid(name, values.detector_grids[name])[1] if name in values.detector_grids else []:
            found.setdefault("grids", []).append(problem)
    for problem in held_out_problems(values) if values.id_preset not in OPENOOD_PRESETS else []:
        found.setdefault("id_val", []).append(problem)
    if values.tune and config.id_val is None and config.ood_val is None:
        found.setdefault("id_val", []).append(
            f"tuning needs validation data: set 'ID validation' above to '{HELD_OUT}' (how many: the number above) "
            f"or '{VALIDATION_FOLDER}', and choose an 'OOD validation set' below"
        )
    return found


def openood_sets(config: RunConfig) -> str:
    """``"near cifar100, tin; far mnist, ..."``: the OOD sets of a benchmark's run, by group."""
    groups = {group: [c.result_name for c in config.ood if c.group == group] for group in ("near", "far")}
    return "; ".join(f"{group} {', '.join(names)}" for group, names in groups.items() if names)


def openood_problems(values: FormValues, config: RunConfig) -> dict[str, list[str]]:
    """For an OpenOOD preset, keyed by field: the form's fields it does not use, when set (the OOD list, the extra
    OOD folder; when tuning, the validation fields: the benchmark names its own sets), and every problem of the data
    root (:func:`oodviz.pipeline.openood.benchmark_problems`: a list file or an image missing, a malformed list,
    each naming what to fetch; problems about ``data_root``). Empty for another preset."""
    if values.id_preset not in OPENOOD_PRESETS:
        return {}
    from oodviz.pipeline.openood import benchmark_problems

    found: dict[str, list[str]] = {}
    preset, sets = values.id_preset, openood_sets(config)
    if values.ood:
        found["ood"] = [
            f"{preset} runs its benchmark's own OOD sets ({sets}), the sets its leaderboard averages over: clear "
            "this list (these sets would not run)"
        ]
    if values.ood_folder.strip():
        found["ood_folder"] = [f"{preset} runs only its benchmark's own OOD sets ({sets}): clear this field"]
    if values.tune:
        lists = "OpenOOD's validation lists of the benchmark (ID: id_val; OOD: ood_val)"
        if values.id_val != NO_VALIDATION:
            found["id_val"] = [f"{preset} tunes on {lists}: set ID validation to {NO_VALIDATION!r}"]
        if values.ood_val != NO_VALIDATION:
            found["ood_val"] = [f"{preset} tunes on {lists}: set the OOD validation set to {NO_VALIDATION!r}"]
    for problem in benchmark_problems(config):
        found.setdefault(problem_field(problem, values), []).append(str(problem))
    return found


def openood_warnings(values: FormValues) -> list[str]:
    """For an OpenOOD preset whose backbone is not its benchmark's network (:data:`OPENOOD_BACKBONES`; for
    ``imagenet`` also torchvision's ViT-B/16 and Swin-T, which its leaderboard has): that the leaderboard's figures
    are of another network. Empty otherwise."""
    benchmark = OPENOOD_PRESETS.get(values.id_preset)
    if benchmark is None or values.backbone == OPENOOD_BACKBONES[benchmark]:
        return []
    if leaderboard_arch(benchmark, values.backbone) is not None:
        return []
    return [
        f"The {benchmark} leaderboard's figures are of {OPENOOD_BACKBONES[benchmark]} (OpenOOD's checkpoints): with "
        f"{values.backbone} the comparison is of another network"
    ]


@dataclass(frozen=True)
class FormFix:
    """A change of the form that a message names: ``label`` says it (a button's text), ``values`` is the form
    with it applied."""

    label: str
    values: FormValues


def form_fixes(fixes: list[Fix], values: FormValues) -> list[FormFix]:
    """Each fix (:class:`~oodviz.problems.Fix`: the pre-flight's, or a failed run's) that the form can make, as a
    change of the form ``values``, labelled for its button; read from the fix's kind and value, never from its
    text:

    - ``pooling``: the model's own pooling (or the fix's) where the form says ``none`` (:func:`oodviz.problems.pooled`);
    - ``drop_layer``: that layer out of the form's layers (when others remain);
    - ``drop_detectors``: those detectors out (when others remain);
    - ``subsample``: every split at most that many images;
    - ``feature_dtype``, ``batch_size``: that value.

    A fix that would change nothing is left out, as is ``advice``."""
    found = []
    for fix in fixes:
        if fix.kind == "pooling" and pooled(values.pooling, fix.value) != values.pooling:
            how = "the model's own pooling" if fix.value is None else f"pooling {fix.value}"
            found.append(
                FormFix(f"Pool the features ({how})", replace(values, pooling=pooled(values.pooling, fix.value)))
            )
        elif fix.kind == "drop_layer" and fix.value in values.layers and len(values.layers) > 1:
            kept = [name for name in values.layers if name != fix.value]
            found.append(FormFix(f"Leave out layer {fix.value} (the widest)", replace(values, layers=kept)))
        elif fix.kind == "drop_detectors":
            dropped = [name for name in values.detectors if name in fix.value]
            if dropped and len(dropped) < len(values.detectors):
                kept = [name for name in values.detectors if name not in fix.value]
                found.append(FormFix(f"Leave out {', '.join(dropped)}", replace(values, detectors=kept)))
        elif fix.kind == "subsample":
            cap = int(fix.value)
            keys = ("fit_subsample", "test_subsample", "ood_subsample")
            capped = {key: min(getattr(values, key) or cap, cap) for key in keys}
            if any(capped[key] != getattr(values, key) for key in keys):
                found.append(FormFix(f"Subsample every split to at most {cap:,} images", replace(values, **capped)))
        elif fix.kind == "feature_dtype" and values.feature_dtype != fix.value:
            found.append(FormFix(f"Store the features as {fix.value}", replace(values, feature_dtype=fix.value)))
        elif fix.kind == "batch_size" and int(fix.value) < values.batch_size:
            smaller = int(fix.value)
            found.append(
                FormFix(f"Batch size {values.batch_size:,} → {smaller:,}", replace(values, batch_size=smaller))
            )
    return found
