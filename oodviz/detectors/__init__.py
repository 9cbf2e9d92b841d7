"""OOD detectors behind one API: ``available()`` lists them, ``create(name, **params)`` makes one.

Every detector has ``fit(batches, head=None, device=None)`` (returns self) and
``score(batches, device=None)`` (CPU float tensor ``[N]``, higher = more OOD); see
:mod:`oodviz.detectors.base`. One module per method, its docstring giving the formula.
``detector.save(directory)`` and ``load(directory)`` keep a fitted detector as files
(:mod:`oodviz.detectors.persist`); ``describe(name)`` gives the formula, paper, inputs and failure note each
detector class declares (``teaching = Teaching(...)``, :mod:`oodviz.detectors.teaching`).
Detectors with ``needs_model`` (``odin``, ``iodin``, ``mahalanobis_odin``, ``mds_ensemble``, ``mcd``, ``rankfeat``,
``adascale``, ``gram``) run the classifier again: they take it as ``create(name, model=...)`` and score
``Batch(inputs=...)``; ``mahalanobis_odin``, ``mds_ensemble``, ``adascale`` and ``gram`` also fit on in-distribution
``Batch(inputs=..., labels=...)`` (:mod:`oodviz.detectors.model_fit`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oodviz.lazy import lazy_attributes

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time each name is imported on first use
    from oodviz.detectors.adascale import AdaSCALE as AdaSCALE
    from oodviz.detectors.ash import ASH as ASH
    from oodviz.detectors.base import Detector as Detector
    from oodviz.detectors.base import FitData as FitData
    from oodviz.detectors.base import ModelDetector as ModelDetector
    from oodviz.detectors.base import NotFittedError as NotFittedError
    from oodviz.detectors.cadref import CADRef as CADRef
    from oodviz.detectors.caref import CARef as CARef
    from oodviz.detectors.cfood import CFOOD as CFOOD
    from oodviz.detectors.combood import CombOOD as CombOOD
    from oodviz.detectors.dice import DICE as DICE
    from oodviz.detectors.energy import Energy as Energy
    from oodviz.detectors.entropy import Entropy as Entropy
    from oodviz.detectors.fdbd import FDBD as FDBD
    from oodviz.detectors.gen import GEN as GEN
    from oodviz.detectors.gmm import GMM as GMM
    from oodviz.detectors.gradnorm import GradNorm as GradNorm
    from oodviz.detectors.gram import Gram as Gram
    from oodviz.detectors.grood import GROOD as GROOD
    from oodviz.detectors.iodin import IODIN as IODIN
    from oodviz.detectors.klm import KLMatching as KLMatching
    from oodviz.detectors.knn import KNN as KNN
    from oodviz.detectors.lts import LTS as LTS
    from oodviz.detectors.mahalanobis import Mahalanobis as Mahalanobis
    from oodviz.detectors.mahalanobis_odin import MahalanobisODIN as MahalanobisODIN
    from oodviz.detectors.maxlogit import MaxLogit as MaxLogit
    from oodviz.detectors.mcd import MCD as MCD
    from oodviz.detectors.mds_ensemble import MDSEnsemble as MDSEnsemble
    from oodviz.detectors.msp import MaxSoftmax as MaxSoftmax
    from oodviz.detectors.nci import NCI as NCI
    from oodviz.detectors.neco import NECO as NECO
    from oodviz.detectors.nnguide import NNGuide as NNGuide
    from oodviz.detectors.odin import ODIN as ODIN
    from oodviz.detectors.openmax import OpenMax as OpenMax
    from oodviz.detectors.persist import DetectorFileError as DetectorFileError
    from oodviz.detectors.pnml import PNML as PNML
    from oodviz.detectors.rankfeat import RankFeat as RankFeat
    from oodviz.detectors.react import ReAct as ReAct
    from oodviz.detectors.registry import available as available
    from oodviz.detectors.registry import create as create
    from oodviz.detectors.registry import describe as describe
    from oodviz.detectors.registry import detector_class as detector_class
    from oodviz.detectors.registry import load as load
    from oodviz.detectors.relation import Relation as Relation
    from oodviz.detectors.residual import Residual as Residual
    from oodviz.detectors.rmd import RelativeMahalanobis as RelativeMahalanobis
    from oodviz.detectors.scale import SCALE as SCALE
    from oodviz.detectors.she import SHE as SHE
    from oodviz.detectors.teaching import Teaching as Teaching
    from oodviz.detectors.tempscale import TemperatureScaling as TemperatureScaling
    from oodviz.detectors.vim import ViM as ViM
    from oodviz.detectors.vra import VRA as VRA
    from oodviz.detectors.weightedebo import WeightedEBO as WeightedEBO
    from oodviz.detectors.weiper import WeiPer as WeiPer

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
    "iodin": ("IODIN",),
    "klm": ("KLMatching",),
    "knn": ("KNN",),
    "lts": ("LTS",),
    "mahalanobis": ("Mahalanobis",),
    "mahalanobis_odin": ("MahalanobisODIN",),
    "maxlogit": ("MaxLogit",),
    "mcd": ("MCD",),
    "mds_ensemble": ("MDSEnsemble",),
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


__all__ = sorted(name for names in _SOURCES.values() for name in names)
