"""Issue 29's bank detectors, relation, cfood, grood and combood: each against its reference code re-written here plainly
in float64 (OpenOOD's ``relation_postprocessor.py``, ``cfood_postprocessor.py``, ``grood.py``'s autograd path;
CombOOD's authors' scikit-learn and FAISS pipeline), streamed in small chunks equal to one pass, and saved and loaded
scoring the same."""

import gc

import numpy as np
import pytest
import torch
from scipy.special import softmax
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import PowerTransformer, StandardScaler

from oodviz import Batch
from oodviz.detectors import bank as bank_module
from oodviz.detectors import create, load


def _float64(problem):
    as64 = lambda t: t.double().numpy()  # noqa: E731
    fx, ex = as64(problem.fit_x), as64(problem.eval_x)
    return fx, ex, as64(problem.logits(problem.fit_x)), as64(problem.logits(problem.eval_x))


def openood_normalize(feat):
    """OpenOOD relation's ``normalize``: ``x / sqrt(|x|^2 + 1e-10)``."""
    return feat / np.sqrt((feat**2).sum(-1) + 1e-10)[:, None]


def relation_kernel(fx, f_logits, ex, e_logits):
    """OpenOOD's ``kernel``: the clamped cosine times the inner product of the softmaxes, ``[N_query, N_train]``."""
    dot = np.clip(openood_normalize(ex) @ openood_normalize(fx).T, 0, None)
    return dot * (softmax(e_logits, axis=1) @ softmax(f_logits, axis=1).T)


def relation_reference(rel, pow, thres=0.03):
    """OpenOOD's ``get_relation`` from the kernel: ``sum sign(r) |r|^pow`` over ``|r| > thres``; negated (OOD score)."""
    masked = (np.abs(rel) > thres) * rel
    return -(np.sign(masked) * np.abs(masked) ** pow).sum(-1)


@pytest.mark.parametrize("pow", [1, 2, 8])
def test_relation_is_openoods_edge_sum(problem, pow):
    fx, ex, fl, el = _float64(problem)
    det = create("relation", pow=pow).fit(problem.fit_batches(), head=problem.head)
    ours = det.score(problem.batches(problem.eval_x)).double().numpy()
    rel = relation_kernel(fx, fl, ex, el)
    expected = relation_reference(rel, pow)
    # An edge within float32 rounding of the cut may fall on either side: at most its own weight apart.
    borderline = np.where(np.abs(rel - 0.03) < 1e-6, rel**pow, 0).sum(-1)
    assert (borderline > 0).mean() < 0.05
    assert np.all(np.abs(ours - expected) <= borderline + 1e-5 * np.abs(expected).max())
    assert det.bank_.shape == (len(fx), fx.shape[1] + fl.shape[1])
    labels = np.r_[np.zeros(len(problem.test_x)), np.ones(len(problem.ood_x))]
    assert abs(roc_auc_score(labels, ours) - roc_auc_score(labels, expected)) < 1e-5


def test_relation_reads_the_batch_logits_or_the_head(problem):
    """Batches without logits get them from the head; batches with other logits are read as given."""
    det = create("relation").fit(problem.fit_batches(), head=problem.head)
    with_logits = det.score(problem.batches(problem.eval_x))
    features_only = [Batch(features=b.features) for b in problem.batches(problem.eval_x)]
    torch.testing.assert_close(det.score(features_only), with_logits, rtol=1e-5, atol=1e-6)
    fx, ex, fl, el = _float64(problem)
    other = 2 * problem.logits(problem.eval_x)  # sharper softmaxes than the head's
    ours = det.score([Batch(problem.eval_x, other)]).double().numpy()
    np.testing.assert_allclose(
        ours, relation_reference(relation_kernel(fx, fl, ex, other.double().numpy()), 1), rtol=1e-4, atol=1e-3
    )


def test_relation_takes_pow_and_thres_without_a_refit(problem):
    det = create("relation", pow=1).fit(problem.fit_batches(), head=problem.head)
    det.set_params(pow=4, thres=0.1)
    fresh = create("relation", pow=4, thres=0.1).fit(problem.fit_batches(), head=problem.head)
    query = problem.batches(problem.eval_x)
    torch.testing.assert_close(det.score(query), fresh.score(query))
    for bad in ({"pow": 0}, {"pow": "2"}, {"thres": 1.0}, {"thres": -0.1}, {"chunk_size": 0}):
        with pytest.raises(ValueError, match="relation: "):
            create("relation", **bad)
    with pytest.raises(ValueError, match="relation needs the classifier's final linear layer"):
        create("relation").fit(problem.fit_batches())


