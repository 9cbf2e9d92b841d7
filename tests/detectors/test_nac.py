"""oodviz.detectors.nac: against pytorch-ood 0.4's NACUE (imported) on a tiny CNN, against a float64 reference of the
paper's equations written here (per-sample autograd on a float64 copy of the model, the penultimate layer's closed
form ``s = f * W^T (softmax - 1/C)``, the authors' intervals and coverage), the differences from pytorch-ood on
purpose, and its streaming, merging, saving and errors."""

import copy

import numpy as np
import pytest
import torch
from detector_checks import auroc, spearman
from kernels import assert_kernel_close
from pytorch_ood.detector import NACUE as PoodNACUE
from tiny_cnn import TinyCNN, backbone_of, inputs
from torch import nn

from oodviz import Batch
from oodviz.detectors import NotFittedError, create, detector_class, load
from oodviz.detectors.nac import interval_edges


def split(x, size=37):
    return [Batch(inputs=a) for a in x.split(size)]


def id_and_ood(n=80):
    """Held-out ID inputs (another seed than the fit's) then OOD ones: the same images shifted and scaled up."""
    return torch.cat([inputs(n=n, seed=11), 1.5 * inputs(n=n, seed=12) + 0.8])


# ---- a float64 reference of the paper's equations ---------------------------------------------------------------


