"""Fit memory growth and fit time: oodviz against pytorch-ood 0.4 on the same in-RAM features.

Each measurement loads the dataset of :func:`harness.write_dataset` into RAM in a fresh process,
warms torch up, and records the peak RSS growth and wall time of construct + fit
(:class:`harness.PeakGrowth`). oodviz gets the tensors as a list of ``Batch`` views (slices, no
copies) of 4096 rows and ``head=(W, b)``; pytorch-ood gets the whole tensors (``fit_features``,
``fit_logits`` for klm).

- :func:`run_fits`: mahalanobis, rmd, vim (d = D/2), klm, she and knn (k=50), each repeated
  (the libraries taking turns) and the median reported with the range.
- :func:`run_store_fit`: knn fitted from the oodviz feature store (the app's path).
- :func:`run_fit6` (issue 6): react (percentile 90), ash (variant "s", percentile 90), scale
  (percentile 85), dice (sparsity 0.9), fdbd, nci and gradnorm, against pytorch-ood's
  ``ReAct.fit_feature_maps`` on the features as ``N x D x 1 x 1`` maps (views, no copy),
  ``DICE.fit_features``, ``fDBD.fit_features`` and ``NCI.fit_features`` (both with the head as an
  ``nn.Linear``). pytorch-ood's ASH, SCALE and GradNorm fit nothing: "no fit", oodviz only.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from harness import (
    BATCH_SIZE,
    KNN_K,
    STORE_KEY,
    PeakGrowth,
    Sizes,
    batch_views,
    load_dataset,
    median_of_runs,
    oodviz_params,
    run_one,
    vim_dim,
    warm_up_torch,
)

NO_FIT_IN_PYTORCH_OOD = ("ash", "scale", "gradnorm")  # pytorch-ood 0.4 has nothing to fit for these


def pytorch_ood_fit(detector: str, data: dict[str, torch.Tensor]):
    """Construct and fit the pytorch-ood 0.4 counterpart of ``detector`` on whole tensors."""
    from pytorch_ood.detector import DICE, KNN, NCI, RMD, SHE, KLMatching, Mahalanobis, ReAct, ViM, fDBD

    z, y, weight, bias = data["features"], data["labels"], data["weight"], data["bias"]
    if detector == "mahalanobis":
        return Mahalanobis(None).fit_features(z, y)
    if detector == "rmd":
        return RMD(None).fit_features(z, y)
    if detector == "vim":
        return ViM(None, d=vim_dim(z.shape[1]), w=weight, b=bias).fit_features(z, y)
    if detector == "klm":
        return KLMatching(None).fit_logits(data["logits"], y)
    if detector == "she":
        return SHE(None, head=data["head_layer"]).fit_features(z, y)
    if detector == "knn":
        return KNN(None, k=KNN_K).fit_features(z, y)
    # issue 6: pytorch-ood's percentiles/sparsities are fractions, oodviz's percentiles are percent
    if detector == "react":  # takes feature maps B x D x H x W; pooled features as D x 1 x 1 maps (a view)
        return ReAct(None, data["head_layer"], percentile=0.9).fit_feature_maps(z[:, :, None, None], y)
    if detector == "dice":
        return DICE(None, w=weight, b=bias, p=0.9).fit_features(z, y)
    if detector == "fdbd":
        return fDBD(None, data["head_layer"]).fit_features(z, y)
    if detector == "nci":
        return NCI(None, data["head_layer"]).fit_features(z, y)
    raise ValueError(detector)


def linear_layer(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer.requires_grad_(False)


def measure_oodviz_fit(data_dir: str, detector: str) -> dict:
    """oodviz ``create(detector).fit(batch views, head=(W, b))`` on the in-RAM dataset."""
    from oodviz.detectors import create

    data = load_dataset(data_dir)
    batches = batch_views(data)
    head = (data["weight"], data["bias"])
    warm_up_torch()
    with PeakGrowth() as peak:
        fitted = create(detector, **oodviz_params(detector, data["features"].shape[1])).fit(batches, head=head)
    del fitted
    return peak.result()


def measure_oodviz_store_fit(data_dir: str, detector: str) -> dict:
    """oodviz ``create(detector).fit(store.batches(4096))`` on the dataset's feature store (the app's path)."""
    from oodviz.detectors import create
    from oodviz.engine import FeatureStore

    store = FeatureStore(os.path.join(data_dir, STORE_KEY))
    data = {name: torch.from_numpy(np.load(os.path.join(data_dir, f"{name}.npy"))) for name in ("weight", "bias")}
    head = (data["weight"], data["bias"])
    warm_up_torch()
    with PeakGrowth() as peak:
        batches = store.batches(BATCH_SIZE, include=("features", "labels"))  # what knn reads; prefetching 2 chunks
        fitted = create(detector, **oodviz_params(detector, store.feature_dim)).fit(batches, head=head)
    del fitted
    return peak.result()


def measure_pytorch_ood_fit(data_dir: str, detector: str) -> dict:
    """pytorch-ood 0.4 construct + ``fit_features`` (``fit_logits`` for klm) on the in-RAM dataset."""
    import pytorch_ood.detector  # noqa: F401
    import sklearn.neighbors  # noqa: F401  (KNN imports it in its constructor)

    data = load_dataset(data_dir)
    data["head_layer"] = linear_layer(data["weight"], data["bias"])  # SHE's head: the model's layer
    warm_up_torch()
    with PeakGrowth() as peak:
        fitted = pytorch_ood_fit(detector, data)
    del fitted
    return peak.result()


# -- the runs (one fresh process per measurement) ---------------------------------------------------


def run_fits(data_dir: str, sizes: Sizes, detectors, libraries, log, repeats: int = 1) -> dict[str, dict[str, dict]]:
    """Fit memory growth and time of every detector, each library, on the in-RAM dataset: the median
    of ``repeats`` fresh processes, the libraries taking turns so that both see the same machine."""
    runs: dict[str, dict[str, list]] = {d: {library: [] for library in libraries} for d in detectors}
    for _ in range(repeats):
        for detector in detectors:
            for library in libraries:
                measurement = measure_oodviz_fit if library == "oodviz" else measure_pytorch_ood_fit
                result = run_one(measurement, sizes.subprocess_timeout_s, data_dir=data_dir, detector=detector)
                runs[detector][library].append(result)
                log(f"fit {detector:<11} {library:<11} {result}")
    return {d: {library: median_of_runs(r) for library, r in by_library.items()} for d, by_library in runs.items()}


def run_store_fit(data_dir: str, sizes: Sizes, detector: str, log, repeats: int = 1) -> dict:
    """Fit memory growth and time of ``detector`` from the dataset's feature store: the median of ``repeats``."""
    runs = [
        run_one(measure_oodviz_store_fit, sizes.subprocess_timeout_s, data_dir=data_dir, detector=detector)
        for _ in range(repeats)
    ]
    result = median_of_runs(runs)
    log(f"fit {detector} from the feature store {result}")
    return result


def run_fit6(data_dir: str, sizes: Sizes, detectors, libraries, log) -> dict[str, dict[str, dict]]:
    """Issue-6 fit memory growth and time; pytorch-ood only where it has something to fit."""
    fits: dict[str, dict[str, dict]] = {}
    for detector in detectors:
        fits[detector] = {}
        for library in libraries:
            if library == "pytorch-ood" and detector in NO_FIT_IN_PYTORCH_OOD:
                fits[detector][library] = {"no_fit": True}
                continue
            measurement = measure_oodviz_fit if library == "oodviz" else measure_pytorch_ood_fit
            fits[detector][library] = result = run_one(
                measurement, sizes.subprocess_timeout_s, data_dir=data_dir, detector=detector
            )
            log(f"fit6 {detector:<9} {library:<11} {result}")
    return fits
