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

from __future__ import annotations

from typing import TYPE_CHECKING

from oodviz.lazy import lazy_attributes

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time each name is imported on first use
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
    from oodviz.detectors.persist import DetectorFileError
    from oodviz.detectors.pnml import PNML
    from oodviz.detectors.rankfeat import RankFeat
    from oodviz.detectors.react import ReAct
    from oodviz.detectors.registry import available, create, describe, detector_class, load
    from oodviz.detectors.relation import Relation
    from oodviz.detectors.residual import Residual
    from oodviz.detectors.rmd import RelativeMahalanobis
    from oodviz.detectors.scale import SCALE
    from oodviz.detectors.she import SHE
    from oodviz.detectors.teaching import Teaching
    from oodviz.detectors.tempscale import TemperatureScaling
    from oodviz.detectors.vim import ViM
    from oodviz.detectors.vra import VRA
    from oodviz.detectors.weightedebo import WeightedEBO
    from oodviz.detectors.weiper import WeiPer

#: Each public name and the submodule that defines it. The package imports a submodule when one of its names is
#: first used, so that torch-free layers (the run config, the app's pages) can import this package and ask it for
#: a detector only when they need one; the detectors import torch.
_SOURCES = {
    "adascale": ("AdaSCALE",),
    "ash": ("ASH",),
    "base": ("Detector", "FitData", "ModelDetector", "NotFittedError"),
    "cadref": ("CADRef",),
    "caref": ("CARef",),
    "cfood": ("CFOOD",),
    "combood": ("CombOOD",),
    "dice": ("DICE",),
    "energy": ("Energy",),
    "entropy": ("Entropy",),
    "fdbd": ("FDBD",),
    "gen": ("GEN",),
    "gmm": ("GMM",),
    "gradnorm": ("GradNorm",),
    "gram": ("Gram",),
    "grood": ("GROOD",),
    "klm": ("KLMatching",),
    "knn": ("KNN",),
    "lts": ("LTS",),
    "mahalanobis": ("Mahalanobis",),
    "maxlogit": ("MaxLogit",),
    "mcd": ("MCD",),
    "msp": ("MaxSoftmax",),
    "nci": ("NCI",),
    "neco": ("NECO",),
    "nnguide": ("NNGuide",),
    "odin": ("ODIN",),
    "openmax": ("OpenMax",),
    "persist": ("DetectorFileError",),
    "pnml": ("PNML",),
    "rankfeat": ("RankFeat",),
    "react": ("ReAct",),
    "relation": ("Relation",),
    "registry": ("available", "create", "describe", "detector_class", "load"),
    "residual": ("Residual",),
    "rmd": ("RelativeMahalanobis",),
    "scale": ("SCALE",),
    "she": ("SHE",),
    "teaching": ("Teaching",),
    "tempscale": ("TemperatureScaling",),
    "vim": ("ViM",),
    "vra": ("VRA",),
    "weightedebo": ("WeightedEBO",),
    "weiper": ("WeiPer",),
}
__getattr__ = lazy_attributes(__name__, _SOURCES, globals())


__all__ = [
    "ASH",
    "AdaSCALE",
    "CADRef",
    "CARef",
    "CFOOD",
    "CombOOD",
    "DICE",
    "Detector",
    "DetectorFileError",
    "Energy",
    "Entropy",
    "FDBD",
    "FitData",
    "GEN",
    "GMM",
    "GROOD",
    "GradNorm",
    "Gram",
    "KLMatching",
    "KNN",
    "LTS",
    "MCD",
    "Mahalanobis",
    "MaxLogit",
    "MaxSoftmax",
    "ModelDetector",
    "NCI",
    "NECO",
    "NNGuide",
    "NotFittedError",
    "ODIN",
    "OpenMax",
    "PNML",
    "RankFeat",
    "ReAct",
    "Relation",
    "RelativeMahalanobis",
    "Residual",
    "SCALE",
    "SHE",
    "Teaching",
    "TemperatureScaling",
    "VRA",
    "ViM",
    "WeiPer",
    "WeightedEBO",
    "available",
    "create",
    "describe",
    "detector_class",
    "load",
]
