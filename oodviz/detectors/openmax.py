"""OpenMax: logits recalibrated by a per-class Weibull model of the distances to the class means.

Bendale & Boult, *Towards Open Set Deep Networks*, CVPR 2016, https://arxiv.org/abs/1511.06233

Fit (logits ``z`` ``[N, C]``, labels ``y`` in ``0..K-1``), two passes:

1. the mean activation vector of each class, ``mu_k = mean_{i: y_i = k} z_i`` ``[K, C]``;
2. the distance of each training sample to its class mean,
   ``d(z, mu) = w_e |z - mu| + (1 - w_e) (1 - <z, mu> / (|z| |mu|))`` (``w_e = euclid_weight``), keeping
   the ``tailsize`` largest per class (``[K, tailsize]``, whatever the number of samples), to which a
   Weibull distribution is fitted by maximum likelihood (:func:`fit_weibull`). As libMR's ``FitHigh`` does, the
   tail is translated first, ``t = d + s - min(tail)`` (``s = tail_shift``), and the Weibull has location 0:
   ``W_k(d) = 1 - exp(-((d + s - m_k) / lambda_k)^c_k)`` (0 where ``d + s - m_k < 0``).

   ``tail_shift`` defaults to 10000, pytorch-ood 0.4's (its libMR port, ``libnotmr``, hard-codes it), which was
   also the default of the Python binding of libMR, the paper's library, in its first public release (v1.1, June
   2016: ``MR(translate_amount=10000)``). libMR's default has been 1 since March 2017 (Vastlab/libMR, setup
   version 0.1.3 on, including 0.1.9, the release on PyPI: ``translate_amount=1``, which ``FitHigh`` adds to the
   tail after subtracting its smallest value). The shift changes the Weibull fitted to the same tail, hence the
   scores.

Score, with logits ``z`` ``[B, C]``: the ``alpha`` classes of largest logits, in decreasing order
``s_1, ..., s_alpha``, get weights ``r_i = (alpha + 1 - i) / alpha`` and ``w_i = r_i W_{s_i}(d(z, mu_{s_i}))``
(``W = 1`` for a class without training samples); then

    v_j = z_j (1 - w_j)   (w_j = 0 outside the top alpha),     v_0 = sum_j z_j w_j
    score(z) = exp(v_0) / (exp(v_0) + sum_j exp(v_j))

the probability of the "unknown" class in the recalibrated softmax (higher = more OOD), as pytorch-ood 0.4's
``OpenMax`` scores it. Two differences from pytorch-ood, neither of which changes the scores of the tests' data:
pytorch-ood clips the revised activations at 709 before ``exp`` (oodviz's softmax is computed stably instead), and
it measures distances only to classes that some sample of the same ``predict`` call has as its top class (the others
count as distance 0); oodviz measures them all. Also as pytorch-ood (the paper uses correctly classified samples
only), the means and tails are those of all training samples of each class by default (``correct_only=False``).
pytorch-ood rounds the translated tail to float32 (a step of ~0.001 at 10000); oodviz keeps it in float64, so the
Weibull shapes differ by ~0.1% and the scores by a little (the tests hold the ranking and AUROC to the usual
bounds).

``correct_only=True`` fits the means and the tails on the training samples the model classifies correctly
(``argmax_k z_k = y``, ties to the lower index), as the paper does; every class of the logits then needs at least
one (one Weibull per class, ``K = C``).

OpenOOD v1.5's ``openmax`` postprocessor (``openood/postprocessors/openmax_postprocessor.py``) computes the same
score (its confidence is minus the unknown class's probability) with fixed settings of its own: Euclidean
distances (``distance_type='euclidean'``, ``euclid_weight=1`` here, the default), tails of 20, ``alpha`` 3, the
means and tails of the correctly classified training samples only, and ``libmr.MR()`` with ``fit_high`` at libMR's
default shift of 1: ``openood_params = {"tailsize": 20, "alpha": 3, "tail_shift": 1.0, "correct_only": True}``
(``protocol = "openood"``). Its ``weibull_threshold`` (0.9) only decides its class prediction, not the score. It
forms ``exp`` of the revised logits without the stable softmax used here (it overflows for logits above ~709).

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`): pass 1's class sums merge by
addition, and pass 2 (distances to the merged means) keeps per shard its ``tailsize`` largest per class,
which merge exactly as the largest of the union (:class:`ClassTails`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, check_all_classes_seen
from oodviz.detectors.protocol import FitState
from oodviz.detectors.stats import ACCUMULATE, ClassMeans
from oodviz.detectors.teaching import Teaching

#: the default translation of the tail before the Weibull fit (``tail_shift``): pytorch-ood 0.4's, and libMR's first
#: default (libMR's default, which OpenOOD uses, has been 1 since 2017; see the module docstring)
TRANSLATION = 10000.0


def fit_weibull(samples: np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood shape ``c`` and scale ``lambda`` of a Weibull with location 0 (float64).

    The shape solves ``sum x^c ln x / sum x^c - 1/c - mean(ln x) = 0`` (increasing in ``c``; bracketed by
    doubling, then Brent's method); then ``lambda = (mean x^c)^(1/c)``. Powers are taken relative to the
    largest sample, ``x^c = max^c exp(c (ln x - ln max))``, so a shape in the tens of thousands (of tails
    translated by 10000) does not overflow. This is what ``scipy.stats.weibull_min.fit(x, floc=0)`` returns.
    """
    # here, not at import: the app lists the detectors without fitting one (a tenth of its import time)
    import scipy.optimize

    logs = np.log(np.asarray(samples, dtype=np.float64))
    if logs.size < 2 or np.ptp(logs) == 0 or not np.all(np.isfinite(logs)):
        raise ValueError(f"fit_weibull needs at least 2 distinct positive samples, got {np.asarray(samples)!r}")
    top, centred = logs.max(), logs - logs.mean()

    def score_equation(c: float) -> float:
        weights = np.exp(c * (logs - top))
        return float((weights * centred).sum() / weights.sum() - 1.0 / c)

    low, high = 1e-6, 1.0
    while score_equation(high) < 0:
        low, high = high, 2 * high
    shape = scipy.optimize.brentq(score_equation, low, high, xtol=1e-12, rtol=4 * np.finfo(float).eps)
    scale = math.exp(top + math.log(np.exp(shape * (logs - top)).mean()) / shape)
    return shape, scale


