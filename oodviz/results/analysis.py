"""What the results of a run say: pure functions from a run's tables to plain data.

Everything the UI shows is computed here or in :mod:`oodviz.results.tables` (and drawn by
:mod:`oodviz.figures.plots`); the Streamlit code only arranges it. Histogram bins and curve points are
computed here too, so every chart the browser receives stays small whatever the number of samples.
Images of samples come from :mod:`oodviz.figures.thumbnails`.

Convention everywhere: **OOD is the positive class; higher score = more OOD.** A sample is
*flagged* (called OOD) when ``score >= threshold``:

- an ID sample that is flagged is a **false alarm**;
- an OOD sample that is not flagged (``score < threshold``) is a **miss** (accepted as ID).

Inputs are the tables of a run (their schema: :mod:`oodviz.results.tables`); ``scores`` is
``scores.parquet``: one row per scored sample with ``split`` (``"id_test"`` or ``"ood"``),
``dataset``, ``index`` (the sample's *source index* in its dataset, as stored by the engine),
``label`` (``-1`` for OOD), ``prediction`` and one float column per detector.

This module never imports streamlit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from oodviz.columns import PENULTIMATE, split_column
from oodviz.results.metrics import aurc, ood_metrics, risk_at_coverage
from oodviz.results.tables import (
    ID_SPLIT,
    OOD_SPLIT,
    SCORE_META_COLUMNS,
    Results,
    check_detector,
    check_ood_dataset,
    detectors_of,
    id_dataset_of,
    ood_datasets_of,
    score_values,
    selective_curve,
)

MiB = 2**20


def id_label(scores: pd.DataFrame) -> str:
    """The key of the ID set in :func:`score_histogram` counts: ``"ID (<dataset>)"``."""
    return f"ID ({id_dataset_of(scores)})"


# -- histograms -----------------------------------------------------------------------------------
def score_histogram(scores: pd.DataFrame, detector: str, bins: int = 60, clip_percentiles=(0.5, 99.5)) -> dict:
    """Score histograms of the ID set and of every OOD dataset on common bins.

    The bins cover a robust range: the ``clip_percentiles`` (default 0.5 and 99.5) of all finite
    scores of ``detector`` (ID and OOD together). Scores outside it are **clipped into the end
    bins** (so the first and last bins also count the outliers below / above); NaN scores are not
    counted (``n_nan``). Higher score = more OOD.

    :returns: ``{"detector", "edges": float [bins + 1], "counts": {label: int [bins]},
        "n": {label: count}, "clipped_low", "clipped_high" (totals over all sets), "n_nan",
        "id_label"}``; the labels are ``"ID (<dataset>)"`` first, then each OOD dataset in run order.
        Each set's counts sum to its number of (non-NaN) samples.
    """
    check_detector(scores, detector)
    if bins < 1:
        raise ValueError(f"bins must be at least 1, got {bins}")
    values = score_values(scores, detector)
    finite = values[np.isfinite(values)]
    if finite.size:
        lo, hi = np.percentile(finite, clip_percentiles)
    else:
        lo, hi = 0.0, 1.0
    if not hi > lo:  # all scores (almost) equal: a unit-wide range around them
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, bins + 1)
    split, dataset = scores.split.to_numpy(), scores.dataset.to_numpy()
    ood = split == OOD_SPLIT
    groups = [(id_label(scores), values[split == ID_SPLIT])]
    groups += [(name, values[ood & (dataset == name)]) for name in ood_datasets_of(scores)]
    counts, sizes = {}, {}
    low = high = nan = 0
    for label, v in groups:
        nan += int(np.isnan(v).sum())
        v = v[~np.isnan(v)]
        low += int((v < lo).sum())
        high += int((v > hi).sum())
        counts[label] = np.histogram(np.clip(v, lo, hi), bins=edges)[0].astype(np.int64)
        sizes[label] = int(v.size)
    return {
        "detector": detector,
        "edges": edges,
        "counts": counts,
        "n": sizes,
        "clipped_low": low,
        "clipped_high": high,
        "n_nan": nan,
        "id_label": groups[0][0],
    }


# -- curves ---------------------------------------------------------------------------------------
def _downsample(x: np.ndarray, y: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of at most ``max_points`` points of the polyline (x, y), spread evenly along its
    length; the first and last points are always kept (the kept points are exact curve points)."""
    n = len(x)
    if n <= max_points:
        return np.arange(n)
    if max_points < 2:
        raise ValueError(f"max_points must be at least 2, got {max_points}")
    step = np.hypot(np.diff(x), np.diff(y))
    length = np.concatenate([[0.0], np.cumsum(step)])
    if length[-1] <= 0:
        return np.array([0, n - 1])
    targets = np.linspace(0.0, length[-1], max_points)
    keep = np.unique(np.clip(np.searchsorted(length, targets, side="left"), 0, n - 1))
    keep[0], keep[-1] = 0, n - 1
    return np.unique(keep)


