"""A run's results: the schema of its tables, every table derived from the scores, and loading them.

The worker (:mod:`oodviz.pipeline.stages`), the CLI and the app all build and read the result files
with this module, so each table is computed in one place. Files in a run directory:

- ``scores.parquet``: one row per sample of every scored split: ``split`` (``id_test`` or
  ``ood``), ``dataset``, ``index`` (the sample's *source index* in its dataset, as stored by the
  engine), ``label`` (-1 for OOD), ``prediction``, and one float column per fitted detector (in a run
  over several layers, ``"<detector>@<layer>"`` for those scored per layer: :mod:`oodviz.results.layers`);
- ``metrics.csv`` (:func:`metrics_table`): one row per detector and OOD dataset, then one per
  detector and near/far group (the mean over that group's datasets, ``ood_dataset`` =
  ``"near (mean)"``): ``detector, ood_dataset, group, auroc, aupr_in, aupr_out, fpr95,
  id_accuracy, aurc, risk_at_95_coverage, threshold`` (``aurc`` and ``risk_at_95_coverage``: the
  detector's score as a reject rule for the classifier on the ID test set, :func:`selective_metrics`;
  the same on every row of a detector);
- ``per_class.csv`` (:func:`per_class_table`): per detector and ID class, the false alarms at
  the threshold that flags 95% of all OOD samples pooled: ``detector, class, class_name, n,
  accuracy, false_alarms, false_alarm_rate, mean_score, threshold``;
- ``detectors.json``: each detector's parameters, fit time and, when it failed, its error and
  traceback; ``meta.json``: versions, device, the splits, how each was sampled and their stores, wall time
  and peak memory per stage (:func:`sampling_table`); plus the run's ``config.json``, ``status.json`` and ``events.jsonl``.

Convention everywhere: **OOD is the positive class; higher score = more OOD.** A sample is
*flagged* (called OOD) when ``score >= threshold``; a flagged ID sample is a **false alarm**.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from oodviz.files import read_json_object, write_atomic
from oodviz.results.metrics import RECALL_LEVEL, aurc, ood_metrics, risk_at_coverage, risk_coverage, threshold_at_recall
from oodviz.runs.rundir import RunDir
from oodviz.sampling import Sampling

ID_SPLIT = "id_test"
OOD_SPLIT = "ood"
#: columns of ``scores.parquet`` that are not detector scores
SCORE_META_COLUMNS = ("split", "dataset", "index", "label", "prediction")
METRIC_NAMES = ("auroc", "aupr_in", "aupr_out", "fpr95")
#: selective classification on the ID test set, per detector (:func:`selective_metrics`)
SELECTIVE_NAMES = ("aurc", "risk_at_95_coverage")
METRICS_COLUMNS = ("detector", "ood_dataset", "group", *METRIC_NAMES, "id_accuracy", *SELECTIVE_NAMES, "threshold")
#: each metric of ``metrics.csv`` as tables show it to people (the app's metrics table, the HTML report)
METRIC_HEADINGS = {
    "auroc": "AUROC",
    "aupr_in": "AUPR-In",
    "aupr_out": "AUPR-Out",
    "fpr95": "FPR95",
    "id_accuracy": "ID accuracy",
    "aurc": "AURC",
    "risk_at_95_coverage": "risk at 95% coverage",
}
#: how a metric is printed: three decimals (AUROC 0.957), and AURC and risk, small where the classifier rarely errs, to
#: three significant digits (0.000123 is not 0.000, a perfect score); :func:`metric_format` picks by heading
METRIC_FORMAT = "{:.3f}"
SELECTIVE_FORMAT = "{:.3g}"
SELECTIVE_HEADINGS = tuple(METRIC_HEADINGS[name] for name in SELECTIVE_NAMES)


def metric_format(heading: str) -> str:
    """The format of a metrics column headed ``heading`` (``"AURC"``, ``"AUROC near"``...): :data:`SELECTIVE_FORMAT`
    for AURC and risk, else :data:`METRIC_FORMAT`."""
    return SELECTIVE_FORMAT if str(heading).startswith(SELECTIVE_HEADINGS) else METRIC_FORMAT


PER_CLASS_COLUMNS = ("class", "class_name", "n", "accuracy", "false_alarms", "false_alarm_rate", "mean_score")
#: ``per_class.csv``: :data:`PER_CLASS_COLUMNS` of every detector, with the threshold they were counted at
PER_CLASS_FILE_COLUMNS = ("detector", *PER_CLASS_COLUMNS, "threshold")
GROUP_MEAN_SUFFIX = " (mean)"
#: the columns a result file must have to be read (:func:`read_table`)
TABLE_COLUMNS = {
    "metrics.csv": tuple(c for c in METRICS_COLUMNS if c not in SELECTIVE_NAMES),  # runs from before them stay readable
    "per_class.csv": PER_CLASS_FILE_COLUMNS,
    "scores.parquet": SCORE_META_COLUMNS,
}


# -- the scores table -------------------------------------------------------------------------------
def score_frame(split: str, dataset: str, indices, labels, predictions) -> pd.DataFrame:
    """The :data:`SCORE_META_COLUMNS` of one scored split (``split``: :data:`ID_SPLIT` or
    :data:`OOD_SPLIT`); the detectors' score columns are added to it one by one."""
    if split not in (ID_SPLIT, OOD_SPLIT):
        raise ValueError(f"split must be {ID_SPLIT!r} or {OOD_SPLIT!r}, got {split!r}")
    return pd.DataFrame(
        {
            "split": split,
            "dataset": dataset,
            "index": np.asarray(indices),
            "label": np.asarray(labels),
            "prediction": np.asarray(predictions),
        }
    )