def authors_thresholds(bins):
    """The authors' ``coverage.logspace(1e3, M)`` written out: ``M`` thresholds, the last interval ``[1.01, 1.2)``."""
    low = np.log(np.linspace(1.0, np.sqrt(1000.0), bins // 2)) / np.log(1000.0)
    t = np.concatenate([low[:-1], (1.0 - low)[::-1]])
    t[-1] += 1e-2
    return np.append(t, 1.2)


def reference_states(model, x, layers, alphas, pooling):
    """``zhat`` per layer, ``[B, N_l]`` numpy float64, on a float64 copy of ``model`` (a TinyCNN, in eval mode: the
    inputs do not interact, so the gradient of the batch's sum of ``KL`` is each input's own): ``dKL(u || p) / dz`` by
    autograd of ``KL = sum_k u_k (log u_k - log p_k)``; the head's input by the closed form ``f * W^T (p - u)``,
    checked against autograd."""
    net = copy.deepcopy(model).double()
    modules = dict(net.named_modules())
    kept = {}
    hooks = [
        modules[n].register_forward_hook(lambda m, a, o, n=n: kept.__setitem__(n, o))
        for n in layers
        if n != "penultimate"
    ]
    hooks.append(net.fc.register_forward_pre_hook(lambda m, a: kept.__setitem__("penultimate", a[0])))
    logits = net(x.double().requires_grad_(True))
    for hook in hooks:
        hook.remove()
    c = logits.shape[1]
    kl = (1.0 / c * (np.log(1.0 / c) - logits.log_softmax(dim=1))).sum(dim=1)  # [B]
    grads = torch.autograd.grad(kl.sum(), [kept[n] for n in layers])
    states = []
    for n, g, alpha in zip(layers, grads, alphas, strict=True):
        z = kept[n].detach()
        if n == "penultimate":
            closed = (logits.softmax(dim=1) - 1.0 / c).detach() @ net.fc.weight.detach()  # [B, D]
            np.testing.assert_allclose(g.numpy(), closed.numpy(), rtol=1e-10, atol=1e-14)
            s = z * closed
        elif pooling == "mean":
            s = z.flatten(2).mean(dim=2) * g.flatten(2).mean(dim=2)
        elif pooling == "sum":
            s = z.flatten(2).sum(dim=2) * g.flatten(2).sum(dim=2)
        else:
            s = (z * g).flatten(2).mean(dim=2)
        states.append((1.0 / (1.0 + torch.exp(-alpha * s))).numpy())
    return states


def reference_scores(fit_states, states, bins, o_stars):
    """The authors' histograms and coverage (``Estimator.update`` / ``get_score`` / ``ood_test``) written out in
    numpy: the negated mean over layers of the mean over neurons of ``min(count / O, 1)`` at each state's interval."""
    per_layer = []
    for fitted, z, m, o in zip(fit_states, states, bins, o_stars, strict=True):
        t = authors_thresholds(m)
        inside = lambda s, t=t: (s[:, None, :] >= t[:-1, None]) & (s[:, None, :] < t[1:, None])  # noqa: E731 [B, M-1, N]
        counts = inside(fitted).sum(axis=0)  # [M-1, N]
        covered = np.minimum(counts / o, 1.0)
        per_layer.append((inside(z) * covered[None]).sum(axis=1).mean(axis=1))
    return -np.mean(per_layer, axis=0)


@pytest.mark.parametrize(
    "layers, params",
    [
        (["penultimate"], {}),  # the defaults: the authors' intervals, alpha 100, M 50, O* 50
        (["penultimate"], {"alpha": 30.0, "bins": 20, "o_star": 5}),
        (["conv1", "conv2", "penultimate"], {"alpha": [3.0, 30.0, 30.0], "bins": [30, 40, 20], "o_star": [5, 10, 5]}),
        (
            ["conv1", "conv2", "penultimate"],
            {"alpha": [0.05, 0.5, 30.0], "bins": [30, 40, 20], "o_star": [5, 10, 5], "pooling": "sum"},
        ),
        (["conv2", "penultimate"], {"alpha": [30.0, 30.0], "bins": 20, "o_star": 5, "pooling": "product"}),
    ],
)
def test_equals_a_float64_reference_of_the_papers_equations(layers, params):
    model = TinyCNN()
    fit_x, x = inputs(n=240, seed=2), id_and_ood()
    det = create("nac", model=backbone_of(model), layers=layers, **params).fit(split(fit_x))
    ours = det.score(Batch(inputs=x)).double().numpy()
    per_layer = det.per_layer
    alphas, bins, o_stars = per_layer("alpha"), per_layer("bins"), per_layer("o_star")
    pooling = params.get("pooling", "mean")
    expected = reference_scores(
        reference_states(model, fit_x, layers, alphas, pooling),
        reference_states(model, x, layers, alphas, pooling),
        bins,
        o_stars,
    )
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-7)
    assert len(np.unique(expected)) >= 10  # the states spread over the intervals: a score that says something


# ---- pytorch-ood 0.4 -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layers, params",
    [
        (["penultimate"], {"alpha": 30.0, "bins": 20, "o_star": 5}),
        (
            ["conv1", "bn", "conv2", "penultimate"],
            {"alpha": [300.0, 300.0, 100.0, 10.0], "bins": [20, 30, 40, 50], "o_star": [5, 10, 20, 10]},
        ),  # fmt: skip
    ],
)
def test_matches_pytorch_ood_with_its_intervals_and_pooling(layers, params):
    """pytorch-ood's NACUE is ``edges="geometric", pooling="product"``; its score sums the layers (``L`` times ours)."""
    model = TinyCNN()
    fit_x, x = inputs(n=300, seed=2), id_and_ood()
    det = create("nac", model=backbone_of(model), layers=layers, edges="geometric", pooling="product", **params)
    det.fit(split(fit_x, 64))
    ours = det.score(Batch(inputs=x)).double().numpy() * len(layers)
    modules = [model.drop if n == "penultimate" else getattr(model, n) for n in layers]  # drop: the head's input
    reference = PoodNACUE(model, modules, m_bins=params["bins"], alpha=params["alpha"], o_star=params["o_star"])
    reference.fit([fit_x[i : i + 50] for i in range(0, 300, 50)])
    theirs = reference.predict(x).double().numpy()
    with torch.no_grad():
        assert model(torch.cat([fit_x, x])).softmax(dim=1).min() > 1e-6  # its log(p + 1e-12) is log p here
    # the same histograms (its [N, M] counts, neuron by neuron), and the same scores to its float32 sums
    counts = [stats.counts[:, :k].flatten() for stats, k in zip(reference._stats, det.layer_intervals_, strict=True)]
    assert torch.equal(torch.cat(counts), det.counts_)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
    assert spearman(ours, theirs) > 0.9999
    # its scores are sums of multiples of 1 / (O* N_l) in float32, in neuron order: inputs covered alike differ in
    # the last bits, which breaks their ties (ours are exact); rounded to 6 decimals they are that sum again
    assert abs(auroc(ours, 80) - auroc(np.round(theirs, 6), 80)) < 1e-5
    assert auroc(ours, 80) > 0.6  # the shifted, scaled inputs are covered less