def _finite_or_nan(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64).copy()
    values[~np.isfinite(values)] = np.nan
    return values


def curves(scores: pd.DataFrame, detector: str, ood_dataset: str | None, max_points: int = 400) -> dict:
    """ROC and PR-Out curves of ``detector`` for ID vs ``ood_dataset`` (``None``: all OOD pooled).

    OOD is the positive class, higher score = more OOD. Curves come from
    ``sklearn.metrics.roc_curve`` / ``precision_recall_curve`` and are thinned to at most
    ``max_points`` points each; every kept point is an exact point of sklearn's curve (with its
    threshold), and the end points are always kept.

    :returns: ``{"detector", "ood_dataset", "fpr", "tpr", "roc_thresholds", "recall",
        "precision", "pr_thresholds", "auroc", "aupr_out", "aupr_in", "fpr95", "n_id", "n_ood"}``;
        the arrays are float64; ROC arrays go from (0, 0) to (1, 1); PR arrays are in order of
        increasing recall. Thresholds that sklearn gives as infinite are NaN. The four metrics are
        exactly :func:`oodviz.results.metrics.ood_metrics` of the same scores.
    """
    from sklearn.metrics import precision_recall_curve, roc_curve

    check_detector(scores, detector)
    id_scores = score_values(scores[scores.split == ID_SPLIT], detector)
    ood_rows = scores[scores.split == OOD_SPLIT]
    if ood_dataset is not None:
        check_ood_dataset(scores, ood_dataset)
        ood_rows = ood_rows[ood_rows.dataset == ood_dataset]
    ood_scores = score_values(ood_rows, detector)
    metrics = ood_metrics(id_scores, ood_scores)  # also rejects empty and non-finite scores
    values = np.concatenate([id_scores, ood_scores])
    is_ood = np.concatenate([np.zeros(id_scores.size, np.int8), np.ones(ood_scores.size, np.int8)])

    fpr, tpr, roc_thr = roc_curve(is_ood, values, drop_intermediate=True)
    keep = _downsample(fpr, tpr, max_points)
    precision, recall, pr_thr = precision_recall_curve(is_ood, values)
    # sklearn orders PR points by decreasing recall, ending with (recall 0, precision 1) that has no threshold
    pr_thr = np.concatenate([pr_thr, [np.inf]])
    precision, recall, pr_thr = precision[::-1], recall[::-1], pr_thr[::-1]
    keep_pr = _downsample(recall, precision, max_points)
    return {
        "detector": detector,
        "ood_dataset": ood_dataset,
        "fpr": fpr[keep].astype(np.float64),
        "tpr": tpr[keep].astype(np.float64),
        "roc_thresholds": _finite_or_nan(roc_thr[keep]),
        "recall": recall[keep_pr].astype(np.float64),
        "precision": precision[keep_pr].astype(np.float64),
        "pr_thresholds": _finite_or_nan(pr_thr[keep_pr]),
        "auroc": metrics["auroc"],
        "aupr_out": metrics["aupr_out"],
        "aupr_in": metrics["aupr_in"],
        "fpr95": metrics["fpr95"],
        "n_id": int(id_scores.size),
        "n_ood": int(ood_scores.size),
    }