def detectors_of(scores: pd.DataFrame) -> list[str]:
    """Detector score columns of ``scores``, in table order."""
    return [c for c in scores.columns if c not in SCORE_META_COLUMNS]


def ood_datasets_of(scores: pd.DataFrame) -> list[str]:
    """OOD datasets of ``scores`` in the order of the run config (order of first appearance)."""
    return list(pd.unique(scores.loc[scores.split == OOD_SPLIT, "dataset"]))


def id_dataset_of(scores: pd.DataFrame) -> str:
    """The name of the ID test dataset (``"ID"`` when the table has no ID rows)."""
    names = pd.unique(scores.loc[scores.split == ID_SPLIT, "dataset"])
    return str(names[0]) if len(names) else "ID"


def check_detector(scores: pd.DataFrame, detector: str) -> None:
    """ValueError naming the run's detectors when ``scores`` has no column for ``detector``."""
    if detector not in scores.columns or detector in SCORE_META_COLUMNS:
        known = ", ".join(detectors_of(scores)) or "none"
        raise ValueError(f"No scores for detector {detector!r}; this run has: {known}")


def check_ood_dataset(scores: pd.DataFrame, ood_dataset: str) -> None:
    """ValueError naming the run's OOD datasets when ``scores`` has no OOD rows of ``ood_dataset``."""
    if ood_dataset not in ood_datasets_of(scores):
        raise ValueError(f"No OOD dataset {ood_dataset!r} in this run; it has: {', '.join(ood_datasets_of(scores))}")


def score_values(rows: pd.DataFrame, detector: str) -> np.ndarray:
    """``detector``'s scores of ``rows`` as float64 ``[len(rows)]``."""
    return rows[detector].to_numpy(dtype=np.float64)


def default_threshold(
    scores: pd.DataFrame, detector: str, ood_dataset: str | None = None, recall: float = RECALL_LEVEL
) -> float:
    """The highest threshold that flags at least ``recall`` of the OOD samples (``score >= t``).

    ``ood_dataset=None`` pools every OOD dataset (the threshold of ``per_class.csv``); a name uses
    that dataset only (the ``threshold`` column of ``metrics.csv``).
    """
    check_detector(scores, detector)
    ood = scores.split == OOD_SPLIT
    if ood_dataset is not None:
        check_ood_dataset(scores, ood_dataset)
        ood &= scores.dataset == ood_dataset
    # the one score column of those rows, not a filtered copy of the whole table
    return threshold_at_recall(score_values(scores, detector)[ood.to_numpy()], recall)


# -- metrics.csv ------------------------------------------------------------------------------------
def group_mean_name(group: str) -> str:
    """The ``ood_dataset`` of a group's mean row: ``"near (mean)"``."""
    return f"{group}{GROUP_MEAN_SUFFIX}"


