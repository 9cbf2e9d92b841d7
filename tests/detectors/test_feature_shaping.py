"""Detectors that reshape the penultimate features or use the head's geometry: ReAct, ASH, SCALE,
DICE, fDBD and NCI. Parity with pytorch-ood 0.4 on the same inputs, float64 reference formulas
written independently here, the exact streaming percentile, and bad input."""

import gc
import math
import warnings
import weakref

import numpy as np
import pytest
import torch
from helpers import Problem, assert_same_ranking, make_problem
from pytorch_ood import detector as pood
from scipy.special import logsumexp

from oodviz import Batch
from oodviz.detectors import create
from oodviz.detectors.quantiles import ColumnQuantiles

NEW = ["react", "ash", "scale", "dice", "fdbd", "nci"]


def _clamped(problem: Problem, fn) -> Problem:
    return Problem(
        fn(problem.fit_x), problem.fit_y, fn(problem.test_x), fn(problem.ood_x), problem.weight, problem.bias
    )


@pytest.fixture(scope="module")
def relu_problem(problem):
    """The shared problem with post-ReLU (non-negative, many exactly zero) features and the same head."""
    return _clamped(problem, lambda x: x.clamp(min=0))


@pytest.fixture(scope="module")
def positive_problem(problem):
    """Strictly positive features without ties (ASH-B's kept set is then unambiguous)."""
    return _clamped(problem, lambda x: x.abs() + 0.01)


