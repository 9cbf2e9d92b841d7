"""One API for every detector: construction, fit/score arguments, devices, streaming, bad input."""

import gc
import os
import warnings

import numpy as np
import pytest
import torch
from helpers import cuda, make_problem
from scipy.special import softmax

from oodviz import Batch
from oodviz.detectors import NotFittedError, available, create, detector_class

NAMES = available()
# Detectors fed with features and logits; the model-based ones (needs_model: odin, mahalanobis_odin, mcd, ...) score model
# inputs with the model and are tested in test_model_based.py.
ALL = [n for n in NAMES if not detector_class(n).needs_model]
FITTED = [n for n in ALL if detector_class(n).needs_fit]
LABELLED = [n for n in ALL if detector_class(n).needs_labels]


def test_registry_lists_the_issue_detectors():
    assert set(NAMES) == {
        "msp",
        "maxlogit",
        "energy",
        "entropy",
        "gen",
        "tempscale",
        "klm",
        "mahalanobis",
        "rmd",
        "vim",
        "she",
        "knn",
        "react",
        "ash",
        "scale",
        "dice",
        "fdbd",
        "nci",
        "gradnorm",
        "odin",
        "iodin",
        "mahalanobis_odin",
        "mds_ensemble",
        "mcd",
        "weiper",
        "adascale",
        "rankfeat",
        "gram",
        "nac",
        "vra",
        "gmm",
        "openmax",
        "nnguide",
        "residual",
        "neco",
        "weightedebo",
        "pnml",
        "lts",
        "caref",
        "cadref",
        "relation",
        "cfood",
        "grood",
        "combood",
    }
    for name in NAMES:
        cls = detector_class(name)
        assert cls.summary and cls.paper.startswith("https://")
        assert cls.__module__.startswith("oodviz.detectors.")
        assert "score" in (cls.__doc__ or "") + (__import__(cls.__module__, fromlist=["_"]).__doc__ or "")


