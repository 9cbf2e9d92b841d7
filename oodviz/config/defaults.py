"""The default detectors of a run, and their parameters, by backbone family (CNN or transformer).

``RunConfig(backbone=...)`` without ``detectors`` takes :func:`default_detector_params` of its backbone's family
(:func:`oodviz.models.architectures.backbone_family`); :data:`FAMILY_REASONS` says why, with the OpenOOD v1.5
ImageNet-1k leaderboard figures (near/far AUROC, %), and the app shows it under the detector list. The detectors'
``in_defaults`` and the families are read from :mod:`oodviz.config.catalog` (checked equal to the code that declares
them), so that neither a config nor the app's form imports torch for them.

- ``cnn``: every detector with ``in_defaults`` (activation shaping, SCALE and ASH, and NCI lead on ResNet-50);
- ``transformer``: the same less ``ash`` and ``gradnorm``, which collapse on ViT, with ``mahalanobis`` and
  ``rmd`` on L2-normalised features (``normalize=True``: MDS++ / RMDS++), which lead on ViT.
"""

from __future__ import annotations

from oodviz.config.catalog import backbone_family, default_detector_names

#: What each family changes in the list of ``in_defaults`` detectors: those it leaves out, and parameters.
FAMILY_CHANGES: dict[str, dict] = {
    "cnn": {"leave_out": (), "params": {}},
    "transformer": {
        "leave_out": ("ash", "gradnorm"),
        "params": {"mahalanobis": {"normalize": True}, "rmd": {"normalize": True}},
    },
}

#: Why: OpenOOD v1.5's ImageNet-1k leaderboard, near/far AUROC (%).
FAMILY_REASONS: dict[str, str] = {
    "cnn": (
        "CNN defaults: every standard detector. On OpenOOD v1.5's ImageNet-1k leaderboard (ResNet-50, near/far "
        "AUROC) activation shaping leads: AdaSCALE-A 84.42/97.27, SCALE 81.36/96.53, NCI 78.69/95.53, ASH "
        "78.17/95.74 (AdaSCALE runs the model again: add it yourself)."
    ),
    "transformer": (
        "Transformer defaults: no ash or gradnorm, mahalanobis and rmd with normalize=True (MDS++ / RMDS++). "
        "On OpenOOD v1.5's ImageNet-1k leaderboard Mahalanobis-style methods lead on transformers (ViT-B "
        "RMDS++ 81.71 near AUROC) while ASH and GradNorm collapse (ViT ASH 53.21/51.56 near/far)."
    ),
}


def default_detector_params(backbone) -> dict[str, dict]:
    """Detector name -> its parameters, in registry order: the default detectors of ``backbone``'s family."""
    changes = FAMILY_CHANGES[backbone_family(backbone)]
    return {
        name: dict(changes["params"].get(name, {}))
        for name in default_detector_names()
        if name not in changes["leave_out"]
    }


def defaults_reason(backbone) -> str:
    """Why ``backbone``'s family has the default detectors it has (:data:`FAMILY_REASONS`)."""
    return FAMILY_REASONS[backbone_family(backbone)]
