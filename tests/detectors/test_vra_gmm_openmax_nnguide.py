"""VRA, GMM, OpenMax and NNGuide: parity with pytorch-ood 0.4 on the same inputs, float64 reference
formulas written independently here, their streaming statistics, and bad input."""

import numpy as np
import pytest
import torch
from helpers import Problem, assert_same_ranking, make_problem
from pytorch_ood import detector as pood
from scipy.special import logsumexp

from oodviz import Batch
from oodviz.detectors import create
from oodviz.detectors.quantiles import ColumnQuantiles, first_bits


def _relu(problem: Problem) -> Problem:
    f = lambda x: x.clamp(min=0)  # noqa: E731
    return Problem(f(problem.fit_x), problem.fit_y, f(problem.test_x), f(problem.ood_x), problem.weight, problem.bias)


@pytest.fixture(scope="module")
def relu_problem(problem):
    """Post-ReLU features (many exact zeros: ties in every unit's order statistics)."""
    return _relu(problem)


def _ours(problem, name, size=97, **params):
    det = create(name, **params).fit(problem.fit_batches(size), head=problem.head)
    return det, det.score(problem.batches(problem.eval_x)).double().numpy()


def _energy(x, w, b):
    return -logsumexp(x @ w.T + b, axis=1)


# ---- vra ---------------------------------------------------------------------------------------

VRA_CASES = [((1, 99), "raw"), ((10, 90), "raw"), ((25, 75), "relu"), ((5, 95), "relu"), ((0, 100), "raw")]


@pytest.mark.parametrize(("percentiles", "kind"), VRA_CASES)
def test_vra_matches_pytorch_ood_and_the_float64_formula(problem, relu_problem, percentiles, kind):
    p = relu_problem if kind == "relu" else problem
    lower, upper = percentiles
    det, ours = _ours(p, "vra", lower_percentile=lower, upper_percentile=upper)
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


# ---- gmm ---------------------------------------------------------------------------------------


def _gmm_reference(fx, fy, ex, reg):
    """float64 negative log-likelihood of the class-conditional mixture, with scipy's multivariate normal."""
    from scipy.stats import multivariate_normal

    classes = np.unique(fy)
    terms = []
    for c in classes:
        xc = fx[fy == c]
        cov = np.cov(xc, rowvar=False, bias=True) + reg * np.eye(fx.shape[1])
        terms.append(np.log(len(xc) / len(fx)) + multivariate_normal(xc.mean(0), cov).logpdf(ex))
    return -logsumexp(np.stack(terms, axis=1), axis=1)


@pytest.mark.parametrize("reg", [1e-6, 0.5])
def test_gmm_matches_pytorch_ood_and_scipy(problem, reg):
    det, ours = _ours(problem, "gmm", reg=reg)
    theirs = pood.GMM(None, reg=reg).fit_features(problem.fit_x, problem.fit_y).predict_features(problem.eval_x)
    assert_same_ranking(ours, theirs.double().numpy(), n_id=len(problem.test_x))
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-5)  # the same number, not just the ranking
    fx, fy, ex = problem.fit_x.double().numpy(), problem.fit_y.numpy(), problem.eval_x.double().numpy()
    np.testing.assert_allclose(ours, _gmm_reference(fx, fy, ex, reg), rtol=1e-5)


def test_gmm_is_exact_under_a_large_feature_offset():
    """Per-class shifts: features ~1e4 from the origin with unit spread give the same covariances."""
    p = make_problem(offset=1e4)
    det, ours = _ours(p, "gmm", size=13)
    fx, fy, ex = p.fit_x.double().numpy(), p.fit_y.numpy(), p.eval_x.double().numpy()
    for c in range(6):
        np.testing.assert_allclose(det.class_means_[c].numpy(), fx[fy == c].mean(0), rtol=1e-12)
    np.testing.assert_allclose(ours, _gmm_reference(fx, fy, ex, 1e-6), rtol=1e-6)