def test_states_are_float64_where_pytorch_oods_float32_sigmoid_cannot_resolve_its_own_intervals():
    """Near 1 a float32 sigmoid moves in steps of 6e-8, a sizeable part of pytorch-ood's geometric intervals there
    (their edges run from 1 - 1e-6 down): at alpha = 100 some of the head's states saturate. oodviz's histogram is
    that of the float64 states; pytorch-ood's differs from it there, and only there."""
    model = TinyCNN()
    fit_x = inputs(n=300, seed=2)
    det = create("nac", model=backbone_of(model), edges="geometric", alpha=100.0).fit(split(fit_x))
    reference = PoodNACUE(model, [model.drop], m_bins=50, alpha=100.0, o_star=50)
    reference.fit([fit_x])
    (states,) = reference_states(model, fit_x, ["penultimate"], [100.0], "mean")
    edges = interval_edges("geometric", 50).numpy()  # its float32 numbers (middle edge 0.49999997)
    j = np.clip(np.searchsorted(edges, np.clip(states, 1e-6, 1 - 1e-6), side="left") - 1, 0, 49)  # (e_j, e_(j+1)]
    float64 = np.stack([np.bincount(j[:, i], minlength=50) for i in range(16)])  # [N, M]
    assert np.array_equal(det.counts_.numpy(), float64.flatten())
    theirs = reference._stats[0].counts.numpy()
    differ = np.argwhere(theirs != float64)
    assert len(differ) and (edges[differ[:, 1]] > 1 - 1e-4).all()  # intervals within 1e-4 of 1


def test_the_exact_kl_gradient_where_pytorch_oods_log_p_plus_1e_12_drops_the_unlikely_classes():
    """A confident head (class probabilities down to 1e-30): oodviz's states are those of the exact gradient
    ``W^T (p - u)`` (the authors' log_softmax); pytorch-ood's ``log(p + 1e-12)`` gives other states, and other
    histograms."""
    model = TinyCNN()
    with torch.no_grad():
        model.fc.weight.mul_(40.0)
    fit_x = inputs(n=200, seed=2)
    with torch.no_grad():
        assert model(fit_x).softmax(dim=1).min() < 1e-20
    det = create("nac", model=backbone_of(model), edges="geometric", pooling="product", alpha=0.3, bins=20)
    det.fit(split(fit_x))
    (states,) = reference_states(model, fit_x, ["penultimate"], [0.3], "mean")
    edges = interval_edges("geometric", 20).numpy()
    j = np.clip(np.searchsorted(edges, np.clip(states, 1e-6, 1 - 1e-6), side="left") - 1, 0, 19)
    exact = np.stack([np.bincount(j[:, i], minlength=20) for i in range(16)]).flatten()
    assert np.array_equal(det.counts_.numpy(), exact)
    reference = PoodNACUE(model, [model.drop], m_bins=20, alpha=0.3, o_star=50)
    reference.fit([fit_x])
    assert not np.array_equal(reference._stats[0].counts.flatten().numpy(), exact)


# ---- the variants ------------------------------------------------------------------------------------------------