# ---- cfood -------------------------------------------------------------------------------------


def openood_cfood(fx, ex, alpha, k, seed):
    """OpenOOD's CFOOD ``setup`` and ``postprocess`` in float64, with the reference rows drawn as documented (row ``i``
    kept when the ``i``-th draw of ``default_rng(seed).random()`` is below ``alpha``). Returns the OOD score
    (``-conf``) and the reference set."""
    feats = fx / (np.linalg.norm(fx, axis=1, keepdims=True) + 1e-10)
    ref = feats if alpha == 1 else feats[np.random.default_rng(seed).random(len(fx)) < alpha]
    n = len(ref)
    kval = np.concatenate((np.linspace(0.001, 0.1, 100), np.linspace(0.105, 0.5, 81), np.linspace(0.51, 0.99, 49)))
    kpos = np.array(kval * n - 1, dtype=int)
    keep = np.concatenate(([True], kpos[:-1] < kpos[1:]))
    kval, kpos = kval[keep], kpos[keep]
    knndst = np.stack([np.sort(((ref[i] - ref) ** 2).sum(1))[kpos + 1] for i in range(n)])
    scores = []
    for v in ex / (np.linalg.norm(ex, axis=1, keepdims=True) + 1e-10):
        dst = ((v - ref) ** 2).sum(1)
        count = (knndst >= dst[:, None]).sum(0) / n
        pos = np.nonzero(count >= k)[0]
        scores.append(kval[pos[0]] if len(pos) else 1.0)
    return np.array(scores), ref, knndst


@pytest.mark.parametrize(("alpha", "k"), [(1.0, 0.01), (0.1, 0.01), (0.5, 0.05), (0.5, 0.001)])
def test_cfood_is_openoods_neighbourhood_fraction(problem, alpha, k):
    fx, ex, _, _ = _float64(problem)
    det = create("cfood", alpha=alpha, k=k, seed=3).fit(problem.fit_batches())
    ours = det.score(problem.batches(problem.eval_x)).double().numpy()
    expected, ref, knndst = openood_cfood(fx, ex, alpha, k, seed=3)
    np.testing.assert_allclose(det.bank_, ref, atol=1e-6)  # the same reference rows, in order
    np.testing.assert_allclose(det.knn_distances_, knndst, atol=2e-6)
    # kappa is a grid value: float32 distances may move a query across a count's threshold at a near-tie, by one step
    same = ours == expected.astype(np.float32)
    assert same.mean() >= 0.99, same.mean()
    grid = det.kval_.numpy()
    assert np.all(np.abs(np.searchsorted(grid, ours[~same]) - np.searchsorted(grid, expected[~same])) <= 1)
    labels = np.r_[np.zeros(len(problem.test_x)), np.ones(len(problem.ood_x))]
    assert abs(roc_auc_score(labels, ours) - roc_auc_score(labels, expected)) < 2e-3
    assert roc_auc_score(labels, ours) > 0.6  # OOD rows (between the classes) need larger neighbourhoods


def test_cfood_takes_k_without_a_refit_and_checks_its_parameters(problem):
    det = create("cfood", alpha=0.5, k=0.01).fit(problem.fit_batches())
    det.set_params(k=0.05)
    query = problem.batches(problem.eval_x)
    torch.testing.assert_close(
        det.score(query), create("cfood", alpha=0.5, k=0.05).fit(problem.fit_batches()).score(query)
    )
    with pytest.raises(ValueError, match="alpha changes what fit learns"):
        det.set_params(alpha=1.0)
    for bad in ({"alpha": 0}, {"alpha": 1.5}, {"k": 0}, {"k": 2}, {"seed": -1}, {"seed": 1.5}):
        with pytest.raises(ValueError, match="cfood: "):
            create("cfood", **bad)
    with pytest.raises(ValueError, match=r"cfood: the reference set has [01] row\(s\).*raise alpha"):
        create("cfood", alpha=1e-4).fit(problem.fit_batches())


# ---- grood -------------------------------------------------------------------------------------


def openood_grood_gradients(x, predicted, prototypes, noise):
    """OpenOOD grood's ``_compute_grad`` (autograd path) in float64: the gradient, with respect to the OOD prototype,
    of the cross-entropy of the predicted class over ``-|x - P|`` for the class prototypes and the OOD one (last)."""
    grads = []
    for row, target in zip(torch.as_tensor(x), torch.as_tensor(predicted)):
        noise_proto = torch.as_tensor(noise).clone().requires_grad_(True)
        prototypes_all = torch.cat([torch.as_tensor(prototypes), noise_proto[None]])
        ncc_scores = -torch.norm(row[None] - prototypes_all, dim=1)
        loss = torch.nn.functional.cross_entropy(ncc_scores[None], target[None])
        grads.append(torch.autograd.grad(loss, noise_proto)[0].numpy())
    return np.stack(grads)