def test_gmm_needs_reg_for_a_class_with_fewer_samples_than_dimensions(problem):
    y = problem.fit_y.clone()
    few = torch.nonzero(y == 4).flatten()[5:]
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[few] = False  # class 4 keeps 5 samples in D = 12: a rank-4 covariance
    batches = problem.batches(problem.fit_x[keep], y[keep])
    with pytest.raises(ValueError, match=r"covariance of class 4 \(5 samples, D=12\) is not positive definite"):
        create("gmm", reg=0).fit(batches)
    det = create("gmm", reg=1e-3).fit(batches)
    assert torch.isfinite(det.score(problem.batches(problem.eval_x))).all()
    with pytest.raises(ValueError, match="reg must be a finite number >= 0"):
        create("gmm", reg=-1)


# ---- openmax -----------------------------------------------------------------------------------


def _openmax_reference(logits, labels, query, tailsize, alpha, euclid_weight, fitted):
    """float64 OpenMax written out sample by sample. ``fitted``'s Weibull of each class must have a likelihood
    at least as high as scipy's fit (which, at shapes of ~1e5 on cosine tails, sometimes stops 1.5% short);
    a 1e-4 change in such a shape moves the scores by ~1e-3, so the scores use ``fitted``'s (shape, scale)."""
    from scipy.stats import weibull_min

    classes = np.unique(labels)
    means = np.stack([logits[labels == c].mean(0) for c in classes])

    def distance(z, mu):
        cosine = z @ mu / (np.linalg.norm(z) * np.linalg.norm(mu))
        return euclid_weight * np.linalg.norm(z - mu) + (1 - euclid_weight) * (1 - cosine)

    weibulls = []
    for c in classes:
        tail = np.sort([distance(z, means[c]) for z in logits[labels == c]])[-tailsize:]
        translated = tail + 10000 - tail.min()
        shape, _, scale = weibull_min.fit(translated, floc=0)
        ours = fitted.weibull_shapes_[c].item(), fitted.weibull_scales_[c].item()
        loglik = lambda c, s, t=translated: weibull_min.logpdf(t, c, scale=s).sum()  # noqa: E731
        assert loglik(*ours) >= loglik(shape, scale) - 1e-9
        assert ours[0] == pytest.approx(shape, rel=0.02)
        weibulls.append((*ours, tail.min()))
    scores = []
    alpha = min(alpha, logits.shape[1])
    for z in query:
        revised, unknown = z.copy(), 0.0
        for i, k in enumerate(np.argsort(-z)[:alpha]):
            shape, scale, low = weibulls[k]
            w = (alpha - i) / alpha * -np.expm1(-(((distance(z, means[k]) + 10000 - low) / scale) ** shape))
            revised[k] = z[k] * (1 - w)
            unknown += z[k] * w
        full = np.concatenate([[unknown], revised])
        scores.append(np.exp(unknown - logsumexp(full)))
    return np.array(scores)


OPENMAX_CASES = [
    {"tailsize": 25, "alpha": 10, "euclid_weight": 1.0},
    {"tailsize": 20, "alpha": 3, "euclid_weight": 0.5},
    {"tailsize": 40, "alpha": 2, "euclid_weight": 0.0},
]


