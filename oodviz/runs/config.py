"""RunConfig: everything that defines a run, as plain data that round-trips through JSON or TOML.

``RunConfig()`` is the bundled offline default: ``digits-cnn`` on scikit-learn's digits against
every bundled OOD set, with every detector but ``mcd`` (it needs dropout layers, which most
classifiers lack). ``validate()`` lists every problem at once, before any work starts.

``preset(name)`` returns a named ready-made config (:data:`PRESETS`): ``"digits"`` (= ``RunConfig()``)
and ``"fashion-mnist"`` (``fashion-cnn`` on the real Fashion-MNIST, :func:`fashion_mnist_config`).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from oodviz.data.base import SUBSAMPLE_MODES
from oodviz.data.registry import GROUPS
from oodviz.engine import FEATURE_DTYPES, PRECISIONS
from oodviz.models import POOLINGS, device_problem

DEFAULT_OOD = (
    "digits-heldout",
    "digits-inverted",
    "digits-rotated",
    "photo-patches",
    "noise-gaussian",
    "noise-uniform",
)


class ConfigError(ValueError):
    """An invalid RunConfig; ``problems`` lists every one found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("Invalid run config:\n" + "\n".join(f"- {p}" for p in problems))


@dataclass
class DatasetChoice:
    """A dataset from ``oodviz.data`` with its parameters, optional subsample and (OOD) near/far group."""

    name: str
    params: dict = field(default_factory=dict)
    subsample: int | None = None
    subsample_mode: str = "first"
    group: str | None = None  # None = the group the dataset registers


@dataclass
class DetectorChoice:
    """A detector from ``oodviz.detectors`` with its parameters."""

    name: str
    params: dict = field(default_factory=dict)


def _default_detectors() -> list[DetectorChoice]:
    from oodviz.detectors import available, detector_class

    # Every detector except those most classifiers cannot support (mcd needs dropout layers).
    return [DetectorChoice(name) for name in available() if detector_class(name).in_defaults]