def grood_reference(problem, noise=None):
    fx, ex, fl, el = _float64(problem)
    fy = problem.fit_y.numpy()
    prototypes = np.stack([fx[fy == c].mean(0) for c in range(fl.shape[1])])
    noise = prototypes.mean(0) if noise is None else np.asarray(noise, dtype=np.float64)
    correct = fl.argmax(1) == fy
    bank = openood_grood_gradients(fx[correct], fl.argmax(1)[correct], prototypes, noise)
    queries = openood_grood_gradients(ex, el.argmax(1), prototypes, noise)
    squared = ((queries[:, None, :] - bank[None, :, :]) ** 2).sum(-1)  # IndexFlatL2's squared distances
    return squared.min(1), bank


@pytest.mark.parametrize("noise", [None, "ood mean"])
def test_grood_is_openoods_nearest_gradient_distance(problem, noise):
    if noise == "ood mean":  # OpenOOD's default OOD prototype: the mean feature of OOD validation samples
        noise = problem.ood_x[:100].double().mean(0).tolist()
    det = create("grood", noise_prototype=noise).fit(problem.fit_batches(), head=problem.head)
    ours = det.score(problem.batches(problem.eval_x)).double().numpy()
    expected, bank = grood_reference(problem, noise)
    np.testing.assert_allclose(det.bank_, bank, rtol=1e-5, atol=1e-7)  # the correct rows' gradients, in order
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-6 * expected.max())
    labels = np.r_[np.zeros(len(problem.test_x)), np.ones(len(problem.ood_x))]
    assert abs(roc_auc_score(labels, ours) - roc_auc_score(labels, expected)) < 1e-4


def test_grood_checks_its_ood_prototype_and_its_bank(problem):
    for bad in ([], [[1.0]], [float("nan")] * 12, "mean"):
        with pytest.raises(ValueError, match="grood: noise_prototype must be D finite numbers"):
            create("grood", noise_prototype=bad)
    with pytest.raises(ValueError, match="grood: noise_prototype has 3 numbers but the features have D=12"):
        create("grood", noise_prototype=[0.0, 1.0, 2.0]).fit(problem.fit_batches(), head=problem.head)
    predicted = problem.logits(problem.fit_x).argmax(1)
    wrong = (predicted + 1) % len(problem.bias)  # every row labelled as a class it is not predicted as
    with pytest.raises(ValueError, match="grood: no fit sample is classified correctly"):
        create("grood").fit(problem.batches(problem.fit_x, wrong), head=problem.head)


# ---- combood ------------------------------------------------------------------------------------


def combood_reference(fx, ex, k=50, reg=1.0):
    """The authors' penultimate-feature CombOOD in float64: their ``normalizer`` (``x / |x| + 1e-10``), scikit-learn's
    StandardScaler then PowerTransformer (Yeo-Johnson, Brent's lambdas), ``np.cov`` + ``reg I`` inverted, the mean 0;
    the squared distance to the k-th nearest training feature (IndexFlatL2's); ``sqrt(D) log d_k^2 + M^2``."""
    normalizer = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True) + 1e-10  # noqa: E731
    zf, ze = normalizer(fx), normalizer(ex)
    scaler, power = StandardScaler(), PowerTransformer(method="yeo-johnson", standardize=True)
    train = power.fit_transform(scaler.fit_transform(zf))
    inverse = np.linalg.inv(np.cov(train, rowvar=False) + reg * np.identity(train.shape[1]))
    test = power.transform(scaler.transform(ze))
    mahalanobis = np.einsum("ij,jk,ik->i", test, inverse, test)
    kth = np.sort(((ze[:, None, :] - zf[None, :, :]) ** 2).sum(-1), axis=1)[:, k - 1]
    return np.sqrt(zf.shape[1]) * np.log(kth) + mahalanobis, power.lambdas_


@pytest.mark.parametrize(("k", "reg"), [(50, 1.0), (5, 0.1)])
def test_combood_is_the_authors_knn_and_gaussianised_mahalanobis(problem, k, reg):
    fx, ex, _, _ = _float64(problem)
    det = create("combood", k=k, reg=reg).fit(problem.fit_batches())
    ours = det.score(problem.batches(problem.eval_x)).double().numpy()
    expected, lambdas = combood_reference(fx, ex, k, reg)
    np.testing.assert_allclose(det.lambdas_.numpy(), lambdas, atol=1e-6)  # Brent's maxima, found on narrowing grids
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)
    labels = np.r_[np.zeros(len(problem.test_x)), np.ones(len(problem.ood_x))]
    assert abs(roc_auc_score(labels, ours) - roc_auc_score(labels, expected)) < 1e-5


