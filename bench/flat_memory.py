"""Flat growth in N: oodviz's fit memory must not depend on the number of samples.

The detectors are fitted from a :class:`harness.SyntheticStream` that generates seeded batches on
the fly (``N x D`` is never materialised), at a small and a large N (50,000 and 1,000,000 at the
full sizes), each in a fresh process; the report compares the two peak RSS growths.
"""

from __future__ import annotations

from harness import PeakGrowth, Sizes, SyntheticStream, oodviz_params, run_one, warm_up_torch


def measure_oodviz_streamed_fit(detector: str, n: int, dim: int, classes: int) -> dict:
    """oodviz fit from a ``SyntheticStream`` of ``n`` samples generated on the fly.

    The batches carry logits only for the detectors that read them (klm, she); generating a
    batch is part of the fit's memory and time here, the same at every N.
    """
    from oodviz.detectors import create

    stream = SyntheticStream(n, dim, classes, with_logits=detector in ("klm", "she"))
    head = (stream.weight, stream.bias)
    warm_up_torch()
    with PeakGrowth() as peak:
        fitted = create(detector, **oodviz_params(detector, dim)).fit(stream, head=head)
    del fitted
    return peak.result()


def run_flat_growth(sizes: Sizes, detectors, log) -> dict[str, dict[int, dict]]:
    """oodviz fit memory growth from streamed batches at the small and the large N."""
    flat: dict[str, dict[int, dict]] = {}
    for detector in detectors:
        flat[detector] = {}
        for n in (sizes.n_fit, sizes.n_flat):
            flat[detector][n] = result = run_one(
                measure_oodviz_streamed_fit,
                sizes.subprocess_timeout_s,
                detector=detector,
                n=n,
                dim=sizes.dim,
                classes=sizes.classes,
            )
            log(f"streamed {detector:<11} N={n:<9} {result}")
    return flat
