"""ASH: activation shaping of each sample's features, then the energy score.

Djurisic, Bozanic, Ashok & Liu, *Extremely Simple Activation Shaping for Out-of-Distribution
Detection*, ICLR 2023, https://arxiv.org/abs/2209.09858 (https://openreview.net/forum?id=ndYXTEL6cZz)

No statistics are fitted. Per sample, with features ``x`` ``[B, D]`` and ``p = percentile``:
keep the ``k = D - round(D p / 100)`` largest of its ``D`` activations and set the other
``D - k`` to zero (``round`` half to even, as ``np.round`` in the authors' code), then

- ``variant="p"`` (ASH-P): keep the ``k`` values as they are;
- ``variant="b"`` (ASH-B): set each of the ``k`` kept units to ``s1 / k``, where ``s1`` is the
  sum of **all** ``D`` activations before pruning: binarised, with the total preserved;
- ``variant="s"`` (ASH-S): multiply the kept values by ``exp(s1 / s2)``, ``s2`` the sum of the
  kept values;

and score the shaped features ``a(x)`` ``[B, D]`` with the head ``(W [C, D], b [C])``:

    score(x) = -logsumexp_k ( a(x) W^T + b )_k

the energy (the paper's confidence is the negative energy; higher = more OOD). This is the
definition of the paper and of its code (``ash_b`` / ``ash_p`` / ``ash_s``), and of
pytorch-ood 0.4's ``ash_b`` / ``ash_p`` / ``ash_s``.

oodviz shapes the pooled penultimate features ``[B, D]`` from the feature store. The paper
shapes the feature map before the final pooling of a ResNet (``[B, D, H, W]``); given pooled
features as ``B x D x 1 x 1`` (as here), the paper's code and pytorch-ood compute what oodviz
computes.

OpenOOD v1.5's ``ash`` postprocessor is always ASH-B (``openood/networks/ash_net.py``'s ``forward_threshold``
calls ``ash_b`` on the pooled features, as ``B x D x 1 x 1``), at ``percentile`` 90 tuned over 65..95:
``openood_params = {"variant": "b"}`` (``protocol = "openood"``); oodviz's default is ASH-S, the paper's best.

Deviations from the paper's code and pytorch-ood:

- Ties at the pruning boundary are broken by unit index (the lower index is kept), the same on
  every device and batch size (:func:`top_k_mask`: ``torch.topk`` for the ``k``-th value, no sort);
  ``torch.topk`` (paper code, pytorch-ood) leaves the choice unspecified. It matters where the ``k``-th largest value is shared, which post-ReLU features
  make common for zeros: ASH-B then fills different (zero) units, so its score differs;
  ASH-P and ASH-S only differ for equal non-zero values.
- ASH-S, outside its assumption of non-negative features: where ``s2 <= 0`` the factor is set
  to 1 instead of ``exp(s1 / s2)`` (for non-negative features this is an all-zero sample, on
  which the factor has no effect). For ``s2 > 0`` the factor is at most ``exp(D / k)``.
- ASH-S forms the scaled logits ``exp(s1/s2) (x_kept W^T) + b`` in float32 and again in float64 when
  that overflows, so a large factor does not overflow float32 on the way; a score beyond the float32
  range raises a ValueError.

``percentile`` is in percent (default 90, OpenOOD v1.5's setting), not a fraction as in
pytorch-ood (whose default is 0.65). ``fit(batches, head=...)`` only stores the head: it
reads the first in-distribution batch to check its width against the head and to settle the
device, nothing more.

Its fit keeps the head only: nothing to split over ranks (every rank fits it on the whole store at no cost).
"""

import numpy as np
import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.react import check_percentile, energy
from oodviz.detectors.teaching import Teaching

VARIANTS = ("b", "p", "s")
_FLOAT32_MAX = torch.finfo(torch.float32).max


def kept_count(n_features: int, percentile: float) -> int:
    """How many of ``D`` activations survive pruning the lowest ``percentile`` percent."""
    return n_features - int(np.round(n_features * percentile / 100.0))


def check_kept(detector: str, n_features: int, percentile: float) -> int:
    """:func:`kept_count`, which must leave at least one activation."""
    k = kept_count(n_features, percentile)
    if k < 1:
        largest = 100.0 * (n_features - 0.5) / n_features
        raise ValueError(
            f"{detector}: percentile={percentile:g} prunes all D={n_features} features (keeps round-half-even "
            f"D - D*percentile/100 = {k}); choose percentile < {largest:g}."
        )
    return k


