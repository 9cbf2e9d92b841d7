"""OpenOOD v1.5's variants and defaults (``protocol = "openood"``, each detector's ``openood_params``) of openmax, mcd,
rankfeat, gram, nnguide and mds_ensemble, against float64 formulas of OpenOOD's postprocessors written here from
their code (``openood/postprocessors/*``), not imported; the paper mode (the defaults) left as it was; the other
detectors of the second half of the registry keeping ``{}``; the new parameters saved and loaded."""

from __future__ import annotations

import copy
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import brentq
from scipy.special import logsumexp, softmax
from scipy.stats import weibull_min
from sklearn.covariance import EmpiricalCovariance
from tiny_cnn import TinyCNN, backbone_of, inputs
from torch import nn
from wide_cnn import WideCNN, images, labelled_images, wide_backbone_of

from oodviz import Batch
from oodviz.config.run import DetectorChoice, RunConfig
from oodviz.detectors import create, detector_class, load
from oodviz.models.openood import CifarResNet18

#: every detector of this half and its ``openood_params``; ``{}``: OpenOOD computes the same with the same defaults,
#: tunes the differing value per benchmark, or has no postprocessor of it (each docstring says which)
OPENOOD_PARAMS = {
    "openmax": {"tailsize": 20, "alpha": 3, "tail_shift": 1.0, "correct_only": True},
    "mcd": {"average": "logits", "samples": 5},
    "rankfeat": {"fuse_layer": "layer3"},
    "gram": {"poles": 5, "divide_by_msp": True, "auto_layers": "conv_relu"},
    "nnguide": {"k": 100},
    "mds_ensemble": {"norm_std": 0.5},
    "nac": {"pooling": "sum"},
    **dict.fromkeys(
        [
            "gradnorm",
            "relation",
            "cfood",
            "grood",
            "combood",
            "odin",
            "iodin",
            "mahalanobis_odin",
            "weiper",
            "adascale",
        ],
        {},
    ),
}
#: the paper mode's values of the parameters the variants set: as before these parameters existed
PAPER_DEFAULTS = {
    "openmax": {"tailsize": 25, "alpha": 10, "tail_shift": 10000.0, "correct_only": False},
    "mcd": {"average": "probabilities", "samples": 30},
    "rankfeat": {"fuse_layer": None},
    "gram": {"poles": 10, "divide_by_msp": False, "auto_layers": "maps"},
    "nnguide": {"k": 10},
    "mds_ensemble": {"norm_std": "auto"},
    "nac": {"pooling": "mean"},
}


@pytest.mark.parametrize("name", sorted(OPENOOD_PARAMS))
def test_the_openood_protocol_gives_each_detector_its_variant_and_the_paper_mode_its_defaults(name):
    cls = detector_class(name)
    assert cls.openood_params == OPENOOD_PARAMS[name]
    assert RunConfig(protocol="openood", detectors=[DetectorChoice(name)]).detectors[0].params == cls.openood_params
    config = RunConfig(protocol="openood", detectors=[DetectorChoice(name)])
    assert not [p for p in config.problems() if "detectors[0]" in p]  # the values pass the config's own checks
    assert RunConfig(detectors=[DetectorChoice(name)]).detectors[0].params == {}
    variant, paper = create(name, **cls.openood_params), create(name)
    assert {k: getattr(variant, k) for k in cls.openood_params} == cls.openood_params
    assert {k: getattr(paper, k) for k in PAPER_DEFAULTS.get(name, {})} == PAPER_DEFAULTS.get(name, {})
    assert "openood_params" in sys.modules[cls.__module__].__doc__  # the docstring says what OpenOOD computes


# ---- openmax ----------------------------------------------------------------------------------------------------


def logit_problem(seed=0, n_classes=4, n_fit=240):
    """Logits of overlapping classes (about a fifth of the fit rows misclassified), labels, and query logits (ID-like
    then flat OOD-like rows)."""
    g = torch.Generator().manual_seed(seed)
    centres = 3.0 * torch.randn(n_classes, n_classes, generator=g) + 4.0 * torch.eye(n_classes)
    y = torch.arange(n_fit) % n_classes
    fit = centres[y] + 2.0 * torch.randn(n_fit, n_classes, generator=g)
    query = torch.cat([centres[torch.arange(40) % n_classes] + 2.0 * torch.randn(40, n_classes, generator=g),
                       1.5 * torch.randn(40, n_classes, generator=g)])  # fmt: skip
    return fit, y, query


