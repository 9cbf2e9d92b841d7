"""Streaming statistics: exact against float64 references, stable, and mergeable across shards."""

import numpy as np
import torch

from oodviz.detectors import create
from oodviz.detectors.mahalanobis import inverse_sqrt
from oodviz.detectors.stats import ClassMeans, ClassMoments, add_gram, mirror_lower, symmetric_eigh, torch_on_one_thread


def _data(n=2000, d=5, c=4, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, c, (n,), generator=g)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) + 2 * y[:, None] + offset
    return x, y


def _reference(x, y, c):
    x, y = x.numpy(), y.numpy()
    means = np.stack([x[y == k].mean(0) for k in range(c)])
    within = sum((x[y == k] - means[k]).T @ (x[y == k] - means[k]) for k in range(c))
    total = (x - x.mean(0)).T @ (x - x.mean(0))
    return means, within, total


def test_class_moments_match_the_two_pass_formula_for_any_batching():
    x, y = _data()
    means, within, total = _reference(x, y, 4)
    for size in (1, 7, 256, 2000):
        m = ClassMoments()
        for i in range(0, len(x), size):
            m.update(x[i : i + size], y[i : i + size])
        np.testing.assert_allclose(m.means.numpy(), means, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(m.within.numpy(), within, rtol=1e-10)
        np.testing.assert_allclose(m.total_scatter().numpy(), total, rtol=1e-10)
        assert m.counts.tolist() == np.bincount(y.numpy()).tolist()


def test_covariance_is_stable_under_a_large_offset():
    """Features of mean 1e6 and unit spread: sum(x x^T) - N mu mu^T would lose every digit."""
    x, y = _data(offset=1e6)
    centred_x, _ = _data(offset=0.0)
    m = ClassMoments()
    for i in range(0, len(x), 100):
        m.update(x[i : i + 100], y[i : i + 100])
    _, within, _ = _reference(centred_x, y, 4)  # the same spread, computed without the offset
    np.testing.assert_allclose(m.within.numpy(), within, rtol=1e-6)
    xn, yn = x.numpy(), y.numpy()
    naive = xn.T @ xn - sum((yn == k).sum() * np.outer(xn[yn == k].mean(0), xn[yn == k].mean(0)) for k in range(4))
    assert np.abs(naive - within).max() > 1e3 * np.abs(m.within.numpy() - within).max()


def test_shards_merge_to_the_statistics_of_the_whole():
    x, y = _data(n=1500)
    means, within, _ = _reference(x, y, 4)
    shard_a, shard_b = ClassMoments(), ClassMoments()
    shard_a.update(x[:400], y[:400])
    y_b = y[400:].clone()
    shard_b.update(x[400:][y_b < 3], y_b[y_b < 3])  # shard b's first update has no class 3: fewer rows
    shard_b.update(x[400:][y_b == 3], y_b[y_b == 3])
    merged = ClassMoments().merge(shard_a).merge(shard_b)
    np.testing.assert_allclose(merged.means.numpy(), means, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(merged.within.numpy(), within, rtol=1e-10, atol=1e-9)
    assert merged.counts.tolist() == np.bincount(y.numpy()).tolist()

    sums_a, sums_b = ClassMeans(), ClassMeans()
    y_first_ten_zero = torch.cat([torch.zeros(10, dtype=torch.long), y[10:]])
    sums_a.update(x[:10], y_first_ten_zero[:10])  # one class only: fewer rows than b
    sums_b.update(x[10:], y[10:])
    sums_a.merge(sums_b)
    np.testing.assert_allclose(sums_a.means.numpy(), _reference(x, y_first_ten_zero, 4)[0], rtol=1e-12, atol=1e-12)


def test_empty_classes_reports_classes_beyond_the_largest_label():
    m = ClassMeans()
    m.update(torch.ones(3, 2), torch.tensor([0, 0, 2]))
    assert m.empty_classes() == [1]
    assert m.empty_classes(n_classes=5) == [1, 3, 4]


def test_mahalanobis_fit_is_exact_for_float64_features():
    x, y = _data(n=900, offset=50.0)
    from oodviz import Batch

    det = create("mahalanobis").fit([Batch(x[i : i + 64], labels=y[i : i + 64]) for i in range(0, 900, 64)])
    means, within, _ = _reference(x, y, 4)
    np.testing.assert_allclose(det.class_means_.numpy(), means, rtol=1e-12)
    np.testing.assert_allclose(det.covariance_.numpy(), within / 900, rtol=1e-9)


def _random_spd(d, seed=0, condition=10.0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    eigenvalues = torch.logspace(0, -np.log10(condition), d, dtype=torch.float64)
    return (q * eigenvalues) @ q.T


def test_inverse_sqrt_of_a_well_conditioned_matrix_is_the_inverse_cholesky_factor():
    a = _random_spd(40)
    s = inverse_sqrt(a)
    assert torch.equal(s, s.triu())  # L^-T: the Cholesky path, no eigendecomposition
    np.testing.assert_allclose((s @ s.T).numpy(), np.linalg.inv(a.numpy()), rtol=1e-10, atol=1e-12)


def test_inverse_sqrt_of_a_rank_deficient_matrix_is_the_pseudo_inverse():
    """A dead unit (zero row and column) and a duplicated feature: rank 38 of 40."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(500, 40, generator=g, dtype=torch.float64)
    x[:, 7] = 0.0
    x[:, 12] = x[:, 3]
    a = x.T @ x / 500
    s = inverse_sqrt(a)
    assert s.shape == (40, 38)
    reference = np.linalg.pinv(a.numpy(), rcond=40 * np.finfo(np.float64).eps, hermitian=True)
    np.testing.assert_allclose((s @ s.T).numpy(), reference, atol=1e-9)


def test_inverse_sqrt_falls_back_to_eigh_when_the_condition_number_may_be_too_large():
    """Condition 1e14: all eigenvalues are above the cutoff (40 eps = 9e-15), but the trace bound
    (up to D^2 times the condition number) cannot show it, so the eigendecomposition decides."""
    a = _random_spd(40, condition=1e14)
    s = inverse_sqrt(a)
    assert s.shape == (40, 40) and not torch.equal(s, s.triu())
    # The numbers, not only the path: s s^T is a generalised inverse of a (a X a = a), and s whitens a
    # (s^T a s = I, to the ~1e-3 that a condition number of 1e14 leaves of float64's digits).
    np.testing.assert_allclose((a @ s @ s.T @ a).numpy(), a.numpy(), rtol=0, atol=1e-13)
    np.testing.assert_allclose((s.T @ a @ s).numpy(), np.eye(40), rtol=0, atol=1e-2)


def test_mahalanobis_with_dead_and_duplicated_units_matches_the_float64_pseudo_inverse():
    x, y = _data(n=1200, d=8, c=3)
    x = torch.cat([x, torch.zeros(len(x), 1, dtype=x.dtype), x[:, :1]], dim=1)  # dead unit, copy of unit 0
    from oodviz import Batch

    det = create("mahalanobis").fit([Batch(x[i : i + 100], labels=y[i : i + 100]) for i in range(0, 1200, 100)])
    query = torch.randn(50, 10, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    means, within, _ = _reference(x, y, 3)
    precision = np.linalg.pinv(within / 1200, rcond=10 * np.finfo(np.float64).eps, hermitian=True)
    q = query.numpy()
    expected = np.min([np.einsum("nd,de,ne->n", q - m, precision, q - m) for m in means], axis=0)
    np.testing.assert_allclose(det.score(Batch(query)).numpy(), expected, rtol=1e-4)


def test_symmetric_updates_match_a_full_product_in_either_triangle():
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(300, 16, generator=g, dtype=torch.float64)
    accumulator = torch.eye(16, dtype=torch.float64)
    lower_only = add_gram(accumulator, rows)
    add_gram(accumulator, rows[:50], alpha=-1.0)
    expected = torch.eye(16, dtype=torch.float64) + rows[50:].T @ rows[50:]
    torch.testing.assert_close(accumulator.tril(), expected.tril())
    if lower_only:
        mirror_lower(accumulator)
    torch.testing.assert_close(accumulator, expected)
    eigenvalues, _ = symmetric_eigh(expected.tril())  # reads the lower triangle only
    torch.testing.assert_close(eigenvalues, torch.linalg.eigvalsh(expected))


def test_torch_on_one_thread_restores_the_thread_count_after_an_error():
    threads = torch.get_num_threads()
    try:
        with torch_on_one_thread(torch.device("cpu")):
            assert torch.get_num_threads() == 1
            raise KeyError("inside")
    except KeyError:
        pass
    assert torch.get_num_threads() == threads


def test_all_finite_needs_no_full_size_temporary_and_survives_an_overflowing_sum():
    from oodviz.detectors.base import all_finite

    big = torch.full((64, 8), 3e38)  # every value finite, their float32 sum is inf
    assert all_finite(big)
    assert all_finite(torch.full((64, 8), 6e4, dtype=torch.float16))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = big.clone()
        x[40, 3] = bad
        assert not all_finite(x)
        assert not all_finite(torch.ones(64, 8).index_put_((torch.tensor([5]), torch.tensor([2])), torch.tensor(bad)))
    assert all_finite(torch.arange(5))