def is_group_mean(metrics: pd.DataFrame) -> pd.Series:
    """Boolean mask of the near/far mean rows of a ``metrics.csv`` table."""
    return metrics.ood_dataset.str.endswith(GROUP_MEAN_SUFFIX)


def metrics_table(scores: pd.DataFrame, groups: dict[str, str]) -> pd.DataFrame:
    """``metrics.csv``: :func:`oodviz.results.metrics.ood_metrics` of each detector of ``scores`` for the ID
    test set against each OOD dataset, then per detector the mean of each metric over each group.

    ``groups``: OOD dataset -> ``"near"`` / ``"far"``. ``id_accuracy`` is the classifier's accuracy
    on the ID test set (the same on every row); ``aurc`` and ``risk_at_95_coverage`` the detector's
    :func:`selective_metrics` (the same on each of its rows); ``threshold`` is the dataset's
    :func:`default_threshold` (NaN on the mean rows). Columns :data:`METRICS_COLUMNS`; rows by
    detector in table order, datasets in run order, then the groups in alphabetical order.
    """
    id_rows = scores[scores.split == ID_SPLIT]
    id_accuracy = float((id_rows.label == id_rows.prediction).mean())
    rows = []
    for detector in detectors_of(scores):
        selective = selective_metrics(scores, detector)
        per_dataset = [
            {
                "detector": detector,
                "ood_dataset": dataset,
                "group": groups[dataset],
                **ood_metrics(score_values(id_rows, detector), score_values(ood_rows, detector)),
                "id_accuracy": id_accuracy,
                **selective,
                "threshold": threshold_at_recall(score_values(ood_rows, detector)),
            }
            for dataset, ood_rows in scores[scores.split == OOD_SPLIT].groupby("dataset", sort=False)
        ]
        rows += per_dataset
        for group, members in pd.DataFrame(per_dataset).groupby("group", sort=True):
            rows.append(
                {
                    "detector": detector,
                    "ood_dataset": group_mean_name(group),
                    "group": group,
                    **members[list(METRIC_NAMES)].mean().to_dict(),
                    "id_accuracy": id_accuracy,
                    **selective,
                    "threshold": np.nan,
                }
            )
    return pd.DataFrame(rows, columns=list(METRICS_COLUMNS))


#: the fewest classifier errors on the ID test set for AURC and risk at coverage to rank detectors: below it a
#: detector's reject order is judged on a handful of samples (2 errors in 362: eleven detectors at AURC 0.000)
MIN_CLASSIFIER_ERRORS = 20


def misclassified(id_rows: pd.DataFrame) -> np.ndarray:
    """bool ``[n]``: the classifier is wrong on each of ``id_rows`` (``prediction != label``, the stored ones)."""
    return id_rows.prediction.to_numpy() != id_rows.label.to_numpy()


def classifier_errors(scores: pd.DataFrame) -> tuple[int, int]:
    """``(errors, n)``: the ID test samples the classifier gets wrong (:func:`misclassified`) and the ID test
    samples, the counts that AURC and risk at coverage (:func:`selective_metrics`) rest on."""
    id_rows = scores[scores.split == ID_SPLIT]
    return int(misclassified(id_rows).sum()), len(id_rows)


def classifier_errors_note(scores: pd.DataFrame) -> tuple[str, bool]:
    """What AURC and risk at coverage rest on, as a sentence, and whether they can rank detectors (at least
    :data:`MIN_CLASSIFIER_ERRORS` classifier errors on the ID test set)."""
    errors, n = classifier_errors(scores)
    rests = f"AURC and risk at 95% coverage rest on the classifier's {errors:,} errors among {n:,} ID test images"
    if errors >= MIN_CLASSIFIER_ERRORS:
        return f"{rests}.", True
    return f"{rests}: fewer than {MIN_CLASSIFIER_ERRORS}, too few to rank detectors by.", False


#: the columns of :func:`sampling_table`
SAMPLING_COLUMNS = ("split", "dataset", "images", "classes without an image")