def libmr_weibull_fit(data):
    """libMR's ``weibull_fit`` (MATLAB's ``wblfit``): the maximum likelihood of an extreme-value distribution of
    ``x = log(data)``: ``sigma`` solves ``sigma + mean(x) - sum(x e^(x/sigma)) / sum(e^(x/sigma)) = 0``
    (``weibull_scale_likelihood``), ``mu = sigma log mean(e^(x/sigma))``; shape ``1 / sigma``, scale ``e^mu``.
    scipy's ``weibull_min.fit`` stops ~1e-5 short of this maximum."""
    x = np.log(data)
    top = x.max()

    def equation(sigma):
        w = np.exp((x - top) / sigma)
        return sigma + x.mean() - (w * x).sum() / w.sum()

    sigma = brentq(equation, 1e-6, 10 * (np.ptp(x) + 1), xtol=1e-14, rtol=1e-15)
    mu = top + sigma * np.log(np.exp((x - top) / sigma).mean())
    shape, scale = 1 / sigma, np.exp(mu)
    assert (
        weibull_min.logpdf(data, shape, scale=scale).sum()
        >= weibull_min.logpdf(data, *weibull_min.fit(data, floc=0)[::2]).sum()
    )
    return shape, scale


def openood_openmax(fit, labels, query, tail=20, alpha=3, shift=1.0):
    """OpenOOD's OpenMax postprocessor as its code reads, in float64: the means (``mavs``) and Euclidean distances of
    the correctly classified training logits per class, ``libmr.MR().fit_high`` on each class's ``tail`` largest
    distances (libMR's FitHigh: ``tail + translate_amount - min(tail)``, a maximum-likelihood Weibull at location 0
    whose CDF ``w_score(d)`` is evaluated at ``d + translate_amount - min(tail)``, 0 below 0), then ``openmax``'s
    recalibration with ``alpha`` ranks and ``compute_openmax_prob``'s unknown probability (OpenOOD's confidence is
    its negative: the OOD score is the probability)."""
    n_classes = fit.shape[1]
    correct = fit.argmax(axis=1) == labels
    weibulls = []
    for c in range(n_classes):
        own = fit[correct & (labels == c)]
        mav = own.mean(axis=0)
        distances = np.sqrt(((own - mav) ** 2).sum(axis=1))
        tailtofit = np.sort(distances)[-tail:]
        small = tailtofit.min()
        shape, scale = libmr_weibull_fit(tailtofit + shift - small)
        weibulls.append((mav, small, shape, scale))
    scores = []
    for z in query:
        ranked = np.argsort(z)[::-1][:alpha]
        omega = np.zeros(n_classes)
        omega[ranked] = [((alpha + 1) - i) / alpha for i in range(1, alpha + 1)]
        modified, unknown = np.empty(n_classes), np.empty(n_classes)
        for c, (mav, small, shape, scale) in enumerate(weibulls):
            x = np.sqrt(((z - mav) ** 2).sum()) + shift - small
            wscore = 0.0 if x < 0 else 1 - np.exp(-((x / scale) ** shape))
            modified[c] = z[c] * (1 - wscore * omega[c])
            unknown[c] = z[c] - modified[c]
        denominator = np.exp(modified).sum() + np.exp(unknown.sum())
        scores.append(np.exp(unknown.sum()) / denominator)
    return np.array(scores)


