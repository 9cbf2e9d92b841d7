"""OpenOOD v1.5's benchmarks as oodviz runs, and their figures beside the published leaderboard's.

``oodviz bench openood-v1.5 <benchmark> --data-root DIR --checkpoint CKPT [CKPT ...]`` (:func:`oodviz.cli.cmd_bench`)
runs, for each checkpoint (OpenOOD publishes three training seeds per benchmark), one ordinary oodviz run made by
:func:`benchmark_config`:

- the backbone: the benchmark's network (:data:`oodviz.models.OPENOOD_NETWORKS`: OpenOOD's ResNet-18 at 32 x 32
  for CIFAR-10/100, at 224 x 224 for ImageNet-200, torchvision's ResNet-50 for ImageNet-1k) with the checkpoint,
  and OpenOOD's test preprocessing of the benchmark (``preprocessing = "openood:<benchmark>"``);
- the data, from a data root in OpenOOD's layout (:mod:`oodviz.data.openood`): the detectors fitted on the ID
  training list (``id_train``, as OpenOOD's postprocessors' ``setup`` reads it), scored on the ID test list and
  on every near- and far-OOD test list, each OOD set titled with OpenOOD's name for it (``tin``, ``ssb_hard``)
  and put in its group; with ``tune``, each detector's grid is tried on OpenOOD's validation lists (``id_val``
  and ``ood_val``, as its automatic parameter search does);
- the detectors given, else the backbone family's defaults.

Before any work, :func:`benchmark_problems` checks every list file the runs read and every image each one names
(:func:`oodviz.data.openood.layout_problems`). :func:`bench_table` then averages each detector's figures over the
runs (mean, and the population standard deviation as OpenOOD's ``scripts/eval_ood.py`` takes it, ``np.std``) and
sets them beside the leaderboard's (:func:`oodviz.results.leaderboard.compare`).

Figures differ from the leaderboard's where oodviz's detectors compute their paper's formula and OpenOOD's
postprocessors a variant (the detectors' docstrings say where), where hyper-parameters differ (oodviz's defaults,
or its grids with ``tune``, against OpenOOD's tuned values), and for other checkpoints than OpenOOD's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from oodviz import models
from oodviz.config.run import OPENOOD_PREPROCESSING, DatasetChoice, DetectorChoice, RunConfig
from oodviz.data.openood import OpenOODSet, benchmark_splits, layout_problems
from oodviz.results.leaderboard import LEADERBOARD_METRICS, compare, run_figures

#: the protocols ``oodviz bench`` runs
PROTOCOLS = ("openood-v1.5",)


def _choice(openood_set: OpenOODSet) -> DatasetChoice:
    params = {"benchmark": openood_set.benchmark, "split": openood_set.split}
    if openood_set.group is None:
        return DatasetChoice("openood", params)
    return DatasetChoice("openood", params, group=openood_set.group, title=openood_set.name)


def benchmark_config(
    benchmark: str,
    data_root: str | Path,
    checkpoint: str | Path | None,
    *,
    weights: str = "default",
    detectors: list[str] | None = None,
    tune: bool = False,
    **settings,
) -> RunConfig:
    """The run of OpenOOD v1.5's ``benchmark`` (``cifar10``, ``cifar100``, ``imagenet200``, ``imagenet``) over the
    data root ``data_root`` with the network's ``checkpoint`` (None with ``weights="random"``: a dry run), as the
    module's docstring describes. ``detectors``: their names (None: the backbone family's defaults); ``tune``: tune
    each on OpenOOD's validation lists; ``settings``: other :class:`RunConfig` fields (``device``,
    ``batch_size``, ``protocol``: ``"openood"`` for OpenOOD's variants, ...). Not validated: call ``validate()``."""

    sets = benchmark_splits(benchmark)
    role = {s.role: s for s in sets if s.role in ("id_train", "id_val", "id_test", "ood_val")}
    network = models.OPENOOD_NETWORKS[sets[0].benchmark]
    config = RunConfig(
        backbone=network.backbone,
        weights=weights,
        checkpoint=None if checkpoint is None else str(checkpoint),
        preprocessing=OPENOOD_PREPROCESSING + sets[0].benchmark,
        data_root=str(data_root),
        id_fit=_choice(role["id_train"]),
        id_test=_choice(role["id_test"]),
        ood=[_choice(s) for s in sets if s.role in ("near", "far")],
        id_val=_choice(role["id_val"]) if tune else None,
        ood_val=_choice(role["ood_val"]) if tune else None,
        **settings,
    )
    if detectors is not None:
        config.detectors = [DetectorChoice(name) for name in detectors]
    return config.apply_protocol()


