"""Which float results the tests may compare bit for bit, and the one tolerance for the others (issue 32).

**Bit for bit** only where the code guarantees it on every CPU: the same operations on the same shapes in the same
order, in processes with the same kernels: a store read back, a saved detector reloaded and scoring the same
batches, the same batches through the same model, a merge that adds the same numbers in the same order.

**To float32 rounding** (:func:`assert_kernel_close`) wherever PyTorch may pick other kernels: features through a
conv stack at another batch size (oneDNN chooses convolution kernels by shape), in another thread count, another
process or on another CPU (AVX-512 against AVX2), with oneDNN on or off; sums over another number of ranks or
threads. Such kernels add the same products in another order. A float32 dot product of ``K`` terms summed in
another order moves by about ``sqrt(K) * eps`` of the terms' magnitude (``eps = 2**-23``, rounding errors that add
like a random walk); the bundled digits-cnn has ``K <= 3 * 3 * 32 = 288`` and four layers in sequence (three
convolutions and the head), so ``4 * sqrt(288) * eps ~ 8e-6`` of the largest value in the array, and
:data:`KERNEL_RTOL` takes 2.5 times that. Measured (bench/kernel_rounding.py, bench/RESULTS.md): up to 4.3e-6 with
oneDNN off, 4.0e-7 with AVX2 or a batch of one.

``make test-kernels`` reruns the tests marked ``kernels`` (those whose comparisons involve float kernels) with one
thread and AVX2 kernels at another batch size, then with oneDNN off (tests/kernel_variant), so that a comparison
that holds on this CPU only fails here too. :func:`run_batch_size` is the batch size such a test runs at.
"""

from __future__ import annotations

import os

import numpy as np

FLOAT32_EPS = float(np.finfo(np.float32).eps)
#: |a - b| <= KERNEL_RTOL * scale for float32 results of other kernels, ``scale`` the magnitude of the values
#: computed (see the module's docstring for the derivation and the measurements).
KERNEL_RTOL = 2e-5
#: ``make test-kernels``: the batch size that replaces the tests' usual one (unset: each test's own)
BATCH_SIZE_VARIABLE = "OODVIZ_TEST_BATCH_SIZE"


def assert_kernel_close(actual, expected, *, scale: float | None = None, err_msg: str = "") -> None:
    """``actual`` equals ``expected`` to float32 kernels' rounding: ``|actual - expected| <= KERNEL_RTOL * scale``
    elementwise, ``scale`` the magnitude of the quantities compared (default: ``max |expected|``; a score with a
    natural scale says it, e.g. 4 for the squared distance of unit vectors)."""
    actual, expected = (np.asarray(a, dtype=np.float64) for a in (actual, expected))
    if scale is None:
        scale = float(np.abs(expected).max()) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=0, atol=KERNEL_RTOL * scale, err_msg=err_msg)


def run_batch_size(default: int) -> int:
    """The batch size a ``kernels`` test runs at: its own ``default``, or ``make test-kernels``'s other one."""
    return int(os.environ.get(BATCH_SIZE_VARIABLE, default))
