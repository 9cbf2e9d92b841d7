"""Recent post-hoc detectors (issue 17): weiper, adascale, rankfeat, gram.

Each is compared with pytorch-ood 0.4 where it implements the method (rankfeat, gram), otherwise
with a float64 reference written here from the OpenOOD v1.5 code (weiper, adascale).
"""

import copy

import numpy as np
import pytest
import torch
from helpers import cuda
from pytorch_ood.detector import Gram as PoodGram
from pytorch_ood.detector import RankFeat as PoodRankFeat
from scipy.special import logsumexp, softmax
from scipy.stats import spearmanr
from torch import nn

from oodviz import Batch
from oodviz.detectors import NotFittedError, create
from oodviz.models import wrap_model
from oodviz.results.metrics import ood_metrics


def spearman(a, b) -> float:
    return spearmanr(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)).statistic


def auroc(scores, n_id) -> float:
    scores = torch.as_tensor(np.asarray(scores, dtype=np.float64))
    return ood_metrics(scores[:n_id], scores[n_id:])["auroc"]


# ---- weiper ----------------------------------------------------------------------------------


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


# ---- model-based: a tiny CNN ---------------------------------------------------------------------


class WideCNN(nn.Module):
    """body (conv - ReLU - conv - ReLU: a feature map ``[B, 32, 8, 8]``) - avg pool - fc; inputs [B, 3, 8, 8], C = 5."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 5)
        with torch.no_grad():
            self.fc.weight.mul_(4.0)
        self.eval()

    def feature_map(self, x):
        return self.body(x)

    def head(self, maps):
        return self.fc(self.pool(maps).flatten(1))

    def forward(self, x):
        return self.head(self.body(x))


def images(n=40, seed=1, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g) * torch.linspace(0.2, spread, n).view(-1, 1, 1, 1)


def backbone_of(model):
    return wrap_model(model, lambda image: image, head="fc", input_shape=(3, 8, 8), name="wide")


# ---- adascale --------------------------------------------------------------------------------


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
    det = create("adascale", model=backbone_of(model), **params).fit(
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
        create("adascale", model=backbone_of(model), k1=10.0, k2=5.0).score(Batch(inputs=images(4)))
    with pytest.raises(ValueError, match="min_percentile=90 exceeds max_percentile=80"):
        create("adascale", min_percentile=90.0, max_percentile=80.0)
    with pytest.raises(ValueError, match="variant must be 'a'"):
        create("adascale", variant="b")


# ---- rankfeat --------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [None, "body", "body.2"])
def test_rankfeat_matches_pytorch_ood(layer):
    model, x = WideCNN(), images(48, spread=4.0)
    ours = create("rankfeat", model=model, layer=layer).score(Batch(inputs=x))
    if layer == "body.2":  # the map before the last ReLU
        backbone, head = model.body[:3], lambda m: model.head(model.body[3](m))
    else:
        backbone, head = model.feature_map, model.head
    reference = PoodRankFeat(backbone=backbone, head=head).predict(x)
    assert spearman(ours, reference) > 0.9999
    assert abs(auroc(ours, 24) - auroc(reference, 24)) < 1e-5
    torch.testing.assert_close(ours, reference.float(), rtol=1e-4, atol=1e-5)
    # float64 reference: the rank-1 part from numpy's SVD, the rest of the network in float64
    net = copy.deepcopy(model).double()
    split = 3 if layer == "body.2" else 4
    with torch.no_grad():
        maps = net.body[:split](x.double())
        u, s, vh = np.linalg.svd(maps.flatten(2).numpy(), full_matrices=False)
        removed = maps - torch.from_numpy(s[:, 0, None, None] * u[:, :, :1] @ vh[:, :1, :]).view_as(maps)
        expected = -torch.logsumexp(net.head(net.body[split:](removed)), dim=1)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-4, atol=1e-5)
    plain = model(x).detach()
    assert not torch.allclose(ours, -torch.logsumexp(plain, dim=1))  # the removal changes the logits


def test_rankfeat_removes_exactly_the_top_singular_direction():
    from oodviz.detectors.rankfeat import without_rank1

    maps = images(6, spread=2.0).abs()  # [6, 3, 8, 8]
    out = without_rank1(maps).double().flatten(2)
    before = torch.linalg.svdvals(maps.double().flatten(2))
    after = torch.linalg.svdvals(out)
    torch.testing.assert_close(after[:, :2], before[:, 1:], rtol=1e-4, atol=1e-5)
    assert (after[:, 2] < 1e-4).all()


def test_rankfeat_needs_an_unpooled_layer():
    model, x = WideCNN(), images(4)
    with pytest.raises(ValueError, match="layer 'fc' gave \\(4, 5\\), not an unpooled feature map"):
        create("rankfeat", model=model, layer="fc").score(Batch(inputs=x))
    with pytest.raises(ValueError, match=r"has no layer\(s\) 'layer4'; its top-level layers: body, pool, fc"):
        create("rankfeat", model=model, layer="layer4").score(Batch(inputs=x))
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(192, 5))
    with pytest.raises(ValueError, match=r"needs a layer whose output is a feature map \[B, C, H, W\]"):
        create("rankfeat", model=mlp).score(Batch(inputs=x))
    with pytest.raises(ValueError, match="needs an nn.Module"):
        create("rankfeat", model=lambda t: model(t)).score(Batch(inputs=x))


# ---- gram ------------------------------------------------------------------------------------


def labelled_images(n=90, seed=5):
    x = images(n, seed=seed, spread=2.0)
    return x, torch.arange(n) % 5


def held_out_first_randperm(holdout):
    """``torch.randperm(n)`` that lists oodviz's held-out positions (every 1/holdout-th) first, so pytorch-ood's
    random hold-out of ``int(holdout n)`` samples per class is the same samples."""
    real = torch.randperm

    def randperm(n, *args, **kwargs):
        j = torch.arange(n)
        held = torch.floor((j + 1).double() * holdout) > torch.floor(j.double() * holdout)
        assert int(held.sum()) == int(holdout * n)
        return torch.cat([j[held], j[~held]])

    return real, randperm


@pytest.mark.parametrize("holdout", [0.0, 0.1])
def test_gram_matches_pytorch_ood(monkeypatch, holdout):
    model = WideCNN().double()
    fit_x, fit_y = labelled_images()
    fit_x = fit_x.double()
    x = torch.cat([images(30, seed=6, spread=2.0), images(30, seed=7, spread=8.0)]).double()
    layers = ["body.0", "body.1", "body.2", "body.3"]
    det = create("gram", model=model, layers=layers, poles=3, holdout=holdout)
    det.fit([Batch(inputs=fit_x[:37], labels=fit_y[:37]), Batch(inputs=fit_x[37:], labels=fit_y[37:])])
    ours = det.score(Batch(inputs=x)).double()
    _, randperm = held_out_first_randperm(holdout)
    monkeypatch.setattr(torch, "randperm", randperm)
    reference = PoodGram(model.head, [model.body[i] for i in range(4)], num_classes=5, num_poles_list=[1, 2, 3])
    reference.validation_fraction = holdout
    reference.fit([(fit_x[i : i + 30], fit_y[i : i + 30]) for i in range(0, 90, 30)])
    theirs = reference.predict(x).double()
    torch.testing.assert_close(det.layer_norm_.cpu(), reference.layer_norm.double(), rtol=1e-6, atol=1e-9)
    if holdout == 0:
        assert torch.equal(det.layer_norm_, torch.ones(4, dtype=torch.float64))
    else:
        assert (det.layer_norm_ != 1).any()  # the held-out samples do deviate
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert spearman(ours, theirs) > 0.9999
    assert abs(auroc(ours, 30) - auroc(theirs, 30)) < 1e-5
    assert auroc(ours, 30) > 0.7  # the busy images deviate more


def test_gram_statistics_equal_the_gram_matrix_row_sums_in_float64():
    from oodviz.detectors.gram import gram_rows

    maps = images(3, spread=1.5)[:, :, :4, :4]  # [3, 3, 4, 4], signed values
    g = gram_rows(maps, 3)
    f = maps.double().flatten(2).numpy()
    for p in (1, 2, 3):
        fp = f**p
        sums = np.einsum("bcn,bdn->bcd", fp, fp).sum(2)
        np.testing.assert_allclose(g[:, p - 1].numpy(), np.sign(sums) * np.abs(sums) ** (1 / p), rtol=1e-12)


def test_gram_finds_its_layers_streams_two_passes_and_says_what_is_wrong():
    model = WideCNN()
    fit_x, fit_y = labelled_images()
    det = create("gram", model=model, poles=2).fit([Batch(inputs=fit_x, labels=fit_y)])
    assert det.layers_ == ["body.0", "body.1", "body.2", "body.3", "pool"]  # every leaf with a map output
    assert det.minimum_.shape == (5, 2, 16 + 16 + 32 + 32 + 32)
    with pytest.raises(ValueError, match="one-shot iterator"):
        create("gram", model=model).fit(iter([Batch(inputs=fit_x, labels=fit_y)]))
    keep = fit_y != 3
    with pytest.raises(ValueError, match=r"class\(es\) 3 have no inputs outside the held-out part"):
        create("gram", model=model, poles=2).fit([Batch(inputs=fit_x[keep], labels=fit_y[keep])])
    with pytest.raises(ValueError, match="fits on class labels"):
        create("gram", model=model).fit([Batch(inputs=fit_x)])
    with pytest.raises(ValueError, match=r"has no layer\(s\) 'layer1'; its top-level layers: body, pool, fc"):
        create("gram", model=model, layers=["layer1"]).fit([Batch(inputs=fit_x, labels=fit_y)])
    with pytest.raises(ValueError, match="holdout is the fraction"):
        create("gram", holdout=1.0)


# ---- in a run ----------------------------------------------------------------------------------


def test_a_run_fits_and_scores_the_new_detectors_on_the_bundled_model(tmp_path):
    """adascale and gram fit on the ID fit split's images inside the run (the pipeline's own pass), and
    give what the library gives on the same images."""
    import json

    import pandas as pd

    from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
    from oodviz.config.splits import load_split
    from oodviz.models import load_backbone
    from oodviz.pipeline.reporter import Reporter
    from oodviz.pipeline.stages import run_pipeline
    from oodviz.runs.rundir import RunDir

    names = ["msp", "adascale", "gram"]
    gram_params = {"layers": ["features.3", "features.6"], "poles": 2}
    config = RunConfig(
        id_fit=DatasetChoice("digits-test"),  # 362 images, not 1081: the fit passes stay short
        ood=[DatasetChoice("noise-uniform", params={"n": 100})],
        detectors=[DetectorChoice(n, gram_params if n == "gram" else {}) for n in names],
        batch_size=128,
    ).validate()
    run = RunDir.create(tmp_path, config.to_dict())
    run_pipeline(config, run, Reporter(run))
    log = json.loads((run.path / "detectors.json").read_text())
    assert not [n for n in names if "error" in log[n]], log
    scores = pd.read_parquet(run.path / "scores.parquet")
    assert list(scores.columns[5:]) == names
    assert set(pd.read_csv(run.path / "metrics.csv").detector) == set(names)
    bb = load_backbone("digits-cnn")
    fit_set, test_set = load_split(config, config.id_fit, False), load_split(config, config.id_test, False)
    fit_x = torch.stack([bb.transform(fit_set[i][0]) for i in range(len(fit_set))])
    fit_y = torch.tensor([fit_set[i][1] for i in range(len(fit_set))])
    test_x = torch.stack([bb.transform(test_set[i][0]) for i in range(len(test_set))])
    id_rows = scores[scores.split == "id_test"]
    for name, params in (("adascale", {}), ("gram", gram_params)):
        det = create(name, model=bb, **params).fit([Batch(inputs=fit_x, labels=fit_y)])
        expected = det.score(Batch(inputs=test_x)).numpy()
        np.testing.assert_allclose(id_rows[name].to_numpy(), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["adascale", "rankfeat", "gram"])
def test_model_based_ones_ask_for_the_model_and_keep_it_as_it_was(name):
    x, y = labelled_images(20)
    with pytest.raises(ValueError, match=rf"create\('{name}', model=\.\.\.\)"):
        create(name).score(Batch(inputs=x))
    with pytest.raises(ValueError, match=rf"create\('{name}', model=\.\.\.\)"):
        create(name).fit([Batch(inputs=x, labels=y)])
    model = WideCNN()
    model.train()
    model.body[0].eval()
    before = [m.training for m in model.modules()]
    params = {"adascale": {"k1": 10.0, "k2": 5.0}, "gram": {"poles": 2}}.get(name, {})
    det = create(name, model=backbone_of(model), **params).fit([Batch(inputs=x, labels=y)])
    scores = det.score(Batch(inputs=x))
    assert scores.shape == (20,) and torch.isfinite(scores).all()
    assert [m.training for m in model.modules()] == before
    assert all(p.grad is None for p in model.parameters())
    assert not model.body[0]._forward_hooks and not model.body._forward_hooks  # hooks removed


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["adascale", "rankfeat", "gram"])
def test_model_based_ones_fit_and_score_on_the_gpu_as_on_the_cpu(name):
    x, y = labelled_images(40)
    params = {"adascale": {"k1": 10.0, "k2": 5.0}, "gram": {"poles": 2}}.get(name, {})
    model = WideCNN()
    on_cpu = create(name, model=model, **params).fit([Batch(inputs=x, labels=y)], head=model.fc)
    on_gpu = create(name, model=model, **params).fit([Batch(inputs=x, labels=y)], head=model.fc, device="cuda")
    assert all(p.device.type == "cpu" for p in model.parameters())  # put back
    expected = on_cpu.score(Batch(inputs=x))
    torch.testing.assert_close(on_gpu.score(Batch(inputs=x.cuda())), expected, rtol=1e-3, atol=1e-3)
