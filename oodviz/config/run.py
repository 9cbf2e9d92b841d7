"""RunConfig: everything that defines a run, as plain data that round-trips through JSON or TOML.

``RunConfig()`` is the bundled offline default: ``digits-cnn`` on scikit-learn's digits against
every bundled OOD set, with the default detectors of its backbone's family (:func:`default_detectors`: for a CNN
every detector with ``in_defaults``, so not ``mcd``, which needs dropout layers most classifiers lack).
``id_val`` and ``ood_val`` with ``DetectorChoice.grid`` make a run tune its detectors on validation data
(:mod:`oodviz.pipeline.tuning`). ``validate()`` lists every problem at once, before any work starts.

``preset(name)`` returns a named ready-made config (:data:`PRESETS`): ``"digits"`` (= ``RunConfig()``)
and ``"fashion-mnist"`` (``fashion-cnn`` on the real Fashion-MNIST, :func:`fashion_mnist_config`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from oodviz import detectors, engine, models
from oodviz.columns import PENULTIMATE
from oodviz.config.defaults import default_detector_params
from oodviz.config.layers import layers_problems
from oodviz.config.tuning import tuning_problems
from oodviz.config.validation import MAX_BATCH_SIZE, ConfigError, cpu_count, device_problem_here, read_config_file
from oodviz.files import write_json
from oodviz.models.hub_names import hub_kind
from oodviz.params import describe, matches, non_finite, param_problems, shown
from oodviz.problems import Problem, detector_problem, problems_at
from oodviz.sampling import SUBSAMPLE_MODES

#: ``RunConfig.preprocessing``'s prefix for OpenOOD v1.5's test transform of a benchmark (``"openood:cifar10"``)
OPENOOD_PREPROCESSING = "openood:"
#: ``RunConfig.protocol``'s values: each detector's paper, or OpenOOD v1.5's variants (:meth:`RunConfig.apply_protocol`)
PROTOCOLS = ("paper", "openood")
DEFAULT_OOD = (
    "digits-heldout",
    "digits-inverted",
    "digits-rotated",
    "photo-patches",
    "noise-gaussian",
    "noise-uniform",
)


@dataclass
class DatasetChoice:
    """A dataset from ``oodviz.data`` with its parameters, optional subsample, (OOD) near/far group and title.

    ``subsample``: at most this many images (``None`` = all), taken by ``subsample_mode`` with the run's seed
    (:func:`oodviz.sampling.subsample_indices`): ``"stratified"`` (the default: each class its share, drawn
    uniformly; an OOD set, without classes, a uniform draw), ``"random"``, or ``"first"`` / ``"last"`` (what
    tuning's held-out ID images use: the fit takes the first images, validation the last ones)."""

    name: str
    params: dict = field(default_factory=dict)
    subsample: int | None = None
    subsample_mode: str = "stratified"
    group: str | None = None  # None = the group the dataset registers
    #: the name the run's results and pages give the set (None: the dataset's ``name``); two OOD sets of one dataset
    #: (two image folders, two OpenOOD lists) each need one
    title: str | None = None

    @property
    def result_name(self) -> str:
        """The name the run's results (``scores.parquet``'s ``dataset``, ``metrics.csv``'s ``ood_dataset``, the
        ``ood:<name>`` split) give this set: ``title``, else the dataset's ``name``."""
        return self.title or self.name


@dataclass
class DetectorChoice:
    """A detector from ``oodviz.detectors`` with its parameters and, for a run that tunes on validation data
    (:mod:`oodviz.pipeline.tuning`), the values to try: ``grid`` ``{parameter: [values]}``; None = the detector's
    ``default_grid`` less the parameters set in ``params``, ``{}`` = no tuning."""

    name: str
    params: dict = field(default_factory=dict)
    grid: dict | None = None


def default_detectors(backbone) -> list[DetectorChoice]:
    """The default detectors of ``backbone``'s family and their parameters (:mod:`oodviz.config.defaults`)."""

    return [DetectorChoice(name, params) for name, params in default_detector_params(backbone).items()]


@dataclass
class RunConfig:
    """What a run asks for: the backbone and its layers, the data, the detectors, and how to run them.

    Every field has a default: ``RunConfig()`` is the bundled offline default (``digits-cnn`` on scikit-learn's
    digits against held-out and transformed digits, photo patches and noise, the family's default detectors).
    :meth:`load` reads a ``.json`` or ``.toml`` file with these fields as keys, :meth:`save` writes one, and
    :meth:`problems` lists everything wrong with a config at once (types, datasets and detector parameters
    against their signatures, the layer against the architecture, the device against this machine), before any
    work. :func:`preset` gives the named ready-made configs. The documentation's Configs page describes every
    field; ``oodviz.run(config)`` runs one in this process (:func:`oodviz.pipeline.worker.run`).
    """

    backbone: str = "digits-cnn"
    weights: str = "default"  # "default" (pretrained / bundled) or "random" (a dry run)
    checkpoint: str | None = None  # a TorchScript file or a state dict for the backbone's architecture
    layer: str | None = None  # None = the penultimate layer
    #: several layers in one forward pass (module names, or "penultimate"); [] = one layer, ``layer``
    #: (:mod:`oodviz.pipeline.layers`)
    layers: list = field(default_factory=list)
    #: how a layer's output becomes a [B, D] feature (models.POOLINGS); None = the model's own: what its head reads
    #: for a layer holding a transformer's token sequence ("cls", or "mean" of the patch tokens), "avg" for every
    #: other layer (Backbone.default_pooling). Or a table layer -> pooling (a layer it does not name: the model's
    #: own), e.g. {"blocks.5": "mean", "blocks.8": "avg"} for a ViT
    pooling: str | dict | None = None
    id_fit: DatasetChoice = field(default_factory=lambda: DatasetChoice("digits-train"))
    id_test: DatasetChoice = field(default_factory=lambda: DatasetChoice("digits-test"))
    ood: list[DatasetChoice] = field(default_factory=lambda: [DatasetChoice(name) for name in DEFAULT_OOD])
    #: None = the default detectors of the backbone's family (:func:`default_detectors`)
    detectors: list[DetectorChoice] | None = None
    device: str = "auto"  # "auto" = the first GPU if there is one, else the CPU
    batch_size: int = 256
    precision: str = "fp32"
    #: DataLoader workers reading image folders and torchvision sets; "auto" = a function of the CPU cores and
    #: the dataset (0 for the in-memory sets, transformed a batch at a time: oodviz.engine.loading.auto_workers)
    num_workers: int | str = "auto"
    seed: int = 0
    data_root: str = "data"
    download: bool = False
    feature_dtype: str = "float32"
    #: an extra cap (GiB) on the disk the new feature stores may take, below the free disk; None = the disk's own
    #: free space (the pre-flight check, :mod:`oodviz.pipeline.preflight`, compares with the machine's real limits)
    memory_budget_gb: float | None = None
    #: a ``timm:`` backbone's constructor arguments (e.g. ``{"img_size": 32}`` for a checkpoint trained at 32 x 32)
    model_args: dict = field(default_factory=dict)
    #: the images' preprocessing: None = the backbone's own; ``"openood:<benchmark>"`` = OpenOOD v1.5's test
    #: transform of that benchmark (:func:`oodviz.models.openood_transform`), as its leaderboard's figures were made
    preprocessing: str | None = None
    #: ``"paper"``: each detector computes its paper's formula with oodviz's defaults; ``"openood"``: OpenOOD v1.5's
    #: variant and defaults wherever they differ (each detector's ``openood_params``, under the parameters given)
    protocol: str = "paper"
    #: tuning on validation data (:mod:`oodviz.pipeline.tuning`): held-out ID images and an OOD set that is not a test set
    id_val: DatasetChoice | None = None
    ood_val: DatasetChoice | None = None

    def __post_init__(self):
        if self.detectors is None:
            self.detectors = default_detectors(self.backbone)
        self.apply_protocol()

    def apply_protocol(self) -> RunConfig:
        """Under ``protocol = "openood"``, give each known detector its ``openood_params`` (OpenOOD v1.5's variant and
        defaults) where its own ``params`` do not set them, so that the run config records them; nothing otherwise.
        Done when a config is made; call it again after changing ``protocol`` or ``detectors``. Returns self."""
        if self.protocol != "openood" or not isinstance(self.detectors, list):
            return self
        known = set(detectors.available())
        for choice in self.detectors:
            if isinstance(choice, DetectorChoice) and choice.name in known and isinstance(choice.params, dict):
                choice.params = {**detectors.detector_class(choice.name).openood_params, **choice.params}
        return self

    # -- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> RunConfig:
        """Build a config from plain data. Unknown keys, and datasets or detectors that are neither a name nor
        a table with a ``name``, are a ConfigError listing them all; the values are checked by :meth:`problems`."""
        if not isinstance(data, Mapping):
            raise ConfigError([f"a run config is a table of settings, got {shown(data)}"])
        data = dict(data)
        problems = [f"unknown setting {key!r}" for key in sorted(set(data) - set(cls.__dataclass_fields__), key=str)]
        for key in ("id_fit", "id_test", "id_val", "ood_val"):
            if key in data and not (key in ("id_val", "ood_val") and data[key] is None):  # null: no validation split
                data[key] = _choice(DatasetChoice, data[key], key, problems)
        for key, kind in (("ood", DatasetChoice), ("detectors", DetectorChoice)):
            if key not in data:
                continue
            if isinstance(data[key], list):
                data[key] = [_choice(kind, item, f"{key}[{i}]", problems) for i, item in enumerate(data[key])]
            else:
                problems.append(f"{key} must be a list of names or tables, got {shown(data[key])}")
        if problems:
            raise ConfigError(problems)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def load_backbone(self):
        """The run's :class:`oodviz.models.Backbone` (architecture, weights or checkpoint, layer, pooling)."""

        transform, input_shape = None, None
        if self.preprocessing is not None:
            transform, input_shape = models.openood_transform(self.preprocessing.removeprefix(OPENOOD_PREPROCESSING))
        return models.load_backbone(
            self.backbone,
            weights=self.weights,
            checkpoint=self.checkpoint,
            layer=self.layer,
            pooling=self.pooling_at(None),
            model_args=self.model_args or None,
            transform=transform,
            input_shape=input_shape,
        )

    def save(self, path: Path) -> None:

        write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        """Read a ``.json`` or ``.toml`` file (:func:`oodviz.config.validation.read_config_file`); a
        ConfigError with one message for a file that cannot be read as a table of settings."""
        return cls.from_dict(read_config_file(Path(path)))

    # -- validation -------------------------------------------------------------------------
    def problems(self) -> list[Problem]:
        """Every problem with this config (empty when it is valid), checked against this machine's devices
        and the model's layer names and classes; no data is loaded, no weights are read. Each is a
        :class:`~oodviz.problems.Problem`: its message, and the field it is about (``"backbone"``, ``"ood[1]"``,
        ``"detectors[0]"``, ``"detectors[0].grid"``; ``""``: the config as a whole)."""
        wrong = _type_problems(self, _FIELD_TYPES, "")
        found = [Problem(message, key) for key, message in wrong.items()]
        model_found = self._model_problems(wrong)
        found += model_found
        if "layers" not in wrong and self.layers:
            model_known = not ({"backbone", "layer"} & set(wrong)) and not model_found
            found += problems_at("layers", layers_problems(self, model_known=model_known))
        named = [("id_fit", self.id_fit), ("id_test", self.id_test)]
        named += [(f"ood[{i}]", d) for i, d in enumerate(self.ood)] if "ood" not in wrong else []
        named += [(key, getattr(self, key)) for key in ("id_val", "ood_val") if getattr(self, key) is not None]
        model_known = not ({"backbone", "weights", "checkpoint"} & set(wrong)) and not model_found
        for where, choice in named:
            found += problems_at(where, _dataset_problems(choice, where, self if model_known else None))
        if "ood" not in wrong:
            if not self.ood:
                found.append(Problem("choose at least one OOD dataset", "ood"))
            ood_names = [d.result_name for d in self.ood if isinstance(d, DatasetChoice) and isinstance(d.name, str)]
            for name in sorted({n for n in ood_names if isinstance(n, str) and ood_names.count(n) > 1}, key=str):
                message = f"OOD dataset {name!r} is listed twice: give each of its entries its own title (the name its results take)"
                found.append(Problem(message, "ood"))
        if "detectors" not in wrong:
            if not self.detectors:
                found.append(Problem("choose at least one detector", "detectors"))
            for i, choice in enumerate(self.detectors):
                found += _detector_problems(choice, f"detectors[{i}]")
            names = [d.name for d in self.detectors if isinstance(d, DetectorChoice) and isinstance(d.name, str)]
            for name in sorted({n for n in names if names.count(n) > 1}):  # one result column per name
                message = f"detector {name!r} is listed twice: keep one (to compare its parameters, give it a grid)"
                found.append(Problem(message, "detectors"))
        # models.device_problem checks the type too, with the message that lists the accepted names
        if problem := models.device_problem(self.device) or device_problem_here(self.device):
            found.append(Problem(problem, "device"))
        limits = {"batch_size": (1, MAX_BATCH_SIZE), "num_workers": (0, cpu_count()), "seed": (0, None)}
        if "num_workers" not in wrong and isinstance(self.num_workers, str):
            if self.num_workers != engine.AUTO_WORKERS:
                message = f"num_workers must be an integer >= 0 or {engine.AUTO_WORKERS!r}, got {self.num_workers!r}"
                found.append(Problem(message, "num_workers"))
            wrong["num_workers"] = ""  # "auto" or reported: no bounds to check
        for key, (low, high) in limits.items():
            value = getattr(self, key)
            if key in wrong:
                continue
            if value < low:
                found.append(Problem(f"{key} must be an integer >= {low}, got {value!r}", key))
            elif high is not None and value > high:
                why = "the largest batch oodviz takes" if key == "batch_size" else "the CPU cores this process may use"
                found.append(Problem(f"{key} must be at most {high} ({why}), got {value!r}", key))
        if "pooling" not in wrong:
            model_known = not ({"backbone", "layer", "layers", "model_args"} & set(wrong)) and not model_found
            found += self._pooling_problems(model_known and not any(p.field == "layers" for p in found))
        for key, allowed in (
            ("precision", tuple(engine.PRECISIONS)),
            ("feature_dtype", engine.FEATURE_DTYPES),
        ):
            if key not in wrong and getattr(self, key) not in allowed:
                found.append(Problem(f"{key} must be one of {allowed}, got {getattr(self, key)!r}", key))
        if "memory_budget_gb" not in wrong and self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            message = f"memory_budget_gb must be a positive number, got {self.memory_budget_gb!r}"
            found.append(Problem(message, "memory_budget_gb"))
        return found + tuning_problems(self, detectors_checked="detectors" not in wrong)

    def _pooling_problems(self, model_known: bool) -> list[Problem]:
        """``pooling``: unset, one of the poolings, or a table naming the run's layers, each with one of them (or
        null: the model's own). With ``model_known`` (the backbone and its layers are fine), a ``cls`` or ``mean``
        pooling of a layer that holds no token sequence of the model's (:func:`oodviz.models.architecture_token_layout`:
        a CNN's maps, a ViT's patch embedding) is refused; the penultimate features, already the head's input, are
        left as they are by every pooling. A problem of a table's entry is about ``pooling[<layer>]``."""
        allowed = tuple(models.POOLINGS)
        if self.pooling is None:
            return []
        if isinstance(self.pooling, str):
            if self.pooling not in allowed:
                return [
                    Problem(
                        f"pooling must be one of {allowed} or unset (the model's own), got {self.pooling!r}", "pooling"
                    )
                ]
            entries = dict.fromkeys(self.layer_names, ("pooling", self.pooling))
        else:
            found, entries = [], {}
            for layer, pooling in self.pooling.items():
                where = f"pooling[{layer}]"
                if layer not in self.layer_names:
                    message = f"pooling names layer {layer!r}, which the run does not extract; its layers: {', '.join(self.layer_names)}"
                    found.append(Problem(message, where, message))
                elif pooling is not None and pooling not in allowed:
                    message = f"pooling of {layer} must be one of {allowed} or null (the model's own), got {pooling!r}"
                    found.append(Problem(message, where, message))
                else:
                    entries[layer] = (where, pooling)
            if found:
                return found
        token_entries = {
            layer: entry
            for layer, entry in entries.items()
            if entry[1] in models.TOKEN_POOLINGS and layer != PENULTIMATE
        }
        if not model_known or not token_entries or self.backbone in models.USER_MODEL_NAMES:
            return []
        try:
            tokens = models.architecture_token_layout(self.backbone, self.model_args or None)
        except Exception:  # a model the meta device cannot run: the run's own probe says what is wrong
            return []
        found = []
        for layer, (where, pooling) in token_entries.items():
            what = "the class token" if pooling == "cls" else "the mean of the patch tokens"
            if tokens is None:
                message = (
                    f"pooling {pooling!r} of {layer} reads {what} of a transformer's token sequence; {self.backbone} "
                    "has none that oodviz knows (its layers give feature maps): use 'avg' or 'max', or leave it "
                    "unset (the model's own: avg)"
                )
            elif layer not in tokens.layers:
                message = (
                    f"pooling {pooling!r} of {layer} reads {what}, but {layer} does not give {self.backbone}'s token "
                    f"sequence (the layers from {tokens.layers[0]} to {tokens.layers[-1]} do): use 'avg' or 'max' "
                    "here, or leave it unset (the model's own: avg)"
                )
            else:
                continue
            found.append(Problem(message, where, message))
        return found

    @property
    def layer_names(self) -> list[str]:
        """The layers the run extracts: ``layers``, else ``[layer]``, else ``["penultimate"]``."""
        return list(self.layers) if self.layers else [self.layer or PENULTIMATE]

    def pooling_at(self, layer: str | None) -> str | None:
        """The pooling of ``layer`` (None: the run's main layer, the first it extracts): ``pooling``, or its entry
        in the table; None (the model's own, which the backbone resolves: :attr:`oodviz.models.Backbone.default_pooling`)
        where it is unset or the table does not name the layer."""
        if not isinstance(self.pooling, Mapping):
            return self.pooling
        return self.pooling.get(self.layer_names[0] if layer is None else layer)

    def _model_problems(self, wrong: dict[str, str]) -> list[Problem]:
        """The backbone, its weights, checkpoint file and layer."""
        found = []
        if "weights" not in wrong and self.weights not in ("default", "random"):
            found.append(Problem(f"weights must be 'default' or 'random', got {self.weights!r}", "weights"))
        if "checkpoint" not in wrong and self.checkpoint is not None and not _is_file(self.checkpoint):
            found.append(Problem(f"checkpoint file {self.checkpoint} does not exist", "checkpoint"))
        if "protocol" not in wrong and self.protocol not in PROTOCOLS:
            found.append(Problem(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}", "protocol"))
        if "preprocessing" not in wrong and self.preprocessing is not None:
            choices = [OPENOOD_PREPROCESSING + name for name in models.OPENOOD_BENCHMARKS]
            if self.preprocessing not in choices:
                message = f"preprocessing must be unset (the backbone's own) or one of {', '.join(choices)}, got {self.preprocessing!r}"
                found.append(Problem(message, "preprocessing"))
        if "backbone" in wrong:
            return found
        if self.backbone in models.OPENOOD_ARCHITECTURES and self.checkpoint is None and self.weights != "random":
            message = (
                f"backbone {self.backbone!r} has no weights of its own: give checkpoint, one of OpenOOD's checkpoints "
                "(its download script: python scripts/download/download.py --contents checkpoints --checkpoints "
                "ood_v1.5), or weights 'random' for a dry run"
            )
            found.append(Problem(message, "checkpoint"))
        backbones = models.available_backbones()
        if self.backbone in models.USER_MODEL_NAMES:
            if self.checkpoint is None:
                message = f"backbone {self.backbone!r} needs checkpoint: the path of your model file"
                found.append(Problem(message, "checkpoint"))
            if self.layer is not None:
                message = (
                    f"layer={self.layer!r} is not supported for {self.backbone} models (hooks cannot be attached "
                    "to them); leave layer unset, or load a state dict of a built-in architecture"
                )
                found.append(Problem(message, "layer"))
        elif hub_kind(self.backbone):  # timm:<model name>, hf:<directory>: the name, the directory, the package
            try:
                names = models.architecture_layer_names(self.backbone, self.model_args or None)
            except (ValueError, FileNotFoundError, ImportError) as error:
                found.append(Problem(str(error), "backbone"))
            else:
                if "layer" not in wrong and self.layer is not None and self.layer not in names:
                    found.append(Problem(models.unknown_layer_message(self.backbone, self.layer, names), "layer"))
        elif self.backbone not in backbones:
            message = (
                f"backbone {self.backbone!r} is unknown; choose one of: {', '.join(backbones)} "
                f"(or {' / '.join(models.USER_MODEL_NAMES)} with a checkpoint file, timm:<model name> or "
                "hf:<directory of a saved transformers image classifier>)"
            )
            found.append(Problem(message, "backbone"))
        elif "layer" not in wrong and self.layer is not None:
            names = models.architecture_layer_names(self.backbone)
            if self.layer not in names:
                found.append(Problem(models.unknown_layer_message(self.backbone, self.layer, names), "layer"))
        return found

    def validate(self) -> RunConfig:
        """Self when valid, else a ConfigError listing every problem."""
        found = self.problems()
        if found:
            raise ConfigError(found)
        return self


#: The type of every RunConfig setting that holds a value (the datasets and detectors are checked apart).
_FIELD_TYPES = {
    "backbone": str,
    "weights": str,
    "checkpoint": str | None,
    "layer": str | None,
    "layers": list,
    "pooling": str | dict | None,
    "ood": list,
    "detectors": list,
    "batch_size": int,
    "precision": str,
    "num_workers": int | str,
    "seed": int,
    "data_root": str,
    "download": bool,
    "feature_dtype": str,
    "memory_budget_gb": float | None,
    "model_args": dict,
    "preprocessing": str | None,
    "protocol": str,
}
_DATASET_TYPES = {
    "name": str,
    "params": dict,
    "subsample": int | None,
    "subsample_mode": str,
    "group": str | None,
    "title": str | None,
}
_DETECTOR_TYPES = {"name": str, "params": dict}


def _type_problems(obj, types: dict, where: str) -> dict[str, str]:
    """Attribute name -> its problem, for each attribute of ``obj`` named in ``types`` whose value has
    another type or is not finite; messages name the attribute prefixed by ``where``."""
    found = {}
    for key, annotation in types.items():
        value = getattr(obj, key)
        name = f"{where}{key}"
        if annotation in (list, dict):
            if not isinstance(value, annotation):
                found[key] = f"{name} must be a {'list' if annotation is list else 'table'}, got {shown(value)}"
        elif value is None and not matches(None, annotation):
            found[key] = f"{name} needs a value ({describe(annotation)}), got null"
        elif not matches(value, annotation):
            found[key] = f"{name} must be {describe(annotation)}, got {shown(value)}"
        elif non_finite(value, name):
            found[key] = non_finite(value, name)[0]
    return found


def _dataset_problems(choice: DatasetChoice, where: str, config: RunConfig | None) -> list[str]:
    """What is wrong with one dataset choice; ``config`` (None when its model is wrong) gives the model's
    classes for ``class_map="model"``."""
    from oodviz.data import available_datasets, dataset_param_problems
    from oodviz.data.registry import GROUPS

    if not isinstance(choice, DatasetChoice):
        return [f"{where} must be a DatasetChoice, got {choice!r}"]
    wrong = _type_problems(choice, _DATASET_TYPES, f"{where}.")
    found = list(wrong.values())
    datasets = available_datasets()
    if "name" not in wrong:
        if choice.name not in datasets:
            found.append(f"{where}: dataset {choice.name!r} is unknown; choose one of: {', '.join(datasets)}")
        elif "params" not in wrong:
            found += dataset_param_problems(choice.name, choice.params, f"{where} ({choice.name})")
            if not found and choice.params.get("class_map") == "model" and config is not None:
                classes = models.backbone_classes(config.backbone, config.weights, config.checkpoint)
                if not classes:
                    found.append(
                        f'{where}: class_map="model" needs a model with class names; {config.backbone} '
                        f"{'with a checkpoint ' if config.checkpoint else ''}has none, so leave class_map unset"
                    )
    if "subsample" not in wrong and choice.subsample is not None and choice.subsample <= 0:
        found.append(f"{where}: subsample must be a positive number of samples, got {choice.subsample!r}")
    if "subsample_mode" not in wrong and choice.subsample_mode not in SUBSAMPLE_MODES:
        found.append(f"{where}: subsample_mode must be one of {SUBSAMPLE_MODES}, got {choice.subsample_mode!r}")
    if "group" not in wrong and choice.group not in GROUPS:
        found.append(f"{where}: group must be 'near', 'far' or unset, got {choice.group!r}")
    return found


def _detector_problems(choice: DetectorChoice, where: str) -> list[Problem]:
    """What is wrong with one detector choice: its name, its parameters' names, types and values; about field
    ``where`` (``detectors[i]``), each ``detail`` said as ``"<name>: ..."`` (the app's form names a detector once)."""
    if not isinstance(choice, DetectorChoice):
        return [Problem(f"{where} must be a DetectorChoice, got {choice!r}", where)]
    found = problems_at(where, _type_problems(choice, _DETECTOR_TYPES, f"{where}.").values())
    if found:
        return found
    if choice.name not in detectors.available():
        detail = f"detector {choice.name!r} is unknown; choose one of: {', '.join(detectors.available())}"
        return [Problem.at(where, detail)]
    # the detectors check their values themselves, with messages that say more (mcd's samples >= 2 for "var")
    named = f"{where} ({choice.name})"
    cls = detectors.detector_class(choice.name)
    messages = param_problems(cls, choice.params, named, skip=("model",), signs=False)
    if not messages:
        try:
            detectors.create(choice.name, **choice.params)
        except (ValueError, TypeError) as error:
            messages = [f"{named}: {error}"]
    return [detector_problem(message, named, where, choice.name) for message in messages]


def _choice(kind: type, value, where: str, problems: list[str]):
    """A DatasetChoice or DetectorChoice from a name or a table (unknown keys are problems)."""
    if isinstance(value, str):
        return kind(value)
    if not isinstance(value, Mapping) or "name" not in value:
        what = "dataset" if kind is DatasetChoice else "detector"
        problems.append(f"{where} must be a {what} name or a table with a 'name', got {shown(value)}")
        return None
    known = {f.name for f in fields(kind)}
    problems.extend(f"{where}: unknown setting {key!r}" for key in sorted(set(value) - known, key=str))
    return kind(**{k: v for k, v in value.items() if k in known})


# -- presets ------------------------------------------------------------------------------------

#: The Fashion-MNIST preset's OOD sets: held-out classes and covariate shifts (near), digits, photo
#: patches and noise at 28 x 28 (far).
FASHION_OOD = (
    DatasetChoice("fashion-mnist-heldout"),
    DatasetChoice("fashion-mnist-inverted"),
    DatasetChoice("fashion-mnist-rotated"),
    DatasetChoice("digits-28"),
    DatasetChoice("photo-patches", {"size": 28}),
    DatasetChoice("noise-gaussian", {"size": 28}),
    DatasetChoice("noise-uniform", {"size": 28}),
)


def fashion_mnist_config() -> RunConfig:
    """``fashion-cnn`` on the real Fashion-MNIST: fit on the 48,000 training images of the 8 ID
    classes, test on their 8,000 test images, against Shirt and Ankle boot (held out), inverted and
    rotated ID test images, 28 x 28 digits, photo patches and noise; the default detectors.

    Needs the Fashion-MNIST files (``apt-get install dataset-fashion-mnist``, the files under
    ``data_root``, or ``download=True``)."""
    from copy import deepcopy

    return RunConfig(
        backbone="fashion-cnn",
        id_fit=DatasetChoice("fashion-mnist-id", {"split": "train"}),
        id_test=DatasetChoice("fashion-mnist-id", {"split": "test"}),
        ood=[deepcopy(choice) for choice in FASHION_OOD],
    )


#: Named ready-made configs: name -> a function returning a fresh RunConfig.
PRESETS: dict[str, Callable[[], RunConfig]] = {
    "digits": RunConfig,
    "fashion-mnist": fashion_mnist_config,
}


def preset(name: str) -> RunConfig:
    """A fresh copy of preset ``name`` (one of :data:`PRESETS`)."""
    if name not in PRESETS:
        raise ConfigError([f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}"])
    return PRESETS[name]()


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):  # a name the OS cannot take (a NUL byte, too long)
        return False
