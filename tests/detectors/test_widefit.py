"""Wide-feature fits (issue 13.2): the Gram-matrix path for N <= D / 2, in-place eigendecompositions."""

import numpy as np
import scipy.linalg
import torch
from helpers import cuda

from oodviz import Batch
from oodviz.detectors import create, widefit
from oodviz.detectors.mahalanobis import inverse_sqrt
from oodviz.detectors.stats import symmetric_eigh
from oodviz.detectors.vim import linear_origin
from oodviz.detectors.widefit import FewRows, gram_inverse_sqrt

EPS = np.finfo(np.float64).eps


def _wide(n=60, d=160, c=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % c
    means = torch.rand(c, d, generator=g, dtype=torch.float64) * 3
    x = means[y] + torch.randn(n, d, generator=g, dtype=torch.float64)
    return x.to(dtype), y


def _batches(x, y, size=16):
    return [Batch(x[i : i + size], labels=y[i : i + size]) for i in range(0, len(x), size)]


def _pinv(covariance: np.ndarray) -> np.ndarray:
    """The float64 pseudo-inverse with inverse_sqrt's cutoff (D eps lambda_max)."""
    values, vectors = np.linalg.eigh(covariance)
    keep = values > values.max() * len(values) * EPS
    return (vectors[:, keep] / values[keep]) @ vectors[:, keep].T


def _decomposed_sizes(monkeypatch) -> list[int]:
    """The orders of the matrices scipy.linalg.eigh decomposes from now on."""
    sizes, eigh = [], scipy.linalg.eigh

    def recording(a, *args, **kwargs):
        sizes.append(len(a))
        return eigh(a, *args, **kwargs)

    monkeypatch.setattr(scipy.linalg, "eigh", recording)
    return sizes


def test_gram_whitening_equals_the_d_by_d_pseudo_inverse_in_float64():
    x, y = _wide(dtype=torch.float64)
    rows = FewRows()
    for i in range(0, len(x), 16):
        assert rows.add(x[i : i + 16], y[i : i + 16])
    rows.release()
    centred = (x - rows.means[y]).numpy()
    within = centred.T @ centred / len(x)
    s = rows.inverse_sqrt_within(torch.float64)
    assert s.shape == (160, 60 - 3)  # rank N - C: the class means take C directions
    np.testing.assert_allclose((s @ s.T).numpy(), _pinv(within), rtol=1e-9, atol=1e-12 * np.abs(_pinv(within)).max())
    total = x.numpy() - x.numpy().mean(0)
    s0 = rows.inverse_sqrt_total(torch.float64)
    np.testing.assert_allclose((s0 @ s0.T).numpy(), _pinv(total.T @ total / len(x)), rtol=1e-9, atol=1e-9)


def test_total_whitening_from_the_within_class_rows_equals_that_of_the_rows_centred_on_the_grand_mean(monkeypatch):
    """rmd's background on the Gram path: G_t and S_t from blocks of columns of the within-class rows,
    P = X_c O^T and Q = O O^T, never forming the rows about the grand mean, equal the Gram path on those rows
    formed explicitly (float64, within 1e-12); the blocks (here 3 of 64, 64 and 32 columns) change nothing."""
    x, y = _wide(n=70, c=5, dtype=torch.float64)
    x += 40  # a large common offset: the grand-mean centring must not cancel
    rows = FewRows()
    for i in range(0, len(x), 16):
        assert rows.add(x[i : i + 16], y[i : i + 16])
    rows.release()
    formed = x - rows.means[y] + (rows.means - rows.grand_mean)[y]  # what the call used to build
    np.testing.assert_allclose(formed.numpy(), x.numpy() - x.numpy().mean(0), atol=1e-12 * 40)
    reference = gram_inverse_sqrt(lambda: iter([(slice(0, 160), formed)]), len(x), torch.float64)
    monkeypatch.setattr(widefit, "BLOCK_BYTES", 8 * 70 * 64)
    blocks = [columns for columns, _ in rows.centred_columns()]
    s0 = rows.inverse_sqrt_total(torch.float64)
    assert blocks == [slice(0, 64), slice(64, 128), slice(128, 160)]
    assert s0.shape == reference.shape == (160, 69)  # rank N - 1: the grand mean takes one direction
    expected = (reference @ reference.T).numpy()
    np.testing.assert_allclose((s0 @ s0.T).numpy(), expected, rtol=0, atol=1e-12 * np.abs(expected).max())
    monkeypatch.setattr(widefit, "BLOCK_BYTES", 8 * 70 * 160)
    centred = next(rows.centred_columns())[1]  # a single block
    np.testing.assert_allclose(centred.numpy(), (x - rows.means[y]).numpy(), rtol=0, atol=0)


def test_mahalanobis_and_rmd_with_fewer_samples_than_dimensions_never_decompose_a_d_by_d_matrix(monkeypatch):
    """N = 60 < D / 2 = 80: only the 60 x 60 Gram matrix is decomposed, and the scores are the float64
    formula's with the D x D pseudo-inverse."""
    x, y = _wide()
    sizes = _decomposed_sizes(monkeypatch)
    maha = create("mahalanobis").fit(_batches(x, y))
    rmd = create("rmd").fit(_batches(x, y))
    assert sizes and max(sizes) == 60
    x64, q = x.double().numpy(), (torch.randn(40, 160, generator=torch.Generator().manual_seed(5)) + 1).double().numpy()
    means = np.stack([x64[y.numpy() == k].mean(0) for k in range(3)])
    centred = x64 - means[y.numpy()]
    precision = _pinv(centred.T @ centred / 60)
    distance = np.min([np.einsum("nd,de,ne->n", q - m, precision, q - m) for m in means], axis=0)
    np.testing.assert_allclose(maha.score(Batch(torch.from_numpy(q).float())).numpy(), distance, rtol=2e-4)
    assert not hasattr(maha, "covariance_") and not hasattr(rmd, "covariance_")  # no D x D matrix on this path
    total = x64 - x64.mean(0)
    background = np.einsum("nd,de,ne->n", q - x64.mean(0), _pinv(total.T @ total / 60), q - x64.mean(0))
    np.testing.assert_allclose(rmd.score(Batch(torch.from_numpy(q).float())).numpy(), distance - background, rtol=2e-3)


def test_a_stream_longer_than_half_the_dimension_streams_as_before(monkeypatch):
    """N = 200 > D / 2 = 80 (first in small batches, then one big batch): the rows are handed to the
    streaming statistics, the D x D covariance decides, and the result is the same as batch by batch."""
    x, y = _wide(n=200)
    sizes = _decomposed_sizes(monkeypatch)
    small = create("mahalanobis").fit(_batches(x, y, size=8))
    big = create("mahalanobis").fit([Batch(x[:24], labels=y[:24]), Batch(x[24:], labels=y[24:])])
    assert 60 not in sizes and all(s == 160 for s in sizes)
    torch.testing.assert_close(small.covariance_, big.covariance_, rtol=1e-12, atol=1e-12)
    x64 = x.double().numpy()
    means = np.stack([x64[y.numpy() == k].mean(0) for k in range(3)])
    np.testing.assert_allclose(small.class_means_.numpy(), means, rtol=1e-12)


def test_in_place_eigendecomposition_gives_the_matrix_back_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(30, 50, generator=g, dtype=torch.float64)
    matrix = rows.T @ rows  # rank 30 of 50
    matrix = (matrix + matrix.T) / 2
    original = matrix.clone()
    values, vectors = symmetric_eigh(matrix, symmetric=True)
    assert torch.equal(matrix, original)
    np.testing.assert_allclose(values.numpy(), np.linalg.eigvalsh(original.numpy()), atol=1e-10)
    np.testing.assert_allclose(((vectors * values) @ vectors.T).numpy(), original.numpy(), atol=1e-9)
    s = inverse_sqrt(matrix)  # rank-deficient: the eigen path, in place on the caller's matrix
    assert torch.equal(matrix, original)
    np.testing.assert_allclose((s @ s.T).numpy(), _pinv(original.numpy()), rtol=1e-8, atol=1e-10)


def test_vim_computes_only_the_residual_eigenvectors_and_matches_the_full_decomposition():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(400, 24, generator=g) @ torch.randn(24, 24, generator=g)
    weight, bias = torch.randn(5, 24, generator=g), torch.randn(5, generator=g)
    det = create("vim", dim=10).fit([Batch(x[i : i + 64]) for i in range(0, 400, 64)], head=(weight, bias))
    assert det.residual_space_.shape == (24, 14)
    centred = x.double() - linear_origin(weight, bias)
    _, vectors = np.linalg.eigh((centred.T @ centred / 400).numpy())
    residual = vectors[:, :14]
    projector = det.residual_space_.double() @ det.residual_space_.double().T
    np.testing.assert_allclose(projector.numpy(), residual @ residual.T, atol=1e-5)


# -- bounded inside a batch (issue 13.3) ----------------------------------------------------------------


def test_ood_rows_are_dropped_a_chunk_at_a_time_never_copying_a_whole_tensor(monkeypatch):
    from oodviz.detectors import fitdata

    monkeypatch.setattr(fitdata, "CHUNK_BYTES", 100 * (64 * 4 + 8))  # 100 rows of features and labels
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1000, 64, generator=g)
    labels = torch.arange(1000) % 4
    labels[::10] = -1  # OOD rows in every chunk
    data = fitdata.FitData([Batch(x, labels=labels)], None, create("mahalanobis"), None)
    for _ in range(2):  # the validating pass and a later one
        kept = list(data)
        assert len(kept) == 10 and all(len(b) == 90 for b in kept)
        assert all(b.features.untyped_storage().nbytes() <= 100 * 64 * 4 for b in kept)  # copies of one chunk
        assert torch.equal(torch.cat([b.features for b in kept]), x[labels != -1])
        assert torch.equal(torch.cat([b.labels for b in kept]), labels[labels != -1])