ORACLE = "oracle (errors rejected first)"


def risk_coverage_curves(scores: pd.DataFrame, detectors=None, max_points: int = 400) -> dict[str, dict]:
    """Risk–coverage curves of ``detectors`` (default: all) on the ID test set, each detector's score as a
    reject rule for the classifier (:func:`oodviz.results.tables.selective_curve`), thinned to ``max_points`` exact
    curve points, plus :data:`ORACLE`: the best any rule could do, rejecting the misclassified samples first
    (risk ``max(0, k - n_correct) / k`` at coverage ``k / n``).

    :returns: ``{name: {"coverage", "risk", "thresholds" (NaN for the oracle): float64 arrays,
        "aurc", "risk_at_95_coverage"}}``, detectors in table order, the oracle last. Lower is better.
    """

    names = detectors_of(scores) if detectors is None else list(detectors)
    id_rows = scores[scores.split == ID_SPLIT]
    n = len(id_rows)
    if not n:
        raise ValueError("risk_coverage_curves: the scores have no ID test rows")
    correct = int((id_rows.label == id_rows.prediction).sum())
    accepted = np.arange(1, n + 1, dtype=np.float64)
    oracle = {"coverage": accepted / n, "risk": np.maximum(0.0, accepted - correct) / accepted}
    oracle["thresholds"] = np.full(n, np.nan)
    result = {}
    for name, curve in [*((d, selective_curve(scores, d)) for d in names), (ORACLE, oracle)]:
        keep = _downsample(curve["coverage"], curve["risk"], max_points)
        result[name] = {
            key: np.asarray(curve[key], dtype=np.float64)[keep] for key in ("coverage", "risk", "thresholds")
        }
        result[name].update(aurc=aurc(curve), risk_at_95_coverage=risk_at_coverage(curve))
    return result


# -- at a threshold -------------------------------------------------------------------------------
def _rate(count: int, n: int) -> float:
    return count / n if n else float("nan")


def counts_at_threshold(scores: pd.DataFrame, detector: str, threshold: float) -> dict:
    """What flagging ``score >= threshold`` as OOD does to each set.

    :returns: ``{"threshold", "detector",
        "id": {"dataset", "n", "false_alarms", "false_alarm_rate"},
        "ood": {dataset: {"n", "detected", "missed", "miss_rate"}},
        "total": {"n_id", "n_ood", "false_alarms", "false_alarm_rate", "detected", "missed",
        "miss_rate"}}``. False alarm: ID with ``score >= threshold``; miss: OOD with
        ``score < threshold`` (accepted as ID). Rates are fractions (NaN for an empty set).
    """
    check_detector(scores, detector)
    threshold = float(threshold)
    split = scores.split.to_numpy()
    values = score_values(scores, detector)
    id_values = values[split == ID_SPLIT]
    false_alarms = int((id_values >= threshold).sum())
    is_ood = split == OOD_SPLIT
    # one pass over the OOD rows, counted per set (codes in order of first appearance: ood_datasets_of's order)
    codes, names = pd.factorize(scores.dataset.to_numpy()[is_ood])
    sizes = np.bincount(codes, minlength=len(names))
    misses = np.bincount(codes, weights=values[is_ood] < threshold, minlength=len(names))
    ood = {}
    for name, n, missed in zip(names, sizes.tolist(), misses.astype(np.int64).tolist()):
        ood[str(name)] = {"n": n, "detected": n - missed, "missed": missed, "miss_rate": _rate(missed, n)}
    n_ood = sum(d["n"] for d in ood.values())
    missed = sum(d["missed"] for d in ood.values())
    return {
        "threshold": threshold,
        "detector": detector,
        "id": {
            "dataset": id_dataset_of(scores),
            "n": int(id_values.size),
            "false_alarms": false_alarms,
            "false_alarm_rate": _rate(false_alarms, id_values.size),
        },
        "ood": ood,
        "total": {
            "n_id": int(id_values.size),
            "n_ood": n_ood,
            "false_alarms": false_alarms,
            "false_alarm_rate": _rate(false_alarms, id_values.size),
            "detected": n_ood - missed,
            "missed": missed,
            "miss_rate": _rate(missed, n_ood),
        },
    }