@dataclass
class RunConfig:
    backbone: str = "digits-cnn"
    weights: str = "default"  # "default" (pretrained / bundled) or "random" (a dry run)
    checkpoint: str | None = None  # a TorchScript file or a state dict for the backbone's architecture
    layer: str | None = None  # None = the penultimate layer
    pooling: str = "avg"
    id_fit: DatasetChoice = field(default_factory=lambda: DatasetChoice("digits-train"))
    id_test: DatasetChoice = field(default_factory=lambda: DatasetChoice("digits-test"))
    ood: list[DatasetChoice] = field(default_factory=lambda: [DatasetChoice(name) for name in DEFAULT_OOD])
    detectors: list[DetectorChoice] = field(default_factory=_default_detectors)
    device: str = "auto"  # "auto" = the first GPU if there is one, else the CPU
    batch_size: int = 256
    precision: str = "fp32"
    num_workers: int = 0
    seed: int = 0
    data_root: str = "data"
    download: bool = False
    feature_dtype: str = "float32"
    memory_budget_gb: float = 8.0

    # -- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """Build a config from plain data; unknown keys are a ConfigError listing them all."""
        data = dict(data)
        problems = [f"unknown setting {key!r}" for key in sorted(set(data) - set(cls.__dataclass_fields__))]
        sets = {}
        for key in ("id_fit", "id_test"):
            if key in data:
                sets[key] = _dataset_choice(data.pop(key), key, problems)
        if "ood" in data:
            sets["ood"] = [_dataset_choice(d, f"ood[{i}]", problems) for i, d in enumerate(data.pop("ood") or [])]
        if "detectors" in data:
            sets["detectors"] = [
                _detector_choice(d, f"detectors[{i}]", problems) for i, d in enumerate(data.pop("detectors") or [])
            ]
        if problems:
            raise ConfigError(problems)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__}, **sets)

    def save(self, path: Path) -> None:
        from oodviz.runs.rundir import write_json

        write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        """Read a ``.json`` or ``.toml`` file."""
        path = Path(path)
        text = path.read_text()
        try:
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
            raise ConfigError([f"{path} is not valid {path.suffix.lstrip('.').upper() or 'JSON'}: {error}"]) from None
        return cls.from_dict(data)

    # -- validation -------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every problem with this config (empty when it is valid); no data is loaded."""
        from oodviz.data import available_datasets
        from oodviz.detectors import available, create
        from oodviz.models import available_backbones
        from oodviz.models.registry import USER_MODEL_NAMES

        found = []
        backbones = available_backbones()
        if self.backbone in USER_MODEL_NAMES:
            if self.checkpoint is None:
                found.append(f"backbone {self.backbone!r} needs checkpoint: the path of your model file")
        elif self.backbone not in backbones:
            found.append(
                f"backbone {self.backbone!r} is unknown; choose one of: {', '.join(backbones)} "
                f"(or {' / '.join(USER_MODEL_NAMES)} with a checkpoint file)"
            )
        if self.weights not in ("default", "random"):
            found.append(f"weights must be 'default' or 'random', got {self.weights!r}")
        if self.checkpoint is not None and not Path(self.checkpoint).is_file():
            found.append(f"checkpoint file {self.checkpoint} does not exist")
        if self.pooling not in POOLINGS:
            found.append(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        datasets = available_datasets()
        named = [("id_fit", self.id_fit), ("id_test", self.id_test)] + [
            (f"ood[{i}] ", d) for i, d in enumerate(self.ood)
        ]
        for where, choice in named:
            where = where.strip()
            if choice.name not in datasets:
                found.append(f"{where}: dataset {choice.name!r} is unknown; choose one of: {', '.join(datasets)}")
            if choice.subsample is not None and (not isinstance(choice.subsample, int) or choice.subsample <= 0):
                found.append(f"{where}: subsample must be a positive number of samples, got {choice.subsample!r}")
            if choice.subsample_mode not in SUBSAMPLE_MODES:
                found.append(f"{where}: subsample_mode must be one of {SUBSAMPLE_MODES}, got {choice.subsample_mode!r}")
            if choice.group not in GROUPS:
                found.append(f"{where}: group must be 'near', 'far' or unset, got {choice.group!r}")
        if not self.ood:
            found.append("choose at least one OOD dataset")
        ood_names = [d.name for d in self.ood]
        for name in sorted({n for n in ood_names if ood_names.count(n) > 1}):
            found.append(f"OOD dataset {name!r} is listed twice")
        if not self.detectors:
            found.append("choose at least one detector")
        for i, choice in enumerate(self.detectors):
            if choice.name not in available():
                found.append(
                    f"detectors[{i}]: detector {choice.name!r} is unknown; choose one of: {', '.join(available())}"
                )
                continue
            try:
                create(choice.name, **choice.params)
            except (ValueError, TypeError) as error:
                found.append(f"detectors[{i}] ({choice.name}): {error}")
        if (problem := device_problem(self.device)) is not None:
            found.append(problem)
        for key in ("batch_size", "seed", "num_workers"):
            value = getattr(self, key)
            minimum = 1 if key == "batch_size" else 0
            if not isinstance(value, int) or value < minimum:
                found.append(f"{key} must be an integer >= {minimum}, got {value!r}")
        if self.precision not in PRECISIONS:
            found.append(f"precision must be one of {tuple(PRECISIONS)}, got {self.precision!r}")
        if self.feature_dtype not in FEATURE_DTYPES:
            found.append(f"feature_dtype must be one of {FEATURE_DTYPES}, got {self.feature_dtype!r}")
        if not isinstance(self.memory_budget_gb, (int, float)) or self.memory_budget_gb <= 0:
            found.append(f"memory_budget_gb must be a positive number, got {self.memory_budget_gb!r}")
        return found

    def validate(self) -> RunConfig:
        """Self when valid, else a ConfigError listing every problem."""
        found = self.problems()
        if found:
            raise ConfigError(found)
        return self


def _dataset_choice(value, where: str, problems: list[str]) -> DatasetChoice | None:
    if isinstance(value, str):
        return DatasetChoice(value)
    if not isinstance(value, dict) or "name" not in value:
        problems.append(f"{where} must be a dataset name or a table with a 'name', got {value!r}")
        return None
    unknown = sorted(set(value) - set(DatasetChoice.__dataclass_fields__))
    problems.extend(f"{where}: unknown setting {key!r}" for key in unknown)
    return DatasetChoice(**{k: v for k, v in value.items() if k in DatasetChoice.__dataclass_fields__})


def _detector_choice(value, where: str, problems: list[str]) -> DetectorChoice | None:
    if isinstance(value, str):
        return DetectorChoice(value)
    if not isinstance(value, dict) or "name" not in value:
        problems.append(f"{where} must be a detector name or a table with a 'name', got {value!r}")
        return None
    unknown = sorted(set(value) - {"name", "params"})
    problems.extend(f"{where}: unknown setting {key!r}" for key in unknown)
    return DetectorChoice(value["name"], dict(value.get("params") or {}))


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
