"""What the sidebar offers and how its values become a RunConfig (no streamlit here: unit-testable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from oodviz.runs.config import DatasetChoice, DetectorChoice, RunConfig

#: ID presets: label -> (fit split, test split). Torchvision sets use their train/test splits.
ID_PRESETS: dict[str, tuple[DatasetChoice, DatasetChoice]] = {
    "digits (bundled, 8x8)": (DatasetChoice("digits-train"), DatasetChoice("digits-test")),
    "Fashion-MNIST, 8 classes (for fashion-cnn)": (
        DatasetChoice("fashion-mnist-id", {"split": "train"}), DatasetChoice("fashion-mnist-id", {"split": "test"})
    ),
    **{
        f"{name} (torchvision files)": (DatasetChoice(name, {"split": "train"}), DatasetChoice(name, {"split": "test"}))
        for name in ("mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100")
    },
}
FOLDER_PRESET = "image folders (your own)"

#: Datasets offered as OOD sets (the registry's OOD sources plus the ID-capable torchvision sets).
OOD_CHOICES = (
    "digits-heldout", "digits-inverted", "digits-rotated", "photo-patches", "noise-gaussian", "noise-uniform",
    "fashion-mnist-heldout", "fashion-mnist-inverted", "fashion-mnist-rotated", "digits-28",
    "mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100", "svhn", "dtd",
)  # fmt: skip


def ood_label(name: str) -> str:
    from oodviz.data import dataset_info

    info = dataset_info(name)
    group = info.group or "far"
    return f"{name} ({group}, {info.source})"


@dataclass
class FormValues:
    """The sidebar's values, as the widgets give them."""

    backbone: str = "digits-cnn"
    weights: str = "default"
    checkpoint: str = ""
    layer: str = ""
    pooling: str = "avg"
    id_preset: str = "digits (bundled, 8x8)"
    fit_folder: str = ""
    test_folder: str = ""
    ood: list[str] = field(default_factory=lambda: list(RunConfig().to_dict()["ood"][i]["name"] for i in range(6)))
    ood_folder: str = ""
    detectors: list[str] = field(default_factory=lambda: [d.name for d in RunConfig().detectors])
    detector_params: dict[str, dict] = field(default_factory=dict)
    device: str = "auto"
    batch_size: int = 256
    precision: str = "fp32"
    fit_subsample: int = 0  # 0 = all
    test_subsample: int = 0
    ood_subsample: int = 0
    data_root: str = "data"
    download: bool = False


def _subsample(n: int) -> int | None:
    return int(n) if n and n > 0 else None


def config_from_form(values: FormValues) -> RunConfig:
    """The RunConfig the sidebar describes (not validated: call ``problems()`` on it)."""
    if values.id_preset == FOLDER_PRESET:
        fit = DatasetChoice("folder", {"path": values.fit_folder.strip()})
        test = DatasetChoice("folder", {"path": values.test_folder.strip()})
    else:
        fit, test = (DatasetChoice(c.name, dict(c.params)) for c in ID_PRESETS[values.id_preset])
    fit.subsample = _subsample(values.fit_subsample)
    test.subsample = _subsample(values.test_subsample)
    ood = []
    for name in values.ood:
        params = {"split": "test"} if name in ("mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100", "svhn", "dtd") else {}
        ood.append(DatasetChoice(name, params, subsample=_subsample(values.ood_subsample)))
    if values.ood_folder.strip():
        ood.append(DatasetChoice("folder", {"path": values.ood_folder.strip()}, subsample=_subsample(values.ood_subsample), group="far"))
    detectors = [DetectorChoice(name, dict(values.detector_params.get(name, {}))) for name in values.detectors]
    return RunConfig(
        backbone="torchscript" if values.backbone == "torchscript" else values.backbone,
        weights=values.weights,
        checkpoint=values.checkpoint.strip() or None,
        layer=values.layer.strip() or None,
        pooling=values.pooling,
        id_fit=fit,
        id_test=test,
        ood=ood,
        detectors=detectors,
        device=values.device,
        batch_size=int(values.batch_size),
        precision=values.precision,
        data_root=values.data_root.strip() or "data",
        download=bool(values.download),
    )
