"""Pre-flight: a run's needs against what this machine has, before anything is extracted.

Needs, from the backbone's ``D`` and ``C`` and each split's size ``N``:

- **disk** under the feature store root: the stores still to extract, ``N x (D x b + C x 4 + 24)`` bytes per
  split (``b`` = 4 for float32 features, 2 for float16; :func:`oodviz.models.estimate_memory`), plus head room
  (:func:`store_disk_need`, the same number the run checks before it extracts); knn's bank
  is the id_fit store itself (every row of a run's fit split is in-distribution), no second copy;
- **RAM** of each detector's fit: :meth:`oodviz.detectors.Detector.fit_memory_bytes` (``8 x 2.5 x D^2`` for
  mahalanobis, ``8 x 3.5 x D^2`` for rmd, ...); knn holds one bank chunk, ``chunk_size x D x 4``
  (:func:`knn_fit_memory_bytes`);
- **GPU** memory of the same fits, only when the run's device is CUDA;
- **RAM (and GPU) of one batch through the model**, when the run has model-based detectors (odin, mcd, rankfeat,
  adascale, gram): the extraction batch and each such detector's batch (odin's autograd, mcd's dropout passes),
  measured by a one-batch probe (:mod:`oodviz.pipeline.batchprobe`; in the app, inside the estimate's own process)
  in the run's precision and scaled to the rows the run passes at once: the extraction's ``batch_size``, and for
  each such detector the batch size of its own that the memory allows
  (:func:`~oodviz.pipeline.batchprobe.rows_from_memory`), so that only a detector of which not even one row fits is
  over. Over the limit, the fixes are the largest ``batch_size`` whose extraction batch fits, and leaving out the
  detectors that do not fit at one row.

A run over several layers (``RunConfig.layers``) needs a store per layer and split, and fits each detector that
reads features at every layer (:func:`oodviz.pipeline.layers.detector_columns`): each layer's ``D`` counts, so
its stores and its ``D x D`` fit states are rows of their own (:func:`layer_estimates`).

Available: free disk under the runs root (``shutil.disk_usage``, capped by ``memory_budget_gb`` when set),
``psutil.virtual_memory().available`` and ``torch.cuda.mem_get_info``. Each detector fits on its own, so each
fit is compared with the whole RAM. :func:`preflight` loads the model and the datasets (their sizes only) and
refuses what no machine could run (an unreadable checkpoint, knn's ``k`` above the fit rows, vim's ``dim`` not
below D: :func:`oodviz.config.validation.check_sizes`) and checks that the model's classes are the ID labels
(:mod:`oodviz.pipeline.classifier_check`: a run that fails is refused unless forced, as one over the limits);
:func:`assess` does the arithmetic for a loaded backbone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from oodviz.columns import split_column
from oodviz.config.layers import detector_columns
from oodviz.config.splits import load_split, run_splits, store_key_params
from oodviz.config.validation import CANNOT_START, ConfigError, check_sizes
from oodviz.detectors import detector_class
from oodviz.engine import STORES_DIRNAME
from oodviz.engine.store import find_store, space, store_key
from oodviz.models import CheckpointError, estimate_memory
from oodviz.models.memory import format_bytes, pooling_advice
from oodviz.pipeline import batchprobe
from oodviz.pipeline.batchprobe import EXTRACTION, BatchProbeError, sized
from oodviz.pipeline.classifier_check import ClassifierCheck, check_classifier
from oodviz.pipeline.job import resolve_device
from oodviz.pipeline.layers import backbone_views
from oodviz.problems import Fix, Problem

#: Features wider than this get the detectors with a ``D x D`` state named even when they fit.
WIDE_FEATURES = 16_384
KNN_DEFAULT_CHUNK = 16_384


@dataclass
class Need:
    """One row of the table: ``what`` needs ``needed`` bytes of ``resource`` (disk, RAM, GPU), ``available``."""

    resource: str
    what: str
    needed: int
    available: int
    #: "store", "fit" or "batch" (one batch through the model): which fixes apply
    kind: str = "fit"

    @property
    def over(self) -> bool:
        return self.needed > self.available

    def to_dict(self) -> dict:
        """The row as data (JSON): ``resource, what, needed, available, kind`` and ``over``."""
        return {**asdict(self), "over": self.over}


@dataclass
class Preflight:
    """The needs of a run, the machine's limits, and the fixes when something does not fit."""

    needs: list[Need]
    #: what would make it fit (or, for a run that fits, advice): :class:`~oodviz.problems.Fix` objects
    fixes: list[Fix] = field(default_factory=list)
    estimate: dict = field(default_factory=dict)
    #: whether the model's classes are the ID labels (:mod:`oodviz.pipeline.classifier_check`); None: not checked
    classifier: ClassifierCheck | None = None

    @property
    def over(self) -> list[Need]:
        return [need for need in self.needs if need.over]

    @property
    def fits(self) -> bool:
        return not self.over

    @property
    def classifier_problem(self) -> str | None:
        """:meth:`ClassifierCheck.problem` of the check, when it was made and fails."""
        return self.classifier.problem() if self.classifier is not None else None

    @property
    def startable(self) -> bool:
        """Nothing to refuse: the needs fit and the model's classes are the ID labels (as far as checked)."""
        return self.fits and self.classifier_problem is None

    def table(self) -> str:
        """One line per need: resource, what, needed, available and ``OVER`` when it does not fit."""
        width = max((len(need.what) for need in self.needs), default=4)
        lines = [f"{'':<5} {'need':<{width}}  {'needed':>10}  {'available':>10}"]
        for need in self.needs:
            flag = "  OVER" if need.over else ""
            lines.append(
                f"{need.resource:<5} {need.what:<{width}}  {format_bytes(need.needed):>10}  "
                f"{format_bytes(need.available):>10}{flag}"
            )
        return "\n".join(lines)

    def message(self) -> str:
        """The table and the fixes, for a refusal."""
        text = "This run does not fit on this machine:\n" + self.table()
        if self.fixes:
            text += "\nTo make it fit:\n" + "\n".join(f"- {fix.text}" for fix in self.fixes)
        return text