def test_openmax_openood_variant_is_libmrs_shift_of_1_on_the_correct_samples():
    fit, y, query = logit_problem()
    assert 0.1 < float((fit.argmax(1) != y).float().mean()) < 0.4  # misclassified rows, left out by the variant
    batches = [Batch(logits=a, labels=b) for a, b in zip(fit.split(70), y.split(70), strict=True)]
    variant = create("openmax", **detector_class("openmax").openood_params).fit(batches)
    ours = variant.score(Batch(logits=query)).double().numpy()
    expected = openood_openmax(fit.double().numpy(), y.numpy(), query.double().numpy())
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-9)
    # each part of the variant matters here: the shift, the correct samples, the tail and alpha
    for change in ({"tail_shift": 10000.0}, {"correct_only": False}, {"tailsize": 25}, {"alpha": 10}):
        other = create("openmax", **{**variant.get_params(), **change}).fit(batches)
        assert np.abs(other.score(Batch(logits=query)).double().numpy() - expected).max() > 1e-3, change
    # the paper mode: every sample, pytorch-ood's shift of 10000 (test_openmax.py checks its formula)
    paper = create("openmax").fit(batches)
    assert len(paper.class_means_) == 4 and torch.allclose(paper.class_means_, fit.double().view(-1, 4, 4).mean(0))


def test_openmax_correct_only_needs_a_correct_sample_in_every_class_of_the_logits():
    fit, y, _ = logit_problem()
    wrong = fit.clone()
    wrong[y == 3, 3] = -100.0  # class 3 never predicted
    with pytest.raises(ValueError, match=r"class\(es\) 3 have no correctly classified samples"):
        create("openmax", correct_only=True).fit(Batch(logits=wrong, labels=y))
    create("openmax").fit(Batch(logits=wrong, labels=y))  # all samples: class 3 has them
    for bad in (0, -1.0, math.inf, True, "1"):
        with pytest.raises(ValueError, match="tail_shift"):
            create("openmax", tail_shift=bad)
    with pytest.raises(ValueError, match="correct_only"):
        create("openmax", correct_only=1)


# ---- mcd --------------------------------------------------------------------------------------------------------


class Recorded(nn.Module):
    """A model that keeps the logits of its every forward of ``rows`` inputs (``calls``; not those of the one-input
    forward that measures its memory)."""

    def __init__(self, model, rows):
        super().__init__()
        self.model, self.rows, self.calls = model, rows, []

    def forward(self, x):
        out = self.model(x)
        if len(x) == self.rows:
            self.calls.append(out.detach().double().numpy())
        return out


class DropoutNet(nn.Module):
    """OpenOOD's ``DropoutNet`` around TinyCNN's layers: ``F.dropout2d(feature, p, training=True)`` on the pooled
    penultimate features, then ``fc`` (its dropout is always on)."""

    def __init__(self, tiny, p=0.5):
        super().__init__()
        self.tiny, self.p = tiny, p

    def forward(self, x):
        t = self.tiny
        feature = t.flatten(t.pool(torch.relu(t.conv2(torch.relu(t.bn(t.conv1(x)))))))
        with pytest.warns(UserWarning, match="dropout2d"):  # a 2-D input: element-wise, as F.dropout
            dropped = F.dropout2d(feature, self.p, training=True)
        return t.fc(dropped)


def test_mcd_openood_variant_averages_the_logits_of_the_passes_before_the_softmax():
    x = inputs(n=24)
    model = Recorded(TinyCNN(dropout=0.5), rows=len(x))
    params = detector_class("mcd").openood_params
    ours = create("mcd", model=model, seed=5, **params).score(Batch(inputs=x)).double().numpy()
    passes = np.stack(model.calls)  # [5, B, C]
    assert len(passes) == 5 and not np.allclose(passes[0], passes[1])  # five passes, other masks
    expected = -softmax(passes.mean(axis=0), axis=1).max(axis=1)  # DropoutPostProcessor: softmax(mean logits)
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-9)  # float32 scores of float64 sums
    # the paper mode on the same masks (same seed): the mean of the softmax, a different number
    model.calls.clear()
    paper = create("mcd", model=model, seed=5, samples=5).score(Batch(inputs=x)).double().numpy()
    np.testing.assert_allclose(paper, -softmax(np.stack(model.calls), axis=2).mean(axis=0).max(axis=1), rtol=1e-6)
    assert np.abs(paper - expected).max() > 1e-3
    # OpenOOD's DropoutNet (dropout on the penultimate features in its forward) from the same random state: the same
    # masks as TinyCNN's nn.Dropout(0.5), so the same score
    net = DropoutNet(TinyCNN(dropout=0.5)).eval()
    torch.manual_seed(5)  # the seed oodviz's mcd draws its masks from
    with torch.no_grad():
        theirs = torch.stack([net(x) for _ in range(5)]).double().mean(dim=0).softmax(dim=1).amax(dim=1).neg()
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="average='logits'.*mode='mean'"):
        create("mcd", average="logits", mode="var")
    with pytest.raises(ValueError, match="average must be one of"):
        create("mcd", average="softmax")