def counts_table(counts: dict) -> pd.DataFrame:
    """:func:`counts_at_threshold` as one row per set: ``set, n, wrong, wrong_rate, kind`` where
    ``wrong`` is false alarms for the ID set and misses for each OOD dataset."""
    rows = [
        {
            "set": f"ID ({counts['id']['dataset']})",
            "kind": "false alarms (ID flagged as OOD)",
            "n": counts["id"]["n"],
            "wrong": counts["id"]["false_alarms"],
            "wrong_rate": counts["id"]["false_alarm_rate"],
        }
    ]
    for name, d in counts["ood"].items():
        rows.append(
            {
                "set": name,
                "kind": "missed (OOD accepted as ID)",
                "n": d["n"],
                "wrong": d["missed"],
                "wrong_rate": d["miss_rate"],
            }
        )
    total = counts["total"]
    rows.append(
        {
            "set": "all OOD",
            "kind": "missed (OOD accepted as ID)",
            "n": total["n_ood"],
            "wrong": total["missed"],
            "wrong_rate": total["miss_rate"],
        }
    )
    return pd.DataFrame(rows, columns=["set", "kind", "n", "wrong", "wrong_rate"])


# -- failure cases --------------------------------------------------------------------------------
def _top(rows: pd.DataFrame, detector: str, k: int, highest: bool) -> pd.DataFrame:
    v = score_values(rows, detector)
    ok = ~np.isnan(v)
    rows, v = rows[ok], v[ok]
    order = np.argsort(-v if highest else v, kind="stable")[: max(int(k), 0)]  # ties: table order
    out = rows.iloc[order].copy()
    out.insert(0, "row", out.index.to_numpy())
    out.insert(0, "rank", np.arange(1, len(out) + 1))
    out["score"] = v[order]
    return out.reset_index(drop=True)