def knn_fit_memory_bytes(n_features: int, params: dict) -> int:
    """knn's fit holds one bank chunk in RAM, ``chunk_size x D x 4`` bytes (float32); the bank is on disk."""
    return int(params.get("chunk_size", KNN_DEFAULT_CHUNK)) * n_features * 4


def fit_memory_bytes(name: str, params: dict, n_features: int, n_classes: int, n_samples: int) -> int:

    if name in ("knn", "nnguide"):  # nnguide keeps its bank as knn does
        return knn_fit_memory_bytes(n_features, params)
    return int(detector_class(name).fit_memory_bytes(n_features, n_classes, n_samples))


def disk_cap_bytes(config) -> int | None:
    """``memory_budget_gb`` in bytes: an extra cap on the disk the new stores may take (None: no cap)."""
    return None if config.memory_budget_gb is None else int(config.memory_budget_gb * 2**30)


def machine_limits(store_root, device, disk_cap: int | None = None) -> dict[str, int]:
    """``{"disk": free bytes under store_root (at most disk_cap), "ram": available RAM[, "gpu": free]}``."""

    disk = space.free_bytes(store_root)
    limits = {
        "disk": disk if disk_cap is None else min(disk, disk_cap),
        "ram": psutil.virtual_memory().available,
    }
    if device is not None and device.type == "cuda":
        import torch

        limits["gpu"] = int(torch.cuda.mem_get_info(device)[0])
    return limits


