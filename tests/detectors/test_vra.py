"""oodviz.detectors.vra (and the column quantiles it fits, oodviz.detectors.quantiles): parity with pytorch-ood 0.4 on the same inputs, float64 reference formulas written independently here,
its streaming statistics, and bad input."""

import numpy as np
import pytest
import torch
from detector_checks import fitted_scores
from helpers import Problem, assert_same_ranking, make_problem
from pytorch_ood import detector as pood
from scipy.special import logsumexp

from oodviz.detectors import create
from oodviz.detectors.quantiles import ColumnQuantiles, first_bits


def _relu(problem: Problem) -> Problem:
    f = lambda x: x.clamp(min=0)  # noqa: E731
    return Problem(f(problem.fit_x), problem.fit_y, f(problem.test_x), f(problem.ood_x), problem.weight, problem.bias)


@pytest.fixture(scope="module")
def relu_problem(problem):
    """Post-ReLU features (many exact zeros: ties in every unit's order statistics)."""
    return _relu(problem)


def _energy(x, w, b):
    return -logsumexp(x @ w.T + b, axis=1)


VRA_CASES = [((1, 99), "raw"), ((10, 90), "raw"), ((25, 75), "relu"), ((5, 95), "relu"), ((0, 100), "raw")]


@pytest.mark.parametrize(("percentiles", "kind"), VRA_CASES)
def test_vra_matches_pytorch_ood_and_the_float64_formula(problem, relu_problem, percentiles, kind):
    p = relu_problem if kind == "relu" else problem
    lower, upper = percentiles
    det, ours = fitted_scores(p, "vra", lower_percentile=lower, upper_percentile=upper)
    with torch.no_grad():
        theirs = pood.VRA(None, p.logits, lower_percentile=lower / 100, upper_percentile=upper / 100)
        theirs = theirs.fit_feature_maps(p.fit_x, p.fit_y).predict_feature_maps(p.eval_x).double().numpy()
    assert_same_ranking(ours, theirs, n_id=len(p.test_x))
    fx, ex = p.fit_x.double().numpy(), p.eval_x.double().numpy()
    lo, hi = np.quantile(fx, lower / 100, axis=0), np.quantile(fx, upper / 100, axis=0)
    np.testing.assert_array_equal(det.lower_threshold_.numpy(), lo.astype(np.float32))
    np.testing.assert_array_equal(det.upper_threshold_.numpy(), hi.astype(np.float32))
    expected = _energy(np.clip(ex, lo, hi), p.weight.double().numpy(), p.bias.double().numpy())
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_column_quantiles_are_numpys_exactly_for_any_batching(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(500, 7, generator=g) * 100, torch.zeros(200, 7), -torch.rand(301, 7, generator=g)])
    x[:, 3] = 2.5  # a constant unit
    x[::7, 5] = -0.0  # signed zeros among the zeros
    x = x.to(dtype)
    x = x[torch.randperm(len(x), generator=g)]
    quantiles = [0.0, 0.013, 0.5, 0.77, 0.999, 1.0]
    expected = np.quantile(x.float().numpy().astype(np.float64), quantiles, axis=0)
    for size in (1001, 64, 13):
        streaming = ColumnQuantiles(quantiles)
        while not streaming.complete:
            for start in range(0, len(x), size):
                streaming.update(x[start : start + size])
            streaming = streaming.next_pass()
        np.testing.assert_array_equal(streaming.result().numpy(), expected)


def test_column_quantiles_state_does_not_grow_with_n_and_refuses_changed_passes():
    sizes = []
    for n in (100, 5000):
        x = 1 + torch.rand(n, 5, generator=torch.Generator().manual_seed(n)) * 2.0**-10  # one bin of the first pass
        streaming = ColumnQuantiles([0.1, 0.9])
        streaming.update(x)
        sizes.append(streaming.counts.numel())
        streaming = streaming.next_pass()
        streaming.update(x[1:])
        with pytest.raises(ValueError, match=rf"a pass saw {n - 1} rows, the first saw {n}"):
            streaming.next_pass()
    assert sizes[0] == sizes[1] == 5 * 2 ** first_bits(5) == 5 * 65536
    assert 512 * 2 ** first_bits(512) == 2048 * 2 ** first_bits(2048) == 2**20  # about a million counts


def test_vra_percentiles_in_percent_and_ordered(relu_problem):
    with pytest.raises(ValueError, match="lower_percentile=60 exceeds upper_percentile=40"):
        create("vra", lower_percentile=60, upper_percentile=40)
    with pytest.raises(ValueError, match="upper_percentile"):
        create("vra", upper_percentile=101)
    with pytest.raises(ValueError, match=r"needs the classifier's final linear layer"):
        create("vra").fit(relu_problem.fit_batches())


def test_vra_state_is_independent_of_n():
    sizes = []
    for n in (300, 3000):
        p = make_problem(n_fit=n)
        det = create("vra").fit(p.fit_batches(), head=p.head)
        sizes.append(sum(v.numel() for v in vars(det).values() if isinstance(v, torch.Tensor)))
    assert sizes[0] == sizes[1]