def failure_cases(
    scores: pd.DataFrame,
    detector: str,
    k: int = 12,
    id_class: int | None = None,
    ood_dataset: str | None = None,
    class_names=None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The samples ``detector`` gets most wrong.

    - ``id_false_alarms``: the ``k`` ID test samples with the **highest** scores (most confidently
      flagged as OOD although they are ID), optionally only of true class ``id_class``;
    - ``ood_accepted``: the ``k`` OOD samples with the **lowest** scores (most confidently accepted
      as ID), optionally only of ``ood_dataset``.

    Columns: ``rank`` (1 = worst), ``row`` (row of ``scores``), ``split, dataset, index`` (source
    index, for :func:`oodviz.figures.thumbnails.thumbnails`), ``label, prediction, score`` and, with
    ``class_names``, ``class_name`` (true class; ``"OOD"`` for OOD rows) and ``predicted_name``
    (the class the model gave). ID tables also get ``correct`` (the classifier was right). Ties
    keep table order; NaN scores are left out.
    """
    check_detector(scores, detector)
    keep = list(SCORE_META_COLUMNS)
    id_rows = scores.loc[scores.split == ID_SPLIT, keep + [detector]]
    if id_class is not None:
        id_rows = id_rows[id_rows.label == int(id_class)]
    ood_rows = scores.loc[scores.split == OOD_SPLIT, keep + [detector]]
    if ood_dataset is not None:
        check_ood_dataset(scores, ood_dataset)
        ood_rows = ood_rows[ood_rows.dataset == ood_dataset]
    flagged = _top(id_rows, detector, k, highest=True).drop(columns=detector)
    accepted = _top(ood_rows, detector, k, highest=False).drop(columns=detector)
    flagged["correct"] = flagged.label == flagged.prediction
    if class_names is not None:
        names = [str(c) for c in class_names]

        def name(c: int) -> str:
            return "OOD" if c < 0 else (names[c] if c < len(names) else str(c))

        for table in (flagged, accepted):
            table["class_name"] = [name(int(c)) for c in table.label]
            table["predicted_name"] = [name(int(c)) for c in table.prediction]
    return flagged, accepted


# -- comparing runs -------------------------------------------------------------------------------
COMPARE_COLUMNS = ["detector", "ood_dataset", "auroc_a", "auroc_b", "auroc_delta", "fpr95_a", "fpr95_b", "fpr95_delta"]


@dataclass(frozen=True)
class ResultColumn:
    """A detector's result column in one run, as :func:`compare_runs` matches it: its ``name`` in that run's
    tables, the ``detector`` and the ``layer`` it scores at, ``None`` where the name does not say and the run does
    not either (a plain name of a run over several layers reads only the logits or runs the model: the same at
    every layer; a run known only by its metrics table)."""

    name: str
    detector: str
    layer: str | None

    @property
    def plain(self) -> bool:
        """Named without its layer: ``"mahalanobis"``, not ``"mahalanobis@penultimate"``."""
        return split_column(self.name)[1] is None

    def matches(self, other: ResultColumn) -> bool:
        """The same detector at the same layer, or both plain (two single-layer runs, whatever their layers: the
        config difference says so; a logits detector of a run over several layers)."""
        return self.detector == other.detector and (self.layer == other.layer or (self.plain and other.plain))


def result_columns(names, config: dict | None) -> list[ResultColumn]:
    """Each detector column ``names`` of a run with ``config`` (``None``: unknown) as a :class:`ResultColumn`: a
    plain name of a single-layer run scores at the run's layer (``config["layer"]``, the penultimate features by
    default)."""
    single_layer = config is not None and not config.get("layers")
    run_layer = (config.get("layer") or PENULTIMATE) if single_layer else None
    columns = []
    for name in names:
        detector, layer = split_column(name)
        columns.append(ResultColumn(name, detector, layer if layer is not None else run_layer))
    return columns


@dataclass
class ColumnMatch:
    """Which detector columns of run A and run B :func:`compare_runs` compares: ``pairs`` of (A's name, B's name,
    the name shown: the one that names the layer), and ``unmatched``: one ``{"run", "detector", "why"}`` per
    column of either run with no counterpart, ``run`` ``"A"`` or ``"B"``."""

    pairs: list[tuple[str, str, str]]
    unmatched: list[dict[str, str]]


def _why_unmatched(column: ResultColumn, others: list[ResultColumn], other_run: str) -> str:
    same = [o for o in others if o.detector == column.detector]
    if not same:
        return f"run {other_run} has no {column.detector}"
    layers = ", ".join(sorted({o.layer or "every layer" for o in same}))
    return f"run {other_run} has {column.detector} at {layers}, not at {column.layer or 'its layer'}"


def match_columns(names_a, config_a: dict | None, names_b, config_b: dict | None) -> ColumnMatch:
    """Run A's detector columns against run B's (:meth:`ResultColumn.matches`), in A's order: a single-layer
    run's ``mahalanobis`` (at the penultimate layer) is a run over several layers' ``mahalanobis@penultimate``,
    its ``msp`` the other's ``msp``; whatever cannot be matched is listed with why."""
    a, b = result_columns(names_a, config_a), result_columns(names_b, config_b)
    pairs, used = [], set()
    for column in a:
        match = next((other for other in b if other.name not in used and column.matches(other)), None)
        if match is not None:
            used.add(match.name)
            shown = match.name if column.plain and not match.plain else column.name
            pairs.append((column.name, match.name, shown))
    matched_a = {pair[0] for pair in pairs}
    unmatched = [
        {"run": "A", "detector": c.name, "why": _why_unmatched(c, b, "B")} for c in a if c.name not in matched_a
    ] + [{"run": "B", "detector": c.name, "why": _why_unmatched(c, a, "A")} for c in b if c.name not in used]
    return ColumnMatch(pairs, unmatched)


def _metrics_and_config(results) -> tuple[pd.DataFrame | None, dict | None]:
    if isinstance(results, Results):
        return results.metrics, results.config
    return results, None


