"""The detector registry: every detector class by its name, and what is done by name (create, describe, load).

Importing this module imports every detector module (and torch); :mod:`oodviz.detectors` reaches it lazily.
"""

from __future__ import annotations

from pathlib import Path

from oodviz.detectors.adascale import AdaSCALE
from oodviz.detectors.ash import ASH
from oodviz.detectors.base import Detector
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
from oodviz.detectors.iodin import IODIN
from oodviz.detectors.klm import KLMatching
from oodviz.detectors.knn import KNN
from oodviz.detectors.lts import LTS
from oodviz.detectors.mahalanobis import Mahalanobis
from oodviz.detectors.mahalanobis_odin import MahalanobisODIN
from oodviz.detectors.maxlogit import MaxLogit
from oodviz.detectors.mcd import MCD
from oodviz.detectors.mds_ensemble import MDSEnsemble
from oodviz.detectors.msp import MaxSoftmax
from oodviz.detectors.nac import NACUE
from oodviz.detectors.nci import NCI
from oodviz.detectors.neco import NECO
from oodviz.detectors.nnguide import NNGuide
from oodviz.detectors.odin import ODIN
from oodviz.detectors.openmax import OpenMax
from oodviz.detectors.persist import MANIFEST, OBJECT_PARAMS, DetectorFileError, read_manifest, restore_state
from oodviz.detectors.pnml import PNML
from oodviz.detectors.rankfeat import RankFeat
from oodviz.detectors.react import ReAct
from oodviz.detectors.relation import Relation
from oodviz.detectors.residual import Residual
from oodviz.detectors.rmd import RelativeMahalanobis
from oodviz.detectors.scale import SCALE
from oodviz.detectors.she import SHE
from oodviz.detectors.teaching import teaching_of
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
        IODIN,
        MahalanobisODIN,
        MDSEnsemble,
        MCD,
        WeiPer,
        AdaSCALE,
        RankFeat,
        Gram,
        NACUE,
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


def describe(name: str) -> dict:
    """``{"name", "summary", "formula", "citation", "paper" (link), "reads", "fails_when", "inputs",
    "needs_fit", "needs_labels", "needs_head", "needs_model"}`` of the registered detector ``name``
    (:func:`oodviz.detectors.teaching.teaching_of`)."""
    return {"name": name, **teaching_of(detector_class(name), name)}


def load(directory, **objects) -> Detector:
    """The detector saved in ``directory`` by :func:`oodviz.detectors.persist.save`, fitted as it was; ``objects``
    are the constructor parameters not saved (``model=`` for the detectors that run the classifier again).
    :class:`~oodviz.detectors.persist.DetectorFileError` when a file is missing, damaged, changed or not an oodviz
    detector's."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    name = manifest.get("name")
    if name not in available():
        raise DetectorFileError(
            f"{directory / MANIFEST} is a {name!r} detector, which this oodviz does not have "
            f"({', '.join(available())}); update oodviz"
        )
    unknown = sorted(set(objects) - set(OBJECT_PARAMS))
    if unknown:
        raise ValueError(f"load: {', '.join(unknown)} are saved parameters, not objects; only {OBJECT_PARAMS} are")
    try:
        detector = create(name, **manifest["params"], **objects)
    except (TypeError, ValueError) as error:
        raise DetectorFileError(f"{directory / MANIFEST}: its parameters are refused: {error}") from None
    return restore_state(detector, directory, manifest["state"])