class ClassTails:
    """The ``size`` largest values seen per class, ``[K, size]`` float64 (``-inf`` where a class has fewer);
    shards merge exactly as the largest of the union."""

    def __init__(self, size: int):
        self.size = size
        self.values: Tensor | None = None

    def add(self, label: int, values: Tensor, n_classes: int) -> None:
        if self.values is None:
            self.values = torch.full((n_classes, self.size), -math.inf, dtype=ACCUMULATE, device=values.device)
        self.values[label] = torch.topk(torch.cat([self.values[label], values.to(ACCUMULATE)]), self.size).values

    def merge(self, other: ClassTails) -> ClassTails:
        if other.values is not None:
            if self.values is None:
                self.values = other.values.clone()
            else:
                both = torch.cat([self.values, other.values.to(self.values.device)], dim=1)
                self.values = torch.topk(both, self.size, dim=1).values
        return self

    def state_dict(self) -> dict:
        return {"values": self.values}

    def load_state_dict(self, state: dict) -> ClassTails:
        self.values = state["values"]
        return self


class OpenMax(Detector):
    name = "openmax"
    fitted_shapes = {
        **Detector.fitted_shapes,
        "class_means_": "KC",
        "tail_minima_": "K",
        "weibull_shapes_": "K",
        "weibull_scales_": "K",
    }
    summary = "Probability of an 'unknown' class after moving logit mass by per-class Weibull models of the distances."
    paper = "https://arxiv.org/abs/1511.06233"
    teaching = Teaching(
        formula=r"s(x) = \frac{e^{v_0}}{e^{v_0} + \sum_j e^{v_j}},\quad v_j = z_j (1 - w_j),\quad v_0 = \sum_j z_j w_j",
        citation="Bendale & Boult, *Towards Open Set Deep Networks*, CVPR 2016",
        reads="the logits and labels of the fit split (mean logits per class, Weibull fits of the largest distances)",
        fails_when="Weibull fits of a few tail distances per class are unstable, and near-OOD logits close to a class mean get little mass.",
    )
    inputs = ("logits",)
    needs_labels = True
    fit_passes = 2
    in_defaults = False  # the default list is issue 17's per-backbone choice

    openood_params = {"tailsize": 20, "alpha": 3, "tail_shift": 1.0, "correct_only": True}

    def __init__(
        self,
        tailsize: int = 25,
        alpha: int = 10,
        euclid_weight: float = 1.0,
        tail_shift: float = TRANSLATION,
        correct_only: bool = False,
    ):
        for label, value in (("tailsize", tailsize), ("alpha", alpha)):
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"openmax: {label} must be a positive integer, got {value!r}")
        if isinstance(euclid_weight, bool) or not (0.0 <= euclid_weight <= 1.0):
            raise ValueError(
                f"openmax: euclid_weight must be in [0, 1] (1 - it weighs the cosine), got {euclid_weight!r}"
            )
        if tailsize < 2:
            raise ValueError("openmax: tailsize must be at least 2 (a Weibull fit needs two distances)")
        if isinstance(tail_shift, bool) or not isinstance(tail_shift, (int, float)) or not 0 < tail_shift < math.inf:
            raise ValueError(
                f"openmax: tail_shift (added to each class's tail after subtracting its smallest distance, so that "
                f"the Weibull sees positive values) must be a number > 0 (libMR's 1, pytorch-ood's 10000), got "
                f"{tail_shift!r}"
            )
        if not isinstance(correct_only, bool):
            raise ValueError(f"openmax: correct_only must be true or false, got {correct_only!r}")
        self.tailsize = int(tailsize)
        self.alpha = int(alpha)
        self.euclid_weight = float(euclid_weight)
        self.tail_shift = float(tail_shift)
        self.correct_only = correct_only

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """``8 x (C x C + C x (tailsize 25 + 4))``: class means of the logits and distance tails (float64)."""
        return 8 * (n_classes * n_classes + n_classes * 29)

    def distances(self, logits: Tensor, means: Tensor) -> Tensor:
        """``d(z_b, mu_k)`` ``[B, K]`` float64 for logits ``[B, C]`` and class means ``[K, C]``."""
        z = logits.to(ACCUMULATE)
        distance = torch.zeros(len(z), len(means), dtype=ACCUMULATE, device=z.device)
        if self.euclid_weight > 0:
            distance += self.euclid_weight * torch.cdist(
                z, means.to(ACCUMULATE), compute_mode="donot_use_mm_for_euclid_dist"
            )
        if self.euclid_weight < 1:
            # an all-zero row has cosine 0 (distance 1), not 0 / 0
            cosine = (z @ means.T) / (z.norm(dim=1, keepdim=True) * means.norm(dim=1)).clamp(min=1e-300)
            distance += (1 - self.euclid_weight) * (1 - cosine)
        return distance

    mergeable = True

    def _new_parts(self, pass_index: int) -> dict:
        """Pass 0: the class sums of the logits; pass 1: each class's ``tailsize`` largest distances."""
        return {"means": ClassMeans()} if pass_index == 0 else {"tails": ClassTails(self.tailsize)}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        logits, labels = batch.logits, batch.labels
        if self.correct_only:  # every class of the logits gets a mean (K = C): a class never right is an error
            correct = logits.argmax(dim=1) == labels
            logits, labels = logits[correct], labels[correct]
        if state.pass_index == 0:
            means = state.parts["means"]
            if self.correct_only:
                means.n_classes = batch.logits.shape[1]
            means.update(logits, labels)
            return
        tails = state.parts["tails"]
        for label in torch.unique(labels).tolist():
            own = self.distances(logits[labels == label], self.class_means_[label : label + 1])[:, 0]
            tails.add(label, own, len(self.class_means_))

    def _finish_pass(self, state: FitState) -> bool:
        if state.pass_index == 0:
            sums = state.parts["means"]
            if self.correct_only:  # every class of the logits, K = C
                empty = list(range(state.n_classes)) if sums.sums is None else sums.empty_classes(state.n_classes)
                check_all_classes_seen(self.name, empty, "correctly classified samples")
            check_all_classes_seen(self.name, sums.empty_classes())
            self.class_means_ = sums.means  # [K, C] float64
            return False
        means, tails = self.class_means_, state.parts["tails"].values
        shapes, scales = [], []
        for label, tail in enumerate(tails.cpu().numpy()):
            tail = tail[np.isfinite(tail)]  # a class with fewer than tailsize samples: all of them
            if len(tail) < 2 or np.ptp(tail) == 0:
                raise ValueError(
                    f"openmax: class {label} has {len(tail)} training sample(s) whose distances to the class mean "
                    "are all equal; a Weibull fit needs at least two different ones: give the class more samples."
                )
            shape, scale = fit_weibull(tail + self.tail_shift - tail.min())
            shapes.append(shape)
            scales.append(scale)
        self.tail_minima_ = tails.nan_to_num(neginf=math.inf).amin(dim=1)  # [K]
        self.weibull_shapes_ = torch.tensor(shapes, dtype=ACCUMULATE, device=means.device)  # [K]
        self.weibull_scales_ = torch.tensor(scales, dtype=ACCUMULATE, device=means.device)  # [K]
        return True

    def weibull_cdf(self, distances: Tensor) -> Tensor:
        """``W_k(d)`` for distances ``[B, K]`` to each class mean."""
        translated = (distances + self.tail_shift - self.tail_minima_).clamp(min=0)
        return -torch.expm1(-((translated / self.weibull_scales_) ** self.weibull_shapes_))

    def _score(self, batch: Batch) -> Tensor:
        z = batch.logits.to(ACCUMULATE)
        n_classes = z.shape[1]
        alpha = min(self.alpha, n_classes)
        known = len(self.class_means_)
        outlier = torch.ones_like(z)  # W = 1 for classes without training samples
        outlier[:, :known] = self.weibull_cdf(self.distances(z, self.class_means_))
        top = torch.topk(z, alpha, dim=1).indices  # [B, alpha], largest first
        ranks = (alpha - torch.arange(alpha, dtype=ACCUMULATE, device=z.device)) / alpha  # (alpha + 1 - i) / alpha
        weights = torch.zeros_like(z).scatter_(1, top, outlier.gather(1, top) * ranks)
        revised = torch.cat([(z * weights).sum(dim=1, keepdim=True), z * (1 - weights)], dim=1)
        return torch.softmax(revised, dim=1)[:, 0]
