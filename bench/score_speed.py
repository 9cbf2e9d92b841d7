"""Scoring throughput (samples/s) of fitted detectors, each in a fresh process on in-RAM batch views.

- :func:`run_scoring`: Mahalanobis, oodviz ``det.score(batches)`` against pytorch-ood 0.4
  ``Mahalanobis.predict_features(z)`` (a loop over the C classes), and the Pearson correlation of
  their scores on the same samples. pytorch-ood scores fewer samples (it is slow); a rate does
  not depend on the count.
- :func:`run_score6` (issue 6): oodviz's rate for react, ash, scale, dice, fdbd, nci and gradnorm.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
from harness import Sizes, batch_views, load_dataset, oodviz_params, run_one


def measure_oodviz_scoring(data_dir: str, n: int, n_saved: int) -> dict:
    """Samples/s of oodviz Mahalanobis ``score`` on the first ``n`` rows (batch views)."""
    from oodviz.detectors import create

    data = load_dataset(data_dir)
    detector = create("mahalanobis").fit(batch_views(data))
    detector.score(batch_views(data, 64))  # warm-up
    batches = batch_views(data, n)
    start = time.perf_counter()
    scores = detector.score(batches)
    seconds = time.perf_counter() - start
    np.save(os.path.join(data_dir, "scores-oodviz.npy"), scores[:n_saved].numpy())
    return {"samples": n, "seconds": seconds, "samples_per_s": n / seconds}


def measure_pytorch_ood_scoring(data_dir: str, n: int) -> dict:
    """Samples/s of pytorch-ood Mahalanobis ``predict_features`` on the first ``n`` rows."""
    from pytorch_ood.detector import Mahalanobis

    data = load_dataset(data_dir)
    detector = Mahalanobis(None).fit_features(data["features"], data["labels"])
    detector.predict_features(data["features"][:8])  # warm-up
    z = data["features"][:n]
    start = time.perf_counter()
    scores = detector.predict_features(z)
    seconds = time.perf_counter() - start
    np.save(os.path.join(data_dir, "scores-pytorch-ood.npy"), scores.numpy())
    return {"samples": n, "seconds": seconds, "samples_per_s": n / seconds}


def measure_oodviz_detector_scoring(data_dir: str, detector: str, n: int) -> dict:
    """Samples/s of oodviz ``score`` for ``detector`` (fitted on the whole set) on the first ``n`` rows."""
    from oodviz.detectors import create

    data = load_dataset(data_dir)
    head = (data["weight"], data["bias"])
    fitted = create(detector, **oodviz_params(detector, data["features"].shape[1])).fit(batch_views(data), head=head)
    fitted.score(batch_views(data, 64))  # warm-up
    batches = batch_views(data, n)
    start = time.perf_counter()
    fitted.score(batches)
    seconds = time.perf_counter() - start
    return {"samples": n, "seconds": seconds, "samples_per_s": n / seconds}


# -- the runs (one fresh process per measurement) ---------------------------------------------------


def run_scoring(data_dir: str, sizes: Sizes, libraries, log) -> tuple[dict, dict, float | None]:
    """Mahalanobis scoring throughput of both libraries, and how well their scores agree."""
    timeout = sizes.subprocess_timeout_s
    ours = run_one(
        measure_oodviz_scoring, timeout, data_dir=data_dir, n=sizes.n_score_oodviz, n_saved=sizes.n_score_pytorch_ood
    )
    log(f"scoring oodviz {ours}")
    if "pytorch-ood" not in libraries:
        return ours, {"error": "pytorch-ood not installed"}, None
    theirs = run_one(measure_pytorch_ood_scoring, timeout, data_dir=data_dir, n=sizes.n_score_pytorch_ood)
    log(f"scoring pytorch-ood {theirs}")
    correlation = None
    with contextlib.suppress(OSError):
        a = np.load(os.path.join(data_dir, "scores-oodviz.npy"))
        b = np.load(os.path.join(data_dir, "scores-pytorch-ood.npy"))
        correlation = float(np.corrcoef(a, b)[0, 1])
    return ours, theirs, correlation


def run_score6(data_dir: str, sizes: Sizes, detectors, log) -> dict[str, dict]:
    """oodviz scoring throughput of each issue-6 detector, fitted on the whole in-RAM set."""
    scoring = {}
    for detector in detectors:
        scoring[detector] = result = run_one(
            measure_oodviz_detector_scoring,
            sizes.subprocess_timeout_s,
            data_dir=data_dir,
            detector=detector,
            n=sizes.n_score_oodviz,
        )
        log(f"score6 {detector:<9} {result}")
    return scoring
