"""ASH's pruning without a sort (issue 13.7): the same kept units as a stable full sort, ties included."""

from __future__ import annotations

import pytest
import torch

from oodviz import Batch
from oodviz.detectors import create
from oodviz.detectors.ash import top_k_mask


@pytest.mark.parametrize("seed", range(3))
def test_top_k_mask_keeps_what_a_stable_descending_sort_keeps(seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (9, 37), generator=generator).float()  # small integers: ties everywhere
    x[0] = 0.0  # a row of one value
    for k in range(1, 38):
        order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :k]
        expected = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, True)
        mask, kept_sum = top_k_mask(x, k)
        assert torch.equal(mask, expected), k
        torch.testing.assert_close(kept_sum, (x * expected).sum(dim=1))


@pytest.mark.parametrize("variant", ["b", "p", "s"])
def test_ash_scores_match_pytorch_ood_on_untied_features(variant):
    from pytorch_ood.detector.ash import ash_b, ash_p, ash_s

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 200, generator=generator).relu_() + torch.rand(64, 200, generator=generator) * 1e-3
    weight, bias = torch.randn(10, 200, generator=generator) / 15, torch.randn(10, generator=generator)
    shaping = {"b": ash_b, "p": ash_p, "s": ash_s}[variant]
    shaped = shaping(x[:, :, None, None].double(), 0.9).flatten(1)
    expected = -torch.logsumexp(shaped @ weight.double().T + bias.double(), dim=1)
    det = create("ash", variant=variant, percentile=90).fit([Batch(x)], head=(weight, bias))
    torch.testing.assert_close(det.score(Batch(x)).double(), expected, rtol=1e-5, atol=1e-4)
