"""Wide-feature fits (issue 13.2): memory beyond the fitted state, and time, of the ``D x D`` detectors.

For each ``(N, D)`` given, mahalanobis, rmd and vim (d = D/2) are fitted by oodviz (4096-row ``Batch``
views, ``head=(W, b)``) and by pytorch-ood 0.4 (whole tensors) on the same seeded data, each in a fresh
process (:func:`harness.run_one`), and the script prints per fit:

- ``growth``: peak RSS growth of construct + fit (:class:`harness.PeakGrowth`, VmHWM);
- ``state``: the bytes of the fitted detector's tensors (oodviz: attributes ending in ``_``;
  pytorch-ood: every tensor attribute), what a fitted detector must hold anyway;
- ``beyond``: growth minus state, in units of ``D^2 x 8`` bytes (the issue's bound: 1.5);
- ``seconds``: wall time.

The data: ``C`` classes with random non-negative means, ``x = relu(mu_y + 1.5 eps)``; labels cycle
through the classes, so every class occurs once ``N >= C``. ``N < D`` is the case of few images of a wide
layer (96 images of an unpooled ViT block in the issue).

    .venv/bin/python bench/wide_fit.py --sizes 1000x2048 8192x2048 --classes 10
"""

from __future__ import annotations

import argparse

import torch
from harness import BATCH_SIZE, MiB, PeakGrowth, run_one, warm_up_torch

DETECTORS = ("mahalanobis", "rmd", "vim")


def make_data(n: int, dim: int, classes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    means = torch.rand(classes, dim, generator=generator) * 2
    labels = torch.arange(n) % classes
    features = (means[labels] + 1.5 * torch.randn(n, dim, generator=generator)).relu_()
    weight = torch.randn(classes, dim, generator=generator) / dim**0.5
    bias = torch.randn(classes, generator=generator)
    return {"features": features, "labels": labels, "weight": weight, "bias": bias}


def tensor_bytes(obj, suffix: str | None) -> int:
    seen, total = set(), 0
    objects = [obj] + [v for v in vars(obj).values() if hasattr(v, "__dict__") and not isinstance(v, torch.Tensor)]
    for item in objects:
        for key, value in vars(item).items():
            if isinstance(value, torch.Tensor) and (suffix is None or key.endswith(suffix)) and id(value) not in seen:
                seen.add(id(value))
                total += value.untyped_storage().nbytes()
    return total


def measure(library: str, detector: str, n: int, dim: int, classes: int) -> dict:
    data = make_data(n, dim, classes)
    warm_up_torch()
    z, y, weight, bias = data["features"], data["labels"], data["weight"], data["bias"]
    if library == "oodviz":
        from oodviz import Batch
        from oodviz.detectors import create

        batches = [Batch(z[i : i + BATCH_SIZE], labels=y[i : i + BATCH_SIZE]) for i in range(0, n, BATCH_SIZE)]
        params = {"dim": dim // 2} if detector == "vim" else {}
        with PeakGrowth() as peak:
            fitted = create(detector, **params).fit(batches, head=(weight, bias))
        state = tensor_bytes(fitted, "_")
    else:
        from pytorch_ood.detector import RMD, Mahalanobis, ViM

        with PeakGrowth() as peak:
            if detector == "mahalanobis":
                fitted = Mahalanobis(None).fit_features(z, y)
            elif detector == "rmd":
                fitted = RMD(None).fit_features(z, y)
            else:
                fitted = ViM(None, d=dim // 2, w=weight, b=bias).fit_features(z, y)
        state = tensor_bytes(fitted, None)
    square = dim * dim * 8
    growth = peak.growth_mib * MiB
    return {
        "growth_mib": round(peak.growth_mib, 1),
        "state_mib": round(state / MiB, 1),
        "beyond_d2": round((growth - state) / square, 2),
        "seconds": round(peak.seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["1000x2048", "8192x2048"], help="NxD pairs")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--detectors", nargs="+", default=list(DETECTORS))
    parser.add_argument("--libraries", nargs="+", default=["oodviz", "pytorch-ood"])
    parser.add_argument("--timeout", type=int, default=600)
    args = parser.parse_args()
    import wide_fit  # run_one names the measurement by its module, which must not be __main__

    for size in args.sizes:
        n, dim = (int(v) for v in size.split("x"))
        for detector in args.detectors:
            for library in args.libraries:
                result = run_one(
                    wide_fit.measure,
                    args.timeout,
                    library=library,
                    detector=detector,
                    n=n,
                    dim=dim,
                    classes=args.classes,
                )
                print(f"N={n:<6} D={dim:<5} {detector:<11} {library:<11} {result}", flush=True)


if __name__ == "__main__":
    main()
