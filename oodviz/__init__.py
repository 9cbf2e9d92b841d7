"""oodviz: see which inputs a classifier would wrongly trust, and which OOD detector catches them.

The front door, for Python users (nothing heavy is imported until a name is used)::

    import oodviz

    config = oodviz.RunConfig.load("examples/fashion-mnist-quick.toml")  # or oodviz.preset(...), RunConfig(...)
    results = oodviz.run(config, out="runs/first")           # a whole evaluation in this process
    results.metrics                                           # pandas: AUROC, FPR95, AUPR per detector and OOD set
    oodviz.load_results("runs/first").scores                  # a finished run, read back

    det = oodviz.detectors.create("mahalanobis")              # or: from oodviz.detectors import Mahalanobis
    det.fit(oodviz.FeatureStore(store_dir).batches(4096))     # any iterable of oodviz.Batch
    scores = det.score(oodviz.Batch(features=x))              # higher = more OOD

The library never imports streamlit; the app lives in :mod:`oodviz.ui`. The packages follow the data flow
(docs/layout.md): :mod:`oodviz.data`, :mod:`oodviz.models` → :mod:`oodviz.engine`, :mod:`oodviz.detectors` →
:mod:`oodviz.config` → :mod:`oodviz.results` → :mod:`oodviz.pipeline` → :mod:`oodviz.figures` → :mod:`oodviz.ui`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time each name is imported on first use
    from oodviz import config, data, detectors, engine, figures, models, pipeline, results
    from oodviz.batch import OOD_LABEL, Batch
    from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig, preset
    from oodviz.config.validation import ConfigError
    from oodviz.engine import FeatureStore, extract
    from oodviz.pipeline.worker import RunFailed, run
    from oodviz.results.tables import Results, load_results

#: Each public name and the module that defines it, imported on first use: small processes (a run's supervisor,
#: the app's pages) import ``oodviz`` without torch.
_SOURCES = {
    "oodviz.batch": ("Batch", "OOD_LABEL"),
    "oodviz.config.run": ("DatasetChoice", "DetectorChoice", "RunConfig", "preset"),
    "oodviz.config.validation": ("ConfigError",),
    "oodviz.engine": ("FeatureStore", "extract"),
    "oodviz.pipeline.worker": ("RunFailed", "run"),
    "oodviz.results.tables": ("Results", "load_results"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}
#: the subpackages, each an attribute of ``oodviz`` once used (``oodviz.detectors.create(...)``)
_SUBPACKAGES = ("config", "data", "detectors", "engine", "figures", "models", "pipeline", "results")


def __getattr__(name: str):
    import importlib

    if name in _SUBPACKAGES:
        return importlib.import_module(f"oodviz.{name}")
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'oodviz' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "OOD_LABEL",
    "Batch",
    "ConfigError",
    "DatasetChoice",
    "DetectorChoice",
    "FeatureStore",
    "Results",
    "RunConfig",
    "RunFailed",
    "__version__",
    "config",
    "data",
    "detectors",
    "engine",
    "extract",
    "figures",
    "load_results",
    "models",
    "pipeline",
    "preset",
    "results",
    "run",
]
