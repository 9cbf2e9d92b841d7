"""oodviz.detectors.mds_ensemble: against a float64 reference written here (per layer and per sample, autograd on a
float64 copy of the model), against OpenOOD v1.5's mds_ensemble procedure written out (its precision from sklearn,
its step, its alpha weights), and against mahalanobis and mahalanobis_odin at one layer."""

import copy

import numpy as np
import pytest
import torch
from detector_checks import spearman
from helpers import assert_same_ranking
from kernels import assert_kernel_close
from sklearn.covariance import EmpiricalCovariance
from wide_cnn import WideCNN, images, labelled_images, wide_backbone_of

from oodviz import Batch
from oodviz.detectors import create, detector_class, load
from oodviz.detectors.mahalanobis_odin import EPSILON_GRID

LAYERS = ["body.0", "body.1", "penultimate"]  # a conv's output (signed), its ReLU, the pooled last map: 16, 16, 32


def split(x, y, size=37):
    return [Batch(inputs=a, labels=b) for a, b in zip(x.split(size), y.split(size), strict=True)]


def id_and_ood(n=30):
    """Held-out ID images then OOD ones (busier, shifted)."""
    return torch.cat([labelled_images(n, seed=11)[0], 2.5 * images(n, seed=12) + 0.5])


def float64_layers(net):
    """Layer name -> features ``[B, D_l]`` of a float64 copy of WideCNN, computed by hand (no hooks)."""

    def features(t):
        conv = net.body[0](t)
        relu = net.body[1](conv)
        maps = net.body[3](net.body[2](relu))
        return {"body.0": conv.mean(dim=(2, 3)), "body.1": relu.mean(dim=(2, 3)), "penultimate": maps.mean(dim=(2, 3))}

    return features


def gaussians(f, y):
    """Class means and the precision of the tied covariance ``1/N sum (f - mu_y)(f - mu_y)^T`` (float64 numpy)."""
    means = np.stack([f[y == k].mean(axis=0) for k in range(y.max() + 1)])
    centred = f - means[y]
    return means, np.linalg.inv(centred.T @ centred / len(f))


def distances(f, means, precision):
    d = f[:, None, :] - means[None]
    return np.einsum("bcd,de,bce->bc", d, precision, d)


@pytest.mark.parametrize("epsilon, weights", [(0.002, None), (0.02, [0.5, 2.0, 1.0]), (0.0, None)])
def test_equals_a_float64_reference_per_layer_and_sample(epsilon, weights):
    model = WideCNN()
    fit_x, fit_y = labelled_images(200)
    x = id_and_ood()
    det = create("mds_ensemble", model=wide_backbone_of(model), layers=LAYERS, epsilon=epsilon, weights=weights)
    ours = det.fit(split(fit_x, fit_y)).score(Batch(inputs=x)).double().numpy()

    features = float64_layers(copy.deepcopy(model).double())
    with torch.no_grad():
        fitted = {name: gaussians(f.numpy(), fit_y.numpy()) for name, f in features(fit_x.double()).items()}
    expected = np.zeros(len(x))
    for i, name in enumerate(LAYERS):
        means, precision = fitted[name]
        w = 1.0 / len(precision) if weights is None else weights[i]  # 1 / rank: full rank here
        for b, one in enumerate(x.double()):
            one = one[None].clone().requires_grad_(True)
            f = features(one)[name]
            k = int(distances(f.detach().numpy(), means, precision).argmin())
            d = f[0] - torch.from_numpy(means[k])
            (gradient,) = torch.autograd.grad(d @ torch.from_numpy(precision) @ d, one)
            moved = (one - epsilon * gradient.sign()).detach()
            with torch.no_grad():
                expected[b] += w * distances(features(moved)[name].numpy(), means, precision).min()
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    assert spearman(ours, expected) > 0.9999


