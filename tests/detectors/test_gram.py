"""oodviz.detectors.gram: against pytorch-ood 0.4 on a tiny CNN (the same held-out samples), its statistics in
float64, its layers and two streamed passes."""

import numpy as np
import pytest
import torch
from detector_checks import auroc, spearman
from pytorch_ood.detector import Gram as PoodGram
from wide_cnn import WideCNN, images, labelled_images

from oodviz import Batch
from oodviz.detectors import create


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