def sampling_table(meta: dict | None) -> pd.DataFrame:
    """How each split of a run was taken from its dataset, read from its ``meta.json`` (``splits``; a run from
    before splits recorded it gives no row): :data:`SAMPLING_COLUMNS`, ``images`` being
    :meth:`~oodviz.sampling.Sampling.describe` (mode, seed, N of M)."""
    rows = []
    for split, entry in ((meta or {}).get("splits") or {}).items():
        if entry.get("sampling"):
            sampling = Sampling(**entry["sampling"])
            rows.append((split, entry.get("dataset"), sampling.describe(), ", ".join(sampling.empty_classes)))
    return pd.DataFrame(rows, columns=list(SAMPLING_COLUMNS))


def selective_curve(scores: pd.DataFrame, detector: str) -> dict[str, np.ndarray]:
    """:func:`oodviz.results.metrics.risk_coverage` of ``detector`` on the ID test rows: the classifier's error rate
    (``prediction != label``, from the stored predictions) among the samples accepted (``score <= t``)."""
    check_detector(scores, detector)
    id_rows = scores[scores.split == ID_SPLIT]
    return risk_coverage(score_values(id_rows, detector), misclassified(id_rows))


def selective_metrics(scores: pd.DataFrame, detector: str) -> dict[str, float]:
    """``{"aurc", "risk_at_95_coverage"}`` of :func:`selective_curve` (lower is better for both)."""
    curve = selective_curve(scores, detector)
    return {"aurc": aurc(curve), "risk_at_95_coverage": risk_at_coverage(curve)}


def group_means(metrics: pd.DataFrame, values=METRIC_NAMES) -> pd.DataFrame:
    """The group mean rows of ``metrics.csv`` side by side: one row per detector (table order), one
    column per ``(metric, group)`` of ``values``."""
    wide = metrics[is_group_mean(metrics)].pivot(index="detector", columns="group", values=list(values))
    return wide.reindex([d for d in metrics.detector.unique() if d in wide.index])


def best_detector(metrics: pd.DataFrame) -> dict:
    """``best_detector`` with the highest AUROC averaged over the OOD datasets (not the group
    means), its ``best_auroc`` and ``best_fpr95`` (the mean FPR95 over the same datasets)."""
    means = metrics[~is_group_mean(metrics)].groupby("detector")[["auroc", "fpr95"]].mean()
    best = means.auroc.idxmax()
    return {"best_detector": best, "best_auroc": float(means.auroc[best]), "best_fpr95": float(means.fpr95[best])}


# -- per_class.csv ----------------------------------------------------------------------------------
def per_class_at_threshold(
    scores: pd.DataFrame, detector: str, threshold: float, class_names=None, worst_first: bool = True
) -> pd.DataFrame:
    """Per true ID class: how many of its test samples ``detector`` flags as OOD (``score >= threshold``).

    Columns :data:`PER_CLASS_COLUMNS`: ``class, class_name`` (``class_names[class]``, else the
    number), ``n``, ``accuracy`` (of the classifier), ``false_alarms``, ``false_alarm_rate``
    (``false_alarms / n``), ``mean_score`` (float64 mean). One row per class present in the ID test
    set, ``worst_first``: by ``false_alarm_rate``, highest first (ties by class), else by class.
    """
    check_detector(scores, detector)
    class_names = list(class_names or [])
    # counted per class with bincount over the ID rows (a groupby copies each class's rows)
    id_rows = scores.split.to_numpy() == ID_SPLIT
    labels = scores.label.to_numpy()[id_rows].astype(np.int64)
    values = score_values(scores, detector)[id_rows]
    classes, codes = np.unique(labels, return_inverse=True)
    n = np.bincount(codes, minlength=classes.size)
    correct = np.bincount(codes, weights=labels == scores.prediction.to_numpy()[id_rows], minlength=classes.size)
    flagged = np.bincount(codes, weights=values >= float(threshold), minlength=classes.size).astype(np.int64)
    # each class's mean by numpy's own (pairwise) sum, as a per-class mean gives it, to the last bit
    by_class = np.split(values[np.argsort(codes, kind="stable")], np.cumsum(n)[:-1]) if classes.size else []
    means = [float(part.mean()) for part in by_class]
    rows = [
        {
            "class": label,
            "class_name": class_names[label] if 0 <= label < len(class_names) else str(label),
            "n": int(size),
            "accuracy": right / size,
            "false_alarms": int(alarms),
            "false_alarm_rate": alarms / size,
            "mean_score": mean,
        }
        for label, size, right, alarms, mean in zip(
            classes.tolist(), n.tolist(), correct.tolist(), flagged.tolist(), means
        )
    ]
    table = pd.DataFrame(rows, columns=list(PER_CLASS_COLUMNS))
    if worst_first:
        table = table.sort_values(["false_alarm_rate", "class"], ascending=[False, True], kind="stable")
    return table.reset_index(drop=True)


