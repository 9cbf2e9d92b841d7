"""The stages a run goes through, in order, as :mod:`oodviz.pipeline.stages` names them in ``events.jsonl``:
for the app's "stage k of N" and the run's header line. A detector that fails drops its later stages, so a
failed detector's run ends with fewer stages than planned."""

from __future__ import annotations

from pathlib import PurePath

from oodviz import detectors
from oodviz.config.layers import COMBINE_STAGE, combines_layers, detector_columns
from oodviz.config.run import RunConfig
from oodviz.config.splits import run_splits
from oodviz.config.tuning import tuned_columns, validation_splits


def planned_stages(config: RunConfig) -> list[str]:
    """``load model``, ``load data``, ``extract <split>`` per split, ``tune <column>`` per detector with a grid
    (per detector and layer in a run over several layers) when the run tunes (:mod:`oodviz.pipeline.tuning`), ``fit <column>`` per detector (per detector and layer in a
    run over several layers), then per scored split (id_test, each OOD set) ``score <split> with <name>`` per
    model-based detector and ``score <split>``, then (several layers with mahalanobis) ``combine mahalanobis over
    layers``, ``save detectors`` and ``metrics`` (a sharded run's rank 0 does the last two)."""

    splits = [split for split, _, _ in run_splits(config)]
    model_based = [c.name for c in config.detectors if detectors.detector_class(c.name).needs_model]
    stages = ["load model", "load data", *(f"extract {split}" for split in splits)]
    stages += [f"tune {column}" for column, _, _, _ in tuned_columns(config)]
    stages += [f"fit {column}" for column, _, _ in detector_columns(config)]
    validation = [split for split, _, _ in validation_splits(config)]
    for split in [s for s in splits[1:] if s not in validation]:  # id_test and the OOD sets are scored
        stages += [f"score {split} with {name}" for name in model_based] + [f"score {split}"]
    stages += [COMBINE_STAGE] if combines_layers(config) else []
    return stages + ["save detectors", "metrics"]


def run_headline(config: RunConfig, paths: bool = True) -> str:
    """One line saying what a run runs: backbone (and layer), ID set, OOD sets (an image folder by its path, or
    without ``paths`` by its last name only: the app shows no server path to others), detector count."""
    layer = f" ({config.layer or ', '.join(config.layers)})" if config.layer or config.layers else ""
    ood = ", ".join(_folder_shown(choice, paths) if choice.name == "folder" else choice.name for choice in config.ood)
    detectors = len(config.detectors)
    return (
        f"{config.backbone}{layer} · ID {config.id_test.name} · OOD {ood} · "
        f"{detectors} detector{'s' if detectors != 1 else ''}"
    )


#: the config entries (at any depth: a dataset's ``params``, a detector's) that hold a path on the server
PATH_KEYS = frozenset({"data_root", "checkpoint", "path", "bank_dir", "weights_dir"})


def config_shown(config: dict, paths: bool = True) -> dict:
    """A run's config as a page shows it: as it is, or (not ``paths``: the app shows no server path to others) with
    every path entry (:data:`PATH_KEYS`) cut to ``".../<last name>"``."""
    if paths:
        return config

    def shown(value, key=None):
        if isinstance(value, dict):
            return {k: shown(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [shown(v) for v in value]
        if key in PATH_KEYS and isinstance(value, str) and value:
            return f".../{PurePath(value).name}"
        return value

    return shown(config)


def _folder_shown(choice, paths: bool) -> str:
    """An image folder's path as given, or (not ``paths``) its last name, ``folder <name>``."""
    path = str(choice.params.get("path", choice.name))
    return path if paths else f"folder {PurePath(path).name}"