def assess(
    config,
    estimate: dict,
    limits: dict[str, int],
    new_splits: list[str] | None = None,
    layers: dict | None = None,
    batches: list | None = None,
) -> Preflight:
    """The needs of ``config`` from its store ``estimate`` (:func:`oodviz.models.estimate_memory`) against
    ``limits`` (:func:`machine_limits`); ``new_splits``: the splits whose store is not there yet (default: all).
    ``layers`` (a run over several layers): layer -> ``(estimate, new splits)`` of that layer's stores
    (:func:`layer_estimates`); ``estimate`` is then the first layer's (the run's main store). ``batches``:
    the measured :class:`~oodviz.pipeline.batchprobe.BatchPeak` of one batch through the model."""
    layers = layers or {None: (estimate, list(estimate["splits"]) if new_splits is None else new_splits)}
    c = int(estimate["num_classes"])
    n_fit = int(estimate["splits"]["id_fit"]["n_samples"])
    stores = {layer: new_store_bytes({layer: part}) for layer, part in layers.items()}
    splits = len(estimate["splits"])
    if len(layers) > 1:  # every layer's stores share the disk: one need, each layer's part named
        parts = "; ".join(
            f"{layer}: D={int(part['feature_dim']):,}, {len(new)}/{splits} splits, {format_bytes(stores[layer])}"
            for layer, (part, new) in layers.items()
        )
        what = f"feature stores, {len(layers)} layers ({parts})"
    else:
        what = f"feature stores ({len(layers[None][1])} of {splits} splits to extract, {estimate['feature_dtype']})"
    needed = store_disk_need(layers)
    what += f" + {format_bytes(needed - sum(stores.values()))} head room"
    needs = [Need("disk", what, needed, limits["disk"], kind="store")]
    dims = {layer: int(layer_estimate["feature_dim"]) for layer, (layer_estimate, _) in layers.items()}
    fits = []  # (result column, bytes, D)
    for column, choice, layer in _fitted_columns(config, layers):
        d = dims[layer]
        fits.append((column, fit_memory_bytes(choice.name, choice.params, d, c, n_fit), d))
    for resource in [r for r in ("ram", "gpu") if r in limits]:
        for column, needed, d in fits:
            if needed:
                needs.append(Need(resource, f"fit {column} (D={d:,}, C={c:,}, N={n_fit:,})", needed, limits[resource]))
    needs += batch_needs(batches or [], limits)
    report = Preflight(needs, estimate=dict(estimate))
    if len(layers) > 1:
        report.estimate["layers"] = {layer: dict(layer_estimate) for layer, (layer_estimate, _) in layers.items()}
    widest = max((part for part, _ in layers.values()), key=lambda part: int(part["feature_dim"]))  # pool it
    report.fixes = fixes(widest, report, fits, limits, dims) + batch_fixes(batches or [], limits)
    return report


def new_store_bytes(layers: dict) -> int:
    """Bytes of the feature stores still to extract: ``layers`` maps a layer (None: a single-layer run) to
    ``(estimate, new splits)`` (:func:`oodviz.models.estimate_memory`, :func:`layer_estimates`)."""
    return sum(int(part["splits"][split]["total_bytes"]) for part, new in layers.values() for split in new)


def store_disk_need(layers: dict) -> int:
    """The free disk a run asks for under its feature store root: :func:`new_store_bytes` plus the head room
    (:func:`oodviz.engine.store.space.margin_for`: headers and ``meta.json`` are not in the estimate). The pre-flight
    (:func:`assess`) and the run's own check before extraction
    (:func:`oodviz.pipeline.stages.check_disk_space`) both compare this with the free space."""

    needed = new_store_bytes(layers)
    return needed + space.margin_for(needed)


def _fitted_columns(config, layers: dict) -> list[tuple]:
    """``(result column, DetectorChoice, key of layers)`` of every fit: per layer for a run over several layers (a
    detector scored on the main store: the first layer's), else each detector once (key None)."""
    if list(layers) == [None]:
        return [(choice.name, choice, None) for choice in config.detectors]

    first = next(iter(layers))
    return [(column, choice, first if layer is None else layer) for column, choice, layer in detector_columns(config)]


def layer_estimates(config, backbone, sizes: dict[str, int], new_splits) -> dict:
    """Layer -> ``(estimate, new splits)`` of its stores, for a run over several layers (``config.layers``; each
    layer a view of ``backbone``, :meth:`~oodviz.models.Backbone.with_layer`, with one probe forward); None for a
    single-layer run. ``new_splits(view)``: the splits whose store of that view is still to extract."""

    if not config.layers:
        return None
    return {
        layer: (estimate_memory(view, sizes, feature_dtype=config.feature_dtype), new_splits(view))
        for layer, view in backbone_views(backbone, config.layers, config.pooling_at).items()
    }


