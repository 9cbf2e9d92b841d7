"""oodviz.detectors.rankfeat: against pytorch-ood 0.4 on a tiny CNN, and the top singular direction it removes."""

import copy

import numpy as np
import pytest
import torch
from detector_checks import auroc, spearman
from pytorch_ood.detector import RankFeat as PoodRankFeat
from torch import nn
from wide_cnn import WideCNN, images

from oodviz import Batch
from oodviz.detectors import create


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
