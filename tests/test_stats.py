"""Streaming statistics: exact against float64 references, stable, and mergeable across shards."""

import numpy as np
import torch

from oodviz.detectors import create
from oodviz.detectors.stats import ClassMeans, ClassMoments


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
    whole = ClassMoments()
    whole.update(x, y)
    shard_a, shard_b = ClassMoments(), ClassMoments()
    shard_a.update(x[:400], y[:400])
    y_b = y[400:].clone()
    shard_b.update(x[400:][y_b < 3], y_b[y_b < 3])  # shard b never sees class 3: fewer rows
    shard_b.update(x[400:][y_b == 3], y_b[y_b == 3])
    merged = ClassMoments().merge(shard_a).merge(shard_b)
    torch.testing.assert_close(merged.means, whole.means, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged.within, whole.within, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(merged.counts, whole.counts)

    sums_a, sums_b, sums = ClassMeans(), ClassMeans(), ClassMeans()
    sums_a.update(x[:10], torch.zeros(10, dtype=torch.long))  # one class only: fewer rows than b
    sums_b.update(x[10:], y[10:])
    sums.update(x[:10], torch.zeros(10, dtype=torch.long))
    sums.update(x[10:], y[10:])
    sums_a.merge(sums_b)
    torch.testing.assert_close(sums_a.means, sums.means)


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