def top_k(features: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Values and indices ``[B, k]`` of each row's ``k`` largest entries; ties go to the lower index."""
    values, indices = torch.sort(features, dim=1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def top_k_mask(features: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """bool ``[B, D]``: each row's ``k`` largest entries, ties at the ``k``-th value going to the lower indices
    (the entries :func:`top_k` picks), found by ``torch.topk`` without a sort; and their sum ``[B]``. A row with
    more than ``k`` entries at or above its ``k``-th value (a tie there) is redone with a running count of the
    tied entries (ties do not change the sum)."""
    values = torch.topk(features, k, dim=1, sorted=False).values  # [B, k]
    kth = values.amin(dim=1, keepdim=True)  # [B, 1]
    keep = features >= kth
    # int32 sum: torch sums a bool tensor in int64 through a slow path (~100x slower on a CPU)
    tied = torch.nonzero(keep.sum(dim=1, dtype=torch.int32) > k).flatten()
    if len(tied):
        rows, row_kth = features[tied], kth[tied]
        above = rows > row_kth
        at_kth = rows == row_kth
        left = k - above.sum(dim=1, keepdim=True, dtype=torch.int32)  # tied entries still to keep
        keep[tied] = above | (at_kth & (at_kth.cumsum(dim=1, dtype=torch.int32) <= left))
    return keep, values.sum(dim=1)


def scaled_energy(features: Tensor, log_factor: Tensor, weight: Tensor, bias: Tensor, detector: str) -> Tensor:
    """``-logsumexp(exp(r) (x W^T) + b)`` ``[B]`` for features ``x`` ``[B, D]`` and ``r`` ``[B]``: in float32, and
    again in float64 when a float32 score is not finite (``exp(r)`` or a logit beyond the float32 range)."""
    raw = features @ weight.T  # [B, C], the head without its bias
    scores = torch.logsumexp(torch.addcmul(bias, torch.exp(log_factor.float())[:, None], raw), dim=1).neg_()
    if bool(torch.isfinite(scores).all()):  # float32 is enough unless the factor overflowed it on the way
        return scores
    logits = torch.exp(log_factor.double())[:, None] * raw.double() + bias.double()
    scores = -torch.logsumexp(logits, dim=1)
    if not bool((scores.abs() <= _FLOAT32_MAX).all()):
        raise ValueError(
            f"{detector}: the scaling factor exp(s1/s2) made the energy exceed the float32 range for some samples; "
            "choose a lower percentile (keep more features)."
        )
    return scores


def log_scale(total: Tensor, kept_sum: Tensor) -> Tensor:
    """``s1 / s2`` in float64, or 0 where ``s2 <= 0`` (no positive activation kept)."""
    total, kept_sum = total.double(), kept_sum.double()
    positive = kept_sum > 0
    return torch.where(positive, total / torch.where(positive, kept_sum, 1.0), 0.0)


def store_head(detector: Detector, data: FitData) -> None:
    """Fit of a shaping detector: only the head, after reading the first in-distribution batch
    (which checks D against the head and settles the device)."""
    check_kept(detector.name, data.n_features, detector.percentile)
    for _ in data:
        break
    detector.head_weight_, detector.head_bias_ = data.head


class ASH(Detector):
    name = "ash"
    param_choices = {"variant": VARIANTS}
    summary = "Energy after pruning each sample's lowest activations; the rest binarised (b), kept (p) or scaled (s)."
    paper = "https://arxiv.org/abs/2209.09858"
    default_grid = {"percentile": (65.0, 70.0, 75.0, 80.0, 85.0, 90.0, 95.0)}
    score_params = ("variant", "percentile")
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_k e^{(\mathrm{shape}_p(x) W^\top + b)_k}",
        citation="Djurisic et al., *Extremely Simple Activation Shaping for Out-of-Distribution Detection*, ICLR 2023",
        reads="the features and the head; nothing to fit",
        fails_when="Tuned for post-ReLU features of large CNNs; pruning small or signed features (ViTs, tiny models) loses the signal.",
    )
    inputs = ("features",)
    needs_head = True

    openood_params = {"variant": "b"}

    def __init__(self, variant: str = "s", percentile: float = 90.0):
        if variant not in VARIANTS:
            pytorch_ood_name = isinstance(variant, str) and variant.lower() in ("ash-b", "ash-p", "ash-s")
            raise ValueError(
                f"ash: variant must be one of 'b' (binarise), 'p' (prune) or 's' (scale), got {variant!r}"
                + (f"; use variant={variant[-1].lower()!r}" if pytorch_ood_name else "")
            )
        self.variant = variant
        self.percentile = check_percentile(self.name, percentile, upper_open=True)

    def _fit(self, data: FitData) -> None:
        store_head(self, data)

    def shape_features(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """The shaped features ``[B, D]`` (before any ASH-S factor) and ``log`` of the ASH-S factor ``[B]``."""
        x = features.float()
        k = check_kept(self.name, x.shape[1], self.percentile)
        kept, kept_sum = top_k_mask(x, k)
        total = x.sum(dim=1)
        if self.variant == "b":
            shaped = kept.to(x.dtype).mul_((total / k)[:, None])
        else:
            shaped = torch.where(kept, x, 0.0)
        if self.variant == "s":
            return shaped, log_scale(total, kept_sum)
        return shaped, torch.zeros(len(x), dtype=torch.float64, device=x.device)

    def _score(self, batch: Batch) -> Tensor:
        shaped, log_factor = self.shape_features(batch.features)
        if self.variant == "s":
            return scaled_energy(shaped, log_factor, self.head_weight_, self.head_bias_, self.name)
        return energy(shaped, self.head_weight_, self.head_bias_)