def benchmark_problems(config: RunConfig) -> list:
    """What is missing or malformed in the data root of a :func:`benchmark_config` run, before any work: every list
    file it reads and every image those name (:class:`oodviz.data.openood.LayoutProblem`, each naming its set and
    OpenOOD's download-script archive for it)."""
    choices = [config.id_fit, config.id_test, *config.ood, config.id_val, config.ood_val]
    openood = [choice for choice in choices if choice is not None and choice.name == "openood"]
    if not openood:
        return []
    benchmark = openood[0].params["benchmark"]
    return layout_problems(config.data_root, benchmark, [choice.params["split"] for choice in openood])


def bench_table(runs: list[str | Path], benchmark: str, arch: str | None = None) -> pd.DataFrame:
    """The finished ``runs`` of one benchmark (one per checkpoint) beside the leaderboard's figures: each detector's
    figures (:data:`~oodviz.results.leaderboard.LEADERBOARD_METRICS`, percent) averaged over the runs, as
    :func:`~oodviz.results.leaderboard.compare` gives them (``m_ours``, ``m_published``, ``m_published_std``,
    ``m_diff``), with ``m_ours_std`` (``np.std`` over the runs: 0 for one run) and ``runs`` (how many runs had
    the detector) after ``m_ours``."""

    per_run = [run_figures(run) for run in runs]
    stacked = pd.concat(per_run, ignore_index=True)
    order = list(pd.unique(stacked.detector))
    grouped = stacked.groupby("detector", sort=False)
    means = grouped[list(LEADERBOARD_METRICS)].mean().reindex(order)
    spreads = grouped[list(LEADERBOARD_METRICS)].agg(lambda values: float(np.std(values.to_numpy()))).reindex(order)
    ours = means.reset_index()
    ours["params"] = [grouped.get_group(name).params.iloc[0] for name in order]
    table = compare(ours, benchmark, arch=arch)
    spread_of = spreads.to_dict("index")
    counts = grouped.size().to_dict()
    for name in LEADERBOARD_METRICS:
        column = table.columns.get_loc(f"{name}_ours") + 1
        values = [spread_of.get(d, {}).get(name, np.nan) if isinstance(d, str) else np.nan for d in table.detector]
        table.insert(column, f"{name}_ours_std", values)
    table.insert(table.columns.get_loc("status") + 1, "runs", [counts.get(d, 0) for d in table.detector])
    return table


#: the figures :func:`bench_summary` shows, with their headings
SUMMARY_METRICS = {"near_auroc": "near AUROC", "far_auroc": "far AUROC", "id_accuracy": "ID accuracy"}


def _figure(mean: float, std: float) -> str:
    if np.isnan(mean):
        return "-"
    return f"{mean:.2f}" if np.isnan(std) else f"{mean:.2f} ± {std:.2f}"


def bench_summary(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of a :func:`bench_table` whose detector ran, as text for a terminal: ``detector``, then per figure
    of :data:`SUMMARY_METRICS` ``"<ours ± std> | <published ± std> | <ours - published>"`` (``-`` where a side has
    no figure, as the leaderboard publishes none for a detector it lacks)."""
    ran = table[table.runs > 0]
    rows = []
    for entry in ran.itertuples(index=False):
        row = {"detector": entry.detector}
        for name, heading in SUMMARY_METRICS.items():
            ours = _figure(getattr(entry, f"{name}_ours"), getattr(entry, f"{name}_ours_std"))
            board = _figure(getattr(entry, f"{name}_published"), getattr(entry, f"{name}_published_std"))
            diff = getattr(entry, f"{name}_diff")
            row[f"{heading}: ours | published | diff"] = f"{ours} | {board} | " + (
                "-" if np.isnan(diff) else f"{diff:+.2f}"
            )
        rows.append(row)
    return pd.DataFrame(rows)