def _linear(problem) -> torch.nn.Linear:
    linear = torch.nn.Linear(problem.weight.shape[1], problem.weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(problem.weight)
        linear.bias.copy_(problem.bias)
    return linear


def _ours(problem, name, **params):
    det = create(name, **params).fit(problem.fit_batches(), head=problem.head)
    return det, det.score(problem.batches(problem.eval_x)).double().numpy()


def _theirs(problem, name, **params):
    """The same method in pytorch-ood 0.4, fitted by pytorch-ood on the same data, on the same inputs
    (pooled features as B x D x 1 x 1 where it wants maps)."""
    linear = _linear(problem)
    ex = problem.eval_x
    maps = ex[:, :, None, None]
    head_of_maps = lambda m: linear(m.flatten(1))  # noqa: E731
    with torch.no_grad():
        if name == "react":  # np.percentile of the float32 activations (a fraction in pytorch-ood)
            s = pood.ReAct(None, linear, percentile=params["percentile"] / 100)
            s = s.fit_feature_maps(problem.fit_x, problem.fit_y).predict_feature_maps(ex)
        elif name == "ash":
            variant, fraction = f"ash-{params['variant']}", params["percentile"] / 100
            s = pood.ASH(None, head_of_maps, variant=variant, percentile=fraction).predict_feature_maps(maps)
        elif name == "scale":
            s = pood.SCALE(None, head_of_maps, percentile=params["percentile"] / 100).predict_feature_maps(maps)
        elif name == "dice":
            s = pood.DICE(None, problem.weight, problem.bias, p=params["sparsity"])
            s = s.fit_features(problem.fit_x, problem.fit_y).predict_features(ex)
        elif name == "fdbd":
            s = pood.fDBD(None, linear).fit_features(problem.fit_x).predict_features(ex)
        elif name == "nci":
            s = pood.NCI(None, linear, alpha=params["alpha"]).fit_features(problem.fit_x).predict_features(ex)
    return s.double().numpy()


PARITY = [
    ("react", {"percentile": 90}, "relu"),
    ("react", {"percentile": 65}, "relu"),
    ("ash", {"variant": "b", "percentile": 90}, "relu"),
    ("ash", {"variant": "p", "percentile": 90}, "relu"),
    ("ash", {"variant": "s", "percentile": 90}, "relu"),
    ("ash", {"variant": "p", "percentile": 65}, "relu"),
    ("ash", {"variant": "s", "percentile": 65}, "relu"),
    # With 65% pruned, some ReLU samples have fewer than k positive units: which zeros ASH-B keeps
    # (and fills) is a tie that torch.topk breaks arbitrarily and oodviz by index. Untied data here.
    ("ash", {"variant": "b", "percentile": 65}, "positive"),
    ("scale", {"percentile": 85}, "relu"),
    ("scale", {"percentile": 65}, "relu"),
    ("dice", {"sparsity": 0.9}, "relu"),
    ("dice", {"sparsity": 0.5}, "relu"),
    ("fdbd", {}, "relu"),
    ("fdbd", {}, "raw"),
    ("nci", {"alpha": 0.0}, "raw"),
    ("nci", {"alpha": 1e-4}, "raw"),
    ("nci", {"alpha": 0.05}, "relu"),
]


FIXTURE = {"relu": "relu_problem", "positive": "positive_problem", "raw": "problem"}


def _case_id(value):
    return "-".join(map(str, value.values())) if isinstance(value, dict) else str(value)


@pytest.mark.parametrize(("name", "params", "kind"), PARITY, ids=_case_id)
def test_matches_pytorch_ood(request, name, params, kind):
    problem = request.getfixturevalue(FIXTURE[kind])
    _, ours = _ours(problem, name, **params)
    theirs = _theirs(problem, name, **params)
    assert_same_ranking(ours, theirs, n_id=len(problem.test_x))


def test_react_threshold_is_np_percentile_of_all_activations(relu_problem, problem):
    for p, percentile in [(relu_problem, 90), (relu_problem, 65), (problem, 90), (problem, 3.7)]:
        det = create("react", percentile=percentile).fit(p.fit_batches(size=13), head=p.head)
        activations = p.fit_x.numpy()
        # Exact: the same float64 number as numpy on the float32 activations taken as float64.
        assert det.threshold_ == np.percentile(activations.astype(np.float64), percentile)
        # pytorch-ood calls np.percentile on the float32 array (interpolating in float32).
        theirs = pood.ReAct(None, None, percentile=percentile / 100).fit_feature_maps(p.fit_x, p.fit_y).threshold
        assert det.threshold_ == pytest.approx(theirs, rel=2e-7)


# ---- float64 reference formulas, written independently of the library ---------------------


def _np(problem):
    fx = problem.fit_x.double().numpy()
    ex = problem.eval_x.double().numpy()
    w, b = problem.weight.double().numpy(), problem.bias.double().numpy()
    return fx, ex, w, b


def _energy(x, w, b):
    return -logsumexp(x @ w.T + b, axis=1)


def _kept(d, percentile):
    return d - int(np.round(d * percentile / 100))


def reference(problem, name, **params):
    fx, ex, w, b = _np(problem)
    d = ex.shape[1]
    if name == "react":
        c = np.percentile(fx.ravel(), params["percentile"])
        return _energy(np.minimum(ex, c), w, b)
    if name == "ash":
        k = _kept(d, params["percentile"])
        shaped = np.zeros_like(ex)
        for i, x in enumerate(ex):
            keep = np.argsort(-x, kind="stable")[:k]  # the k largest; ties to the lower index
            if params["variant"] == "p":
                shaped[i, keep] = x[keep]
            elif params["variant"] == "b":
                shaped[i, keep] = x.sum() / k
            else:
                shaped[i, keep] = x[keep] * np.exp(x.sum() / x[keep].sum())
        return _energy(shaped, w, b)
    if name == "scale":
        k = _kept(d, params["percentile"])
        top = -np.sort(-ex, axis=1)[:, :k]
        factor = np.exp(ex.sum(1) / top.sum(1))
        return _energy(ex * factor[:, None], w, b)
    if name == "dice":
        contribution = fx.mean(0)[None, :] * w
        threshold = np.percentile(contribution, 100 * params["sparsity"])
        return _energy(ex, np.where(contribution > threshold, w, 0.0), b)
    if name == "fdbd":
        mu = fx.mean(0)
        z = ex @ w.T + b
        scores = []
        for x, logits in zip(ex, z):
            c = logits.argmax()
            others = [j for j in range(len(w)) if j != c]
            distances = [abs(logits[c] - logits[j]) / np.linalg.norm(w[c] - w[j]) for j in others]
            scores.append(-np.mean(distances) / np.linalg.norm(x - mu))
        return np.array(scores)
    if name == "nci":
        mu = fx.mean(0)
        c = (ex @ w.T + b).argmax(1)
        centred = ex - mu
        proximity = np.einsum("nd,nd->n", centred, w[c]) / np.linalg.norm(centred, axis=1)
        return -proximity - params["alpha"] * np.abs(ex).sum(1)
    raise KeyError(name)


REFERENCE = [
    ("react", {"percentile": 90}, "relu"),
    ("react", {"percentile": 42.5}, "raw"),
    ("ash", {"variant": "b", "percentile": 90}, "relu"),
    ("ash", {"variant": "b", "percentile": 65}, "relu"),  # ties at zero: the lower index is kept
    ("ash", {"variant": "p", "percentile": 65}, "relu"),
    ("ash", {"variant": "s", "percentile": 90}, "relu"),
    ("ash", {"variant": "s", "percentile": 65}, "relu"),
    ("scale", {"percentile": 85}, "relu"),
    ("scale", {"percentile": 50}, "relu"),
    ("dice", {"sparsity": 0.9}, "relu"),
    ("dice", {"sparsity": 0.3}, "relu"),
    ("fdbd", {}, "raw"),
    ("fdbd", {}, "relu"),
    ("nci", {"alpha": 1e-4}, "raw"),
    ("nci", {"alpha": 0.05}, "relu"),
]


@pytest.mark.parametrize(("name", "params", "kind"), REFERENCE, ids=_case_id)
def test_matches_float64_formula(request, name, params, kind):
    problem = request.getfixturevalue(FIXTURE[kind])
    _, ours = _ours(problem, name, **params)
    expected = reference(problem, name, **params)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * scale)