def test_one_big_batch_is_scored_in_row_chunks_with_the_scores_of_small_batches(monkeypatch):
    from oodviz.detectors import fitdata

    x, y = _wide(n=600, d=32, c=4)
    det = create("mahalanobis").fit(_batches(x, y, size=64))
    expected = torch.cat([det.score(Batch(x[i : i + 50])) for i in range(0, 600, 50)])
    monkeypatch.setattr(fitdata, "CHUNK_BYTES", 50 * 32 * 4)
    seen, score_rows = [], det._score

    def recording(batch):
        seen.append(len(batch))
        return score_rows(batch)

    monkeypatch.setattr(det, "_score", recording)
    torch.testing.assert_close(det.score(Batch(x)), expected, rtol=1e-6, atol=1e-5)
    assert seen == [50] * 12


@cuda
def test_a_big_cpu_batch_reaches_the_gpu_a_chunk_at_a_time():
    """A 64 MiB CPU batch fitted and scored on the GPU: the device never holds it whole."""
    x, y = _wide(n=65_536, d=256, c=4)  # 64 MiB of float32 features
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    det = create("mahalanobis").fit(Batch(x, labels=y), device="cuda")
    scores = det.score(Batch(x), device="cuda")
    assert torch.cuda.max_memory_allocated() - base < 48 * 2**20
    reference = create("mahalanobis").fit(_batches(x, y, size=4096)).score(Batch(x))
    torch.testing.assert_close(scores, reference, rtol=1e-3, atol=1e-3)


