"""oodviz.detectors.weiper: against a float64 reference written here from the OpenOOD v1.5 code."""

import numpy as np
import pytest
import torch
from detector_checks import auroc, spearman
from scipy.special import softmax

from oodviz.detectors import create


def openood_weiper_kld(problem, n_repeats, delta, n_bins, s1, s2, lambda_1, lambda_2, seed):
    """OpenOOD v1.5's WeiPer+KLD (``exact_minmax=True``), step by step, in numpy float64 (float32 bin edges)."""
    w, b = problem.weight.double().numpy(), problem.bias.double().numpy()
    noise = torch.randn((n_repeats, *w.shape), generator=torch.Generator().manual_seed(seed)).double().numpy()
    noise /= np.linalg.norm(noise, axis=2, keepdims=True)
    w_tilde = (w + delta * np.linalg.norm(w, axis=1)[None, :, None] * noise).reshape(-1, w.shape[1])
    b_tilde = np.tile(b, n_repeats)
    fit, ev = problem.fit_x.double().numpy(), problem.eval_x.double().numpy()

    def edges(values):  # linspace(min, max + 1e-8, n_bins + 1) in float32, as OpenOOD's jit linspace
        lo, hi = np.float32(values.min()), np.float32(values.max())
        steps = np.arange(n_bins + 1, dtype=np.float32) / np.float32(n_bins)
        return lo + steps * (hi + np.float32(1e-8) - lo)

    def density(values, e):  # per row, the fraction of its values in [e_j, e_j+1)
        index = np.searchsorted(e, values.astype(np.float32), side="right") - 1
        return np.stack([np.bincount(i[(i >= 0) & (i < n_bins)], minlength=n_bins) / len(i) for i in index])

    def smooth(q, size):  # OpenOOD's UniformKernel: a replicate-padded "same" Conv1d, one channel per sample
        conv = torch.nn.Conv1d(len(q), len(q), size, padding="same", padding_mode="replicate", bias=False).double()
        with torch.no_grad():
            conv.weight.zero_()
            conv.weight[range(len(q)), range(len(q))] = 1.0 / size
            return conv(torch.from_numpy(q)).numpy()

    def kl(p, q, eps):
        p_, q_ = p + eps, q + eps
        p_, q_ = p_ / p_.sum(), q_ / q_.sum(axis=1, keepdims=True)
        return (p_ * np.log(p_ / q_)).sum(1) + (q_ * np.log(q_ / p_)).sum(1)

    fit_p, ev_p = fit @ w_tilde.T + b_tilde, ev @ w_tilde.T + b_tilde
    e, e_p = edges(fit.astype(np.float32)), edges(fit_p.astype(np.float32))
    p, p_p = density(fit, e).mean(0), density(fit_p, e_p).mean(0)
    q, q_p = smooth(density(ev, e), s1), smooth(density(ev_p, e_p), s2)
    msp = softmax(ev_p.reshape(len(ev), n_repeats, -1), axis=2).max(2).mean(1)
    return kl(p, q, 0.01) + lambda_1 * kl(p_p, q_p, 0.025) - lambda_2 * msp, msp


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"n_repeats": 7, "perturbation": 0.8, "n_bins": 30, "smoothing": 5, "smoothing_perturbed": 4, "lambda_1": 2.5},
    ],
)
def test_weiper_kld_equals_the_openood_procedure_in_float64(problem, params):
    full = {"n_repeats": 100, "perturbation": 2.1, "n_bins": 100, "smoothing": 20, "smoothing_perturbed": 20}
    full |= {"lambda_1": 1.0, "lambda_2": 1.0, "seed": 0} | params
    det = create("weiper", **params).fit(problem.fit_batches(), head=problem.head)
    ours = det.score(problem.batches(problem.eval_x)).double().numpy()
    expected, msp = openood_weiper_kld(
        problem,
        full["n_repeats"],
        full["perturbation"],
        full["n_bins"],
        full["smoothing"],
        full["smoothing_perturbed"],
        full["lambda_1"],
        full["lambda_2"],
        full["seed"],
    )
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)
    assert spearman(ours, expected) > 0.9999
    n_id = len(problem.test_x)
    assert abs(auroc(ours, n_id) - auroc(expected, n_id)) < 1e-5
    assert auroc(ours, n_id) > 0.6  # the OOD set lies between the classes: the score separates it
    # WeiPer+MSP is the mean MSP of the perturbed heads alone
    msp_only = create("weiper", variant="msp", **params).fit(problem.fit_batches(), head=problem.head)
    np.testing.assert_allclose(msp_only.score(problem.batches(problem.eval_x)).numpy(), -msp, rtol=1e-5, atol=1e-6)


def test_weiper_perturbed_rows_have_the_relative_length_and_a_seed(problem):
    det = create("weiper", n_repeats=5, perturbation=0.5, seed=3).fit(problem.fit_batches(), head=problem.head)
    w = problem.weight.double()
    moved = det.perturbed_weight_.double().view(5, *w.shape) - w
    torch.testing.assert_close(moved.norm(dim=2), 0.5 * w.norm(dim=1).expand(5, -1))
    again = create("weiper", variant="msp", n_repeats=5, perturbation=0.5, seed=3).fit(
        problem.fit_batches(), head=problem.head
    )
    assert torch.equal(again.perturbed_weight_, det.perturbed_weight_)
    other = create("weiper", variant="msp", n_repeats=5, perturbation=0.5, seed=4).fit(
        problem.fit_batches(), head=problem.head
    )
    assert not torch.equal(other.perturbed_weight_, det.perturbed_weight_)
    # the mean histograms are densities over the bins (mass outside [min, max) only from the maximum)
    assert det.feature_density_.sum() == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(ValueError, match="variant must be 'kld'"):
        create("weiper", variant="react")
    with pytest.raises(ValueError, match="n_bins must be an integer >= 2"):
        create("weiper", n_bins=1)