def compare_runs(results_a, results_b) -> pd.DataFrame:
    """Metrics of two runs side by side, over the (detector, OOD dataset) pairs both have.

    Arguments are :class:`Results` or ``metrics.csv`` tables. Detectors are matched by :func:`match_columns`
    (with the runs' configs for :class:`Results`: a single-layer run's ``mahalanobis`` against another run's
    ``mahalanobis@penultimate``, shown by the name with the layer); :func:`unmatched_detectors` lists the others.
    Columns ``detector, ood_dataset, auroc_a, auroc_b, auroc_delta, fpr95_a, fpr95_b, fpr95_delta`` with
    ``delta = b - a`` (AUROC: higher is better; FPR95: lower is better), plus ``group`` when both tables have
    it. Rows in run A's order, including the near/far mean rows both runs have. Empty when either run has no
    metrics.
    """
    (a, config_a), (b, config_b) = _metrics_and_config(results_a), _metrics_and_config(results_b)
    if a is None or b is None or not len(a) or not len(b):
        return pd.DataFrame(columns=COMPARE_COLUMNS)
    match = match_columns(a.detector.unique(), config_a, b.detector.unique(), config_b)
    keys = ["detector", "ood_dataset"]
    left = a[a.detector.isin([p[0] for p in match.pairs])].replace({"detector": {p[0]: p[2] for p in match.pairs}})
    right = b[b.detector.isin([p[1] for p in match.pairs])].replace({"detector": {p[1]: p[2] for p in match.pairs}})
    left, right = (side[keys + ["auroc", "fpr95"]].drop_duplicates(keys) for side in (left, right))
    table = left.merge(right, on=keys, how="inner", suffixes=("_a", "_b"), sort=False)
    table["auroc_delta"] = table.auroc_b - table.auroc_a
    table["fpr95_delta"] = table.fpr95_b - table.fpr95_a
    table = table[COMPARE_COLUMNS]
    if "group" in a.columns:
        groups = a.drop_duplicates(["ood_dataset"]).set_index("ood_dataset")["group"]
        table.insert(2, "group", [groups.get(o) for o in table.ood_dataset])
    return table.reset_index(drop=True)


def unmatched_detectors(results_a, results_b) -> list[dict[str, str]]:
    """The detector columns of either run that :func:`compare_runs` could not match, each with why
    (:attr:`ColumnMatch.unmatched`); ``[]`` when either run has no metrics."""
    (a, config_a), (b, config_b) = _metrics_and_config(results_a), _metrics_and_config(results_b)
    if a is None or b is None:
        return []
    return match_columns(a.detector.unique(), config_a, b.detector.unique(), config_b).unmatched


# -- memory ---------------------------------------------------------------------------------------
def memory_timeline(events: list[dict]) -> pd.DataFrame:
    """Memory over time from a run's events (every event carries a memory snapshot).

    Columns: ``time_s`` (seconds since the first event), ``stage``, ``event``, ``cpu_rss_mib``
    and, only when the run reported them (CUDA), ``gpu_allocated_mib``, ``gpu_reserved_mib``,
    ``gpu_peak_mib`` (MiB). Events without ``cpu_rss`` (e.g. the final ``done``) are skipped.
    """
    rows = [e for e in events if isinstance(e, dict) and e.get("cpu_rss") is not None and e.get("time") is not None]
    columns = ["time_s", "stage", "event", "cpu_rss_mib"]
    if not rows:
        return pd.DataFrame(columns=columns)
    start = min(float(e["time"]) for e in rows)
    gpu = [k for k in ("gpu_allocated", "gpu_reserved", "gpu_peak") if any(e.get(k) is not None for e in rows)]
    table = pd.DataFrame(
        {
            "time_s": [float(e["time"]) - start for e in rows],
            "stage": [e.get("stage") for e in rows],
            "event": [e.get("event") for e in rows],
            "cpu_rss_mib": [float(e["cpu_rss"]) / MiB for e in rows],
            **{f"{k}_mib": [math.nan if e.get(k) is None else float(e[k]) / MiB for e in rows] for k in gpu},
        }
    )
    return table.sort_values("time_s", kind="stable").reset_index(drop=True)
