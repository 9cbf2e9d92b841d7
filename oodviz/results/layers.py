"""Several feature layers in one run: result column names, the multi-layer Mahalanobis, the "which layer?" table.

A run with ``layers = ["features.0", "features.3", "penultimate"]`` (:class:`oodviz.config.run.RunConfig`)
scores every detector that reads features once per layer; its score column (``scores.parquet``) and its
``detector`` in ``metrics.csv`` / ``per_class.csv`` are ``"<detector>@<layer>"`` (:func:`layer_column`).
Detectors that read only the logits, or run the model themselves, are the same at every layer and keep
their plain name; so does every detector of a single-layer run (old runs read as before).
:func:`split_column` gives back ``(detector, layer or None)``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from oodviz.columns import COMBINED, PENULTIMATE, split_column
from oodviz.results.tables import is_group_mean


def depth_order(layers: list[str], module_names: list[str]) -> list[str] | None:
    """``layers`` from shallow to deep: by their place in ``module_names`` (``model.named_modules()``: modules in
    the order the model registers them, which is the forward order of torchvision's models and of models built
    as a sequence of blocks), :data:`PENULTIMATE` (the head's input) last. ``None`` when ``module_names`` does not
    place every layer (a TorchScript or callable backbone without module names): the depth is then unknown."""
    position = {name: i for i, name in enumerate(module_names)}
    inner = [layer for layer in layers if layer != PENULTIMATE]
    if any(layer not in position for layer in inner):
        return None
    return sorted(inner, key=position.__getitem__) + ([PENULTIMATE] if PENULTIMATE in layers else [])


def combine_standardised(
    layer_scores: dict[str, np.ndarray], reference_scores: dict[str, np.ndarray]
) -> tuple[np.ndarray, dict[str, dict[str, float]]]:
    """The multi-layer score: per-layer scores standardised on ID reference scores, then summed.

    ``s(x) = sum_l (s_l(x) - mu_l) / sigma_l`` with ``mu_l`` and ``sigma_l`` the mean and the standard
    deviation (``ddof=0``) of layer ``l``'s scores on the ID reference samples (a run uses its held-out ID
    validation split ``id_val`` when it has one, else its ID fit split, the samples the per-layer detectors were
    fitted on: in-sample, so their scores there are lower than on unseen ID images). With Mahalanobis,
    ``s_l(x) = min_c (f_l(x) - mu_c)^T Sigma^-1 (f_l(x) - mu_c)``
    (:class:`~oodviz.detectors.mahalanobis.Mahalanobis`, higher = more OOD), so the sum keeps the sign: **higher =
    more OOD**. Standardising puts layers whose distances live on different scales (``D`` from 16 to 2048) on one
    footing before they are added; it is the equal-weight form of the feature ensemble of Lee et al. 2018 ("A
    Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial Attacks", NeurIPS), which
    instead weights the layers with a logistic regression fitted on OOD validation data (not needed here, and not
    biased towards one OOD set). :func:`standardisation_stats` then :func:`standardised_sum`.

    :param layer_scores: layer -> scores ``[N]`` of the samples to score (the same rows in every layer)
    :param reference_scores: layer -> scores ``[M]`` of the ID reference samples; the same layers
    :returns: the combined scores ``[N]`` (float64) and layer -> ``{"mean", "std"}``
    :raises ValueError: when the layers differ, or a layer's reference scores have no spread (``sigma = 0``)
    """
    if set(layer_scores) != set(reference_scores) or not layer_scores:
        raise ValueError(
            f"scores and reference scores must name the same layers, got {sorted(layer_scores)} and "
            f"{sorted(reference_scores)}"
        )
    stats = standardisation_stats({layer: reference_scores[layer] for layer in layer_scores})
    return standardised_sum(layer_scores, stats), stats


def standardisation_stats(reference_scores: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Layer -> ``{"mean": mu_l, "std": sigma_l}`` of its ID reference scores ``[M]`` (float64, ``ddof=0``);
    ValueError when a layer's scores have no spread."""
    stats = {}
    for layer, values in reference_scores.items():
        reference = np.asarray(values, dtype=np.float64)
        mean, std = float(reference.mean()), float(reference.std())
        if not np.isfinite(std) or std <= 0:
            raise ValueError(f"layer {layer}: the ID reference scores have no spread (std {std}); cannot standardise")
        stats[layer] = {"mean": mean, "std": std}
    return stats


def standardised_sum(layer_scores: dict[str, np.ndarray], stats: dict[str, dict[str, float]]) -> np.ndarray:
    """``sum_l (s_l - mean_l) / std_l`` in float64, the layers added in the order of ``layer_scores`` (so the same
    scores and ``stats``, e.g. those recorded in ``detectors.json``, give the same bits: ``oodviz score``)."""
    total = None
    for layer, values in layer_scores.items():
        standardised = (np.asarray(values, dtype=np.float64) - stats[layer]["mean"]) / stats[layer]["std"]
        total = standardised if total is None else total + standardised
    return total


def layer_ranking(metrics: pd.DataFrame, layers: list[str] | None = None) -> pd.DataFrame:
    """The "which layer?" table: per detector scored at several layers, each layer's mean AUROC and FPR95
    over the OOD datasets (the per-dataset rows of ``metrics.csv``, not the near/far means) and its rank
    (1 = the highest AUROC).

    Columns ``detector, layer, auroc, fpr95, rank``; rows by detector (table order), best layer first.
    ``layers`` (the run's ``layers``) orders ties and keeps only those layers and :data:`COMBINED`;
    detectors with a plain name (one layer, or none) are left out. Empty when the run has one layer.
    """
    rows = metrics[~is_group_mean(metrics)]
    parts = rows.detector.map(split_column)
    frame = rows.assign(base=parts.str[0], layer=parts.str[1]).dropna(subset=["layer"])
    if layers is not None:
        frame = frame[frame.layer.isin([*layers, COMBINED])]
    columns = ["detector", "layer", "auroc", "fpr95", "rank"]
    if frame.empty:
        return pd.DataFrame(columns=columns)
    order = {layer: i for i, layer in enumerate([*(layers or []), COMBINED])}
    means = frame.groupby(["base", "layer"], sort=False)[["auroc", "fpr95"]].mean().reset_index()
    means["order"] = means.layer.map(order).fillna(len(order))
    means = means.sort_values(["auroc", "order"], ascending=[False, True], kind="stable")
    means["rank"] = means.groupby("base").cumcount() + 1
    detectors = list(dict.fromkeys(frame.base))
    means["base"] = pd.Categorical(means.base, categories=detectors, ordered=True)
    means = means.sort_values(["base", "rank"], kind="stable").rename(columns={"base": "detector"})
    means["detector"] = means.detector.astype(str)
    return means[columns].reset_index(drop=True)
