"""The stages a run goes through, in order, as :mod:`oodviz.pipeline.stages` names them in ``events.jsonl``:
for the app's "stage k of N" and the run's header line. A detector that fails drops its later stages, so a
failed detector's run ends with fewer stages than planned."""

from __future__ import annotations

import re
from pathlib import PurePath

from oodviz import detectors
from oodviz.config.layers import COMBINE_STAGE, combines_layers, detector_columns
from oodviz.config.run import RunConfig
from oodviz.config.splits import run_splits
from oodviz.config.tuning import tuned_columns, validation_splits


def _scoring_stages(config: RunConfig) -> list[str]:
    """Per scored split (id_test, each OOD set: not the validation splits) ``score <split> with <name>`` per
    model-based detector, then ``score <split>``."""
    model_based = [c.name for c in config.detectors if detectors.detector_class(c.name).needs_model]
    validation = [split for split, _, _ in validation_splits(config)]
    splits = [split for split, _, _ in run_splits(config)][1:]  # id_fit is not scored
    stages = []
    for split in [s for s in splits if s not in validation]:
        stages += [f"score {split} with {name}" for name in model_based] + [f"score {split}"]
    return stages


#: The steps of a run in the order the worker runs them, each with the named stages it reports for a config (what
#: ``events.jsonl`` says): the one list of steps; :data:`oodviz.pipeline.stages.STAGES` and a sharded run's
#: :func:`oodviz.pipeline.sharded.sharded_stages` take their order from it.
STEPS = (
    ("load_model", lambda config: ["load model"]),
    ("load_data", lambda config: ["load data"]),
    ("extract_splits", lambda config: [f"extract {split}" for split, _, _ in run_splits(config)]),
    ("tune_detectors", lambda config: [f"tune {column}" for column, _, _, _ in tuned_columns(config)]),
    ("fit_detectors", lambda config: [f"fit {column}" for column, _, _ in detector_columns(config)]),
    ("score_splits", _scoring_stages),
    ("combine_layers", lambda config: [COMBINE_STAGE] if combines_layers(config) else []),
    ("save_detectors", lambda config: ["save detectors"]),
    ("write_scores", lambda config: []),
    ("write_metrics", lambda config: ["metrics"]),
    ("write_meta", lambda config: []),
)


def planned_stages(config: RunConfig) -> list[str]:
    """The named stages of a run of ``config``, in order (:data:`STEPS`): ``load model``, ``load data``, ``extract
    <split>`` per split, ``tune <column>`` per tuned column, ``fit <column>`` per detector (per detector and layer
    in a run over several layers), the scoring stages, ``combine mahalanobis over layers`` (several layers with
    mahalanobis), ``save detectors`` and ``metrics`` (a sharded run's rank 0 does the last two)."""
    return [stage for _, stages in STEPS for stage in stages(config)]


def run_headline(config: RunConfig, paths: bool = True) -> str:
    """One line saying what a run runs: backbone (and layer), ID set, OOD sets (an image folder by its path, or
    without ``paths`` by its last name only: the app shows no server path to others), detector count."""
    layer = f" ({config.layer or ', '.join(config.layers)})" if config.layer or config.layers else ""
    ood = ", ".join(
        _folder_shown(choice, paths) if choice.name == "folder" and not choice.title else choice.result_name
        for choice in config.ood
    )
    detectors = len(config.detectors)
    return (
        f"{config.backbone}{layer} · ID {config.id_test.result_name} · OOD {ood} · "
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


#: an absolute path in a message: ``/`` (not inside a word, a URL or a relative path) then at least one folder, up to
#: a space, a quote or punctuation that ends it
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/-])/(?:[^\s/'\"`:;,()\[\]{}<>|]+/)+[^\s/'\"`:;,()\[\]{}<>|]*")


def cut_paths(text: str) -> str:
    """``text`` with every absolute path (two parts or more) cut to ``.../<last name>``, as the config is shown to
    others (:func:`config_shown`): what a run's error, a damaged file's message or a subprocess's
    last line says about the server's folders stays on the server."""
    return _ABSOLUTE_PATH.sub(lambda match: f".../{[part for part in match.group(0).split('/') if part][-1]}", text)


def _folder_shown(choice, paths: bool) -> str:
    """An image folder's path as given, or (not ``paths``) its last name, ``folder <name>``."""
    path = str(choice.params.get("path", choice.name))
    return path if paths else f"folder {PurePath(path).name}"
