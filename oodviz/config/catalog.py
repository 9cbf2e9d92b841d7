"""What the app's run form offers, without importing torch: a catalog built from the code that declares it.

The form is drawn on every page, and a first page load must not wait for torch, torchvision and every detector
module (issue 14.5, cold first load). So the facts it shows are read from the code once by :func:`build` (which
imports torch), in a process of its own, into a cache file named by a hash of the package's sources and the installed
versions of the libraries it reads (:func:`catalog_path`), and read back here. Nothing is committed: a changed
detector, backbone or dataset changes the hash, and the next page builds the catalog again. ``oodviz app`` builds it
before serving (:func:`ensure_catalog`). Its entries:

- ``detectors``: every detector name, in registry order (:func:`oodviz.detectors.available`);
- ``default_detectors``: those with ``in_defaults`` (the list :mod:`oodviz.config.defaults` starts from);
- ``params``: per detector, the parameters a browser user may edit (:func:`oodviz.params.editable_fields`),
  each ``{"name", "kind", "default", "optional", "choices"}``;
- ``default_grids``: per detector, its ``default_grid`` (parameter -> values tried when tuning);
- ``backbones``: the registry backbones (:func:`oodviz.models.available_backbones`), each with its ``family``
  (:func:`oodviz.models.architectures.backbone_family`), ``layers`` (:func:`oodviz.models.architecture_layer_names`)
  and ``tokens`` (:func:`oodviz.models.architecture_token_layout`: ``{"head_pooling", "layers"}`` of a transformer
  whose token sequence oodviz knows, ``null`` for the others; left out when the model could not be probed);
- ``poolings``, ``token_poolings``, ``precisions``, ``feature_dtypes``: the choices of those fields (``token_poolings``:
  the poolings that read a transformer's token sequence, :data:`oodviz.models.TOKEN_POOLINGS`);
- ``datasets``: per registered dataset, its ``group`` and ``source`` (:func:`oodviz.data.dataset_info`);
- ``bundled_sizes``: the image count of each bundled ID split (:data:`BUNDLED_SPLITS`), ``fashion_id_classes``
  (:data:`oodviz.data.FASHION_ID_CLASSES`), ``system_dirs``, ``mnist_folders`` and ``mnist_files``
  (:mod:`oodviz.data.torchvision_sets`' ``SYSTEM_DIRS``, ``MNIST_FOLDERS``, ``MNIST_FILES``), for :func:`known_split_size`.

``python -m oodviz.config.catalog [PATH]`` writes it (default: :func:`catalog_path`).
"""

from __future__ import annotations

import fcntl
import functools
import gzip
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from oodviz import detectors, engine, models
from oodviz.files import write_atomic
from oodviz.models.hub_names import hub_family, hub_kind
from oodviz.params import ParamField, editable_fields

#: where the built catalogs are kept (default ``~/.cache/oodviz``)
CACHE_DIR_VARIABLE = "OODVIZ_CACHE_DIR"
#: the installed libraries whose versions the catalog depends on (backbones, layers, datasets)
CATALOG_LIBRARIES = ("torch", "torchvision", "timm", "transformers", "scikit-learn")
#: how long building the catalog may take (imports torch and every detector, builds every listed backbone's skeleton)
BUILD_TIMEOUT_S = 600
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
#: The bundled ID splits whose size the catalog holds (they ship with scikit-learn: always there).
BUNDLED_SPLITS = ("digits-train", "digits-test")
_MNIST_PREFIXES = ("train", "t10k")  # of the label file per split (train, test)