def per_class_table(scores: pd.DataFrame, class_names) -> pd.DataFrame:
    """``per_class.csv``: :func:`per_class_at_threshold` of every detector of ``scores`` at its
    pooled :func:`default_threshold`, rows by detector then class; columns :data:`PER_CLASS_FILE_COLUMNS`."""
    tables = []
    for detector in detectors_of(scores):
        threshold = default_threshold(scores, detector)
        table = per_class_at_threshold(scores, detector, threshold, class_names, worst_first=False)
        tables.append(table.assign(detector=detector, threshold=threshold))
    if not tables:
        return pd.DataFrame(columns=list(PER_CLASS_FILE_COLUMNS))
    return pd.concat(tables, ignore_index=True)[list(PER_CLASS_FILE_COLUMNS)]


def class_names_of(per_class: pd.DataFrame | None) -> list[str]:
    """Class names (index = label) from a ``per_class`` table; labels it lacks are named by number."""
    if per_class is None or not len(per_class) or "class" not in per_class:
        return []
    names = per_class.drop_duplicates("class").set_index("class")["class_name"]
    top = int(names.index.max())
    return [str(names[c]) if c in names.index else str(c) for c in range(top + 1)]


# -- files ------------------------------------------------------------------------------------------
def write_table(path: Path, frame: pd.DataFrame) -> None:
    """CSV or Parquet by suffix, written atomically."""
    buffer = io.BytesIO()
    if Path(path).suffix == ".parquet":
        frame.to_parquet(buffer, index=False)
    else:
        frame.to_csv(buffer, index=False)
    write_atomic(path, buffer.getvalue())


#: what :func:`read_table_checked` and :func:`scores_file_problem` say of a result file that is not there
MISSING = "is missing"


def _unreadable(path: Path) -> str:
    """What is said of a result file that cannot be parsed."""
    return f"is not a readable {'Parquet' if path.suffix == '.parquet' else 'CSV'} table (truncated or damaged)"


def _lacking(found, columns) -> str | None:
    missing = [c for c in columns if c not in set(found)]
    return f"lacks the column(s) {', '.join(missing)}" if missing else None


def read_table_checked(path: Path, columns=()) -> tuple[pd.DataFrame | None, str | None]:
    """``(the CSV or Parquet table in path (by suffix), None)``, or ``(None, what is wrong)`` when it is missing,
    cannot be parsed or lacks one of ``columns`` (a result file's: :data:`TABLE_COLUMNS`); what is wrong is said
    of the file: ``"is missing"``, ``"is not a readable Parquet table (truncated or damaged)"``, ``"lacks the
    column(s) ..."``. Never raises."""
    path = Path(path)
    if not path.exists():
        return None, MISSING
    try:
        table = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except Exception:  # an unreadable or empty table is reported as what is wrong, not as a crash of the page
        return None, _unreadable(path)
    problem = _lacking(table.columns, columns)
    return (None, problem) if problem else (table, None)


def read_table(path: Path, columns=()) -> pd.DataFrame | None:
    """:func:`read_table_checked`'s table: ``None`` when it is missing, cannot be parsed or lacks one of ``columns``."""
    return read_table_checked(path, columns)[0]


def read_result_table(run_dir: Path, name: str) -> pd.DataFrame | None:
    """The result table ``name`` of a run (``metrics.csv``, ``per_class.csv``, ``scores.parquet``), or
    ``None`` when it is missing or damaged (not parsed, or without the schema's columns)."""
    return read_table(Path(run_dir) / name, TABLE_COLUMNS[name])


