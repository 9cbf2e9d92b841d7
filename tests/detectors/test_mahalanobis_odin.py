"""oodviz.detectors.mahalanobis_odin: against float64 references written here (a closed form on a linear model,
per-sample autograd on a CNN), against pytorch-ood 0.4's MahalanobisODIN (imported, and its formulas written out),
and against mahalanobis itself (the same Gaussians, bit for bit)."""

import copy

import numpy as np
import pytest
import torch
from detector_checks import auroc, spearman
from helpers import assert_same_ranking
from kernels import assert_kernel_close
from pytorch_ood.detector import MahalanobisODIN as PoodMahalanobisODIN
from tiny_cnn import TinyCNN, backbone_of, inputs
from torch import nn
from wide_cnn import WideCNN, labelled_images, wide_backbone_of

from oodviz import Batch
from oodviz.detectors import NotFittedError, create, detector_class
from oodviz.detectors.mahalanobis_odin import EPSILON_GRID, MahalanobisODIN


def labelled(n, seed):
    """``n`` TinyCNN inputs, labelled ``0..4`` in turn (five overlapping Gaussians: the closest class varies)."""
    return inputs(n=n, seed=seed), torch.arange(n) % 5


def split(x, y, size=37):
    return [Batch(inputs=a, labels=b) for a, b in zip(x.split(size), y.split(size), strict=True)]


def id_and_ood(n=60):
    """Held-out ID inputs (another seed than the fit's) then OOD ones: the same images shifted and scaled up."""
    x_id = inputs(n=n, seed=11)
    x_ood = 1.5 * inputs(n=n, seed=12) + 0.8
    return torch.cat([x_id, x_ood])


def float64_gaussians(features, labels):
    """Class means ``[C, D]`` and the precision ``Sigma^-1`` of the tied covariance ``1/N sum (f - mu_y)(f - mu_y)^T``,
    in numpy float64 (the paper's estimate)."""
    f, y = np.asarray(features, dtype=np.float64), np.asarray(labels)
    means = np.stack([f[y == k].mean(axis=0) for k in range(y.max() + 1)])
    centred = f - means[y]
    return means, np.linalg.inv(centred.T @ centred / len(f))


def distances(f, means, precision):
    """``M_k(f)`` ``[B, C]``: the squared Mahalanobis distance of each row to each class mean (solved, not whitened)."""
    d = f[:, None, :] - means[None, :, :]
    return np.einsum("bcd,de,bce->bc", d, precision, d)


