"""The published OpenOOD v1.5 leaderboard, shipped with oodviz, and a run's figures set beside it.

:func:`published` reads the leaderboard's figures (``oodviz/results/data/openood_v1_5.csv``; where they come from
and when they were read: :func:`source`, its sidecar ``openood_v1_5.json``); :func:`run_figures` (a run) or
:func:`figures_from_metrics` (a ``metrics.csv`` table) gives oodviz's figures in the leaderboard's shape;
:func:`compare` sets the two side by side, with the difference ``ours - published``. :func:`run_benchmark` says which
benchmark a run ran (None for a run of other data) and :func:`leaderboard_arch` which of the leaderboard's models its
backbone is.

The leaderboard's shape, all in percent, per detector:

- ``near_auroc``, ``far_auroc``: the mean of the AUROC over the near-OOD and over the far-OOD sets (each set's
  AUROC against the whole ID test set, then the plain mean over the group's sets, as OpenOOD's
  ``Evaluator._eval_ood`` averages them);
- ``near_fpr95``, ``far_fpr95``: the same means of FPR@95;
- ``id_accuracy``: the classifier's top-1 accuracy on the ID test set.

**What the shipped table has.** Near- and far-OOD AUROC and ID accuracy (mean and std over 3 training runs on
CIFAR-10, CIFAR-100 and ImageNet-200; one run, no std, on ImageNet-1K) of every row of the leaderboard's four
standard benchmarks (``cifar10``, ``cifar100``, ``imagenet200``, ``imagenet``), read from its CSV files
(zjysteven/OpenOOD, branch ``leaderboard``, commit 28d3a40, 2025-07-19). **FPR@95 is not published there**: the
``*_fpr95`` columns of :func:`compare` have no published figure, only oodviz's.

**Conventions.** Both sides score OOD as the positive class. AUROC: OpenOOD's ``metrics.auc`` of
``roc_curve(is_ood, -conf)`` is :func:`sklearn.metrics.roc_auc_score` (ties count one half), as oodviz's
(:mod:`oodviz.results.metrics`). FPR@95: both take the false-positive rate (ID samples flagged as OOD) at the
first ROC point whose true-positive rate (OOD samples caught) reaches 95%, i.e. at the threshold that catches 95%
of the OOD samples. One difference: OpenOOD's ``roc_curve`` drops collinear points (scikit-learn's default
``drop_intermediate=True``) and oodviz keeps them; when tied scores put the 95% point in the middle of a straight
run of ROC points, OpenOOD reads the FPR at the end of that run (equal or higher). With untied scores the two
agree.

**Matching.** Each OpenOOD postprocessor maps to an oodviz detector and, where one oodviz detector covers several
of them, the parameters that make it that one (:data:`OPENOOD_DETECTORS`: ``MDS++`` is ``mahalanobis`` with
``normalize=True``); ``None`` where oodviz has no such detector (``OpenGAN``, ``OTOD``, the training
methods' own postprocessors; OpenOOD's ``MCD`` is a training method with outlier data, not oodviz's Monte-Carlo
dropout). Other hyper-parameters (``k`` of KNN, ReAct's percentile, ...) are not compared: the same detector may
run with other values than OpenOOD's tuned ones. The leaderboard's figures are of OpenOOD's checkpoints
(ResNet-18 trained on CIFAR-10/100 and ImageNet-200, torchvision's ResNet-50, ViT-B/16, Swin-T and RegNet-Y-16GF
on ImageNet-1K) and of its OOD sets (``source()["ood_sets"]``); figures of another model or other sets differ for
that reason alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from functools import cache
from importlib import resources
from pathlib import Path

import pandas as pd

from oodviz.results.tables import Results, is_group_mean, load_results

#: the leaderboard's standard OOD benchmarks, by OpenOOD's ID dataset names
BENCHMARKS = ("cifar10", "cifar100", "imagenet200", "imagenet")
#: the model :func:`compare` takes by default: OpenOOD's own ResNet-18 checkpoints, torchvision's ResNet-50
DEFAULT_ARCH = {"cifar10": "ResNet18", "cifar100": "ResNet18", "imagenet200": "ResNet18", "imagenet": "ResNet50"}
#: the training of the post-hoc rows: a plain cross-entropy classifier, oodviz's case
STANDARD_TRAINING = "CrossEntropy"
#: the figures of a detector on the leaderboard, in percent
LEADERBOARD_METRICS = ("near_auroc", "far_auroc", "near_fpr95", "far_fpr95", "id_accuracy")
#: those the shipped table publishes (with a ``<name>_std`` column each)
PUBLISHED_METRICS = ("near_auroc", "far_auroc", "id_accuracy")
GROUPS = ("near", "far")
#: the columns of :func:`published`
PUBLISHED_COLUMNS = (
    "benchmark",
    "training",
    "postprocessor",
    "detector",
    "detector_params",
    "arch",
    "description",
    "outlier_data",
    *(f"{name}{suffix}" for name in PUBLISHED_METRICS for suffix in ("", "_std")),
)
#: the columns of :func:`figures_from_metrics` and :func:`run_figures`
FIGURES_COLUMNS = ("detector", *LEADERBOARD_METRICS, "near_sets", "far_sets", "params")

#: :func:`compare`'s ``status`` of a row
COMPARED = "compared"  # both figures
NOT_PUBLISHED = "not published"  # oodviz's detector has no row on the leaderboard
NOT_RUN = "not in these results"  # a leaderboard row of an oodviz detector that ``ours`` lacks
NO_DETECTOR = "no oodviz detector"  # a leaderboard row of a method oodviz does not have

#: OpenOOD's postprocessor -> ``(oodviz detector, the parameters that make it that method)``; ``None``: oodviz has
#: no such detector. The parameters are given only where one oodviz detector covers several postprocessors.
OPENOOD_DETECTORS: dict[str, tuple[str, dict] | None] = {
    "MSP": ("msp", {}),
    "TempScale": ("tempscale", {}),
    "ODIN": ("odin", {}),
    "i-ODIN": ("iodin", {}),
    "MDS": ("mahalanobis", {"normalize": False}),
    "MDS++": ("mahalanobis", {"normalize": True}),
    "MDSEns": ("mds_ensemble", {}),  # its layer weights: OpenOOD fits them on OOD validation data, oodviz 1/rank
    "RMDS": ("rmd", {"normalize": False}),
    "RMDS++": ("rmd", {"normalize": True}),
    "Gram": ("gram", {}),
    "EBO": ("energy", {}),
    "MLS": ("maxlogit", {}),
    "GEN": ("gen", {}),
    "KLM": ("klm", {}),
    "VIM": ("vim", {}),
    "KNN": ("knn", {}),
    "NNGuide": ("nnguide", {}),
    "ReAct": ("react", {}),
    "ASH": ("ash", {}),
    "SCALE": ("scale", {}),
    "AdaSCALE-A": ("adascale", {"variant": "a"}),
    "AdaSCALE-L": ("adascale", {"variant": "l"}),
    "DICE": ("dice", {}),
    "SHE": ("she", {}),
    "GradNorm": ("gradnorm", {}),
    "RankFeat": ("rankfeat", {}),
    "OpenMax": ("openmax", {}),
    "Relation": ("relation", {}),
    "fDBD": ("fdbd", {}),
    "NCI": ("nci", {}),
    "CombOOD": ("combood", {}),
    "WeiPer+KLD": ("weiper", {"variant": "kld"}),
    "NAC": ("nac", {}),  # its layers and per-layer values were searched per benchmark (APS): nac's docstring
    "OpenGAN": None,
    "OTOD": None,
    "MCD": None,  # Maximum Classifier Discrepancy (Yu & Aizawa 2019), trained with outliers; not Monte-Carlo dropout
    "ConfBranch": None,
    "RotPred": None,
    "G-ODIN": None,
    "ARPL": None,
    "MOS": None,
    "T2FNorm": None,
}
#: oodviz's default of each parameter :data:`OPENOOD_DETECTORS` names: what a detector whose parameters are not
#: recorded (a hand-built frame) runs with
DETECTOR_DEFAULTS: dict[str, dict] = {
    "mahalanobis": {"normalize": False},
    "rmd": {"normalize": False},
    "adascale": {"variant": "a"},
    "weiper": {"variant": "kld"},
}

_DATA = "data"
_TABLE = "openood_v1_5.csv"
_SIDECAR = "openood_v1_5.json"
_TEXT_COLUMNS = ("benchmark", "training", "postprocessor", "arch", "description", "outlier_data")


def _data_file(name: str):
    return resources.files("oodviz.results").joinpath(_DATA, name)


@cache
def source() -> dict:
    """Where the shipped figures come from: the sidecar ``openood_v1_5.json`` (``website``, ``paper``, ``source``
    with the repository, branch, commit and each file's path and SHA-256, ``read_on``, ``how`` they were read,
    ``runs`` behind each mean, ``ood_sets``: each benchmark's near and far sets, ``missing``, ``notes``)."""
    return json.loads(_data_file(_SIDECAR).read_text(encoding="utf-8"))


@cache
def _table() -> pd.DataFrame:
    with _data_file(_TABLE).open("r", encoding="utf-8") as handle:
        raw = pd.read_csv(handle, dtype=str, keep_default_na=False)
    table = raw[list(_TEXT_COLUMNS)].copy()
    for name in PUBLISHED_METRICS:
        for column in (name, f"{name}_std"):
            table[column] = pd.to_numeric(raw[column].mask(raw[column] == ""), errors="raise").astype("float64")
    mapped = [OPENOOD_DETECTORS.get(name) for name in table.postprocessor]
    table.insert(3, "detector", pd.Series([None if m is None else m[0] for m in mapped], dtype=object))
    table.insert(4, "detector_params", pd.Series([{} if m is None else dict(m[1]) for m in mapped], dtype=object))
    return table[list(PUBLISHED_COLUMNS)]


def check_benchmark(benchmark: str) -> str:
    """``benchmark`` when it is one of :data:`BENCHMARKS`, else a ValueError naming them."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown OpenOOD benchmark {benchmark!r}; choose one of: {', '.join(BENCHMARKS)}")
    return benchmark


def published(benchmark: str) -> pd.DataFrame:
    """The leaderboard of ``benchmark`` (one of :data:`BENCHMARKS`), every row in the leaderboard's order.

    Columns :data:`PUBLISHED_COLUMNS`: OpenOOD's ``training`` (``"CrossEntropy"`` for the post-hoc methods on a
    plain classifier), ``postprocessor``, the oodviz ``detector`` it maps to (``None`` where oodviz has none) and
    the ``detector_params`` that make it that method (:data:`OPENOOD_DETECTORS`; the mapping is of the
    postprocessor, whatever the training), ``arch``, ``description`` and ``outlier_data`` as published, then
    ``near_auroc``, ``far_auroc``, ``id_accuracy`` in percent, each with its ``_std`` over the training runs (NaN
    where the leaderboard gives none: ImageNet-1K, and an ID accuracy it does not report). No FPR@95: the
    leaderboard does not publish it. ``attrs["source"]`` is :func:`source`.
    """
    check_benchmark(benchmark)
    table = _table()
    rows = table[table.benchmark == benchmark].reset_index(drop=True).copy()
    rows["detector_params"] = [dict(p) for p in rows.detector_params]  # the caller's own copies
    rows.attrs["source"] = source()
    return rows


#: ``imagenet``'s networks by oodviz backbone -> the leaderboard's model of that name (torchvision's weights, as
#: OpenOOD's ImageNet-1k rows); the other benchmarks have one model each (OpenOOD's ResNet-18)
LEADERBOARD_ARCHS = {"imagenet": {"resnet50": "ResNet50", "vit_b_16": "ViT-B/16", "swin_t": "Swin-T"}}


def run_benchmark(config: Mapping | None) -> str | None:
    """The OpenOOD v1.5 benchmark a run ran (its config, ``config.json`` as a mapping, fits on the ``openood``
    dataset: that dataset's ``benchmark``), else None: not a benchmark run, or a config that names none."""
    fit = (config or {}).get("id_fit")
    if not isinstance(fit, Mapping) or fit.get("name") != "openood":
        return None
    params = fit.get("params")
    benchmark = params.get("benchmark") if isinstance(params, Mapping) else None
    return benchmark if isinstance(benchmark, str) else None


def leaderboard_arch(benchmark: str, backbone: str | None) -> str | None:
    """The leaderboard's model whose figures a run of ``backbone`` on ``benchmark`` compares with
    (:data:`LEADERBOARD_ARCHS`: ``"ViT-B/16"`` for ``vit_b_16`` on ``imagenet``), else None: the benchmark's own
    network, :data:`DEFAULT_ARCH` (as ``oodviz bench`` without ``--arch``)."""
    return LEADERBOARD_ARCHS.get(benchmark, {}).get(backbone)


# -- oodviz's figures in the leaderboard's shape -----------------------------------------------------------------
def _check_groups(groups: dict) -> None:
    wrong = {name: group for name, group in groups.items() if group not in (*GROUPS, None)}
    if wrong:
        raise ValueError(f"groups must map each OOD dataset to 'near', 'far' or None (left out), got {wrong}")


def figures_from_metrics(
    metrics: pd.DataFrame, groups: dict[str, str | None] | None = None, params: dict[str, dict] | None = None
) -> pd.DataFrame:
    """oodviz's figures of each detector of a ``metrics.csv`` table (:func:`oodviz.results.tables.metrics_table`)
    in the leaderboard's shape, in percent.

    ``near_auroc`` (``far_auroc``, ``near_fpr95``, ``far_fpr95``) is the plain mean over the OOD datasets of the
    near (far) group of their per-dataset rows, as OpenOOD averages; ``id_accuracy`` the classifier's accuracy on
    the ID test set. The groups are those the run recorded for each dataset (its ``group`` column), unless
    ``groups`` (OOD dataset -> ``"near"``, ``"far"`` or ``None``) regroups them: then a dataset it does not name,
    or maps to ``None``, is left out, so that the means are over OpenOOD's sets only. A group with no dataset gives
    NaN. ``near_sets`` and ``far_sets`` name the datasets each mean is over (``", "``-joined, in run order).
    ``params``: detector -> the parameters it ran with (``detectors.json``), kept in the ``params`` column
    (``None`` where not given) for :func:`compare` to tell variants apart.

    Columns :data:`FIGURES_COLUMNS`; one row per detector, in table order.
    """
    if groups is not None:
        _check_groups(groups)
    rows = metrics[~is_group_mean(metrics)]
    group_of = rows["group"] if groups is None else rows.ood_dataset.map(lambda name: groups.get(name))
    out = []
    for detector in pd.unique(rows.detector):
        mine = rows.detector == detector
        figures = {"detector": detector}
        for group in GROUPS:
            chosen = rows[mine & (group_of == group)]
            figures[f"{group}_auroc"] = 100.0 * chosen.auroc.mean() if len(chosen) else math.nan
            figures[f"{group}_fpr95"] = 100.0 * chosen.fpr95.mean() if len(chosen) else math.nan
            figures[f"{group}_sets"] = ", ".join(chosen.ood_dataset.astype(str))
        figures["id_accuracy"] = 100.0 * float(rows.loc[mine, "id_accuracy"].iloc[0])
        figures["params"] = (params or {}).get(detector)
        out.append(figures)
    return pd.DataFrame(out, columns=list(FIGURES_COLUMNS))


def run_figures(run: Results | str | Path, groups: dict[str, str | None] | None = None) -> pd.DataFrame:
    """:func:`figures_from_metrics` of a run (a run directory or its :func:`~oodviz.results.tables.load_results`),
    read from its ``metrics.csv``, with each detector's parameters from its ``detectors.json``.

    :raises ValueError: when the run has no readable ``metrics.csv`` (not finished, or the file is damaged; a
        finished run's damaged file raises :class:`~oodviz.results.tables.ResultsFileError`, a ValueError)
    """
    results = run if isinstance(run, Results) else load_results(run)
    results.check_results("metrics.csv")
    if results.metrics is None:
        raise ValueError(
            f"the run {results.path} has no metrics yet (state {results.state!r}); "
            "compare it with the leaderboard once it is done"
        )
    params = {
        column: dict(entry["params"])
        for column, entry in (results.detectors or {}).items()
        if isinstance(entry, dict) and isinstance(entry.get("params"), dict)
    }
    return figures_from_metrics(results.metrics, groups, params)


# -- side by side -----------------------------------------------------------------------------------------------
def _runs_as(detector: str, wanted: dict, params) -> bool:
    """Whether a detector with ``params`` (``None``: not recorded, so its defaults) runs as the variant
    ``wanted``."""
    given = params if isinstance(params, dict) else {}
    defaults = DETECTOR_DEFAULTS.get(detector, {})
    return all(given.get(key, defaults.get(key)) == value for key, value in wanted.items())


def compare(
    ours: pd.DataFrame, benchmark: str, *, arch: str | None = None, training: str = STANDARD_TRAINING
) -> pd.DataFrame:
    """oodviz's figures beside the leaderboard's, with the difference ``ours - published``.

    :param ours: one row per detector: ``detector`` and any of :data:`LEADERBOARD_METRICS` in percent (a metric it
        lacks counts as not measured), optionally ``params`` (a dict, or None for the detector's defaults), as
        :func:`run_figures` gives
    :param benchmark: one of :data:`BENCHMARKS`
    :param arch: the leaderboard's model (``"ResNet50"``, ``"ViT-B/16"``, ...); default :data:`DEFAULT_ARCH`
    :param training: the leaderboard rows' training; default the plain classifier (the post-hoc methods)
    :returns: the leaderboard's rows of that model and training, in its order, then oodviz's detectors it does not
        have. Columns ``benchmark, arch, postprocessor, detector, status``, then per metric ``m`` of
        :data:`LEADERBOARD_METRICS`: ``m_ours``, ``m_published``, ``m_published_std`` and ``m_diff`` (``ours -
        published``; NaN where either is missing: always for FPR@95, which the leaderboard does not publish).
        ``status``: ``"compared"`` (both sides), ``"not published"`` (an oodviz detector the leaderboard lacks:
        NaN published figures), ``"not in these results"`` (a leaderboard row of an oodviz detector that ``ours``
        lacks), ``"no oodviz detector"`` (a method oodviz does not have).
    :raises ValueError: for an unknown benchmark or model, ``ours`` without a ``detector`` column, or two rows of
        ``ours`` that both run as one leaderboard row's method
    """
    check_benchmark(benchmark)
    arch = DEFAULT_ARCH[benchmark] if arch is None else arch
    if "detector" not in ours.columns:
        raise ValueError("ours needs a 'detector' column (run_figures gives the right frame)")
    board = published(benchmark)
    models = sorted(pd.unique(board.loc[board.training == training, "arch"]))
    if arch not in models:
        raise ValueError(
            f"the {benchmark} leaderboard has no {training!r} rows of model {arch!r}; it has: {', '.join(models)}"
        )
    board = board[(board.training == training) & (board.arch == arch)].reset_index(drop=True)
    ours = ours.reset_index(drop=True)
    params = list(ours["params"]) if "params" in ours.columns else [None] * len(ours)
    values = {
        name: pd.to_numeric(ours[name], errors="coerce").astype("float64")
        for name in LEADERBOARD_METRICS
        if name in ours
    }

    def ours_value(index, name):
        return float(values[name].iloc[index]) if index is not None and name in values else math.nan

    rows, matched = [], set()
    for entry in board.itertuples(index=False):
        index, status = None, NO_DETECTOR
        if isinstance(entry.detector, str):
            found = [
                i
                for i in range(len(ours))
                if ours.at[i, "detector"] == entry.detector
                and _runs_as(entry.detector, entry.detector_params, params[i])
            ]
            if len(found) > 1:
                raise ValueError(
                    f"{len(found)} rows of ours run as {entry.postprocessor} ({entry.detector}); keep one per method"
                )
            index, status = (found[0], COMPARED) if found else (None, NOT_RUN)
            matched.update(found)
        row = {
            "benchmark": benchmark,
            "arch": arch,
            "postprocessor": entry.postprocessor,
            "detector": entry.detector,
            "status": status,
        }
        for name in LEADERBOARD_METRICS:
            mean = getattr(entry, name) if name in PUBLISHED_METRICS else math.nan
            std = getattr(entry, f"{name}_std") if name in PUBLISHED_METRICS else math.nan
            mine = ours_value(index, name)
            row |= {f"{name}_ours": mine, f"{name}_published": mean, f"{name}_published_std": std}
            row[f"{name}_diff"] = mine - mean
        rows.append(row)
    for index in range(len(ours)):
        if index in matched:
            continue
        row = {
            "benchmark": benchmark,
            "arch": arch,
            "postprocessor": None,
            "detector": ours.at[index, "detector"],
            "status": NOT_PUBLISHED,
        }
        for name in LEADERBOARD_METRICS:
            row |= {
                f"{name}_ours": ours_value(index, name),
                f"{name}_published": math.nan,
                f"{name}_published_std": math.nan,
                f"{name}_diff": math.nan,
            }
        rows.append(row)
    columns = ["benchmark", "arch", "postprocessor", "detector", "status"]
    columns += [
        f"{name}{part}" for name in LEADERBOARD_METRICS for part in ("_ours", "_published", "_published_std", "_diff")
    ]
    table = pd.DataFrame(rows, columns=columns)
    for name in ("postprocessor", "detector"):  # None, not NaN, where there is none
        table[name] = pd.Series([entry[name] for entry in rows], index=table.index, dtype=object)
    return table
