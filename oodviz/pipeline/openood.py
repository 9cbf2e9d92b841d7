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
sets them beside the leaderboard's (:func:`oodviz.results.leaderboard.compare`); :func:`summary_cells` writes the
figures of the detectors that ran as text, the same for the terminal (:func:`bench_summary`) and for the app's
metrics view, which shows them for any run of a benchmark (:func:`~oodviz.results.leaderboard.run_benchmark`), with
:func:`comparison_notes`.

Figures differ from the leaderboard's where oodviz's detectors compute their paper's formula and OpenOOD's
postprocessors a variant (the detectors' docstrings say where), where hyper-parameters differ (oodviz's defaults,
or its grids with ``tune``, against OpenOOD's tuned values), and for other checkpoints than OpenOOD's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from oodviz import detectors, models
from oodviz.config.run import OPENOOD_PREPROCESSING, DatasetChoice, DetectorChoice, RunConfig
from oodviz.data.openood import OpenOODSet, benchmark_splits, layout_problems
from oodviz.results.leaderboard import (
    LEADERBOARD_METRICS,
    STANDARD_TRAINING,
    compare,
    leaderboard_arch,
    run_benchmark,
    run_figures,
)
from oodviz.results.leaderboard import source as leaderboard_source

#: the protocols ``oodviz bench`` runs
PROTOCOLS = ("openood-v1.5",)


def _choice(openood_set: OpenOODSet) -> DatasetChoice:
    """The set as a run's dataset, titled with OpenOOD's name for it (``cifar10``, ``tin``), an OOD set in its group."""
    params = {"benchmark": openood_set.benchmark, "split": openood_set.split}
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


#: the figures :func:`summary_cells` shows, with their headings
SUMMARY_METRICS = {"near_auroc": "near AUROC", "far_auroc": "far AUROC", "id_accuracy": "ID accuracy"}
#: the parts of each figure in :func:`summary_cells`
SUMMARY_PARTS = ("ours", "published", "diff")


def _figure(mean: float, std: float) -> str:
    if np.isnan(mean):
        return "-"
    return f"{mean:.2f}" if np.isnan(std) else f"{mean:.2f} ± {std:.2f}"


def summary_cells(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of a :func:`bench_table` whose detector ran, in its order, as text: ``detector``, ``method`` (the
    leaderboard's name of that method, ``-`` where it has none), then per figure ``m`` of :data:`SUMMARY_METRICS`
    ``m_ours`` (the mean, ``± std`` where it is over two runs or more), ``m_published`` (``± std`` where the
    leaderboard gives one) and ``m_diff`` (``ours - published``, signed), each with two decimals and ``-`` where
    there is no figure (always for a detector the leaderboard lacks)."""
    ran = table[table.runs > 0]
    rows = []
    for entry in ran.itertuples(index=False):
        method = entry.postprocessor
        row = {"detector": entry.detector, "method": method if isinstance(method, str) else "-"}
        for name in SUMMARY_METRICS:
            spread = getattr(entry, f"{name}_ours_std") if entry.runs > 1 else np.nan
            diff = getattr(entry, f"{name}_diff")
            row[f"{name}_ours"] = _figure(getattr(entry, f"{name}_ours"), spread)
            row[f"{name}_published"] = _figure(
                getattr(entry, f"{name}_published"), getattr(entry, f"{name}_published_std")
            )
            row[f"{name}_diff"] = "-" if np.isnan(diff) else f"{diff:+.2f}"
        rows.append(row)
    columns = ["detector", "method", *(f"{name}_{part}" for name in SUMMARY_METRICS for part in SUMMARY_PARTS)]
    return pd.DataFrame(rows, columns=columns)


def bench_summary(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of a :func:`bench_table` whose detector ran, as text for a terminal: ``detector``, then per figure
    of :data:`SUMMARY_METRICS` ``"<ours ± std> | <published ± std> | <ours - published>"``, the cells of
    :func:`summary_cells` (``-`` where a side has no figure, as the leaderboard publishes none for a detector it
    lacks; no ``± std`` of ours for one run)."""
    cells = summary_cells(table)
    summary = pd.DataFrame({"detector": cells.detector})
    for name, heading in SUMMARY_METRICS.items():
        parts = [cells[f"{name}_{part}"] for part in SUMMARY_PARTS]
        summary[f"{heading}: ours | published | diff"] = parts[0] + " | " + parts[1] + " | " + parts[2]
    return summary


def _subsampled(config: Mapping) -> list[str]:
    entries = [("ID fit", config.get("id_fit")), ("ID test", config.get("id_test"))]
    entries += [("OOD", entry) for entry in config.get("ood") or []]
    return list(dict.fromkeys(name for name, entry in entries if isinstance(entry, Mapping) and entry.get("subsample")))


def comparison_notes(config: Mapping, table: pd.DataFrame) -> list[str]:
    """What a reader of a :func:`summary_cells` table of the runs of ``config`` (a run's ``config.json``, one of
    :func:`run_benchmark`'s) must know, one sentence each: where the published figures come from and when they were
    read, what "ours" is, that FPR@95 is not published, the run's protocol, what ``-`` means; then what makes this
    run differ from the leaderboard's setting, where it does (another network, random weights, other preprocessing,
    other OOD sets, subsampled splits)."""
    benchmark = run_benchmark(config)
    if benchmark is None:
        raise ValueError("not a run of an OpenOOD v1.5 benchmark: its ID fit set is not the openood dataset")
    info = leaderboard_source()
    where = info["source"]
    arch = str(table.arch.iloc[0]) if len(table) else "its network"
    runs = int(table.runs.max()) if len(table) else 0
    notes = [
        f"Published: the OpenOOD v1.5 leaderboard ({info['website']}), read from its CSV files "
        f"({where['repository'].removeprefix('https://github.com/')}, branch {where['branch']}, commit "
        f"{where['commit'][:7]} of {where['commit_date']}) on {info['read_on']}: {arch}, {STANDARD_TRAINING} "
        f"training, {info['runs'][benchmark].split(',')[0]}.",
        (
            "Ours: this run, one checkpoint (no std; oodviz bench with several checkpoints gives mean ± std)."
            if runs <= 1
            else f"Ours: mean ± std over {runs} runs."
        )
        + " In percent; diff = ours − published.",
        "The leaderboard publishes no FPR@95 (oodviz's is in the run's metrics).",
    ]
    protocol = config.get("protocol", "paper")
    tuned = isinstance(config.get("id_val"), Mapping) or isinstance(config.get("ood_val"), Mapping)
    parameters = (
        "parameters tuned on the validation data"
        if tuned
        else "parameters not tuned (OpenOOD tuned some on its validation sets)"
    )
    ran = [name for name in table.loc[table.runs > 0, "detector"] if isinstance(name, str)]
    known = set(detectors.available())
    variants = [name for name in ran if name in known and detectors.detector_class(name).openood_params]
    if protocol == "openood":
        notes.append(
            "Protocol openood: each detector ran OpenOOD v1.5's variant and defaults where they differ from its "
            f"paper's ({', '.join(variants) or 'none of these'}); {parameters}."
        )
    else:
        differ = (
            f"OpenOOD's variant or defaults differ for {', '.join(variants)}: protocol openood runs those"
            if variants
            else "none of these detectors has another variant or defaults in OpenOOD"
        )
        notes.append(f"Protocol paper: each detector computed its paper's formula, {parameters}; {differ}.")
    notes.append("'-': no figure (the leaderboard has none for a detector it lacks: its method is '-').")
    network = models.OPENOOD_NETWORKS[benchmark].backbone
    backbone = config.get("backbone")
    if backbone != network and leaderboard_arch(benchmark, backbone) is None:
        notes.append(
            f"This run's backbone is {backbone}, not {network}, the network of the leaderboard's figures: they "
            "differ for that reason alone."
        )
    if config.get("weights") == "random":
        notes.append("Random weights: a dry run, the figures of no trained network.")
    if config.get("preprocessing") != OPENOOD_PREPROCESSING + benchmark:
        notes.append(f"Not OpenOOD's preprocessing of {benchmark} (openood:{benchmark}): the backbone's own.")
    wanted = {s.split: s.group for s in benchmark_splits(benchmark) if s.group is not None}
    ood = [entry for entry in config.get("ood") or [] if isinstance(entry, Mapping)]
    had = {
        (entry.get("params") or {}).get("split"): entry.get("group") for entry in ood if entry.get("name") == "openood"
    }
    if had != wanted or len(ood) != len(wanted):
        notes.append("Other OOD sets than the benchmark's near and far lists: the means are over this run's sets.")
    if subsampled := _subsampled(config):
        notes.append(f"Subsampled ({', '.join(subsampled)}): the figures are of a sample of OpenOOD's sets.")
    return notes
