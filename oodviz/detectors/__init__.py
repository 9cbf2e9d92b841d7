"""OOD detectors behind one API: ``available()`` lists them, ``create(name, **params)`` makes one.

Every detector has ``fit(batches, head=None, device=None)`` (returns self) and
``score(batches, device=None)`` (CPU float tensor ``[N]``, higher = more OOD); see
:mod:`oodviz.detectors.base`. One module per method, its docstring giving the formula.
``detector.save(directory)`` and ``load(directory)`` keep a fitted detector as files
(:mod:`oodviz.detectors.persist`); ``describe(name)`` gives the formula, paper, inputs and failure note each
detector class declares (``teaching = Teaching(...)``, :mod:`oodviz.detectors.teaching`).
Detectors with ``needs_model`` (``odin``, ``mcd``, ``rankfeat``, ``adascale``, ``gram``) run the classifier
again: they take it as ``create(name, model=...)`` and score ``Batch(inputs=...)``; ``adascale`` and ``gram``
also fit on in-distribution ``Batch(inputs=..., labels=...)`` (:mod:`oodviz.detectors.model_fit`).
"""

from oodviz.detectors.adascale import AdaSCALE
from oodviz.detectors.ash import ASH
from oodviz.detectors.base import Detector, FitData, ModelDetector, NotFittedError
from oodviz.detectors.cadref import CADRef
from oodviz.detectors.caref import CARef
from oodviz.detectors.cfood import CFOOD
from oodviz.detectors.combood import CombOOD
from oodviz.detectors.dice import DICE
from oodviz.detectors.energy import Energy
from oodviz.detectors.entropy import Entropy
from oodviz.detectors.fdbd import FDBD
from oodviz.detectors.gen import GEN
from oodviz.detectors.gmm import GMM
from oodviz.detectors.gradnorm import GradNorm
from oodviz.detectors.gram import Gram
from oodviz.detectors.grood import GROOD
from oodviz.detectors.klm import KLMatching
from oodviz.detectors.knn import KNN
from oodviz.detectors.lts import LTS
from oodviz.detectors.mahalanobis import Mahalanobis
from oodviz.detectors.maxlogit import MaxLogit
from oodviz.detectors.mcd import MCD
from oodviz.detectors.msp import MaxSoftmax
from oodviz.detectors.nci import NCI
from oodviz.detectors.neco import NECO
from oodviz.detectors.nnguide import NNGuide
from oodviz.detectors.odin import ODIN
from oodviz.detectors.openmax import OpenMax
from oodviz.detectors.persist import DetectorFileError, load
from oodviz.detectors.pnml import PNML
from oodviz.detectors.rankfeat import RankFeat
from oodviz.detectors.react import ReAct
from oodviz.detectors.relation import Relation
from oodviz.detectors.residual import Residual
from oodviz.detectors.rmd import RelativeMahalanobis
from oodviz.detectors.scale import SCALE
from oodviz.detectors.she import SHE
from oodviz.detectors.teaching import Teaching, describe
from oodviz.detectors.tempscale import TemperatureScaling
from oodviz.detectors.vim import ViM
from oodviz.detectors.vra import VRA
from oodviz.detectors.weightedebo import WeightedEBO
from oodviz.detectors.weiper import WeiPer

_REGISTRY: dict[str, type[Detector]] = {
    cls.name: cls
    for cls in (
        MaxSoftmax,
        MaxLogit,
        Energy,
        WeightedEBO,
        Entropy,
        GEN,
        TemperatureScaling,
        KLMatching,
        Mahalanobis,
        RelativeMahalanobis,
        ViM,
        Residual,
        NECO,
        PNML,
        SHE,
        CARef,
        CADRef,
        KNN,
        ReAct,
        ASH,
        SCALE,
        LTS,
        DICE,
        FDBD,
        NCI,
        GradNorm,
        VRA,
        GMM,
        OpenMax,
        NNGuide,
        Relation,
        CFOOD,
        GROOD,
        CombOOD,
        ODIN,
        MCD,
        WeiPer,
        AdaSCALE,
        RankFeat,
        Gram,
    )
}


def available() -> list[str]:
    """Names of every detector, for ``create``."""
    return list(_REGISTRY)


def detector_class(name: str) -> type[Detector]:
    """The class registered under ``name`` (its ``summary``, ``paper``, ``inputs``, parameters)."""
    if name not in _REGISTRY:
        raise ValueError(f"Unknown detector {name!r}; choose one of: {', '.join(available())}")
    return _REGISTRY[name]


def create(name: str, **params) -> Detector:
    """A new, unfitted detector ``name`` with the given parameters."""
    cls = detector_class(name)
    unknown = sorted(set(params) - set(cls.param_names()))
    if unknown:
        valid = ", ".join(cls.param_names()) or "none"
        raise ValueError(f"Detector {name!r} has no parameter(s) {', '.join(unknown)}; valid parameters: {valid}")
    return cls(**params)


__all__ = [
    "Detector",
    "DetectorFileError",
    "FitData",
    "ModelDetector",
    "NotFittedError",
    "Teaching",
    "available",
    "create",
    "describe",
    "detector_class",
    "load",
]