def test_on_an_oversubscribed_cpu_the_gram_eigendecomposition_runs_on_one_blas_thread(monkeypatch):
    """Load average above the core count: scipy's eigh runs inside a one-thread BLAS limit (threadpoolctl's own
    report, read in the call) and the whitening is still the float64 pseudo-inverse; below it, the BLAS keeps its
    threads."""
    import os

    from threadpoolctl import threadpool_info

    threads, eigh = [], scipy.linalg.eigh

    def recording(a, *args, **kwargs):
        threads.append({info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"})
        return eigh(a, *args, **kwargs)

    monkeypatch.setattr(scipy.linalg, "eigh", recording)
    x, y = _wide(dtype=torch.float64)
    for load in (4.0 * (os.cpu_count() or 1), 0.0):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        rows = FewRows()
        rows.add(x, y)
        rows.release()
        centred = (x - rows.means[y]).numpy()
        s = rows.inverse_sqrt_within(torch.float64)
        pinv = _pinv(centred.T @ centred / len(x))
        np.testing.assert_allclose((s @ s.T).numpy(), pinv, rtol=1e-9, atol=1e-12 * np.abs(pinv).max())
    blas_threads = {info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"}
    assert threads == [{1}, blas_threads]


def test_the_fit_memory_estimate_follows_the_path_the_fit_takes():
    """The pre-flight's bound: below D / 2 rows the Gram path's tensors (kept rows, G and U, the whitening, two
    blocks) times the slack, not the D x D covariance; issue 26 saw 429 GiB for 50 rows of an unpooled ViT layer."""
    from oodviz.detectors import detector_class
    from oodviz.detectors.stats import BLOCK_BYTES

    mahalanobis, rmd = detector_class("mahalanobis"), detector_class("rmd")
    d, c = 151_296, 10  # vit_b_16's tokens unpooled
    for n in (50, 256):
        tensors = 4 * n * d + max(16 * n * n, 8 * n * n + 4 * n * d) + 2 * BLOCK_BYTES  # float32 rows, float64 G
        assert mahalanobis.fit_memory_bytes(d, c, n) == int(2.0 * tensors + 16 * c * d)
        assert rmd.fit_memory_bytes(d, c, n) == int(2.0 * (tensors + 4 * n * d) + 16 * c * d)  # its first S too
    assert mahalanobis.fit_memory_bytes(d, c, 50) < 2**30 < 8 * d * d  # 155 MiB, where D x D float64 is 171 GiB
    # at D / 2 rows the Gram path's bound is below the streamed path's; one row more streams
    d = 2048
    assert mahalanobis.fit_memory_bytes(d, c, d // 2) < mahalanobis.fit_memory_bytes(d, c, d // 2 + 1)
    assert mahalanobis.fit_memory_bytes(d, c, d // 2 + 1) == int(8 * 2.5 * d * d + 16 * c * d)
    # the bound holds what bench/wide_fit.py measured (N = 1,000, D = 2,048: 50.7 and 58.7 MiB)
    assert mahalanobis.fit_memory_bytes(d, c, 1000) > 50.7 * 2**20 and rmd.fit_memory_bytes(d, c, 1000) > 58.7 * 2**20
    # and the path is the one the fit takes: FewRows keeps rows while at most D / 2
    few = FewRows()
    assert few.add(torch.zeros(d // 2, d), torch.zeros(d // 2, dtype=torch.long))
    assert not few.add(torch.zeros(1, d), torch.zeros(1, dtype=torch.long))