def openood_mds_ensemble(model, fit_x, fit_y, x, magnitude, alpha):
    """OpenOOD v1.5's MDSEnsemblePostprocessor (get_MDS_stat, compute_Mahalanobis_score) as its code reads, written
    out on a float64 copy of WideCNN with the feature list ``[body.0, body.1, last map]`` and the ``mean`` feature
    type: sklearn's EmpiricalCovariance precision of the class-centred features; the closest class by
    ``-0.5 M``; ``gradient = (grad >= 0) * 2 - 1``, divided by 0.5 in channels 0-2; ``x - magnitude * gradient``;
    ``conf = sum_l alpha_l max_k -0.5 M_lk(x'_l)``."""
    features = float64_layers(copy.deepcopy(model).double())
    with torch.no_grad():
        fit = features(fit_x.double())
    confidence = torch.zeros(len(x), dtype=torch.float64)
    for name, a in zip(LAYERS, alpha, strict=True):
        f, y = fit[name].numpy(), fit_y.numpy()
        means = np.stack([f[y == k].mean(axis=0) for k in range(y.max() + 1)])
        precision = torch.from_numpy(EmpiricalCovariance(assume_centered=False).fit(f - means[y]).precision_)
        mean_t = torch.from_numpy(means)

        def gaussian_scores(out, mean_t=mean_t, precision=precision):
            return torch.stack(
                [-0.5 * torch.mm(torch.mm(out - mean_t[i], precision), (out - mean_t[i]).t()).diag() for i in range(5)],
                dim=1,
            )

        data = x.double().clone().requires_grad_(True)
        out = features(data)[name]
        sample_pred = gaussian_scores(out.detach()).max(1)[1]
        zero_f = out - mean_t.index_select(0, sample_pred)
        pure_gau = -0.5 * torch.mm(torch.mm(zero_f, precision), zero_f.t()).diag()
        torch.mean(-pure_gau).backward()
        gradient = (torch.ge(data.grad, 0).double() - 0.5) * 2
        gradient[:, :3] = gradient[:, :3] / 0.5
        temp_inputs = data.detach() - magnitude * gradient
        with torch.no_grad():
            confidence += a * gaussian_scores(features(temp_inputs)[name]).max(dim=1).values
    return confidence.numpy()


@pytest.mark.parametrize("alpha", [[1.0, 1.0, 1.0], [0.3, -0.2, 1.5]])
def test_matches_openood_mds_ensemble_written_out(alpha):
    model = WideCNN()
    fit_x, fit_y = labelled_images(200)
    x = id_and_ood()
    det = create(
        "mds_ensemble", model=wide_backbone_of(model), layers=LAYERS, epsilon=0.0014, norm_std=0.5, weights=alpha
    ).fit(split(fit_x, fit_y))
    ours = det.score(Batch(inputs=x)).double().numpy()
    theirs = openood_mds_ensemble(model, fit_x, fit_y, x, 0.0014, alpha)
    np.testing.assert_allclose(ours, -2 * theirs, rtol=1e-4, atol=1e-5 * np.abs(theirs).max())
    assert_same_ranking(ours, -theirs, n_id=30)


def test_one_layer_is_mahalanobis_odin_and_each_layer_holds_mahalanobis_gaussians():
    model = WideCNN()
    bb = wide_backbone_of(model)
    fit_x, fit_y = labelled_images(200)
    x = id_and_ood()
    one = create("mds_ensemble", model=bb, layers=["penultimate"], epsilon=0.01).fit(split(fit_x, fit_y))
    odin = create("mahalanobis_odin", model=bb, epsilon=0.01).fit(split(fit_x, fit_y))
    torch.testing.assert_close(one.score(Batch(inputs=x)) * 32, odin.score(Batch(inputs=x)))  # w = 1 / rank = 1 / 32
    det = create("mds_ensemble", model=bb, layers=LAYERS, epsilon=0.0).fit(split(fit_x, fit_y, size=11))
    assert det.layer_widths_ == det.layer_ranks_ == [16, 16, 32] and det.n_features_in_ == 64
    per_layer = det.layer_features(fit_x, LAYERS)
    start = 0
    for i, features in enumerate(per_layer):
        plain = create("mahalanobis").fit(
            [Batch(features=f, labels=y) for f, y in zip(features.split(11), fit_y.split(11), strict=True)]
        )
        rows, rank = slice(start, start + features.shape[1]), plain.whitening_.shape[1]
        assert torch.equal(det.class_means_[:, rows], plain.class_means_)
        assert torch.equal(det.center_[rows], plain.center_)
        assert torch.equal(det.whitening_[rows, :rank], plain.whitening_)
        assert not det.whitening_[rows, rank:].any()  # the padding adds nothing
        assert torch.equal(det.whitened_means_[i, :, :rank], plain.whitened_means_)
        torch.testing.assert_close(det.distance(i, per_layer[i][:50]), plain.score(Batch(features=features[:50])))
        start += features.shape[1]
    # the weights change only the score: no refit
    before = det.layer_distances(x)
    det.set_params(weights=[1.0, 0.0, 0.0])
    torch.testing.assert_close(det.score(Batch(inputs=x)), before[:, 0])
    with pytest.raises(ValueError, match="2 weights for 3 layers"):
        det.set_params(weights=[1.0, 2.0])