def test_pooling_sum_is_mean_with_alpha_times_p_squared_and_product_differs_on_maps_only():
    model = TinyCNN()
    bb = backbone_of(model)
    fit_x, x = inputs(n=160, seed=2), id_and_ood(40)
    positions = 8 * 8  # conv2's [B, 16, 8, 8]
    summed = create("nac", model=bb, layers=["conv2"], pooling="sum", alpha=0.5, bins=30, o_star=5).fit(split(fit_x))
    mean = create("nac", model=bb, layers=["conv2"], alpha=0.5 * positions**2, bins=30, o_star=5).fit(split(fit_x))
    assert torch.equal(summed.counts_, mean.counts_)
    torch.testing.assert_close(summed.score(Batch(inputs=x)), mean.score(Batch(inputs=x)), rtol=0, atol=0)
    product = create("nac", model=bb, layers=["conv2"], pooling="product", alpha=0.5 * positions, bins=30, o_star=5)
    assert not torch.equal(product.fit(split(fit_x)).counts_, mean.counts_)  # mean(z g) is not mean(z) mean(g)
    head = {p: create("nac", model=bb, pooling=p, alpha=30.0).fit(split(fit_x)) for p in ("mean", "sum", "product")}
    assert torch.equal(head["mean"].counts_, head["sum"].counts_) and torch.equal(
        head["mean"].counts_, head["product"].counts_
    )


def test_the_intervals():
    authors = interval_edges("authors", 50)
    assert len(authors) == 49 and authors[0] == 0 and authors[-1] == 1.01 and (authors.diff() > 0).all()
    np.testing.assert_array_equal(authors.numpy(), authors_thresholds(50)[:-1])  # the dead [1.01, 1.2) left out
    widths = authors.diff()
    assert widths[0] > 10 * widths[23]  # dense around 0.5
    geometric = interval_edges("geometric", 50)
    assert len(geometric) == 51 and (geometric.diff() > 0).all() and abs(geometric[0] - 1e-6) < 1e-12
    assert geometric[25] == torch.tensor(0.5).float().nextafter(torch.tensor(0.0)).double()  # float32, as pytorch-ood's
    assert geometric.diff()[0] < 1e-5 and geometric.diff()[24] > 0.1  # dense near 0 (and 1)
    assert len(interval_edges("geometric", 7)) == 7  # 2 floor(M / 2) intervals
    model = TinyCNN()
    det = create("nac", model=backbone_of(model), bins=[50], edges="geometric").fit(split(inputs(n=40, seed=2)))
    assert det.layer_intervals_ == [50] and det.counts_.shape == (16 * 50,) and det.counts_.sum() == 40 * 16
    authors_fit = create("nac", model=backbone_of(model)).fit(split(inputs(n=40, seed=2)))
    assert authors_fit.layer_intervals_ == [48]
    assert not torch.equal(det.score(Batch(inputs=id_and_ood(20))), authors_fit.score(Batch(inputs=id_and_ood(20))))


# ---- streaming, merging, saving --------------------------------------------------------------------------------


@pytest.mark.kernels
def test_batch_equals_per_sample_and_the_fit_does_not_depend_on_batching():
    model = TinyCNN()
    bb = backbone_of(model)
    fit_x = inputs(n=200, seed=2)
    params = {"layers": ["conv1", "penultimate"], "alpha": [3.0, 30.0], "bins": 20, "o_star": 5}
    det = create("nac", model=bb, **params).fit(split(fit_x))
    x = id_and_ood(20)
    whole = det.score(Batch(inputs=x))
    one_by_one = torch.cat([det.score(Batch(inputs=x[i : i + 1])) for i in range(len(x))])
    assert_kernel_close(one_by_one, whole, scale=1.0)
    at_once = create("nac", model=bb, **params).fit([Batch(inputs=fit_x)])
    assert torch.equal(at_once.counts_, det.counts_) and at_once.fit_rows_ == 200
    # OOD rows (label -1) are left out of the histograms, by fit and by a run's steps (fit_step)
    labels = torch.cat([torch.zeros(100, dtype=torch.long), torch.full((30,), -1), torch.ones(100, dtype=torch.long)])
    mixed = [Batch(inputs=a, labels=b) for a, b in zip(torch.cat([fit_x[:100], 5 * inputs(n=30, seed=7), fit_x[100:]]).split(29), labels.split(29))]  # fmt: skip
    assert torch.equal(create("nac", model=bb, **params).fit(mixed).counts_, det.counts_)
    stepped = create("nac", model=bb, **params)
    stepped.fit_begin()
    assert all(len(stepped.fit_step(batch)) == len(batch) for batch in mixed)
    stepped.end_pass(0, torch.zeros(230))
    assert torch.equal(stepped.counts_, det.counts_) and stepped.n_features_in_ == 8 + 16
    # inside inference mode (a run's passes may be): the gradients are still taken
    with torch.inference_mode():
        inside = create("nac", model=bb, **params).fit(split(fit_x))
        assert torch.equal(inside.counts_, det.counts_)
        assert_kernel_close(inside.score(Batch(inputs=x.clone())), whole, scale=1.0)