def test_combood_gaussianises_skewed_features_as_scikit_learn():
    """Skewed, heavy-tailed and constant dimensions: lambdas far from 1 on both sides, and a zero deviation."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(800, 6, generator=g, dtype=torch.float64)
    fit = torch.stack(
        [base[:, 0].exp(), -base[:, 1].exp(), base[:, 2] ** 3, base[:, 3], base[:, 4].abs() + 0.1, base[:, 5]], dim=1
    )
    fit[:, 5] = 0.0  # constant (0 after the normalisation too)
    query = fit[:40] * 1.5 + 0.2
    det = create("combood", k=10).fit(Batch(features=fit.float()))
    expected, lambdas = combood_reference(fit.float().double().numpy(), query.float().double().numpy(), k=10)
    np.testing.assert_allclose(det.lambdas_.numpy()[:5], lambdas[:5], atol=1e-5)
    ours = det.score(Batch(features=query.float())).double().numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("lmbda", [-1.5, 0.0, 0.3, 1.0, 2.0, 3.7])
def test_yeo_johnson_is_scipys(lmbda):
    from scipy.stats import yeojohnson

    from oodviz.detectors.combood import yeo_johnson

    u = np.r_[np.linspace(-4, 4, 81), -1e-9, 0.0, 1e-9]
    np.testing.assert_allclose(
        yeo_johnson(torch.from_numpy(u), torch.tensor(lmbda, dtype=torch.float64)).numpy(),
        yeojohnson(u, lmbda=lmbda),
        rtol=1e-12,
        atol=1e-14,
    )


def test_combood_takes_k_without_a_refit_and_checks_its_parameters(problem):
    det = create("combood", k=50).fit(problem.fit_batches())
    det.set_params(k=7)
    query = problem.batches(problem.eval_x)
    torch.testing.assert_close(det.score(query), create("combood", k=7).fit(problem.fit_batches()).score(query))
    with pytest.raises(ValueError, match="combood: k=5000 needs at least max"):
        det.set_params(k=5000)
    for bad in ({"k": 0}, {"k": 1.5}, {"reg": 0}, {"reg": "1"}):
        with pytest.raises(ValueError, match="combood: "):
            create("combood", **bad)
    with pytest.raises(ValueError, match="combood.fit reads the batches 6 times but got a one-shot iterator"):
        create("combood").fit(iter(problem.fit_batches()))


# ---- all four: streamed in small chunks, saved and loaded -----------------------------------------


@pytest.mark.parametrize(
    ("name", "params"), [("relation", {"pow": 2}), ("cfood", {"alpha": 0.5}), ("grood", {}), ("combood", {"k": 20})]
)
def test_small_chunks_and_query_blocks_score_as_one_pass(problem, monkeypatch, name, params):
    whole = create(name, **params).fit(problem.fit_batches(size=len(problem.fit_x)), head=problem.head)
    expected = whole.score([Batch(problem.eval_x, problem.logits(problem.eval_x))])
    monkeypatch.setattr(bank_module, "SIMILARITY_BYTES", 4 * 37 * 5)  # 5-row query blocks, 5-row self-distance blocks
    streamed = create(name, chunk_size=37, **params).fit(problem.fit_batches(size=13), head=problem.head)
    if name == "cfood":
        np.testing.assert_allclose(streamed.knn_distances_, whole.knn_distances_, atol=1e-6)  # matmul blocking
    scores = streamed.score(problem.batches(problem.eval_x, size=11))
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "params"), [("relation", {"pow": 2}), ("cfood", {"alpha": 0.5}), ("grood", {}), ("combood", {"k": 20})]
)
@pytest.mark.parametrize("copy_files", [False, True])
def test_saved_and_loaded_scores_the_same(problem, tmp_path, name, params, copy_files):
    det = create(name, **params).fit(problem.fit_batches(), head=problem.head)
    query = problem.batches(problem.eval_x)
    expected = det.score(query)
    det.save(tmp_path / "saved", copy_files=copy_files)
    loaded = load(tmp_path / "saved")
    assert loaded.get_params() == det.get_params()
    if copy_files:  # the copies outlive the detector's temporary files
        del det
        gc.collect()
    assert torch.equal(loaded.score(query), expected)