def test_finds_the_papers_layers_on_a_resnet_and_says_what_is_wrong():
    import torchvision

    from oodviz.models import wrap_model

    resnet = torchvision.models.resnet18(num_classes=5).eval()
    bb = wrap_model(resnet, lambda image: image, head="fc", input_shape=(3, 64, 64), name="r18")
    x, y = torch.randn(20, 3, 64, 64, generator=torch.Generator().manual_seed(0)), torch.arange(20) % 5
    det = create("mds_ensemble", model=bb).fit(split(x, y, size=10))
    assert det.layers_ == ["relu", "layer1", "layer2", "layer3", "layer4"]  # Lee et al.'s five
    assert det.layer_widths_ == [64, 64, 128, 256, 512]
    assert torch.isfinite(det.score(Batch(inputs=x[:4]))).all()
    cls = detector_class("mds_ensemble")
    assert cls.needs_model and cls.needs_fit and cls.needs_labels and not cls.mergeable and not cls.in_defaults
    assert cls.default_grid == {"epsilon": EPSILON_GRID} and set(cls.score_params) == {"epsilon", "norm_std", "weights"}
    model = WideCNN()
    fit_x, fit_y = labelled_images(60)
    with pytest.raises(ValueError, match=r"has no layer\(s\) 'layer9'"):
        create("mds_ensemble", model=wide_backbone_of(model), layers=["layer9"]).fit(split(fit_x, fit_y))
    with pytest.raises(ValueError, match="needs an nn.Module"):
        create("mds_ensemble", model=lambda t: (model.pool(model.body(t)).flatten(1), model(t))).fit(
            split(fit_x, fit_y)
        )
    plain = lambda t: (model.pool(model.body(t)).flatten(1), model(t))  # noqa: E731
    create("mds_ensemble", model=plain, layers=["penultimate"]).fit(split(fit_x, fit_y))  # a callable: its features
    with pytest.raises(ValueError, match="2 weights for 3 layers"):
        create("mds_ensemble", layers=LAYERS, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"2 weights for the 1 layers \['body'\]"):  # the layers found
        create("mds_ensemble", model=wide_backbone_of(model), weights=[1.0, 2.0]).fit(split(fit_x, fit_y))
    found = create("mds_ensemble", model=wide_backbone_of(model)).fit(split(fit_x, fit_y))
    with pytest.raises(ValueError, match=r"2 weights for the 1 fitted layers \['body'\]"):
        found.set_params(weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="names a layer twice"):
        create("mds_ensemble", layers=["body.1", "body.1"])
    with pytest.raises(ValueError, match="layers must be a list"):
        create("mds_ensemble", layers="body.1")
    with pytest.raises(ValueError, match="epsilon is a step size"):
        create("mds_ensemble", epsilon=-1)
    labels = fit_y.clone()
    labels[labels == 1] = 0
    with pytest.raises(ValueError, match=r"mds_ensemble cannot fit: class\(es\) 1 have no samples"):
        create("mds_ensemble", model=wide_backbone_of(model), layers=LAYERS).fit(split(fit_x, labels))


@pytest.mark.kernels
def test_batch_equals_per_sample_ood_rows_are_ignored_and_a_saved_one_scores_alike(tmp_path):
    model = WideCNN()
    bb = wide_backbone_of(model)
    fit_x, fit_y = labelled_images(200)
    x = id_and_ood(10)
    det = create("mds_ensemble", model=bb, layers=LAYERS, epsilon=0.01).fit(split(fit_x, fit_y))
    whole = det.score(Batch(inputs=x))
    assert_kernel_close(torch.cat([det.score(Batch(inputs=x[i : i + 1])) for i in range(len(x))]), whole)
    with_ood = split(torch.cat([fit_x, 4 * images(30, seed=3)]), torch.cat([fit_y, torch.full((30,), -1)]))
    noisy = create("mds_ensemble", model=bb, layers=LAYERS, epsilon=0.01).fit(with_ood)
    assert_kernel_close(noisy.score(Batch(inputs=x)), whole)
    with torch.inference_mode():  # a run's passes may be: the fit's tensors are then inference tensors
        inside = create("mds_ensemble", model=bb, layers=LAYERS, epsilon=0.01).fit(split(fit_x, fit_y))
        assert_kernel_close(inside.score(Batch(inputs=x.clone())), whole)
    det.save(tmp_path / "ensemble")  # the layers' padded state: plain arrays and lists
    loaded = load(tmp_path / "ensemble", model=bb)
    assert loaded.layers_ == LAYERS and loaded.layer_widths_ == [16, 16, 32]
    assert torch.equal(loaded.score(Batch(inputs=x)), whole)