def batch_needs(batches: list, limits: dict[str, int]) -> list[Need]:
    """One row per measured batch (:class:`~oodviz.pipeline.batchprobe.BatchPeak`) and resource: its bytes at the
    rows the run passes at once."""
    needs = []
    for peak in batches:
        what = f"batch of {peak.what} ({peak.rows:,} rows at once)"
        needs.append(Need("ram", what, peak.bytes_at(peak.rows), limits["ram"], kind="batch"))
        if "gpu" in limits and peak.gpu_per_row_bytes is not None:
            needs.append(Need("gpu", what, peak.gpu_bytes_at(peak.rows), limits["gpu"], kind="batch"))
    return needs


def batch_fixes(batches: list, limits: dict[str, int]) -> list[Fix]:
    """For batches over the memory: the largest ``batch_size`` whose extraction batch fits (``fixed + rows x
    per_row`` at most the available RAM, and GPU memory on CUDA), and the model-based detectors to leave out (they
    choose a batch size of their own: over at the rows they chose, they are over at one row)."""
    over = [(peak, peak.rows_fitting(limits["ram"], limits.get("gpu"))) for peak in batches]
    over = [(peak, rows) for peak, rows in over if rows < peak.rows]
    found = []
    for peak, rows in over:
        if peak.what == EXTRACTION and rows >= 1:
            found.append(
                Fix(
                    "batch_size",
                    f"a smaller batch: batch_size={rows:,} or less fits one batch through the model (now {peak.rows:,} rows)",
                    rows,
                )
            )
    detectors = [peak.what for peak, _ in over if peak.what != EXTRACTION]
    if detectors:
        found.append(
            Fix(
                "drop_detectors",
                f"fewer detectors: leave out {', '.join(detectors)} (one batch of it is over the memory)",
                detectors,
            )
        )
    return found


