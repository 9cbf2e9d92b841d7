"""The detector benchmark's report: the environment, markdown tables and PASS/FAIL against the targets.

Targets (issue 2): oodviz's fit memory growth < 64 MiB and at least 10x below pytorch-ood's; fit
time no worse than pytorch-ood's; Mahalanobis scoring >= 10x faster; growth from the small to
the large N within 5 MiB. The issue-6 table has no targets (report only).
"""

from __future__ import annotations

import importlib.util
import os
import platform
from datetime import date

import numpy as np
import torch
from harness import BATCH_SIZE, KNN_K, Sizes, can_reset_peak, vim_dim

# Targets from the issue.
MAX_GROWTH_MIB = 64  # oodviz fit memory growth for the statistics-based detectors
MIN_MEMORY_RATIO = 10  # pytorch-ood growth / oodviz growth
MIN_SCORING_SPEEDUP = 10  # oodviz / pytorch-ood Mahalanobis samples/s
FLAT_TOLERANCE_MIB = 5  # growth at the large N may exceed the growth at the small N by this much


def environment() -> list[str]:
    versions = [f"torch {torch.__version__}", f"numpy {np.__version__}"]
    if importlib.util.find_spec("pytorch_ood"):
        import pytorch_ood

        versions.append(f"pytorch-ood {pytorch_ood.__version__}")
    return [
        f"- date: {date.today().isoformat()}",
        f"- machine: {platform.machine()} CPU, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
        f"Python {platform.python_version()}, {platform.system()}",
        f"- versions: {', '.join(versions)}",
        f"- peak memory: {'VmHWM after /proc/self/clear_refs' if can_reset_peak() else 'psutil sampling thread'}",
        f"- glibc malloc: {'MALLOC_MMAP_THRESHOLD_=' + threshold if (threshold := os.environ.get('MALLOC_MMAP_THRESHOLD_')) else 'default (dynamic mmap threshold)'}",
    ]


def _mib(result: dict) -> str:
    return f"{result['growth_mib']:.1f}" if "growth_mib" in result else "error"


def _secs(result: dict) -> str:
    return f"{result['seconds']:.2f}" if "seconds" in result else "error"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _with_range(result: dict, key: str, digits: int) -> str:
    if key not in result:
        return "error"
    text = f"{result[key]:.{digits}f}"
    low, high = result.get(key + "_range", (result[key], result[key]))
    return text if high - low < 10**-digits else f"{text} ({low:.{digits}f}-{high:.{digits}f})"