@pytest.mark.parametrize("params", OPENMAX_CASES, ids=lambda p: "-".join(map(str, p.values())))
def test_openmax_matches_pytorch_ood_and_the_float64_formula(problem, params):
    det, ours = _ours(problem, "openmax", **params)
    fit_logits, query = problem.logits(problem.fit_x), problem.logits(problem.eval_x)
    # pytorch-ood translates the tail in the logits' dtype: on float32 logits, d + 10000 - min is rounded
    # to float32's step of ~0.001 at 10000, which moves its Weibull shapes by ~0.1% (and AUROC by ~4e-5
    # here). On the same logits as float64 it computes in float64 as oodviz does. Its fit is scipy's
    # Nelder-Mead (exponweib.fit), which stops within ~5e-4 of the maximum likelihood that oodviz solves for;
    # at shapes of ~1e5 (cosine distances) that still flips a pair or two. So: the fits agree to 1e-3, the
    # scoring is pytorch-ood's given oodviz's Weibulls, and oodviz is closer to pytorch-ood in float64 than
    # pytorch-ood's own float32 run is.
    exact = pood.OpenMax(None, **params).fit_logits(fit_logits.double(), problem.fit_y)
    for k in range(6):
        weibull = exact._openmax.distributions[k]
        assert det.weibull_shapes_[k].item() == pytest.approx(weibull.c, rel=1e-3)
        assert det.weibull_scales_[k].item() == pytest.approx(weibull.scale, rel=1e-8)
    if params["euclid_weight"] == 1.0:  # once (pytorch-ood's fit and predict are slow: scipy per class and sample)
        rounded = pood.OpenMax(None, **params).fit_logits(fit_logits, problem.fit_y)
        rows = slice(250, 370)  # ID and OOD rows
        theirs = exact.predict_logits(query[rows].double()).double().numpy()
        theirs_rounded = rounded.predict_logits(query[rows]).double().numpy()
        assert np.abs(ours[rows] - theirs).max() < np.abs(theirs_rounded - theirs).max()
    for k in range(6):
        exact._openmax.distributions[k].c = det.weibull_shapes_[k].item()
        exact._openmax.distributions[k].scale = det.weibull_scales_[k].item()
    theirs = exact.predict_logits(query.double()).double().numpy()
    assert_same_ranking(ours, theirs, n_id=len(problem.test_x))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    expected = _openmax_reference(
        fit_logits.double().numpy(), problem.fit_y.numpy(), query.double().numpy(), **params, fitted=det
    )
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-7)


def test_weibull_fit_is_the_maximum_likelihood_of_scipy():
    from scipy.stats import exponweib, weibull_min

    from oodviz.detectors.openmax import fit_weibull

    rng = np.random.default_rng(0)
    for shape, scale, n in [(1.5, 2.0, 200), (0.7, 30.0, 25), (8.0, 1.0, 50)]:
        x = weibull_min.rvs(shape, scale=scale, size=n, random_state=rng)
        c, lam = fit_weibull(x)
        c_ref, _, lam_ref = weibull_min.fit(x, floc=0)  # scipy's own optimiser: to ~1e-5
        assert c == pytest.approx(c_ref, rel=1e-4) and lam == pytest.approx(lam_ref, rel=1e-4)
        # exponweib with a = 1 (libMR's and pytorch-ood's call) is the same distribution
        _, c_exp, _, lam_exp = exponweib.fit(x, floc=0, f0=1)
        assert c == pytest.approx(c_exp, rel=1e-3) and lam == pytest.approx(lam_exp, rel=1e-3)
        loglik = lambda c, lam, x=x: weibull_min.logpdf(x, c, scale=lam).sum()  # noqa: E731
        assert loglik(c, lam) >= loglik(c_ref, lam_ref) - 1e-12  # at least as likely as scipy's
        assert loglik(c, lam) >= max(loglik(c * 1.001, lam), loglik(c / 1.001, lam), loglik(c, lam * 1.001))
    # libMR's translated tails: a shape in the tens of thousands, no overflow
    tail = 10000 + np.sort(rng.random(25))
    c, lam = fit_weibull(tail)
    c_ref, _, lam_ref = weibull_min.fit(tail, floc=0)
    assert c > 1e4 and c == pytest.approx(c_ref, rel=1e-4) and lam == pytest.approx(lam_ref, rel=1e-9)


