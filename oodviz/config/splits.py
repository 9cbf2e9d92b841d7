"""The splits of a run: which datasets it extracts, under which store key, where the stores live."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from oodviz import engine
from oodviz.config.run import DatasetChoice, RunConfig
from oodviz.config.tuning import validation_splits
from oodviz.runs.rundir import RunDir
from oodviz.sampling import Sampling


def feature_store_root(run: RunDir) -> Path:
    """Stores are shared by every run under the same runs root, so a repeated split is extracted once."""

    return run.path.parent / engine.STORES_DIRNAME


def load_split(config: RunConfig, choice: DatasetChoice, as_ood: bool, model_classes: list[str] | None = None):
    """The dataset of one split; ``model_classes`` (the backbone's class names) lets an image folder with
    ``class_map = "model"`` label its subfolders by the model's class indices."""
    from oodviz.data import load_dataset

    return load_dataset(
        choice.name,
        root=config.data_root,
        download=config.download,
        subsample=choice.subsample,
        subsample_mode=choice.subsample_mode,
        seed=config.seed,
        as_ood=as_ood,
        model_classes=model_classes,
        **choice.params,
    )


#: at most this many class names in :func:`empty_classes_warning`
NAMED_CLASSES = 10


def empty_classes_warning(split: str, sampling: Sampling) -> str | None:
    """The warning for a split whose subsample (``sampling``) holds no image of some of the classes its dataset has
    images of: which ones and how to fix it (the split's ``subsample``); ``None`` when every class has an image."""
    empty = sampling.empty_classes
    if not empty:
        return None
    names = ", ".join(empty[:NAMED_CLASSES]) + (", ..." if len(empty) > NAMED_CLASSES else "")
    return (
        f"{split}: its subsample ({sampling.describe()}) holds no image of {len(empty)} class(es): {names}; its "
        f"results say nothing about them. Raise {split}.subsample (the form's Subsample fields) until every class "
        "has a share, or leave it unset to use every image"
    )


def run_splits(config: RunConfig) -> list[tuple[str, DatasetChoice, bool]]:
    """``(split, dataset choice, loaded as OOD)`` of every split ``config`` extracts: id_fit, id_test, ood:NAME,
    and id_val, ood_val when it tunes (:mod:`oodviz.pipeline.tuning`)."""
    ood = [(f"ood:{choice.result_name}", choice, True) for choice in config.ood]
    return [("id_fit", config.id_fit, False), ("id_test", config.id_test, False), *ood, *validation_splits(config)]


def store_key_params(config: RunConfig, choice: DatasetChoice) -> dict:
    """What, besides the backbone and the dataset object, determines a split's feature store."""
    return {"dataset": asdict(choice), "data_root": str(Path(config.data_root).resolve()), "seed": config.seed}


def split_group(choice: DatasetChoice) -> str:
    """The OOD group (near/far) a dataset's results are averaged in: the config's choice, else the dataset's."""
    from oodviz.data import dataset_info

    return choice.group or dataset_info(choice.name).group or "far"