def fit_table(results: dict[str, dict[str, dict]]) -> list[str]:
    rows = [
        f"| detector | oodviz growth (MiB) | pytorch-ood growth (MiB) | ratio | < {MAX_GROWTH_MIB} MiB | "
        f">= {MIN_MEMORY_RATIO}x below | oodviz fit (s) | pytorch-ood fit (s) | time target |",
        "|---|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for detector, by_library in results.items():
        ours, theirs = by_library["oodviz"], by_library.get("pytorch-ood", {"error": "not run"})
        ratio, small, below, timing = "-", "error", "error", "error"
        if "growth_mib" in ours:
            small = _verdict(ours["growth_mib"] < MAX_GROWTH_MIB)
        if "growth_mib" in ours and "growth_mib" in theirs:
            ratio_value = theirs["growth_mib"] / max(ours["growth_mib"], 0.1)
            ratio = f"{ratio_value:.0f}x" if ratio_value >= 10 else f"{ratio_value:.1f}x"
            below = _verdict(ratio_value >= MIN_MEMORY_RATIO)
            timing = _verdict(ours["seconds"] <= theirs["seconds"])
        rows.append(
            f"| {detector} | {_with_range(ours, 'growth_mib', 1)} | {_with_range(theirs, 'growth_mib', 1)} | {ratio} | "
            f"{small} | {below} | {_with_range(ours, 'seconds', 2)} | {_with_range(theirs, 'seconds', 2)} | {timing} |"
        )
    return rows


def scoring_table(ours: dict, theirs: dict, correlation: float | None) -> list[str]:
    rows = [
        "| library | samples | seconds | samples/s |",
        "|---|---:|---:|---:|",
    ]
    for name, result in (("oodviz `score`", ours), ("pytorch-ood `predict_features`", theirs)):
        if "error" in result:
            rows.append(f"| {name} | - | - | {result['error']} |")
        else:
            rows.append(f"| {name} | {result['samples']} | {result['seconds']:.2f} | {result['samples_per_s']:,.0f} |")
    if "samples_per_s" in ours and "samples_per_s" in theirs:
        speedup = ours["samples_per_s"] / theirs["samples_per_s"]
        rows.append("")
        rows.append(
            f"Speed-up {speedup:,.0f}x (target >= {MIN_SCORING_SPEEDUP}x): {_verdict(speedup >= MIN_SCORING_SPEEDUP)}"
        )
    if correlation is not None:
        rows.append(f"Pearson correlation of the two libraries' scores on the same samples: {correlation:.6f}")
    return rows


def flat_table(results: dict[str, dict[int, dict]], n_small: int, n_large: int) -> list[str]:
    rows = [
        f"| detector | growth at N={n_small:,} (MiB) | growth at N={n_large:,} (MiB) | difference | "
        f"fit at N={n_small:,} (s) | fit at N={n_large:,} (s) | no growth (<= +{FLAT_TOLERANCE_MIB} MiB) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for detector, by_n in results.items():
        small, large = by_n[n_small], by_n[n_large]
        difference, verdict = "-", "error"
        if "growth_mib" in small and "growth_mib" in large:
            delta = large["growth_mib"] - small["growth_mib"]
            difference, verdict = f"{delta:+.1f}", _verdict(delta <= FLAT_TOLERANCE_MIB)
        if "error" in large:
            verdict = f"error: {large['error']}"
        rows.append(
            f"| {detector} | {_mib(small)} | {_mib(large)} | {difference} | {_secs(small)} | {_secs(large)} | {verdict} |"
        )
    return rows


def fit6_table(results: dict[str, dict[str, dict]], scoring: dict[str, dict]) -> list[str]:
    """Issue-6 fits side by side (no targets: report only), with oodviz's scoring rate if measured."""
    rows = [
        "| detector | oodviz growth (MiB) | pytorch-ood growth (MiB) | ratio | oodviz fit (s) | pytorch-ood fit (s) | "
        "oodviz score (samples/s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for detector, by_library in results.items():
        ours = by_library["oodviz"]
        theirs = by_library.get("pytorch-ood", {"error": "not run"})
        ratio = "-"
        if "growth_mib" in ours and "growth_mib" in theirs:
            ratio_value = theirs["growth_mib"] / max(ours["growth_mib"], 0.1)
            ratio = f"{ratio_value:,.0f}x" if ratio_value >= 10 else f"{ratio_value:.1f}x"
        if theirs.get("no_fit"):
            their_mib = their_secs = "no fit"
        elif "error" in theirs:
            their_mib, their_secs = f"error: {theirs['error']}", "error"
        else:
            their_mib, their_secs = _mib(theirs), _secs(theirs)
        rate = scoring.get(detector, {})
        rate = f"{rate['samples_per_s']:,.0f}" if "samples_per_s" in rate else rate.get("error", "-")
        our_mib = _mib(ours) if "error" not in ours else f"error: {ours['error']}"
        rows.append(f"| {detector} | {our_mib} | {their_mib} | {ratio} | {_secs(ours)} | {their_secs} | {rate} |")
    return rows


def print_report(sizes: Sizes, fits, store_knn, scoring, flat, fits6, scoring6) -> None:
    """Every table of the parts that ran (an empty result: the part did not run)."""
    if fits:
        print(f"\n### Fit: memory growth and time, N={sizes.n_fit:,}, D={sizes.dim}, C={sizes.classes}\n")
        print("\n".join(fit_table(fits)))
    if store_knn:
        print(
            f"\nknn fitted from a feature store (`store.batches(4096, include=('features', 'labels'))`, as runs fit; "
            f"the store's file is the bank, nothing is written): growth {_with_range(store_knn, 'growth_mib', 1)} MiB, fit {_with_range(store_knn, 'seconds', 2)} s"
        )
    if scoring:
        print(f"\n### Mahalanobis scoring throughput, D={sizes.dim}, C={sizes.classes}\n")
        print("\n".join(scoring_table(*scoring)))
    if flat:
        print("\n### oodviz fit memory growth from streamed batches, by N\n")
        print("\n".join(flat_table(flat, sizes.n_fit, sizes.n_flat)))
    if fits6 or scoring6:
        if not fits6:
            fits6 = {d: {"oodviz": {"error": "not run"}} for d in scoring6}
        print(
            f"\n### Issue 6 detectors: fit memory growth and time, N={sizes.n_fit:,}, D={sizes.dim}, C={sizes.classes}"
            f" (scoring: {sizes.n_score_oodviz:,} samples)\n"
        )
        print("\n".join(fit6_table(fits6, scoring6)))


def sizes_line(sizes: Sizes, parts: set[str]) -> str:
    return (
        f"- sizes: N={sizes.n_fit:,} D={sizes.dim} C={sizes.classes}, batch {BATCH_SIZE}, "
        f"vim dim {vim_dim(sizes.dim)}, knn k {KNN_K}; parts: {', '.join(sorted(parts))}"
    )