def source_key(package_root: Path = PACKAGE_ROOT) -> str:
    """A hash of every ``.py`` file under ``package_root`` (names and contents) and of the installed versions of
    :data:`CATALOG_LIBRARIES`: what :func:`build` reads. 16 hex digits."""
    digest = hashlib.sha256()
    for path in sorted(package_root.rglob("*.py")):
        digest.update(path.relative_to(package_root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for name in CATALOG_LIBRARIES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{name}={version}\0".encode())
    return digest.hexdigest()[:16]


def catalog_path() -> Path:
    """The cache file of this code's catalog: ``<cache dir>/catalog-<source key>.json``."""
    root = Path(os.environ.get(CACHE_DIR_VARIABLE) or Path.home() / ".cache" / "oodviz")
    return root / f"catalog-{source_key()}.json"


def ensure_catalog() -> Path:
    """:func:`catalog_path`, built first when missing, by ``python -m oodviz.config.catalog PATH`` (torch stays
    out of this process); RuntimeError with the builder's last words when it fails."""
    path = catalog_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:  # one builder; the others wait for its file
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            built = subprocess.run(
                [sys.executable, "-m", "oodviz.config.catalog", str(path)],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
            if built.returncode != 0 or not path.is_file():
                raise RuntimeError(f"building the form's catalog failed: {built.stderr.strip()[-2000:]}")
    return path


@functools.cache
def catalog() -> dict:
    """The catalog :func:`build` reads from the code (built once per version of the code, read once per process)."""
    return json.loads(ensure_catalog().read_text())


def detector_names() -> list[str]:
    return list(catalog()["detectors"])


def default_detector_names() -> list[str]:
    return list(catalog()["default_detectors"])


def detector_params(detector: str) -> list[dict]:
    """The editable parameters of ``detector`` (see the module docstring); ``[]`` for an unknown name."""
    return [dict(field) for field in catalog()["params"].get(detector, [])]


def default_grid(detector: str) -> dict[str, list]:
    """``detector``'s ``default_grid``; KeyError for an unknown name."""
    return {key: list(values) for key, values in catalog()["default_grids"][detector].items()}


def backbone_names() -> list[str]:
    return list(catalog()["backbones"])


def backbone_family(name) -> str:
    """As :func:`oodviz.models.architectures.backbone_family`: ``"transformer"`` or ``"cnn"`` (any other name)."""
    if not isinstance(name, str):
        return "cnn"
    if hub_kind(name):  # any timm model or Hugging Face directory, listed or not
        return hub_family(name)
    return catalog()["backbones"].get(name.strip().lower(), {}).get("family", "cnn")


def backbone_layers(name: str) -> list[str]:
    """The layer names of registry backbone ``name`` (:func:`oodviz.models.architecture_layer_names`)."""
    return list(catalog()["backbones"][name]["layers"])


def choices(field: str) -> tuple[str, ...]:
    """The values of ``"poolings"``, ``"token_poolings"``, ``"precisions"`` or ``"feature_dtypes"``."""
    return tuple(catalog()[field])


def layer_default_pooling(backbone: str, layer: str) -> str | None:
    """What ``pooling`` unset gives ``layer`` of registry backbone ``backbone`` (as
    :attr:`oodviz.models.Backbone.default_pooling`): what the model's head reads (``"cls"`` or ``"mean"``) for a layer
    holding its token sequence, ``"avg"`` for any other; None where the catalog does not know (a name it does not
    list, a model it could not probe)."""
    entry = catalog()["backbones"].get(backbone)
    if entry is None or "tokens" not in entry:
        return None
    tokens = entry["tokens"]
    return tokens["head_pooling"] if tokens and layer in tokens["layers"] else "avg"


def dataset_group_and_source(name: str) -> tuple[str | None, str]:
    entry = catalog()["datasets"][name]
    return entry["group"], entry["source"]


def mnist_folders() -> dict[str, str]:
    """Each MNIST-style set's folder under the data root (``<root>/<folder>/raw``;
    :data:`oodviz.data.torchvision_sets.MNIST_FOLDERS`)."""
    return dict(catalog()["mnist_folders"])


def _mnist_labels_file(name: str, root: str, split: str) -> str | None:
    """The label file the loader reads for MNIST-style ``name``'s ``split``: under the data root when all four files
    (or their ``.gz``) are there, else in the system copy when the root has none of them and the copy has all; None
    when neither (or torchvision's legacy ``processed/`` cache is there)."""
    folder = os.path.join(root, catalog()["mnist_folders"][name], "raw")
    if os.path.exists(os.path.join(folder, "..", "processed")):
        return None
    files = catalog()["mnist_files"]
    label = f"{_MNIST_PREFIXES[split == 'test']}-labels-idx1-ubyte"
    there = [
        next((p for p in (os.path.join(folder, f), os.path.join(folder, f + ".gz")) if os.path.isfile(p)), None)
        for f in files
    ]
    if all(there):
        return there[files.index(label)]
    system = catalog()["system_dirs"].get(name)
    if any(there) or system is None or not all(os.path.isfile(os.path.join(system, f + ".gz")) for f in files):
        return None
    return os.path.join(system, label + ".gz")


def _idx_labels(path: str) -> np.ndarray:
    """The labels of an IDX1 file (``.gz`` or not): a 4-byte magic ``0x00000801``, the count, one byte each."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as file:
        data = file.read()
    if data[:4] != b"\x00\x00\x08\x01" or len(data) != 8 + int.from_bytes(data[4:8], "big"):
        raise ValueError(f"{path} is not an IDX1 label file")
    return np.frombuffer(data, np.uint8, offset=8)


def known_split_size(name: str, params: dict, root: str) -> int | None:
    """How many images dataset ``name`` with ``params`` (no subsample) has, read without torch: a bundled split
    (:data:`BUNDLED_SPLITS`, no params), or a ``{"split": "train" | "test"}`` split of an MNIST-style set or of
    ``fashion-mnist-id`` (its 8 ID classes) from the label file the loader would read (under ``root``, else the
    system copy). None for any other dataset, or when the files are not all there or not readable: count it by
    loading it."""
    if name in BUNDLED_SPLITS and not params:
        return catalog()["bundled_sizes"][name]
    base = "fashion-mnist" if name == "fashion-mnist-id" else name
    if base not in catalog()["mnist_folders"] or set(params) != {"split"} or params["split"] not in ("train", "test"):
        return None
    path = _mnist_labels_file(base, root, params["split"])
    if path is None:
        return None
    try:
        labels = _idx_labels(path)
    except (OSError, ValueError, EOFError):
        return None
    return int(np.isin(labels, catalog()["fashion_id_classes"]).sum()) if base != name else len(labels)


def build() -> dict:
    """The catalog read from the code that declares it (imports torch, torchvision and every detector)."""
    from oodviz.data import FASHION_ID_CLASSES, available_datasets, dataset_info, load_dataset
    from oodviz.data.torchvision_sets import MNIST_FILES, MNIST_FOLDERS, SYSTEM_DIRS

    return {
        "detectors": detectors.available(),
        "default_detectors": [name for name in detectors.available() if detectors.detector_class(name).in_defaults],
        "params": {
            name: [{**asdict(f), "choices": list(f.choices)} for f in editable_fields(detectors.detector_class(name))]
            for name in detectors.available()
        },
        "default_grids": {
            name: {key: list(values) for key, values in detectors.detector_class(name).default_grid.items()}
            for name in detectors.available()
        },
        "backbones": {
            name: {
                "family": models.backbone_family(name),
                "layers": models.architecture_layer_names(name),
                **_token_entry(name),
            }
            for name in models.available_backbones()
        },
        "poolings": list(models.POOLINGS),
        "token_poolings": list(models.TOKEN_POOLINGS),
        "precisions": list(engine.PRECISIONS),
        "feature_dtypes": list(engine.FEATURE_DTYPES),
        "datasets": {
            name: {"group": dataset_info(name).group, "source": dataset_info(name).source}
            for name in available_datasets()
        },
        "bundled_sizes": {name: len(load_dataset(name)) for name in BUNDLED_SPLITS},
        "fashion_id_classes": list(FASHION_ID_CLASSES),
        "system_dirs": dict(SYSTEM_DIRS),
        "mnist_folders": dict(MNIST_FOLDERS),
        "mnist_files": list(MNIST_FILES),
    }


def _token_entry(name: str) -> dict:
    """``{"tokens": ...}`` of backbone ``name`` (see the module docstring); ``{}`` when the model cannot be probed on
    the meta device (the form then offers every pooling, and the run's check says what applies)."""
    try:
        layout = models.architecture_token_layout(name)
    except Exception:  # a model the meta device cannot run: unknown, not an error of the catalog
        return {}
    return {"tokens": None if layout is None else {"head_pooling": layout.head_pooling, "layers": list(layout.layers)}}


def write(path: Path) -> None:
    """:func:`build` into ``path``, atomically (two processes building at once write the same file)."""
    write_atomic(Path(path), json.dumps(build(), indent=1) + "\n")


def param_fields(detector: str) -> list[ParamField]:
    """:func:`oodviz.params.editable_fields` of detector ``detector`` as the catalog holds them (no torch import); ``[]``
    for an unknown name."""
    return [ParamField(**{**field, "choices": tuple(field["choices"])}) for field in detector_params(detector)]


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else catalog_path())