def test_openmax_state_is_bounded_and_bad_input_is_refused(problem):
    sizes = []
    for n in (300, 3000):
        p = make_problem(n_fit=n)
        det = create("openmax").fit(p.fit_batches())
        sizes.append(sum(v.numel() for v in vars(det).values() if isinstance(v, torch.Tensor)))
    assert sizes[0] == sizes[1]
    y = problem.fit_y.clone()
    y[(y == 3).nonzero().flatten()[1:]] = -1  # class 3 keeps one sample
    with pytest.raises(ValueError, match=r"class 3 has 1 training sample\(s\) .*give the class more samples"):
        create("openmax").fit(problem.batches(problem.fit_x, y))
    # an all-zero logits row has cosine 0 to every class mean (distance 1), not 0 / 0
    det = create("openmax", euclid_weight=0.0).fit(problem.fit_batches())
    zero = Batch(logits=torch.zeros(1, 6))
    assert torch.isfinite(det.score(zero)).all()
    mu = det.class_means_.numpy()
    np.testing.assert_allclose(det.distances(torch.zeros(1, 6), det.class_means_).numpy(), np.ones((1, len(mu))))
    for bad in ({"tailsize": 1}, {"alpha": 0}, {"euclid_weight": 1.5}, {"tailsize": 2.5}):
        with pytest.raises(ValueError, match="openmax: "):
            create("openmax", **bad)


# ---- nnguide -----------------------------------------------------------------------------------


def _nnguide_reference(problem, k):
    fx, ex = problem.fit_x.double().numpy(), problem.eval_x.double().numpy()
    w, b = problem.weight.double().numpy(), problem.bias.double().numpy()
    confidence = lambda x: logsumexp(x @ w.T + b, axis=1)  # noqa: E731
    bank = fx / np.linalg.norm(fx, axis=1, keepdims=True) * confidence(fx)[:, None]
    similarities = (ex / np.linalg.norm(ex, axis=1, keepdims=True)) @ bank.T
    guidance = -np.sort(-similarities, axis=1)[:, :k].mean(1)
    return -guidance * confidence(ex)


@pytest.mark.parametrize("k", [1, 10, 37])
def test_nnguide_matches_pytorch_ood_and_the_float64_formula(problem, k):
    det, ours = _ours(problem, "nnguide", k=k)
    with torch.no_grad():
        theirs = pood.NNGuide(None, problem.logits, k=k).fit_features(problem.fit_x, problem.fit_y)
        theirs = theirs.predict_features(problem.eval_x).double().numpy()
    assert_same_ranking(ours, theirs, n_id=len(problem.test_x))
    expected = _nnguide_reference(problem, k)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_nnguide_keeps_its_scaled_bank_on_disk_and_searches_it_in_chunks(problem, tmp_path):
    det = create("nnguide", k=10, chunk_size=7, bank_dir=str(tmp_path)).fit(problem.fit_batches(), head=problem.head)
    assert isinstance(det.bank_, np.memmap) and det.bank_path_.startswith(str(tmp_path))
    fx = problem.fit_x.double().numpy()
    confidence = logsumexp(fx @ problem.weight.double().numpy().T + problem.bias.double().numpy(), axis=1)
    np.testing.assert_allclose(
        det.bank_, fx / np.linalg.norm(fx, axis=1, keepdims=True) * confidence[:, None], rtol=1e-5
    )
    scores = det.score(b for b in problem.batches(problem.eval_x))  # 172 chunks, a one-shot iterable
    expected = _nnguide_reference(problem, 10)
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_nnguide_faiss_flat_backend_gives_the_exact_scores(problem):
    pytest.importorskip("faiss")
    det = create("nnguide", k=10, backend="faiss-flat").fit(problem.fit_batches(), head=problem.head)
    expected = _nnguide_reference(problem, 10)
    np.testing.assert_allclose(det.score(problem.batches(problem.eval_x)).numpy(), expected, rtol=1e-4, atol=1e-4)


def test_nnguide_needs_the_head_and_k_rows(problem):
    with pytest.raises(ValueError, match=r"needs the classifier's final linear layer"):
        create("nnguide").fit(problem.fit_batches())
    with pytest.raises(ValueError, match=r"nnguide: k=50 exceeds the 40 in-distribution samples"):
        create("nnguide", k=50).fit(problem.batches(problem.fit_x[:40], problem.fit_y[:40]), head=problem.head)