# ---- rankfeat ---------------------------------------------------------------------------------------------------


def without_rank1_float64(maps):
    m = maps.flatten(2).numpy()
    u, s, vh = np.linalg.svd(m, full_matrices=False)
    return maps - torch.from_numpy(s[:, 0, None, None] * u[:, :, :1] @ vh[:, :1, :]).view_as(maps)


def openood_rankfeat(net, x):
    """OpenOOD's RankFeatPostprocessor (``accelerate: False``, temperature 1) on a float64 copy of OpenOOD's
    ResNet18_32x32 (oodviz's :class:`CifarResNet18`, the same modules): the rank-1 part removed from
    ``intermediate_forward(x, 4)`` then ``avgpool``, ``fc``; and from ``intermediate_forward(x, 3)`` then ``layer4``,
    ``avgpool``, ``fc``; the logits averaged; confidence ``logsumexp``: the OOD score is its negative. Returns the
    fused score and the block-4-only one."""
    net = copy.deepcopy(net).double()
    with torch.no_grad():
        stem = F.relu(net.bn1(net.conv1(x.double())))
        feat3 = net.layer3(net.layer2(net.layer1(stem)))
        feat4 = net.layer4(feat3)
        head = lambda maps: net.fc(torch.flatten(net.avgpool(maps), 1))  # noqa: E731
        logits1 = head(without_rank1_float64(feat4))
        logits2 = head(net.layer4(without_rank1_float64(feat3)))
        fused = -torch.logsumexp((logits1 + logits2) / 2, dim=1)
        return fused.numpy(), -torch.logsumexp(logits1, dim=1).numpy()


def test_rankfeat_openood_variant_averages_the_block_3_and_block_4_removals_on_openoods_resnet():
    torch.manual_seed(0)
    net = CifarResNet18(num_classes=6).eval()
    with torch.no_grad():
        net.fc.weight.mul_(50.0)  # a spread of logits (a random head's are nearly equal)
    x = torch.cat([torch.randn(3, 3, 16, 16), 3 * torch.rand(3, 3, 16, 16)])  # layer4's maps: 2 x 2
    fused, block4 = openood_rankfeat(net, x)
    params = detector_class("rankfeat").openood_params
    ours = create("rankfeat", model=net, **params).score(Batch(inputs=x)).double().numpy()
    np.testing.assert_allclose(ours, fused, rtol=1e-4, atol=1e-5 * np.abs(fused).max())
    paper = create("rankfeat", model=net).score(Batch(inputs=x)).double().numpy()  # layer=None finds layer4
    np.testing.assert_allclose(paper, block4, rtol=1e-4, atol=1e-5 * np.abs(block4).max())
    assert np.abs(fused - block4).max() > 100 * 1e-5 * np.abs(fused).max()  # the fusion changes the scores


def test_rankfeat_fuse_layer_is_checked():
    model, x = WideCNN(), images(4)
    with pytest.raises(ValueError, match=r"has no layer\(s\) 'layer3'; its top-level layers: body, pool, fc"):
        create("rankfeat", model=model, **detector_class("rankfeat").openood_params).score(Batch(inputs=x))
    with pytest.raises(ValueError, match="fuse_layer 'body' is the layer itself"):
        create("rankfeat", model=model, fuse_layer="body").score(Batch(inputs=x))
    with pytest.raises(ValueError, match="fuse_layer must be a module name"):
        create("rankfeat", fuse_layer="")
    # an earlier map of the tiny CNN: the same fusion, against the float64 formula
    ours = create("rankfeat", model=model, layer="body", fuse_layer="body.1").score(Batch(inputs=x)).double()
    net = copy.deepcopy(model).double()
    with torch.no_grad():
        early = net.body[:2](x.double())
        logits_late = net.head(without_rank1_float64(net.body[2:](early)))
        logits_early = net.head(net.body[2:](without_rank1_float64(early)))
    expected = -torch.logsumexp((logits_late + logits_early) / 2, dim=1)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