# ---- float64 references ------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon, std", [(0.002, None), (0.05, [0.5, 1.0, 2.0]), (0.0, None)])
def test_equals_a_float64_closed_form_on_a_linear_feature_map(epsilon, std):
    """For features ``f(x) = A x + c`` the gradient of ``M_k(x)`` is ``2 A^T Sigma^-1 (f(x) - mu_k)``: no autograd."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(6, 3 * 8 * 8, generator=g, dtype=torch.float64) * 0.2
    c = torch.randn(6, generator=g, dtype=torch.float64)
    head = torch.randn(4, 6, generator=g, dtype=torch.float64)
    encoder = nn.Linear(3 * 8 * 8, 6)
    with torch.no_grad():
        encoder.weight.copy_(a)
        encoder.bias.copy_(c)

    def model(t):  # (features, logits), a plain callable
        f = encoder(t.flatten(1))
        return f, f @ head.float().T

    fit_x = inputs(n=120, seed=2)
    fit_y = (fit_x.double().flatten(1) @ a.T + c) @ head.T
    fit_y = fit_y.argmax(dim=1)
    x = id_and_ood(30)
    det = create("mahalanobis_odin", model=model, epsilon=epsilon, norm_std=std).fit(split(fit_x, fit_y))
    ours = det.score(Batch(inputs=x)).double().numpy()

    features = (fit_x.double().flatten(1) @ a.T + c).numpy()
    means, precision = float64_gaussians(features, fit_y.numpy())
    flat = x.double().flatten(1).numpy()
    f = flat @ a.numpy().T + c.numpy()
    closest = distances(f, means, precision).argmin(axis=1)
    gradient = 2 * (f - means[closest]) @ precision @ a.numpy()  # [B, 192]: d/dx of M_closest
    step = np.sign(gradient).reshape(x.shape)
    if std is not None:
        step = step / np.asarray(std).reshape(1, 3, 1, 1)
    moved = flat - epsilon * step.reshape(len(x), -1)
    expected = distances(moved @ a.numpy().T + c.numpy(), means, precision).min(axis=1)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * expected.max())
    if epsilon:  # the step moves ID inputs towards their class mean: their distance drops
        before = distances(f, means, precision).min(axis=1)
        assert (expected < before).mean() > 0.9 and not np.allclose(ours, before, rtol=1e-3)


@pytest.mark.parametrize("epsilon", [0.002, 0.02])
def test_equals_per_sample_float64_autograd_on_a_cnn(epsilon):
    """The definition, one input at a time, on a float64 copy of the model: the closest class on the unperturbed
    features, the gradient of its distance, the step, the minimum distance over every class of the moved input."""
    model = TinyCNN()
    bb = backbone_of(model)
    fit_x, fit_y = labelled(200, seed=2)
    x = id_and_ood(30)
    ours = create("mahalanobis_odin", model=bb, epsilon=epsilon).fit(split(fit_x, fit_y)).score(Batch(inputs=x))

    net = copy.deepcopy(model).double()

    def features(t):
        return net.flatten(net.pool(torch.relu(net.conv2(torch.relu(net.bn(net.conv1(t)))))))

    with torch.no_grad():
        means, precision = float64_gaussians(features(fit_x.double()).numpy(), fit_y.numpy())
    means_t, precision_t = torch.from_numpy(means), torch.from_numpy(precision)
    expected = []
    for one in x.double():
        one = one[None].clone().requires_grad_(True)
        f = features(one)
        with torch.no_grad():
            k = int(distances(f.numpy(), means, precision).argmin())
        d = f[0] - means_t[k]
        (gradient,) = torch.autograd.grad(d @ precision_t @ d, one)
        moved = (one - epsilon * gradient.sign()).detach()
        with torch.no_grad():
            expected.append(distances(features(moved).numpy(), means, precision).min())
    expected = np.array(expected)
    np.testing.assert_allclose(ours.double().numpy(), expected, rtol=1e-4, atol=1e-5 * expected.max())
    assert spearman(ours, expected) > 0.9999


# ---- pytorch-ood 0.4 -----------------------------------------------------------------------------


def pood_formula(encoder, fit_features, fit_labels, x, eps, norm_std=None):
    """pytorch-ood 0.4's MahalanobisODIN as its code reads (mahalanobis.py), written out in float64: ``Sigma`` the
    unnormalised within-class scatter plus ``1e-6 I`` (``torch.linalg.inv``); the loss the batch mean of half the
    distance to the closest class; ``x' = x - eps * sign(grad) / norm_std``; the score half the smallest distance."""
    z, y = fit_features.double(), fit_labels
    mu = torch.stack([z[y == k].mean(dim=0) for k in range(int(y.max()) + 1)])
    scatter = sum((z[y == k] - mu[k]).T @ (z[y == k] - mu[k]) for k in range(len(mu)))
    precision = torch.linalg.inv(scatter + 1e-6 * torch.eye(len(scatter), dtype=torch.float64))

    def half_distances(f):  # [B, C]
        centred = f[:, None, :] - mu[None]
        return 0.5 * torch.einsum("bcd,de,bce->bc", centred, precision, centred)

    x = x.double().clone().requires_grad_(True)
    f = encoder(x)
    closest = half_distances(f.detach()).argmin(dim=1)
    centred = f - mu[closest]
    loss = (0.5 * ((centred @ precision) * centred).sum(dim=1)).mean()
    (gradient,) = torch.autograd.grad(loss, x)
    step = gradient.sign()
    if norm_std:
        step = step / torch.tensor(norm_std, dtype=torch.float64).view(1, -1, 1, 1)
    moved = (x - eps * step).detach()
    with torch.no_grad():
        return half_distances(encoder(moved)).min(dim=1).values