def test_fdbd_boundary_norms_survive_a_large_common_weight_offset(problem):
    """||w_c - w_j|| from the Gram matrix (float64) stays accurate when the rows share a large offset."""
    offset = Problem(problem.fit_x, problem.fit_y, problem.test_x, problem.ood_x, problem.weight + 30.0, problem.bias)
    _, ours = _ours(offset, "fdbd")
    expected = reference(offset, "fdbd")
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


# ---- the percentile without holding the activations -----------------------------------------


class GeneratedActivations:
    """A re-iterable that makes its batches on the fly from a seed: nothing is kept between passes."""

    def __init__(self, n=25_000, dim=64, size=1000, n_classes=5, seed=3):
        self.n, self.dim, self.size, self.n_classes, self.seed = n, dim, size, n_classes, seed
        self.passes = 0
        self.alive = weakref.WeakSet()

    def batch(self, start, generator):
        rows = min(self.size, self.n - start)
        x = torch.randn(rows, self.dim, generator=generator)
        x = torch.where(x > 0, torch.exp(2 * x) - 1, torch.zeros(()))  # ReLU-like: ~half exact zeros, heavy tail
        x[:, :3] = torch.round(x[:, :3] * 4) / 4  # many exact ties among the positives too
        return Batch(x, labels=torch.arange(start, start + rows) % self.n_classes)

    def __iter__(self):
        self.passes += 1
        generator = torch.Generator().manual_seed(self.seed)
        for start in range(0, self.n, self.size):
            batch = self.batch(start, generator)
            self.alive.add(batch)
            yield batch

    def materialise(self):
        generator = torch.Generator().manual_seed(self.seed)
        return torch.cat([self.batch(start, generator).features for start in range(0, self.n, self.size)])


def test_react_fits_the_exact_percentile_in_at_most_two_streaming_passes():
    source = GeneratedActivations()
    head = (torch.randn(5, source.dim, generator=torch.Generator().manual_seed(0)), torch.zeros(5))
    everything = source.materialise().double().numpy().ravel()  # 1.6M values, only here in the test
    for percentile in [0, 0.5, 37.3, 90, 99.99, 100]:
        source.passes = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # percentile=0.5 is meant (not a fraction)
            det = create("react", percentile=percentile).fit(source, head=head)
        assert source.passes <= 2 and (percentile > 40 or source.passes == 1)  # in the zeros: one key in the bin
        assert det.threshold_ == np.percentile(everything, percentile), percentile
    gc.collect()
    assert len(source.alive) == 0  # no batch is kept by the fitted detector
    fitted = sum(v.numel() for v in vars(det).values() if isinstance(v, torch.Tensor))
    assert fitted == 5 * source.dim + 5  # the head; the threshold is one float