def fixes(
    estimate: dict, report: Preflight, fits: list[tuple], limits: dict[str, int], dims: dict | None = None
) -> list[Fix]:
    """What would make an over-the-limit run fit: pool, another layer (fewer layers, the widest named, for a run
    over several), subsample, float16, fewer detectors; for a run that fits but has ``D > WIDE_FEATURES``, the
    detectors with a ``D x D`` state (a note). ``estimate``: the widest layer's for a run over several (pooling
    it is the fix). ``fits``: ``(result column, bytes, D)``; ``dims``: layer -> D."""
    d, pooled = int(estimate["feature_dim"]), int(estimate.get("pooled_dim") or estimate["feature_dim"])
    widest = max(dim for _, _, dim in fits) if fits else d
    square = sorted({split_column(column)[0] for column, needed, dim in fits if needed >= 8 * dim * dim})
    wide_note = Fix(
        "advice", f"at D={widest:,} the D x D state of {', '.join(square)} is large: pool or leave them out"
    )
    if report.fits:
        return [wide_note] if widest > WIDE_FEATURES and square else []
    if all(need.kind == "batch" for need in report.over):  # the store and the fits are fine: batch_fixes
        return []
    found = []
    if estimate.get("pooling") == "none" and pooled < d:  # value None: the model's own pooling (Fix.apply)
        found.append(Fix("pooling", f"pool the features: {pooling_advice(estimate)}", None))
    found.append(
        Fix("advice", "choose another layer with a smaller D (an earlier or narrower one, or the penultimate layer)")
    )
    if dims and len(dims) > 1:
        layer, dim = max(dims.items(), key=lambda item: item[1])
        found.append(Fix("drop_layer", f"fewer layers: the widest is {layer} (D={dim:,})", layer))
    # fewer rows and float16 shrink the stores, not a fit's state (its size is set by D and C): offered only when a
    # store is over, so that a fix always clears the row it is offered for
    store_over = any(need.kind == "store" for need in report.over)
    largest = max(estimate["splits"].items(), key=lambda item: item[1]["total_bytes"])
    largest_n = int(largest[1]["n_samples"])
    if store_over:
        found.append(
            Fix(
                "subsample",
                f"subsample the largest splits ({largest[0]}: {largest_n:,} samples)",
                max(largest_n // 2, 1),
            )
        )
    if store_over and estimate["feature_dtype"] == "float32":
        found.append(Fix("feature_dtype", "feature_dtype='float16' halves the features on disk", "float16"))
    memory = min(limits["ram"], limits.get("gpu", limits["ram"]))
    too_big = [column for column, needed, _ in fits if needed > memory]
    if too_big:
        names = list(dict.fromkeys(split_column(column)[0] for column in too_big))
        at = max(dim for column, needed, dim in fits if needed > memory)
        found.append(
            Fix(
                "drop_detectors",
                f"fewer detectors: leave out {', '.join(names)} (the fit state is over the memory at D={at:,})",
                names,
            )
        )
    elif widest > WIDE_FEATURES and square:
        found.append(wide_note)
    return found


def splits_to_extract(config, backbone, datasets: dict, chosen: list, store_root) -> list[str]:
    """The splits of ``chosen`` (``(split, dataset choice, as OOD)``) with no finished store under ``store_root``."""

    return [
        split
        for split, choice, _ in chosen
        if find_store(
            store_root,
            store_key(
                backbone,
                datasets[split],
                store_key_params(config, choice),
                feature_dtype=config.feature_dtype,
                precision=config.precision,
            ),
        )
        is None
    ]


def preflight(config, runs_root) -> Preflight:
    """:func:`assess` for ``config`` run under ``runs_root``: loads the backbone (one probe forward) and opens the
    datasets for their sizes; stores already under ``runs_root/.features`` cost no disk. Raises
    :class:`~oodviz.config.validation.ConfigError` for what no run of ``config`` can get past: a checkpoint that cannot
    be read or has other shapes (:class:`~oodviz.models.CheckpointError`), detector parameters the data's sizes rule
    out (:func:`~oodviz.config.validation.check_sizes`). With model-based
    detectors, one batch of the extraction and of each of them is measured
    (:func:`oodviz.pipeline.batchprobe.batch_peaks`), when the stores and the fits fit (a refusal for those comes
    first, without the cost of running the model); the report's ``estimate`` gets ``batch_peaks`` (each
    :class:`~oodviz.pipeline.batchprobe.BatchPeak` as a dict, a model-based detector's ``rows`` the batch size it gets
    within these limits, :func:`~oodviz.pipeline.batchprobe.sized`) and ``batch_probe_failed`` (what could not be
    measured, and why)."""

    try:
        backbone = config.load_backbone()
    except CheckpointError as error:  # no run can start from this file
        raise ConfigError([Problem(str(error), "checkpoint")], CANNOT_START) from None
    chosen = run_splits(config)
    datasets = {split: load_split(config, choice, as_ood, backbone.classes) for split, choice, as_ood in chosen}
    store_root = Path(runs_root) / STORES_DIRNAME
    sizes = {s: len(ds) for s, ds in datasets.items()}
    problems = check_sizes(config, sizes["id_fit"], backbone.feature_dim, backbone.num_classes)
    if problems:
        raise ConfigError(problems, CANNOT_START)
    classifier = check_classifier(backbone, datasets["id_fit"], config.seed, [datasets["id_test"].classes])
    layers = layer_estimates(
        config, backbone, sizes, lambda view: splits_to_extract(config, view, datasets, chosen, store_root)
    )
    if layers:  # the first layer's store is the run's main one
        estimate, new = next(iter(layers.values()))
    else:
        estimate = estimate_memory(backbone, sizes, feature_dtype=config.feature_dtype)
        new = splits_to_extract(config, backbone, datasets, chosen, store_root)
    limits = machine_limits(store_root, resolve_device(config.device), disk_cap_bytes(config))
    report = assess(config, estimate, limits, new, layers)
    batches, failed = [], {}
    model_based = any(detector_class(choice.name).needs_model for choice in config.detectors)
    if model_based and not report.fits:  # refused already: the batches are measured once the stores and the fits fit
        failed = {"batch probe": "not run, the feature stores or the fits are over the limit already"}
    elif model_based:
        try:
            batches, failed = batchprobe.batch_peaks(config, backbone, datasets["id_fit"])
        except BatchProbeError as error:  # the store and fit checks stand without it
            failed = {"batch probe": str(error)}
        batches = sized(batches, limits)
        report = assess(config, estimate, limits, new, layers, batches)
    report.classifier = classifier
    report.estimate.update(
        batch_peaks=[asdict(peak) for peak in batches],
        batch_probe_failed=failed,
        classifier_problem=report.classifier_problem,
    )
    return report