@pytest.mark.parametrize("eps, norm_std", [(0.002, None), (0.01, [0.2, 0.5, 1.5])])
def test_matches_pytorch_ood_and_its_formulas(eps, norm_std):
    model = TinyCNN()
    bb = backbone_of(model)
    fit_x, fit_y = labelled(240, seed=2)
    x = id_and_ood(60)
    det = create("mahalanobis_odin", model=bb, epsilon=eps, norm_std=norm_std).fit(split(fit_x, fit_y))
    ours = det.score(Batch(inputs=x)).double().numpy()
    fit_features = bb.features_and_logits(fit_x)[0]
    # the library itself, given an encoder that keeps the graph and the same fit features
    reference = PoodMahalanobisODIN(lambda t: bb.features_and_logits(t, grad=True)[0], eps=eps, norm_std=norm_std)
    theirs = reference.fit_features(fit_features, fit_y).predict(x).detach().double().numpy()
    assert_same_ranking(ours, theirs, n_id=60)
    # its formulas written out in float64, on a float64 copy of the model
    net = copy.deepcopy(model).double()
    encoder = lambda t: net.flatten(net.pool(torch.relu(net.conv2(torch.relu(net.bn(net.conv1(t)))))))  # noqa: E731
    written = pood_formula(encoder, fit_features, fit_y, x, eps, norm_std).numpy()
    assert_same_ranking(ours, written, n_id=60)
    # the same distances: pytorch-ood's precision is N times the paper's and its score half the distance; its ridge
    # 1e-6 I moves them by up to 7e-4 here (the scatter's smallest eigenvalue is 1.5e-3)
    np.testing.assert_allclose(ours, 2 * len(fit_x) * written, rtol=1e-3)
    np.testing.assert_allclose(theirs, written, rtol=1e-3)
    assert (
        auroc(ours, 60)
        > auroc(create("mahalanobis_odin", model=bb, epsilon=0.0).fit(split(fit_x, fit_y)).score(Batch(inputs=x)), 60)
        - 0.05
    )  # the step does not ruin the detector here


# ---- mahalanobis's Gaussians ---------------------------------------------------------------------


@pytest.mark.parametrize("n_fit", [200, 12])  # streamed (N > D / 2) and the Gram path (N <= D / 2 = 16)
def test_fits_mahalanobis_gaussians_and_epsilon_zero_is_mahalanobis(n_fit):
    model = WideCNN()
    bb = wide_backbone_of(model)
    fit_x, fit_y = labelled_images(n_fit)
    x = labelled_images(50, seed=9)[0] * 2
    det = create("mahalanobis_odin", model=bb, epsilon=0.0).fit(split(fit_x, fit_y, size=7))
    features = bb.features_and_logits(fit_x)[0]
    plain = create("mahalanobis").fit([Batch(features=f, labels=y) for f, y in zip(features.split(7), fit_y.split(7))])
    for key in ("class_counts_", "class_means_", "center_", "whitening_", "whitened_means_", "whitened_norms_"):
        assert torch.equal(getattr(det, key), getattr(plain, key)), key
    assert hasattr(det, "covariance_") == (n_fit == 200) == hasattr(plain, "covariance_")
    assert det.n_features_in_ == 32 and det.n_classes_ == 5 and det.head_weight_ is None
    scores = det.score(Batch(inputs=x))
    torch.testing.assert_close(scores, plain.score(Batch(features=bb.features_and_logits(x)[0])))
    # a step moves the inputs towards their closest class mean: their distance drops
    det.set_params(epsilon=0.01)  # a score parameter: no refit
    moved = det.score(Batch(inputs=x))
    assert (moved < scores).float().mean() > 0.9
    # from_mahalanobis: the same detector without a pass over the images
    handed = MahalanobisODIN.from_mahalanobis(plain, model=bb, epsilon=0.01)
    torch.testing.assert_close(handed.score(Batch(inputs=x)), moved)