def test_sortable_keys_order_like_the_floats_and_decode_back():
    from oodviz.detectors.quantiles import keys_to_floats, sortable_keys

    values = torch.tensor([-float("inf"), -3e38, -1.5, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, float("inf")])
    keys = sortable_keys(values)  # the uint32 patterns, as int64
    assert keys.tolist() == sorted(keys.tolist()) and len(set(keys.tolist())) == len(values)
    assert 0 <= int(keys.min()) and int(keys.max()) < 2**32
    decoded = keys_to_floats(keys).tolist()
    assert [math.copysign(1, v) for v in decoded] == [math.copysign(1, v) for v in values.tolist()]
    assert decoded == values.tolist()


def exact_percentile(passes, percentile: float) -> tuple[float, int]:
    """The percentile by :class:`ColumnQuantiles` over one column, ``passes(i)`` giving pass ``i``'s chunks; and the
    number of passes it read."""
    streaming, read = ColumnQuantiles([percentile / 100]), 0
    while not streaming.complete:
        for chunk in passes(read):
            streaming.update(chunk.reshape(-1, 1))
        streaming, read = streaming.next_pass(), read + 1
    return float(streaming.result()[0, 0]), read


def test_streaming_percentile_of_more_values_than_one_key_block():
    """A batch larger than the million-value key blocks gives np.percentile exactly, in two passes."""
    x = torch.randn(1_300_000, generator=torch.Generator().manual_seed(3)).mul_(7)
    assert exact_percentile(lambda _: [x], 97.5) == (np.percentile(x.double().numpy(), 97.5), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_streaming_percentile_matches_numpy_for_any_batching_and_order(dtype):
    g = torch.Generator().manual_seed(7)
    for trial in range(24):
        n = int(torch.randint(1, 3000 if trial % 6 else 40, (1,), generator=g))  # every 6th: chunks of 1 value
        x = torch.randn(n, generator=g) * 10 ** float(torch.randint(-30, 30, (1,), generator=g))
        if trial % 4 == 1:
            x = x.clamp(min=0)  # many zeros
        if trial % 4 == 2:
            x = torch.round(x)  # ties
        if trial % 4 == 3:
            x = torch.cat([x, torch.tensor([-0.0, 0.0, float("inf"), -float("inf")])])
        x = x.to(dtype)
        values = x.float().double().numpy()  # the values oodviz sees: rounded to float32
        q = float(torch.rand(1, generator=g)) * 100
        for percentile in (0.0, q, 100.0):
            chunks = list(x.split(int(torch.randint(1, 500, (1,), generator=g)) if trial % 6 else 1))
            # the second pass may come in any order
            found, _ = exact_percentile(lambda i, chunks=chunks: chunks if i == 0 else chunks[::-1], percentile)
            with np.errstate(invalid="ignore"):  # inf - inf where both order statistics are infinite
                expected = np.percentile(values, percentile)
            assert found == expected or (math.isnan(expected) and math.isnan(found))


def test_streaming_percentile_refines_when_too_many_values_crowd_a_bin(monkeypatch):
    from oodviz.detectors import quantiles

    g = torch.Generator().manual_seed(5)
    crowd = 1.5 + torch.arange(4).repeat(500) * 2.0**-20  # 2000 values, 4 keys in one 24-bit bin
    x = torch.cat([torch.rand(4000, generator=g) + 1, torch.zeros(3000), torch.randn(500, generator=g), crowd])
    chunks = list(x.split(333))
    # collect at once (2 passes); refine 8 bits while a bin holds over 200 values, or any (limit 0): 16+8+8 bits
    for limit, most in ((1 << 22, 2), (200, 3), (0, 3)):
        monkeypatch.setattr(quantiles, "COLLECT_LIMIT", limit)
        reads = {}
        for percentile in (3.0, 30.0, 50.0, 68.0, 99.0):
            found, reads[percentile] = exact_percentile(lambda _: chunks, percentile)
            assert found == np.percentile(x.double().numpy(), percentile), (limit, percentile)
        assert max(reads.values()) <= most and reads[30.0] == 1, reads  # the zeros: one key in their bin, known
        assert limit == 1 << 22 or reads[68.0] == 3, reads  # in the crowd: refined twice


def test_streaming_percentile_state_does_not_grow_with_n():
    for n in (1000, 100_000):
        x = torch.randn(n, 1, generator=torch.Generator().manual_seed(n))
        streaming = ColumnQuantiles([0.9])
        streaming.update(x)
        assert streaming.counts.numel() == 65536 and not streaming.found  # 16 bits counted, whatever n
        streaming = streaming.next_pass()
        streaming.update(x)
        assert streaming.counts is None and sum(len(k) for k in streaming.found) <= n // 100  # two bins' keys
        assert streaming.next_pass().result()[0, 0] == np.percentile(x.double().numpy(), 90)


def test_streaming_percentile_refuses_mismatched_passes():
    streaming = ColumnQuantiles([0.5])
    values = 1 + torch.arange(10.0)[:, None] * 2.0**-20  # ten keys in one bin of the first pass
    streaming.update(values)
    streaming = streaming.next_pass()
    streaming.update(values[:9])
    with pytest.raises(ValueError, match="a pass saw 9 rows, the first saw 10"):
        streaming.next_pass()


def test_react_refuses_a_one_shot_generator(relu_problem):
    with pytest.raises(ValueError, match="one-shot iterator"):
        create("react").fit(iter(relu_problem.fit_batches()), head=relu_problem.head)


def test_fitted_state_is_independent_of_n():
    small, large = make_problem(n_fit=300), make_problem(n_fit=3000)
    for name in NEW:
        sizes = []
        for p in (small, large):
            det = create(name).fit(p.fit_batches(), head=p.head)
            sizes.append(sum(v.numel() for v in vars(det).values() if isinstance(v, torch.Tensor)))
        assert sizes[0] == sizes[1], name


# ---- shaping details -------------------------------------------------------------------------


def test_ash_and_scale_only_store_the_head_and_read_one_batch(relu_problem):
    for name in ("ash", "scale"):
        read = []

        def stream():
            for batch in relu_problem.fit_batches():
                read.append(batch)  # noqa: B023
                yield batch

        det = create(name).fit(stream(), head=relu_problem.head)
        assert len(read) == 1
        assert torch.equal(det.head_weight_, relu_problem.weight) and torch.equal(det.head_bias_, relu_problem.bias)
        assert {k for k in vars(det) if k.endswith("_")} == {
            "head_weight_",
            "head_bias_",
            "n_features_in_",
            "n_classes_",
        }


def test_ash_b_breaks_ties_by_unit_index():
    weight = torch.eye(6)
    x = torch.tensor([[0.0, 3.0, 0.0, 0.0, 1.0, 0.0]])  # percentile 50 keeps k = 3: units 1, 4 and then 0
    det = create("ash", variant="b", percentile=50).fit([Batch(x)], head=(weight, torch.zeros(6)))
    shaped, _ = det.shape_features(x)
    torch.testing.assert_close(shaped, torch.tensor([[4 / 3, 4 / 3, 0.0, 0.0, 4 / 3, 0.0]]))


@pytest.mark.parametrize(("name", "params"), [("ash", {"variant": "s"}), ("scale", {})])
def test_an_all_zero_sample_keeps_its_features(relu_problem, name, params):
    det = create(name, **params).fit(relu_problem.fit_batches(), head=relu_problem.head)
    score = det.score(Batch(torch.zeros(1, 12)))
    expected = -torch.logsumexp(relu_problem.bias, dim=0)
    torch.testing.assert_close(score, expected[None])


@pytest.mark.parametrize(
    ("name", "params"), [("ash", {"variant": "s", "percentile": 99.9}), ("scale", {"percentile": 99.9})]
)
def test_an_overflowing_scale_factor_is_an_error_not_inf(name, params):
    d = 2000  # one unit kept: exp(s1 / s2) = exp(2000) overflows even float64
    head = (torch.randn(3, d, generator=torch.Generator().manual_seed(0)), torch.zeros(3))
    det = create(name, **params).fit([Batch(torch.rand(4, d))], head=head)
    with pytest.raises(ValueError, match="exceed the float32 range.*lower percentile"):
        det.score(Batch(torch.ones(2, d)))


def test_dice_masks_the_smallest_contributions(relu_problem):
    det = create("dice", sparsity=0.75).fit(relu_problem.fit_batches(), head=relu_problem.head)
    contribution = relu_problem.fit_x.double().mean(0) * relu_problem.weight.double()
    kept = det.masked_weight_ != 0
    assert int(kept.sum()) == 18  # entries above the 75th percentile of 72 (np.percentile interpolates)
    assert contribution[kept].min() > contribution[~kept].max()
    torch.testing.assert_close(det.masked_weight_[kept], relu_problem.weight[kept])


# ---- bad input: a ValueError that names the problem and the fix -----------------------------


@pytest.mark.parametrize("name", NEW)
def test_the_head_is_required(relu_problem, name):
    with pytest.raises(ValueError, match=r"needs the classifier's final linear layer: call fit\(batches, head="):
        create(name).fit(relu_problem.fit_batches())


@pytest.mark.parametrize("name", ["react", "ash", "scale"])
def test_percentile_must_be_in_percent(name):
    for bad in (-1, 101, float("nan"), float("inf"), "90", None, True):
        with pytest.raises(ValueError, match="percentile"):
            create(name, percentile=bad)
    with pytest.warns(UserWarning, match="pass percentile=90"):
        create(name, percentile=0.9)
    if name != "react":  # keeping no activation is meaningless; ReAct at 100 clips at the maximum
        with pytest.raises(ValueError, match="percentile < 100"):
            create(name, percentile=100)
    assert create(name, percentile=50).percentile == 50.0


@pytest.mark.parametrize("name", ["ash", "scale"])
def test_a_percentile_that_prunes_every_feature(relu_problem, name):
    with pytest.raises(ValueError, match=r"percentile=96 prunes all D=12 features .*choose percentile < 95.8333"):
        create(name, percentile=96).fit(relu_problem.fit_batches(), head=relu_problem.head)
    create(name, percentile=95).fit(relu_problem.fit_batches(), head=relu_problem.head)  # keeps 1 of 12


def test_ash_variant():
    with pytest.raises(ValueError, match=r"'b' \(binarise\), 'p' \(prune\) or 's' \(scale\), got 'x'"):
        create("ash", variant="x")
    with pytest.raises(ValueError, match="use variant='b'"):
        create("ash", variant="ash-b")
    assert create("ash").get_params() == {"variant": "s", "percentile": 90.0}


def test_dice_sparsity():
    for bad in (1.0, -0.1, float("nan"), "0.9", None, True):
        with pytest.raises(ValueError, match="0 <= sparsity < 1"):
            create("dice", sparsity=bad)
    with pytest.raises(ValueError, match="use 0.9 for 90%"):
        create("dice", sparsity=90)
    assert create("dice", sparsity=0).sparsity == 0.0


def test_dice_with_all_zero_features_keeps_no_weight(relu_problem):
    zeros = [Batch(torch.zeros(20, 12))]
    with pytest.raises(ValueError, match="sparsity=0.9 keeps no weight.*features are not all zero"):
        create("dice").fit(zeros, head=relu_problem.head)


def test_fdbd_needs_distinct_class_weights_and_two_classes(problem):
    weight = problem.weight.clone()
    weight[4] = weight[1]
    with pytest.raises(ValueError, match="classes 1 and 4 have the same head weight vector"):
        create("fdbd").fit(problem.fit_batches(), head=(weight, problem.bias))
    with pytest.raises(ValueError, match="at least 2 classes"):
        create("fdbd").fit([Batch(problem.fit_x)], head=(problem.weight[:1], problem.bias[:1]))


def test_nci_alpha():
    for bad in (-0.1, float("nan"), float("inf"), "0.1", None, True):
        with pytest.raises(ValueError, match="alpha .* must be a finite number >= 0"):
            create("nci", alpha=bad)
    assert create("nci").alpha == 1e-4