# ---- gram -------------------------------------------------------------------------------------------------------


class BlockCNN(nn.Module):
    """conv - BN - ReLU (module, called twice) - conv - functional ReLU - conv - ReLU (module) - pool - fc; as a
    torchvision ResNet block reuses its ``relu``. Inputs ``[B, 3, 8, 8]``, C = 3."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.conv3 = nn.Conv2d(6, 8, 3, padding=1)
        self.out = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.2, 0.2)
            self.fc.weight.mul_(3.0)
        self.eval()

    def forward(self, x):
        x = self.relu(self.bn(self.conv1(x)))
        x = self.relu(self.conv2(x) + x)  # the same ReLU module a second time (in place, as torchvision's)
        x = self.out(self.conv3(F.relu(x)))
        return self.fc(self.pool(x).flatten(1))


def openood_gram(model, fit_x, fit_y, x, powers=(1, 2, 3, 4, 5), holdout=0.1):
    """OpenOOD's GRAMPostprocessor as its code reads, in float64 from the model's float32 outputs: ``FeatureExtractor``
    hooks every ``nn.ReLU`` and ``nn.Conv2d`` module and keeps each call's output in call order (the tensor itself:
    nothing writes to these outputs afterwards here); ``G_p``; per class the minimum and maximum over the rows not
    held out, the held-out rows' summed deviations per layer averaged over all held-out rows (``normalize_factors``);
    the score ``sum_l sum_p delta / n_l`` on the predicted class, over the maximum softmax probability (OpenOOD's
    confidence ``-deviations / conf``: the OOD score). Its ``random.sample`` of ``int(0.1 n_c)`` rows per class is
    replaced by the rows oodviz holds out (every 10th of each class in stream order, the same count)."""

    def features(inputs):
        found = []
        hooks = [
            m.register_forward_hook(lambda _, __, out: found.append(out.detach().double().clone()))
            for m in model.modules()
            if isinstance(m, (nn.ReLU, nn.Conv2d))
        ]
        with torch.no_grad():
            logits = model(inputs)
        for h in hooks:
            h.remove()
        return logits.double(), found

    def g_p(feature, p):
        t = (feature**p).reshape(feature.shape[0], feature.shape[1], -1)
        t = (t @ t.transpose(2, 1)).sum(dim=2)
        return t.sign() * t.abs() ** (1 / p)

    def delta(mins, maxs, g):
        return (F.relu(mins - g) / (mins + 1e-6).abs()).sum(1) + (F.relu(g - maxs) / (maxs + 1e-6).abs()).sum(1)

    _, fit_features = features(fit_x)
    classes = fit_y.max().item() + 1
    held = torch.zeros(len(fit_y), dtype=torch.bool)
    for c in range(classes):
        rows = torch.nonzero(fit_y == c).flatten()
        j = torch.arange(len(rows)).double()
        held[rows[torch.floor((j + 1) * holdout) > torch.floor(j * holdout)]] = True
        assert int(held[rows].sum()) == int(holdout * len(rows))
    bounds, factors = {}, []
    for layer, feature in enumerate(fit_features):
        total = torch.zeros(len(fit_y), dtype=torch.float64)
        for p in powers:
            g = g_p(feature, p)
            for c in range(classes):
                trn, val = (fit_y == c) & ~held, (fit_y == c) & held
                mins, maxs = g[trn].min(dim=0).values, g[trn].max(dim=0).values
                bounds[layer, p, c] = mins, maxs
                total[val] += delta(mins, maxs, g[val])
        factors.append(total[held].mean())
    logits, query_features = features(x)
    confs, preds = logits.softmax(dim=1).max(dim=1)
    deviations = torch.zeros(len(x), dtype=torch.float64)
    for layer, feature in enumerate(query_features):
        for p in powers:
            g = g_p(feature, p)
            for c in range(classes):
                rows = preds == c
                deviations[rows] += delta(*bounds[layer, p, c], g[rows]) / factors[layer]
    return (deviations / confs).numpy(), len(fit_features)


def test_gram_openood_variant_is_conv_and_relu_calls_five_powers_over_the_msp():
    model = BlockCNN()
    g = torch.Generator().manual_seed(3)
    fit_x, fit_y = torch.randn(90, 3, 8, 8, generator=g), torch.arange(90) % 3
    x = torch.cat([torch.randn(20, 3, 8, 8, generator=g), 4 * torch.rand(20, 3, 8, 8, generator=g)])
    params = detector_class("gram").openood_params
    det = create("gram", model=model, **params)
    det.fit([Batch(inputs=a, labels=b) for a, b in zip(fit_x.split(32), fit_y.split(32), strict=True)])
    # conv1, relu, conv2, relu (again), conv3, out: the ReLU module twice, the functional ReLU not at all
    assert det.layers_ == ["conv1", "relu", "conv2", "relu", "conv3", "out"]
    ours = det.score(Batch(inputs=x)).double().numpy()
    expected, n_layers = openood_gram(model, fit_x, fit_y, x)
    assert n_layers == 6 and det.layer_widths_ == [6, 6, 6, 6, 8, 8]
    np.testing.assert_allclose(ours, expected, rtol=1e-7, atol=1e-9 * np.abs(expected).max())
    # divide_by_msp alone: the same deviations times the maximum softmax probability
    plain = create("gram", model=model, poles=5, auto_layers="conv_relu")
    plain.fit([Batch(inputs=fit_x, labels=fit_y)])
    msp = model(x).detach().double().softmax(dim=1).amax(dim=1).numpy()
    np.testing.assert_allclose(plain.score(Batch(inputs=x)).double().numpy(), ours * msp, rtol=1e-6)
    # the paper mode's layers: every leaf module with a map output, each once (the BN, the pooled map; the ReLU's last call)
    paper = create("gram", model=model, poles=5).fit([Batch(inputs=fit_x, labels=fit_y)])
    assert paper.layers_ == ["conv1", "bn", "relu", "conv2", "conv3", "out", "pool"]
    with pytest.raises(ValueError, match="auto_layers must be one of"):
        create("gram", auto_layers="conv")
    with pytest.raises(ValueError, match="divide_by_msp must be true or false"):
        create("gram", divide_by_msp=0)
    with pytest.raises(ValueError, match=r"no nn.Conv2d or nn.ReLU module"):
        mlp = nn.Sequential(nn.Flatten(), nn.Linear(192, 3))
        create("gram", model=mlp, auto_layers="conv_relu").fit([Batch(inputs=fit_x[:9], labels=fit_y[:9])])


# ---- nnguide, mds_ensemble: OpenOOD's defaults --------------------------------------------------------------------


def test_nnguide_openood_default_is_k_100_of_openoods_formula():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(5, 8, generator=g), torch.randn(5, generator=g)
    fit = torch.randn(300, 8, generator=g).abs()
    query = torch.cat([torch.randn(30, 8, generator=g).abs(), 2 * torch.randn(30, 8, generator=g)])
    det = create("nnguide", **detector_class("nnguide").openood_params)
    ours = det.fit([Batch(features=fit)], head=(weight, bias)).score(Batch(features=query)).double().numpy()

    def normalizer(v):  # OpenOOD's: x / |x| + 1e-10
        return v / np.linalg.norm(v, axis=-1, keepdims=True) + 1e-10

    f, q, w, b = fit.double().numpy(), query.double().numpy(), weight.double().numpy(), bias.double().numpy()
    bank = normalizer(f) * logsumexp(f @ w.T + b, axis=-1)[:, None]
    conf = np.sort(normalizer(q) @ bank.T, axis=1)[:, -100:].mean(axis=1)  # faiss IndexFlatIP, K = 100, mean
    expected = -(conf * logsumexp(q @ w.T + b, axis=-1))
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    paper = create("nnguide").fit([Batch(features=fit)], head=(weight, bias)).score(Batch(features=query))
    assert np.abs(paper.double().numpy() - expected).max() > 1e-3  # k = 10 is another score


def test_mds_ensemble_openood_default_steps_by_a_fixed_half():
    """OpenOOD's compute_Mahalanobis_score at one layer (mean features, sklearn's precision, the closest class by
    ``-0.5 M``, ``sign`` by ``grad >= 0``, divided by 0.5 in channels 0-2, ``x - 0.0014 gradient``); confidence
    ``max_k -0.5 M_k(x')``. oodviz weights one layer by ``1 / rank``: its score is ``-2 conf / rank``."""
    model = WideCNN()
    fit_x, fit_y = labelled_images(200)
    x = torch.cat([labelled_images(20, seed=11)[0], 2.5 * images(20, seed=12) + 0.5])
    params = detector_class("mds_ensemble").openood_params
    det = create("mds_ensemble", model=wide_backbone_of(model), layers=["body.1"], **params)
    ours = det.fit([Batch(inputs=fit_x, labels=fit_y)]).score(Batch(inputs=x)).double().numpy()
    net = copy.deepcopy(model).double()
    features = lambda t: net.body[1](net.body[0](t)).mean(dim=(2, 3))  # noqa: E731
    with torch.no_grad():
        f, y = features(fit_x.double()).numpy(), fit_y.numpy()
    means = np.stack([f[y == k].mean(axis=0) for k in range(5)])
    precision = torch.from_numpy(EmpiricalCovariance(assume_centered=False).fit(f - means[y]).precision_)
    mean_t = torch.from_numpy(means)

    def gaussian(out):
        return torch.stack([-0.5 * ((out - mean_t[k]) @ precision * (out - mean_t[k])).sum(1) for k in range(5)], 1)

    data = x.double().clone().requires_grad_(True)
    out = features(data)
    zero_f = out - mean_t[gaussian(out.detach()).argmax(dim=1)]
    torch.mean(0.5 * (zero_f @ precision * zero_f).sum(1)).backward()
    gradient = (torch.ge(data.grad, 0).double() - 0.5) * 2 / 0.5
    with torch.no_grad():
        conf = gaussian(features(data.detach() - 0.0014 * gradient)).max(dim=1).values.numpy()
    rank = det.layer_ranks_[0]
    np.testing.assert_allclose(ours * rank, -2 * conf, rtol=1e-4, atol=1e-5 * np.abs(conf).max())
    auto = create("mds_ensemble", model=wide_backbone_of(model), layers=["body.1"], epsilon=0.0014, norm_std=1.0)
    other = auto.fit([Batch(inputs=fit_x, labels=fit_y)]).score(Batch(inputs=x)).double().numpy()
    assert np.abs(other * rank + 2 * conf).max() > 1e-3 * np.abs(conf).max()  # a step of 0.0014, not 0.0028


# ---- saved and loaded -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["openmax", "nnguide"])
def test_feature_variants_save_and_load_bit_for_bit(name, tmp_path):
    fit, y, query = logit_problem()
    params = detector_class(name).openood_params
    if name == "openmax":
        batches, head, queries = [Batch(logits=fit, labels=y)], None, Batch(logits=query)
    else:
        g = torch.Generator().manual_seed(1)
        head = (torch.randn(4, 6, generator=g), torch.zeros(4))
        batches, queries = [Batch(features=torch.randn(150, 6, generator=g))], Batch(features=torch.randn(9, 6))
    det = create(name, **params).fit(batches, head=head)
    det.save(tmp_path / name)
    loaded = load(tmp_path / name)
    assert loaded.get_params() == det.get_params() and {k: getattr(loaded, k) for k in params} == params
    assert torch.equal(loaded.score(queries), det.score(queries))


@pytest.mark.parametrize("name", ["mcd", "rankfeat", "gram", "mds_ensemble", "nac"])
def test_model_variants_save_and_load_bit_for_bit(name, tmp_path):
    params = dict(detector_class(name).openood_params)
    model, x = backbone_of(TinyCNN(dropout=0.5)), inputs(n=12)
    if name == "rankfeat":  # TinyCNN's blocks: conv1 and conv2
        params.update(layer="conv2", fuse_layer="conv1")
    if name == "mds_ensemble":
        params["layers"] = ["conv2", "penultimate"]
    det = create(name, model=model, **params)
    if det.needs_fit:
        fit_x = inputs(n=40, seed=2)
        det.fit([Batch(inputs=a, labels=b) for a, b in zip(fit_x.split(8), torch.arange(40).remainder(5).split(8))])
    query = [Batch(inputs=x)]
    before = det.score(query)
    det.save(tmp_path / name)
    loaded = load(tmp_path / name, model=model)
    assert loaded.get_params() == det.get_params()
    assert torch.equal(loaded.score(query), before)