@pytest.mark.kernels
def test_batch_equals_per_sample_and_ood_rows_are_ignored():
    model = TinyCNN()
    bb = backbone_of(model)
    fit_x, fit_y = labelled(200, seed=2)
    det = create("mahalanobis_odin", model=bb, epsilon=0.01).fit(split(fit_x, fit_y))
    x = id_and_ood(20)
    whole = det.score(Batch(inputs=x))
    one_by_one = torch.cat([det.score(Batch(inputs=x[i : i + 1])) for i in range(len(x))])
    assert_kernel_close(one_by_one, whole)
    with_ood = torch.cat([fit_y[:100], torch.full((40,), -1), fit_y[100:]])
    noisy = create("mahalanobis_odin", model=bb, epsilon=0.01).fit(
        split(torch.cat([fit_x[:100], 5 * inputs(n=40, seed=7), fit_x[100:]]), with_ood)
    )
    assert_kernel_close(noisy.score(Batch(inputs=x)), whole)
    # inside inference mode (a run's passes may be): the fit's tensors are then inference tensors
    with torch.inference_mode():
        inside = create("mahalanobis_odin", model=bb, epsilon=0.01).fit(split(fit_x, fit_y))
        assert_kernel_close(inside.score(Batch(inputs=x.clone())), whole)


def test_is_declared_and_says_what_is_wrong():
    cls = detector_class("mahalanobis_odin")
    assert cls.needs_model and cls.needs_fit and cls.needs_labels and not cls.mergeable and not cls.in_defaults
    assert cls.default_grid == {"epsilon": EPSILON_GRID} and set(cls.score_params) == {"epsilon", "norm_std"}
    model = TinyCNN()
    bb = backbone_of(model)
    fit_x, fit_y = labelled(60, seed=2)
    with pytest.raises(NotFittedError, match="call fit"):
        create("mahalanobis_odin", model=bb).score(Batch(inputs=fit_x))
    with pytest.raises(ValueError, match="fits on class labels"):
        create("mahalanobis_odin", model=bb).fit([Batch(inputs=fit_x)])
    with pytest.raises(ValueError, match="fits per class"):
        det = create("mahalanobis_odin", model=bb)
        det.fit_begin()
        det.fit_step(Batch(inputs=fit_x))
    labels = torch.arange(60) % 5
    labels[labels == 2] = 4
    with pytest.raises(ValueError, match=r"mahalanobis_odin cannot fit: class\(es\) 2 have no samples"):
        create("mahalanobis_odin", model=bb).fit(split(fit_x, labels))
    with pytest.raises(ValueError, match=r"must be an oodviz Backbone or return \(features"):
        create("mahalanobis_odin", model=model).fit(split(fit_x, fit_y))  # logits only: no features
    with pytest.raises(ValueError, match="epsilon is a step size"):
        create("mahalanobis_odin", epsilon=-0.1)
    with pytest.raises(ValueError, match="mahalanobis_odin: norm_std must be 'auto'"):
        create("mahalanobis_odin", norm_std=[0.2, 0])
    det = create("mahalanobis_odin", model=bb, norm_std=[0.2, 0.3]).fit(split(fit_x, fit_y))
    with pytest.raises(ValueError, match="mahalanobis_odin: norm_std has 2 values but the inputs have 3 channels"):
        det.score(Batch(inputs=fit_x))
    with pytest.raises(ValueError, match="normalize=False"):
        MahalanobisODIN.from_mahalanobis(create("mahalanobis", normalize=True), model=bb)
    with pytest.raises(ValueError, match="not fitted"):
        MahalanobisODIN.from_mahalanobis(create("mahalanobis"), model=bb)
    wide = create("mahalanobis_odin", model=wide_backbone_of(WideCNN())).fit(split(*labelled_images(60)))
    with pytest.raises(ValueError, match="the model gives 16 features but the detector was fitted on 32"):
        wide.distance(torch.zeros(2, 16))
