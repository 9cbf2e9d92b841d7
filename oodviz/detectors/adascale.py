"""AdaSCALE: SCALE with a per-sample percentile adapted from the features' reaction to a small input perturbation.

Regmi, Panthi, Dangi et al., *AdaSCALE: Adaptive Scaling for OOD Detection*, 2025,
https://arxiv.org/abs/2503.08023 (OpenOOD v1.5's ``adascale_a`` and ``adascale_l`` postprocessors).

Runs the classifier again (a model-based detector with a fit, see :mod:`oodviz.detectors.model_fit`).
For model inputs ``x`` ``[B, ...]`` with penultimate features ``z = f(x)`` ``[B, D]`` (the input of
the head ``(W [C, D], b [C])``) and logits ``g(x) = W z + b``:

1. **Perturbation.** ``grad = d/dx sum_i max_c g_c(x_i)`` (one backward pass, summed over the batch:
   each sample's gradient is its own). In each sample, the ``n = int(o * numel)`` input elements with
   the *smallest* ``|grad|`` (ties: the lower index) move by ``step`` in the direction of the gradient:
   ``x' = x + step * sign(grad) * mask``; ``z' = f(x')`` (a second forward).
2. **Sensitivity.** With ``T_k(z)`` the indices of the ``k`` largest entries of ``z`` (ties: the lower
   index), ``k_1 = max(1, int(D k1 / 100))``, ``k_2 = max(1, int(D k2 / 100))``:

       Q(x) = sum_{j in T_k1(z)} relu(z'_j) + lambda * sum_{j in T_k2(z)} |z_j - z'_j|

3. **Adaptive percentile.** Fit: ``Q`` of every in-distribution input (one pass; ``N`` float32
   values, sorted). Score: ``F(Q)``, the fraction of in-distribution values ``<= Q(x)`` (the
   empirical CDF, as ``statsmodels``' ``ECDF``), and ``p(x) = p_min + (1 - F(Q(x))) (p_max - p_min)``.
4. **Scaling**, of ``a = relu(z)``: with ``k = D - round(D p(x) / 100)`` (half to even), ``s1`` the
   sum of all of ``a`` and ``s2`` that of its ``k`` largest, ``r = s1 / s2``;

   - ``variant="a"`` (AdaSCALE-A): ``logits = exp(r) z W^T + b`` (the features scaled, as SCALE);
   - ``variant="l"`` (AdaSCALE-L): ``logits = r^2 (z W^T + b)`` (the logits scaled);

   ``score(x) = -logsumexp_c logits_c`` (the energy; OpenOOD's confidence is its negation, so
   higher = more OOD).

Defaults are OpenOOD's (``percentiles [75, 85], k1 = 5, k2 = 1, lambda = 10, o = 0.05``, step 0.5 in
model-input units; OpenOOD's ResNet-50 setting is ``[80, 85]``). Deviations: ``k_1, k_2 >= 1`` (for ``D < 100``
OpenOOD's ``int(D k2 / 100)`` is 0 at its default ``k2 = 1``, dropping the shift term); every fit sample enters
the empirical CDF (OpenOOD draws 5,000 of its ID validation set at random); where ``s2 <= 0`` (no
positive activation) the factor is 1, not ``0 / 0``; ties are broken by index (``torch.topk`` leaves
them unspecified); the energy is formed in float64. Memory: ``O(N)`` floats for the CDF
(4 bytes a sample), a batch of inputs and its gradient. Shapes: ``inputs`` ``[B, ...]`` -> ``[B]``.

Not mergeable (the state protocol, :mod:`oodviz.detectors.protocol`): it runs the model on the fit images;
in a run split over ranks every rank fits it on all the ID fit images (the same answer, without the speed-up).

OpenOOD v1.5's ``adascale_a`` and ``adascale_l`` configurations have these defaults, and tune the percentiles on the
benchmark's validation sets over 36 pairs from ``[60, 65]`` to ``[95, 99]`` (``APS_mode: True``; ``k1``, ``k2``,
``lmbda`` and ``o`` have one value each): the pair behind its figures depends on the benchmark (its configuration
notes ``[80, 85]`` for ResNet-50), so ``openood_params = {}``; ``variant`` chooses between the two postprocessors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.ash import log_scale, top_k
from oodviz.detectors.model_fit import FittedModelDetector, features_and_logits
from oodviz.detectors.react import check_percentile
from oodviz.detectors.teaching import Teaching

VARIANTS = ("a", "l")


class AdaSCALE(FittedModelDetector):
    name = "adascale"
    fitted_shapes = {**FittedModelDetector.fitted_shapes, "sensitivities_": "N"}
    param_choices = {"variant": VARIANTS}
    summary = (
        "SCALE's energy with a per-sample percentile set by how much the features move under a small input "
        "perturbation (runs the model)."
    )
    paper = "https://arxiv.org/abs/2503.08023"
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_c e^{(e^{s_1 / s_2(k_x)} z W^\top + b)_c},\quad k_x = D - \mathrm{round}\big(D\, p(x) / 100\big),\quad p(x) = p_{\min} + (1 - F(Q(x)))(p_{\max} - p_{\min})",
        citation="Regmi, Panthi, Dangi et al., *AdaSCALE: Adaptive Scaling for OOD Detection*, arXiv 2025",
        reads="the model itself (one backward, two forwards per input), the head, and the ID inputs of the fit split (the CDF of Q)",
        fails_when="Built on SCALE's activation ratio, so signed or narrow features (ViTs, small models) break it; a backward pass per input.",
    )
    needs_head = True
    #: the default detector list by backbone family is issue 17.4's; until then a run lists it explicitly
    in_defaults = False

    def __init__(
        self,
        variant: str = "a",
        min_percentile: float = 75.0,
        max_percentile: float = 85.0,
        k1: float = 5.0,
        k2: float = 1.0,
        lmbda: float = 10.0,
        o: float = 0.05,
        step: float = 0.5,
        model=None,
    ):
        if variant not in VARIANTS:
            raise ValueError(f"adascale: variant must be 'a' (scale the features) or 'l' (the logits), got {variant!r}")
        self.variant = variant
        self.min_percentile = check_percentile(self.name, min_percentile, "min_percentile", upper_open=True)
        self.max_percentile = check_percentile(self.name, max_percentile, "max_percentile", upper_open=True)
        if self.min_percentile > self.max_percentile:
            raise ValueError(
                f"adascale: min_percentile={min_percentile:g} exceeds max_percentile={max_percentile:g}; "
                "give the range low to high (OpenOOD uses 75, 85)"
            )
        self.k1 = check_percentile(self.name, k1, "k1")
        self.k2 = check_percentile(self.name, k2, "k2")
        for label, value in (("lmbda", lmbda), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"adascale: {label} must be a finite number >= 0, got {value!r}")
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not 0 < o <= 1:
            raise ValueError(f"adascale: o is the fraction of input elements perturbed, 0 < o <= 1, got {o!r}")
        self.lmbda, self.o, self.step = float(lmbda), float(o), float(step)
        super().__init__(model)

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """The sorted sensitivities (float32) while they are gathered and sorted."""
        return 3 * 4 * n_samples + 8 * (n_classes * n_features + n_classes)

    @staticmethod
    def kept(n_features: int, percent: float) -> int:
        """``max(1, int(D percent / 100))``: the number of top features a sum of step 2 reads."""
        return max(1, int(n_features * percent / 100))

    def perturbed(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Features of ``x`` and of ``x'`` (step 1), each ``[B, D]`` float32, no graph."""
        with torch.inference_mode(False):
            x = x.clone() if torch.is_inference(x) else x
            x = x.detach().requires_grad_(True)
            with torch.enable_grad():
                features, logits = features_and_logits(self.model, x, grad=True)
                (gradient,) = torch.autograd.grad(logits.amax(dim=1).sum(), x)
            flat = gradient.reshape(len(x), -1)
            n = int(flat.shape[1] * self.o)
            mask = torch.zeros_like(flat)
            if n:
                smallest = torch.sort(flat.abs(), dim=1, stable=True).indices[:, :n]
                mask.scatter_(1, smallest, 1.0)
            moved = (x + self.step * flat.sign().mul_(mask).view_as(x)).detach()
        with torch.no_grad():
            moved_features, _ = features_and_logits(self.model, moved)
        return features.detach().float(), moved_features.float()

    def sensitivity(self, features: Tensor, moved: Tensor) -> Tensor:
        """``Q`` ``[B]`` (float64) from the features ``z`` and ``z'`` ``[B, D]`` (step 2)."""
        d = features.shape[1]
        _, top1 = top_k(features, self.kept(d, self.k1))
        _, top2 = top_k(features, self.kept(d, self.k2))
        kept = moved.relu().gather(1, top1).double().sum(dim=1)
        shift = (features - moved).abs().gather(1, top2).double().sum(dim=1)
        return kept + self.lmbda * shift

    def fit_step(self, batch: Batch) -> Tensor:
        return self.sensitivity(*self.perturbed(batch.inputs)).float()

    def _end_pass(self, pass_index: int, values: Tensor) -> None:
        self.sensitivities_ = torch.sort(values.float()).values

    def percentiles(self, q: Tensor) -> Tensor:
        """``p(x)`` ``[B]`` (float64) from ``Q`` ``[B]`` (step 3)."""
        ecdf = torch.searchsorted(self.sensitivities_, q.float(), right=True).double() / len(self.sensitivities_)
        return self.min_percentile + (1.0 - ecdf) * (self.max_percentile - self.min_percentile)

    def _score(self, batch: Batch) -> Tensor:
        features, moved = self.perturbed(batch.inputs)
        p = self.percentiles(self.sensitivity(features, moved))
        a = features.relu()
        d = a.shape[1]
        kept = d - torch.round(d * p / 100.0).long()  # [B], at least 1: p < 100
        ranked = torch.sort(a, dim=1, descending=True).values
        kept_sum = (ranked * (torch.arange(d, device=a.device)[None, :] < kept[:, None])).sum(dim=1)
        r = log_scale(a.sum(dim=1), kept_sum)  # s1 / s2, or 0 where s2 <= 0
        raw = (features @ self.head_weight_.T).double()
        if self.variant == "a":
            logits = torch.exp(r)[:, None] * raw + self.head_bias_.double()
        else:
            factor = torch.where(kept_sum > 0, r, 1.0)
            logits = (factor**2)[:, None] * (raw + self.head_bias_.double())
        return -torch.logsumexp(logits, dim=1)