def test_a_layer_changed_in_place_after_it_is_read_as_it_left_its_module():
    """``ReLU(inplace=True)`` after the layer: the state is that of the layer's own output and its gradient, as with
    an out-of-place ReLU."""

    def net(inplace):
        torch.manual_seed(0)
        body = [nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(inplace=inplace), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        return nn.Sequential(*body, nn.Linear(6, 4)).eval()

    fit_x, x = inputs(n=60, seed=2), id_and_ood(10)
    params = {"layers": ["0", "4"], "alpha": [0.5, 30.0], "bins": 20, "o_star": 5, "pooling": "sum"}
    dets = [create("nac", model=net(inplace), **params).fit(split(fit_x)) for inplace in (False, True)]
    assert torch.equal(dets[0].counts_, dets[1].counts_)
    assert torch.equal(dets[0].score(Batch(inputs=x)), dets[1].score(Batch(inputs=x)))


def test_histograms_of_two_halves_add_up_to_the_fit_on_both():
    model = TinyCNN()
    bb = backbone_of(model)
    fit_x, x = inputs(n=160, seed=2), id_and_ood(30)
    params = {"layers": ["conv2", "penultimate"], "alpha": [30.0, 30.0], "bins": 20, "o_star": 5}
    whole = create("nac", model=bb, **params).fit(split(fit_x))
    first = create("nac", model=bb, **params).fit(split(fit_x[:70]))
    second = create("nac", model=bb, **params).fit(split(fit_x[70:]))
    assert not torch.equal(first.counts_, whole.counts_)
    first.add_histograms(second)
    assert torch.equal(first.counts_, whole.counts_) and first.fit_rows_ == 160
    assert torch.equal(first.score(Batch(inputs=x)), whole.score(Batch(inputs=x)))
    with pytest.raises(ValueError, match="same parameters"):
        first.add_histograms(create("nac", model=bb, **{**params, "bins": 30}).fit(split(fit_x)))
    with pytest.raises(ValueError, match="both detectors must be fitted"):
        first.add_histograms(create("nac", model=bb, **params))


def test_o_star_is_a_score_parameter_and_a_saved_detector_scores_bit_for_bit(tmp_path):
    model = TinyCNN()
    bb = backbone_of(model)
    fit_x, x = inputs(n=160, seed=2), id_and_ood(30)
    params = {"layers": ["conv1", "penultimate"], "alpha": [3.0, 30.0], "bins": [30, 20], "o_star": [5, 5]}
    det = create("nac", model=bb, **params).fit(split(fit_x))
    before = det.score(Batch(inputs=x))
    det.set_params(o_star=[50, 50])  # no refit
    refit = create("nac", model=bb, **{**params, "o_star": [50, 50]}).fit(split(fit_x))
    assert torch.equal(det.score(Batch(inputs=x)), refit.score(Batch(inputs=x)))
    assert not torch.equal(det.score(Batch(inputs=x)), before)
    with pytest.raises(ValueError, match="changes what fit learns"):
        det.set_params(alpha=1.0)
    with pytest.raises(ValueError, match="3 values of a per-layer parameter for 2 layers"):
        det.set_params(o_star=[1, 2, 3])
    det.set_params(o_star=[5, 5])
    det.save(tmp_path / "nac")
    loaded = load(tmp_path / "nac", model=bb)
    assert loaded.get_params() == det.get_params() and loaded.counts_.dtype == torch.long
    assert loaded.head_module_ == "fc" and loaded.layer_widths_ == [8, 16] and loaded.layer_intervals_ == [28, 18]
    assert torch.equal(loaded.score(Batch(inputs=x)), before)


# ---- what it is and what it refuses -------------------------------------------------------------------------------


def test_is_declared_and_says_what_is_wrong():
    cls = detector_class("nac")
    assert cls.needs_model and cls.needs_fit and not cls.needs_labels and not cls.mergeable and not cls.in_defaults
    assert cls.default_grid == {"alpha": (1.0, 50.0, 100.0, 3000.0), "bins": (50, 500), "o_star": (10, 50, 500)}
    assert cls.score_params == ("o_star",) and cls.openood_params == {"pooling": "sum"} and cls.activation_copies == 2
    model = TinyCNN()
    bb = backbone_of(model)
    fit_x = inputs(n=40, seed=2)
    with pytest.raises(NotFittedError, match="call fit"):
        create("nac", model=bb).score(Batch(inputs=fit_x))
    with pytest.raises(ValueError, match=r"create\('nac', model=\.\.\.\)"):
        create("nac").fit(split(fit_x))
    for bad, message in [
        ({"alpha": 0.0}, "alpha is the sigmoid's steepness"),
        ({"alpha": [1.0, 2.0]}, "2 values of a per-layer parameter for 1 layers"),
        ({"bins": 3}, "bins is the number of intervals M, an integer >= 4 with edges='authors'"),
        ({"bins": 1, "edges": "geometric"}, "an integer >= 2 with edges='geometric'"),
        ({"bins": 50.0}, "bins is the number of intervals"),
        ({"o_star": 0}, "o_star is the count of fit inputs"),
        ({"pooling": "max"}, "pooling must be one of"),
        ({"edges": "uniform"}, "edges must be one of"),
        ({"layers": "conv1"}, "layers must be a list of module names"),
        ({"layers": ["conv1", "conv1"]}, "names a layer twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            create("nac", **bad)
    with pytest.raises(ValueError, match=r"has no layer\(s\) 'layer9'"):
        create("nac", model=bb, layers=["layer9"]).fit(split(fit_x))
    with pytest.raises(ValueError, match="reads the outputs of the model's layers"):
        create("nac", model=lambda t: model(t)).fit(split(fit_x))
    with pytest.raises(ValueError, match="no nn.Linear runs"):
        create("nac", model=nn.Sequential(nn.Conv2d(3, 5, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())).fit(split(fit_x))
    with pytest.raises(ValueError, match="layer .0. gives"):
        flat = nn.Sequential(nn.Flatten(0), nn.Unflatten(0, (len(fit_x), -1)), nn.Linear(192, 5))
        create("nac", model=flat, layers=["0"]).fit([Batch(inputs=fit_x)])
    with pytest.raises(ValueError, match=r"fit got no in-distribution"):
        create("nac", model=bb).fit([Batch(inputs=fit_x, labels=torch.full((40,), -1))])
    det = create("nac", model=bb).fit(split(fit_x))
    other = create("nac", model=backbone_of(TinyCNN(n_classes=3)), layers=["conv1"])
    other.__dict__.update({k: v for k, v in vars(det).items() if k.endswith("_")})
    with pytest.raises(ValueError, match=r"give \[8\] neurons, but the detector was fitted on \[16\]"):
        other.score(Batch(inputs=fit_x))
