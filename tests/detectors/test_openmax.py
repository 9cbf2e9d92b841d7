"""oodviz.detectors.openmax: parity with pytorch-ood 0.4 on the same inputs, float64 reference formulas written independently here,
its bounded state, and bad input."""

import numpy as np
import pytest
import torch
from detector_checks import fitted_scores
from helpers import assert_same_ranking, make_problem
from pytorch_ood import detector as pood
from scipy.special import logsumexp

from oodviz import Batch
from oodviz.detectors import create


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
    det, ours = fitted_scores(problem, "openmax", **params)
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
    # tails translated by 10000 (pytorch-ood's shift): a shape in the tens of thousands, no overflow
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
