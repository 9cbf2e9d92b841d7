"""Scoring throughput (samples/s) of fitted detectors, each in a fresh process on in-RAM batch views.

- :func:`run_scoring`: Mahalanobis, oodviz ``det.score(batches)`` against pytorch-ood 0.4
  ``Mahalanobis.predict_features(z)`` (a loop over the C classes), and the Pearson correlation of
  their scores on the same samples. pytorch-ood scores fewer samples (it is slow); a rate does
  not depend on the count.
- :func:`run_score6` (issue 6): oodviz's rate for react, ash, scale, dice, fdbd, nci and gradnorm.
- :func:`measure_head_to_head` (issue 13.7): oodviz against pytorch-ood 0.4 for the detectors both have that
  need no fit (ash, energy), in one process, taking turns; ``python bench/score_speed.py`` prints the table::

      python bench/score_speed.py [--n 20000 --dim 512 --classes 100 --repeats 7]
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


def _pytorch_ood_scorer(detector: str, weight, bias):
    """pytorch-ood 0.4's scoring of pooled features ``[N, D]`` (ash: as ``N x D x 1 x 1`` maps) and logits."""
    import torch
    from pytorch_ood.detector import ASH, EnergyBased

    if detector == "energy":
        return lambda features, logits: EnergyBased.score(logits)
    head = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    ash = ASH(backbone=None, head=lambda x: head(x.flatten(1)), variant="ash-s", percentile=0.9)
    return lambda features, logits: ash.predict_feature_maps(features[:, :, None, None])


def measure_head_to_head(detector: str, n: int, dim: int, classes: int, repeats: int, threads: int) -> dict:
    """Seconds to score ``n`` samples (the best of ``repeats``, the two libraries taking turns) for ``detector``
    ("ash": variant s, 90th percentile; "energy"), and the largest score difference between them.

    Features are ``relu(N(0, 1))`` ``[n, dim]`` float32, the head ``N(0, 1/dim)``, logits from the head.
    oodviz scores one ``Batch`` of all rows (it blocks the rows itself), pytorch-ood gets the whole tensors.
    ``threads``: torch's intra-op threads for both (1 gives steadier figures on a shared machine).
    """
    import torch

    torch.set_num_threads(threads)
    from oodviz import Batch
    from oodviz.detectors import create

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(n, dim, generator=generator).relu_()
    weight = torch.randn(classes, dim, generator=generator) / dim**0.5
    bias = torch.randn(classes, generator=generator) * 0.1
    logits = features @ weight.T + bias
    ours = create(detector, **oodviz_params(detector, dim))
    ours = ours.fit([Batch(features[:64], logits[:64])], head=(weight, bias)) if ours.needs_fit else ours
    theirs = _pytorch_ood_scorer(detector, weight, bias)
    batch = Batch(features, logits)
    scorers = {"oodviz": lambda: ours.score(batch), "pytorch-ood": lambda: theirs(features, logits)}
    timings, results = {library: [] for library in scorers}, {}
    with torch.no_grad():
        for _ in range(repeats):
            for library, score in scorers.items():
                start = time.perf_counter()
                results[library] = score()
                timings[library].append(time.perf_counter() - start)
    difference = float((results["oodviz"].double() - results["pytorch-ood"].double()).abs().max())
    best = {library: min(seconds) for library, seconds in timings.items()}
    return {
        "detector": detector,
        "samples": n,
        "oodviz_s": best["oodviz"],
        "pytorch_ood_s": best["pytorch-ood"],
        "speedup": best["pytorch-ood"] / best["oodviz"],
        "max_abs_difference": difference,
    }


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


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="oodviz against pytorch-ood 0.4: scoring time of ash and energy")
    parser.add_argument("--detectors", default="ash,energy")
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both libraries (default: 1)")
    args = parser.parse_args()
    import score_speed  # the measurement by its module name, not __main__, for the fresh process

    print(
        f"\n#### Scoring, oodviz vs pytorch-ood 0.4: N={args.n}, D={args.dim}, C={args.classes}, best of {args.repeats}, "
        f"{args.threads} thread(s)\n"
    )
    print("| detector | oodviz s | pytorch-ood s | speed-up | max abs score difference |")
    print("|---|---:|---:|---:|---:|")
    for detector in args.detectors.split(","):
        r = run_one(
            score_speed.measure_head_to_head,
            1200,
            detector=detector,
            n=args.n,
            dim=args.dim,
            classes=args.classes,
            repeats=args.repeats,
            threads=args.threads,
        )
        if "error" in r:
            print(f"| {detector} | {r['error']} | | | |")
            continue
        print(
            f"| {detector} | {r['oodviz_s']:.4f} | {r['pytorch_ood_s']:.4f} | {r['speedup']:.2f}x | "
            f"{r['max_abs_difference']:.2e} |"
        )


if __name__ == "__main__":
    main()