def scores_file_problem(run_dir: Path) -> str | None:
    """What is wrong with a run's ``scores.parquet`` as far as its footer tells (missing, truncated, not Parquet,
    without the :data:`SCORE_META_COLUMNS`), said of the file as by :func:`read_table_checked`; None when nothing
    is. A check cheap enough for a list of runs: it reads no rows."""
    path = Path(run_dir) / "scores.parquet"
    if not path.exists():
        return MISSING
    try:
        schema = pq.read_schema(path)
    except Exception:  # pyarrow's ArrowInvalid, an OSError: the file cannot be what the run wrote
        return _unreadable(path)
    return _lacking(schema.names, SCORE_META_COLUMNS)


class ResultsFileError(ValueError):
    """A finished (``done``) run's result file that cannot be read: ``path``, the file, and ``problem``, what is
    wrong with it (:func:`read_table_checked`: ``"is missing"``, ...). The fix is to run the config again."""

    def __init__(self, path: Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(
            f"the results file {self.path} {problem}; run the run's config again for new results "
            f"(oodviz run {self.path.parent / 'config.json'})"
        )


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``; ``None`` when it is missing, cannot be parsed or is not an object."""
    value, problem = read_json_object(path)
    return None if problem else value


@dataclass
class Results:
    """Everything a run directory holds; a file that does not exist (yet) is ``None``.

    - ``path``: the run directory;
    - ``config``: ``config.json`` (the RunConfig as a dict; ``{}`` when missing);
    - ``status``: ``status.json`` (``{"state", "stage", "error", ...}``);
    - ``metrics``: ``metrics.csv`` (detector x OOD dataset: auroc, aupr_in, aupr_out, fpr95, ...);
    - ``scores``: ``scores.parquet`` (one row per sample, one column per detector);
    - ``per_class``: ``per_class.csv`` (detector x ID class false alarms at 95% OOD recall);
    - ``meta``: ``meta.json``; ``detectors``: ``detectors.json`` (params, fit time, errors);
    - ``events``: the parsed ``events.jsonl`` (``[]`` when missing);
    - ``unreadable``: result table name -> what is wrong with it (:func:`read_table_checked`), for each of
      ``metrics``, ``scores`` and ``per_class`` that is ``None`` (also a file not written yet: ``"... is missing"``).
    """

    path: Path
    config: dict = field(default_factory=dict)
    status: dict = field(default_factory=dict)
    metrics: pd.DataFrame | None = None
    scores: pd.DataFrame | None = None
    per_class: pd.DataFrame | None = None
    meta: dict | None = None
    detectors: dict | None = None
    events: list = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)

    @property
    def state(self) -> str | None:
        return self.status.get("state")

    def check_results(self, *names: str) -> None:
        """:class:`ResultsFileError` for the first of the result tables ``names`` (``"scores.parquet"``, ...) that a
        ``done`` run lacks or cannot be read; nothing for a run in another state (not finished: no results yet)."""
        for name in names:
            if self.state == "done" and name in self.unreadable:
                raise ResultsFileError(self.path / name, self.unreadable[name])

    @property
    def finished(self) -> bool:
        """True when the run's results are complete (state ``done`` and the scores written)."""
        return self.state == "done" and self.scores is not None

    @property
    def class_names(self) -> list[str]:
        """ID class names, index = label, as recorded in ``per_class.csv`` (``[]`` when unknown)."""
        return class_names_of(self.per_class)


def load_results(run_dir) -> Results:
    """Read a run directory, finished or not, never raising: each missing or unreadable file gives ``None``
    (``config``: ``{}``; ``status``: state ``damaged`` with the reason, :meth:`RunDir.read_status`)."""
    path = Path(run_dir)
    run = RunDir(path)
    tables = {name: read_table_checked(path / name, columns) for name, columns in TABLE_COLUMNS.items()}
    return Results(
        path=path,
        config=read_json(run.config_path) or {},
        status=run.read_status(),
        metrics=tables["metrics.csv"][0],
        scores=tables["scores.parquet"][0],
        per_class=tables["per_class.csv"][0],
        meta=read_json(path / "meta.json"),
        detectors=read_json(path / "detectors.json"),
        events=run.read_events(),
        unreadable={name: problem for name, (_, problem) in tables.items() if problem is not None},
    )
