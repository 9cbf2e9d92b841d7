"""The detectors' state protocol (update / merge / finalize / state_dict): shards merged = one fit on all rows."""

import copy

import numpy as np
import pytest
import torch

from oodviz import Batch
from oodviz.detectors import available, create, detector_class
from oodviz.detectors.protocol import load_merged

pytestmark = pytest.mark.kernels  # fits merged from shards against fits on the whole, and the same stream to the bit

MERGEABLE = [name for name in available() if detector_class(name).mergeable]


def test_the_statistics_detectors_are_mergeable():
    assert set(MERGEABLE) == {
        "mahalanobis",
        "rmd",
        "klm",
        "she",
        "gmm",
        "vim",
        "dice",
        "fdbd",
        "nci",
        "react",
        "tempscale",
        "openmax",
        "vra",
        "weiper",
        "residual",
        "neco",
        "pnml",
        "caref",
        "cadref",
    }


def fit_data(n=900, d=24, c=5, offset=1e3, seed=0):
    """Features with a large common offset (a naive sum of squares would cancel), labels mostly the argmax of
    a head's logits (she needs correctly classified samples in every class), batches of 64 rows."""
    g = torch.Generator().manual_seed(seed)
    x = offset + torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.05, 3, d, dtype=torch.float64)
    weight, bias = torch.randn(c, d, generator=g), torch.randn(c, generator=g)
    logits = (x - offset).float() @ weight.T + bias
    labels = logits.argmax(dim=1)
    flip = torch.rand(n, generator=g) < 0.2
    labels[flip] = torch.randint(0, c, (int(flip.sum()),), generator=g)
    labels[:c] = torch.arange(c)
    batches = [
        Batch(features=x[i : i + 64].float(), logits=logits[i : i + 64], labels=labels[i : i + 64])
        for i in range(0, n, 64)
    ]
    return batches, (weight, bias)


def fit_on_shards(name, shards, head):
    """One detector per shard, each pass: update on its shard, all states merged in shard order into every
    detector, finalize (what :func:`oodviz.pipeline.distributed.fit_across_ranks` does across processes)."""
    detectors = [create(name) for _ in shards]
    while True:
        states = [d.update(shard, head=head).state_dict() for d, shard in zip(detectors, shards, strict=True)]
        for detector in detectors:
            load_merged(detector, copy.deepcopy(states)).finalize()
        if not detectors[0].fit_in_progress:
            return detectors


def fitted_values(detector) -> dict:
    """The fitted floating-point tensors and numbers (attributes ending in ``_``)."""
    return {
        k: v
        for k, v in vars(detector).items()
        if k.endswith("_") and (isinstance(v, float) or isinstance(v, torch.Tensor) and v.is_floating_point())
    }


def assert_same_fit(whole, merged, batches):
    reference, other = fitted_values(whole), fitted_values(merged)
    assert reference.keys() == other.keys() and reference
    for key, value in reference.items():
        if isinstance(value, float):  # float64 results; vim's scale: sums of float32 projections
            assert other[key] == pytest.approx(value, rel=1e-6 if key == "alpha_" else 1e-9), key
            continue
        tolerance = 1e-9 if value.dtype == torch.float64 else 1e-5  # float32: whitenings, templates
        scale = float(value.abs().max()) or 1.0
        np.testing.assert_allclose(other[key].cpu().numpy(), value.numpy(), rtol=0, atol=tolerance * scale, err_msg=key)
    expected = whole.score(batches).numpy()
    np.testing.assert_allclose(merged.score(batches).numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("name", MERGEABLE)
def test_halves_merged_give_the_fit_on_the_whole(name):
    batches, head = fit_data()
    whole = create(name).fit(batches, head=head)
    first, second = fit_on_shards(name, [batches[:5], batches[5:]], head)
    assert_same_fit(whole, first, batches)
    for key, value in fitted_values(first).items():  # every shard's detector holds the same fit
        assert (
            torch.equal(value, fitted_values(second)[key])
            if isinstance(value, torch.Tensor)
            else value == fitted_values(second)[key]
        ), key


@pytest.mark.parametrize("name", MERGEABLE)
def test_an_empty_shard_and_uneven_ones_change_nothing(name):
    batches, head = fit_data(seed=1)
    whole = create(name).fit(batches, head=head)
    rows = [Batch(features=b.features[:0], logits=b.logits[:0], labels=b.labels[:0]) for b in batches[:1]]
    merged, *_ = fit_on_shards(name, [batches[:1], rows, batches[1:11], batches[11:]], head)
    assert_same_fit(whole, merged, batches)


def test_merge_takes_a_detector_and_fit_is_update_then_finalize():
    batches, head = fit_data(seed=2)
    first, second = create("mahalanobis").update(batches[:7]), create("mahalanobis").update(batches[7:])
    merged = first.merge(second).finalize()
    assert not merged.fit_in_progress
    assert_same_fit(create("mahalanobis").fit(batches), merged, batches)
    single = create("klm").update(batches).finalize()
    assert torch.equal(single.templates_, create("klm").fit(batches).templates_)  # the same stream, bit for bit


def test_the_gram_path_survives_a_merge_of_few_wide_rows():
    batches, head = fit_data(n=40, d=128, c=4, seed=3)  # 40 rows <= D / 2: the rows themselves are kept
    batches = [Batch(features=b.features, labels=b.labels) for b in batches]
    whole = create("rmd").fit(batches)
    state = create("rmd").update(batches[:1]).state_dict()
    assert state["parts"]["gaussians"]["gram_path"] and state["parts"]["gaussians"]["rows"].shape == (40, 128)
    merged, _ = fit_on_shards("rmd", [batches[:1], []], None)
    assert_same_fit(whole, merged, batches)


def test_a_state_dict_round_trips_and_refuses_another_detector_or_pass():
    batches, head = fit_data(seed=4)
    state = create("gmm", reg=1e-4).update(batches).state_dict()
    assert state["rows"] == 900 and state["parts"]["scatters"]["scatters"].dtype == torch.float64
    loaded = create("gmm", reg=1e-4).load_state_dict(copy.deepcopy(state)).finalize()
    assert_same_fit(create("gmm", reg=1e-4).fit(batches), loaded, batches)
    with pytest.raises(ValueError, match="not of this detector"):
        create("gmm", reg=1e-3).load_state_dict(state)
    with pytest.raises(ValueError, match="same parameters"):
        create("gmm").merge(create("gmm", reg=1e-3))
    ahead = create("vim").update(batches, head=head).finalize()  # now on pass 2
    with pytest.raises(ValueError, match="different fit passes"):
        ahead.merge(create("vim").update(batches, head=head))
    with pytest.raises(ValueError, match="saw no in-distribution samples"):
        create("she").finalize()


def test_a_detector_without_the_protocol_says_to_fit_on_all_the_data():
    batches, _ = fit_data(seed=5)
    with pytest.raises(ValueError, match="knn has no mergeable fit state .update.; fit it with fit"):
        create("knn").update(batches)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", MERGEABLE)
def test_shards_merged_on_a_gpu_give_the_cpu_fit(name):
    batches, head = fit_data(seed=6)
    whole = create(name).fit(batches, head=head)
    on_gpu = [[b.to("cuda") for b in batches[:6]], [b.to("cuda") for b in batches[6:]]]
    merged, _ = fit_on_shards(name, on_gpu, tuple(t.cuda() for t in head))
    assert_same_fit(whole, merged, batches)
