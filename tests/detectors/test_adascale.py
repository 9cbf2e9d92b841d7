"""oodviz.detectors.adascale: against a float64 reference written here from the OpenOOD v1.5 code, on a tiny CNN."""

import copy

import numpy as np
import pytest
import torch
from detector_checks import spearman
from scipy.special import logsumexp
from wide_cnn import WideCNN, images, wide_backbone_of

from oodviz import Batch
from oodviz.detectors import NotFittedError, create


def openood_adascale(model, fit_x, x, variant, p_min, p_max, k1, k2, lmbda, o):
    """OpenOOD v1.5's AdaSCALE postprocessor and AdaScaleNet, in float64 on a copy of the model (stable ties)."""
    net = copy.deepcopy(model).double()

    def features(t):
        return net.pool(net.feature_map(t)).flatten(1)

    def q_of(t):
        t = t.double().clone().requires_grad_(True)
        f = features(t)
        out = net.fc(f)
        out[torch.arange(len(t)), out.argmax(1)].backward(torch.ones(len(t), dtype=torch.float64))
        grad = t.grad.detach().reshape(len(t), -1).numpy()
        n_pixels = int(grad.shape[1] * o)
        mask = np.zeros_like(grad)
        np.put_along_axis(mask, np.argsort(np.abs(grad), axis=1, kind="stable")[:, :n_pixels], 1.0, axis=1)
        moved = t.detach() + torch.from_numpy(np.sign(grad) * mask * 0.5).view_as(t)
        with torch.no_grad():
            f, f_moved = f.detach().numpy(), features(moved).numpy()
        d = f.shape[1]
        order = np.argsort(-f, axis=1, kind="stable")
        top1, top2 = order[:, : max(1, int(d * k1 / 100))], order[:, : max(1, int(d * k2 / 100))]
        q = np.take_along_axis(np.maximum(f_moved, 0), top1, 1).sum(1)
        return q + lmbda * np.take_along_axis(np.abs(f - f_moved), top2, 1).sum(1), f

    fit_q, _ = q_of(fit_x)
    q, f = q_of(x)
    ecdf = np.searchsorted(np.sort(fit_q.astype(np.float32)), q.astype(np.float32), side="right") / len(fit_q)
    p = p_min + (1 - ecdf) * (p_max - p_min)
    a = np.maximum(f, 0)
    d = a.shape[1]
    ks = d - np.round(d * p / 100.0).astype(int)
    top_sums = np.array([np.sort(row)[::-1][:k].sum() for row, k in zip(a, ks, strict=True)])
    scale = a.sum(1) / top_sums
    w, b = net.fc.weight.detach().numpy(), net.fc.bias.detach().numpy()
    logits = (f * np.exp(scale)[:, None]) @ w.T + b if variant == "a" else (f @ w.T + b) * (scale**2)[:, None]
    return -logsumexp(logits, axis=1), p


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"variant": "l", "min_percentile": 60.0, "max_percentile": 90.0, "k1": 20.0, "k2": 10.0, "lmbda": 2.0},
        {"variant": "a", "min_percentile": 80.0, "max_percentile": 85.0, "k1": 10.0, "k2": 5.0, "o": 0.2},
    ],
)
def test_adascale_equals_the_openood_procedure_in_float64(params):
    model, fit_x, x = WideCNN(), images(60, seed=2), images(40, seed=3, spread=6.0)
    full = {
        "variant": "a",
        "min_percentile": 75.0,
        "max_percentile": 85.0,
        "k1": 5.0,
        "k2": 1.0,
        "lmbda": 10.0,
        "o": 0.05,
    }
    full |= params
    det = create("adascale", model=wide_backbone_of(model), **params).fit(
        [Batch(inputs=fit_x[:25]), Batch(inputs=fit_x[25:])]
    )
    ours = det.score(Batch(inputs=x)).double().numpy()
    expected, p = openood_adascale(
        model,
        fit_x,
        x,
        full["variant"],
        full["min_percentile"],
        full["max_percentile"],
        full["k1"],
        full["k2"],
        full["lmbda"],
        full["o"],
    )
    assert len(np.unique(p)) > 10  # the percentile does adapt per sample
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)
    assert spearman(ours, expected) > 0.9999
    # a plain module returning (features, logits) with the head given to fit gives the same scores
    plain = lambda t: (model.pool(model.feature_map(t)).flatten(1), model(t))  # noqa: E731
    other = create("adascale", model=plain, **params).fit(Batch(inputs=fit_x), head=model.fc)
    torch.testing.assert_close(other.score(Batch(inputs=x)), det.score(Batch(inputs=x)))


def test_adascale_says_what_it_needs():
    model = WideCNN()
    with pytest.raises(ValueError, match="needs the classifier's final linear layer"):
        create("adascale", model=lambda t: (model.pool(model.feature_map(t)).flatten(1), model(t))).fit(
            Batch(inputs=images(4))
        )
    assert [create("adascale").kept(32, k) for k in (1.0, 5.0, 10.0)] == [1, 1, 3]  # at least one feature
    with pytest.raises(NotFittedError, match="call fit"):
        create("adascale", model=wide_backbone_of(model), k1=10.0, k2=5.0).score(Batch(inputs=images(4)))
    with pytest.raises(ValueError, match="min_percentile=90 exceeds max_percentile=80"):
        create("adascale", min_percentile=90.0, max_percentile=80.0)
    with pytest.raises(ValueError, match="variant must be 'a'"):
        create("adascale", variant="b")