def test_create_rejects_unknown_names_and_parameters_listing_valid_ones():
    with pytest.raises(ValueError, match="choose one of: msp, maxlogit"):
        create("mahalanobiss")
    with pytest.raises(ValueError, match=r"no parameter\(s\) t; valid parameters: temperature"):
        create("energy", t=2)
    with pytest.raises(ValueError, match="valid parameters: none"):
        create("msp", temperature=2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        create("energy", temperature=0)
    assert create("energy", temperature=3).get_params() == {"temperature": 3.0}
    assert repr(create("knn", k=7)).startswith("KNN(k=7, ")


@pytest.mark.parametrize("name", ALL)
def test_uniform_fit_and_score_arguments(problem, name):
    det = create(name)
    fitted = det.fit(problem.fit_batches(), head=problem.head, device="cpu")
    assert fitted is det
    scores = det.score(problem.batches(problem.test_x), device="cpu")
    assert scores.device.type == "cpu" and scores.dtype == torch.float32
    assert scores.shape == (len(problem.test_x),)
    assert torch.isfinite(scores).all()
    # A single Batch is accepted and gives the same scores as its rows inside a list.
    single = problem.batches(problem.test_x[:50], size=50)[0]
    torch.testing.assert_close(det.score(single), scores[:50], rtol=1e-5, atol=1e-5)
    public_state = [k for k in vars(det) if not k.startswith("_")]
    assert set(public_state) - set(det.param_names()) == {k for k in public_state if k.endswith("_")}


@pytest.mark.parametrize("name", FITTED)
def test_scoring_before_fit_says_to_call_fit(problem, name):
    with pytest.raises(NotFittedError, match=r"call fit\(batches\)"):
        create(name).score(problem.batches(problem.test_x))


@pytest.mark.parametrize("name", ALL)
def test_scores_do_not_depend_on_batching(problem, name):
    """Streaming fit: 1 batch, uneven batches and batches of 1 to 13 rows give the same detector."""
    whole = create(name).fit(problem.fit_batches(size=len(problem.fit_x)), head=problem.head)
    split = create(name).fit(problem.fit_batches(size=13), head=problem.head)
    query = problem.batches(problem.eval_x)
    torch.testing.assert_close(whole.score(query), split.score(query), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", FITTED)
def test_ood_rows_in_the_fit_data_are_ignored(problem, name):
    x = torch.cat([problem.fit_x, problem.ood_x])
    y = torch.cat([problem.fit_y, torch.full((len(problem.ood_x),), -1)])
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    x, y = x[order], y[order]
    keep = y >= 0
    # Same ID rows in the same order, OOD rows interleaved: the fit must not see them.
    assert torch.equal(x[keep], torch.cat([problem.fit_x, problem.ood_x])[order][keep])
    mixed = create(name).fit(problem.batches(x, y), head=problem.head)
    reordered_clean = create(name).fit(problem.batches(x[keep], y[keep]), head=problem.head)
    query = problem.batches(problem.eval_x)
    torch.testing.assert_close(mixed.score(query), reordered_clean.score(query), rtol=1e-5, atol=1e-5)


class Regenerated:
    """A re-iterable that makes its batches on the fly (nothing is kept between passes)."""

    def __init__(self, problem, size=100):
        self.problem, self.size = problem, size
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        yield from self.problem.fit_batches(self.size)


@pytest.mark.kernels
def test_two_pass_detectors_read_a_reiterable_twice_and_refuse_a_generator(problem):
    source = Regenerated(problem)
    det = create("vim", dim=5).fit(source, head=problem.head)
    assert source.passes == 2  # no extra pass to find the device
    reference = create("vim", dim=5).fit(problem.fit_batches(), head=problem.head)
    assert det.alpha_ == pytest.approx(reference.alpha_, rel=1e-6)
    with pytest.raises(ValueError, match="one-shot iterator"):
        create("vim", dim=5).fit(iter(problem.fit_batches()), head=problem.head)
    # One-pass fits and every score take a generator, first batch included.
    one_shot = create("mahalanobis").fit(b for b in problem.fit_batches())
    fit_x, fit_y = problem.fit_x.double().numpy(), problem.fit_y.numpy()
    class_means = np.stack([fit_x[fit_y == k].mean(0) for k in range(6)])
    np.testing.assert_allclose(one_shot.class_means_.numpy(), class_means, rtol=1e-6, atol=1e-6)
    query = problem.batches(problem.eval_x)
    torch.testing.assert_close(one_shot.score(b for b in query), one_shot.score(query))


class Shrinking(Regenerated):
    """Leaves out its last batch after the first pass: not the same data on every pass."""

    def __iter__(self):
        self.passes += 1
        batches = self.problem.fit_batches(self.size)
        yield from batches if self.passes == 1 else batches[:-1]


@pytest.mark.parametrize("name", [n for n in FITTED if detector_class(n).fit_passes > 1])
def test_a_reiterable_that_changes_between_passes_is_refused(problem, name):
    """Later passes skip the value checks of the first; the row count each must repeat still holds them."""
    with pytest.raises(ValueError, match=r"a later pass gave 1100 samples instead of 1200; pass a list"):
        create(name).fit(Shrinking(problem), head=problem.head)


def test_fitted_state_is_independent_of_n():
    """Statistics detectors keep O(C*D + D^2) numbers whatever the number of samples."""
    small, large = make_problem(n_fit=300), make_problem(n_fit=3000)
    for name in ["mahalanobis", "rmd", "vim", "klm", "she", "tempscale"]:
        sizes = []
        for p in (small, large):
            det = create(name).fit(p.fit_batches(), head=p.head)
            sizes.append(sum(v.numel() for k, v in vars(det).items() if isinstance(v, torch.Tensor)))
        assert sizes[0] == sizes[1], name


def test_knn_keeps_its_bank_on_disk_and_removes_it(problem, tmp_path):
    det = create("knn", k=5).fit(problem.fit_batches())
    assert isinstance(det.bank_, np.memmap)
    fit_x = problem.fit_x.double().numpy()
    # The bank is the unit-normalised fit features, row for row (float64 here, float32 on disk).
    np.testing.assert_allclose(det.bank_, fit_x / np.linalg.norm(fit_x, axis=1, keepdims=True), rtol=1e-6, atol=1e-7)
    path = det.bank_path_
    assert os.path.getsize(path) == problem.fit_x.numel() * 4
    del det
    gc.collect()
    assert not os.path.exists(path)
    kept = create("knn", k=5, bank_dir=str(tmp_path)).fit(problem.fit_batches())
    assert os.path.dirname(kept.bank_path_) == str(tmp_path)


@pytest.mark.parametrize("name", ["knn", "nnguide"])
def test_a_bank_detector_fits_again(problem, name):
    """A second fit writes a new bank (the first fit's row count once shadowed the method writing the rows)."""
    det = create(name, k=5).fit(problem.fit_batches(), head=problem.head)
    first = det.score(problem.batches(problem.eval_x))
    det.fit(problem.fit_batches(size=31), head=problem.head)
    torch.testing.assert_close(det.score(problem.batches(problem.eval_x)), first, rtol=1e-5, atol=1e-5)


# ---- bad input: a ValueError that names the problem and the fix ---------------------------


def test_empty_input(problem):
    for name in ALL:
        with pytest.raises(ValueError, match="empty"):
            create(name).fit(problem.fit_batches(), head=problem.head).score([])
    for name in FITTED:
        with pytest.raises(ValueError, match="no in-distribution samples"):
            create(name).fit([], head=problem.head)
        only_ood = [Batch(problem.ood_x, problem.logits(problem.ood_x), torch.full((len(problem.ood_x),), -1))]
        with pytest.raises(ValueError, match="every label was -1"):
            create(name).fit(only_ood, head=problem.head)


@pytest.mark.parametrize("name", ["mahalanobis", "rmd", "she", "gmm", "openmax"])
def test_a_class_without_samples(problem, name):
    y = problem.fit_y.clone()
    keep = y != 2
    with pytest.raises(ValueError, match=r"class\(es\) 2 have no"):
        create(name).fit(problem.batches(problem.fit_x[keep], y[keep]), head=problem.head)


def test_she_needs_a_correct_sample_per_class(problem):
    predicted = problem.logits(problem.fit_x).argmax(1)
    y = problem.fit_y.clone()
    y[(y == 0) & (predicted == 0)] = -1  # class 0 keeps only its misclassified samples
    assert (y == 0).any()
    with pytest.raises(ValueError, match=r"class\(es\) 0 have no correctly classified samples"):
        create("she").fit(problem.batches(problem.fit_x, y), head=problem.head)


def test_labels_outside_0_to_c_minus_1(problem):
    y = problem.fit_y.clone()
    y[5] = 6  # C = 6 classes
    with pytest.raises(ValueError, match=r"label 6 but the model has C=6 classes; labels must be 0..5"):
        create("mahalanobis").fit(problem.batches(problem.fit_x, y), head=problem.head)
    with pytest.raises(ValueError, match=r"label 6 but the model has C=6"):
        create("tempscale").fit(problem.batches(problem.fit_x, y))
    y[5] = -3
    with pytest.raises(ValueError, match="labels below -1"):
        create("she").fit(problem.batches(problem.fit_x, y), head=problem.head)
    with pytest.raises(ValueError, match="integer tensor"):
        Batch(problem.fit_x, labels=problem.fit_y.float())


@pytest.mark.parametrize("name", ALL)
def test_non_finite_inputs(problem, name):
    x = problem.fit_x.clone()
    logits = problem.logits(x)
    x[7, 3] = float("nan")
    logits[9, 1] = float("inf")
    batches = [Batch(x, logits, problem.fit_y)]
    det = create(name)
    if det.needs_fit:
        with pytest.raises(ValueError, match="NaN or infinite"):
            det.fit(batches, head=problem.head)
        det.fit(problem.fit_batches(), head=problem.head)
    with pytest.raises(ValueError, match="NaN or infinite"):
        det.score(batches)


def test_missing_inputs_name_the_field(problem):
    features_only = [Batch(features=problem.fit_x, labels=problem.fit_y)]
    logits_only = [Batch(logits=problem.logits(problem.fit_x), labels=problem.fit_y)]
    with pytest.raises(ValueError, match="klm needs logits but batch 0 has none"):
        create("klm").fit(features_only)
    with pytest.raises(ValueError, match="mahalanobis needs features"):
        create("mahalanobis").fit(logits_only)
    with pytest.raises(ValueError, match=r"msp needs logits"):
        create("msp").score(features_only)
    with pytest.raises(ValueError, match="fits on class labels"):
        create("mahalanobis").fit([Batch(features=problem.fit_x)])
    with pytest.raises(ValueError, match=r"needs the classifier's final linear layer: call fit\(batches, head="):
        create("vim").fit(features_only)
    with pytest.raises(ValueError, match="give the batches logits, or call fit"):
        create("she").fit(features_only)
    with pytest.raises(ValueError, match=r"Pool feature maps"):
        Batch(features=torch.zeros(4, 3, 7, 7))


def test_head_shape_must_match(problem):
    weight, bias = problem.head
    with pytest.raises(ValueError, match=r"head bias must have shape \[C\] = \(6,\)"):
        create("vim").fit(problem.fit_batches(), head=(weight, bias[:5]))
    with pytest.raises(ValueError, match=r"features with D=12, expected D=11"):
        create("vim").fit(problem.fit_batches(), head=(weight[:, :11], bias))
    with pytest.raises(ValueError, match=r"logits with C=6, expected C=5"):
        create("klm").fit(problem.fit_batches(), head=(weight[:5], bias[:5]))
    linear = torch.nn.Linear(12, 6)  # an nn.Linear is read as (its weight, its bias)
    det = create("vim", dim=4).fit(problem.fit_batches(), head=linear)
    assert torch.equal(det.head_weight_, linear.weight) and torch.equal(det.head_bias_, linear.bias)


def test_dimensions_must_not_change_between_batches_or_after_fit(problem):
    batches = problem.fit_batches()
    bad = batches[:3] + [Batch(problem.fit_x[:10, :11], labels=problem.fit_y[:10])]
    with pytest.raises(ValueError, match=r"batch 3 has features with D=11, expected D=12"):
        create("mahalanobis").fit(bad)
    bad_logits = batches[:2] + [Batch(logits=torch.zeros(10, 7), labels=problem.fit_y[:10])]
    with pytest.raises(ValueError, match=r"batch 2 has logits with C=7, expected C=6"):
        create("klm").fit(bad_logits)
    det = create("knn", k=3).fit(batches)
    with pytest.raises(ValueError, match=r"batch 0 has features with D=5, expected D=12"):
        det.score(Batch(features=torch.ones(3, 5)))


def test_vim_dim_must_leave_a_residual(problem):
    with pytest.raises(ValueError, match=r"dim=12 must be between 1 and D-1 = 11"):
        create("vim", dim=12).fit(problem.fit_batches(), head=problem.head)


@pytest.mark.kernels
def test_vim_reads_the_batch_logits_when_present_and_checks_them(problem):
    """The model's logits when the batch has them, the head's ``x W^T + b`` otherwise: the same
    numbers when they agree; logits of the wrong width or not finite are refused, not used."""
    features_only = [Batch(b.features, labels=b.labels) for b in problem.fit_batches()]
    with_logits = create("vim", dim=4).fit(problem.fit_batches(), head=problem.head)
    from_head = create("vim", dim=4).fit(features_only, head=problem.head)
    assert with_logits.alpha_ == pytest.approx(from_head.alpha_, rel=1e-6)
    query = problem.batches(problem.eval_x)
    torch.testing.assert_close(with_logits.score(query), from_head.score([Batch(b.features) for b in query]))
    shifted = [Batch(b.features, b.logits + 1.0) for b in query]  # logsumexp + 1: scores - 1
    torch.testing.assert_close(with_logits.score(shifted), with_logits.score(query) - 1.0)
    with pytest.raises(ValueError, match=r"logits with C=5, expected C=6"):
        create("vim", dim=4).fit([Batch(problem.fit_x, torch.zeros(len(problem.fit_x), 5))], head=problem.head)
    bad = problem.logits(problem.eval_x)
    bad[3, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite logits"):
        with_logits.score(Batch(problem.eval_x, bad))


def test_knn_k_larger_than_the_data(problem):
    with pytest.raises(ValueError, match=r"k=50 exceeds the 40 in-distribution samples"):
        create("knn").fit(problem.batches(problem.fit_x[:40], problem.fit_y[:40]))


def test_klm_warns_about_classes_never_predicted(problem):
    logits = problem.logits(problem.fit_x)
    logits[:, 4] = -100  # class 4 never predicted
    with pytest.warns(UserWarning, match=r"class\(es\) \[4\]"):
        det = create("klm").fit([Batch(logits=logits)])
    assert det.unmatched_classes_ == [4] and det.template_classes_.tolist() == [0, 1, 2, 3, 5]
    # float64 reference: templates of the predicted classes only, the minimum KL over those
    p = softmax(logits.double().numpy(), axis=1)
    templates = np.stack([p[p.argmax(1) == k].mean(0) for k in (0, 1, 2, 3, 5)])
    np.testing.assert_allclose(det.templates_.numpy(), templates, rtol=1e-5, atol=1e-7)
    # The query's class 4 is as unlikely as in the fit: the templates' class-4 entries (~1e-44, float32
    # subnormals) then weigh nothing, and the float32 scores can be held to the float64 ones.
    query = problem.logits(problem.test_x)
    query[:, 4] = -100
    q = softmax(query.double().numpy(), axis=1)
    expected = np.min([(q * (np.log(q) - np.log(t))).sum(1) for t in templates], axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = det.score([Batch(logits=query)])
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-4, atol=1e-6)


def test_batches_must_be_batches(problem):
    with pytest.raises(ValueError, match=r"item 0 is a tuple. Wrap your tensors"):
        create("mahalanobis").fit([(problem.fit_x, problem.fit_y)])
    with pytest.raises(ValueError, match="an iterable of them, got int"):
        create("msp").score(3)


# ---- devices -------------------------------------------------------------------------------


def test_numpy_and_cpu_inputs_meet_on_one_device(problem):
    batches = [Batch(b.features.numpy(), b.logits.numpy(), b.labels.numpy()) for b in problem.fit_batches()]
    det = create("she").fit(batches, device="cpu")
    assert det.patterns_.device.type == "cpu"
    torch.testing.assert_close(
        det.score(batches), create("she").fit(problem.fit_batches()).score(problem.fit_batches())
    )


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", ALL)
def test_fit_on_one_device_score_on_another(problem, name):
    cpu_batches = problem.fit_batches()
    query = problem.batches(problem.eval_x)
    reference = create(name).fit(cpu_batches, head=problem.head).score(query)
    on_gpu = create(name).fit(cpu_batches, head=problem.head, device="cuda")  # moved batch by batch
    torch.testing.assert_close(on_gpu.score(query), reference, rtol=1e-3, atol=1e-3)  # scored on the CPU
    gpu_query = [b.to("cuda") for b in query]
    scores = on_gpu.score(gpu_query)  # device=None: the batches' device
    assert scores.device.type == "cpu"
    torch.testing.assert_close(scores, reference, rtol=1e-3, atol=1e-3)
    cpu_fitted = create(name).fit([b.to("cuda") for b in cpu_batches], head=problem.head, device="cpu")
    torch.testing.assert_close(cpu_fitted.score(gpu_query, device="cuda"), reference, rtol=1e-3, atol=1e-3)
