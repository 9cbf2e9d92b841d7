"""WeiPer: perturbed class projections of the penultimate features (with the KLD score, WeiPer+KLD).

Granz, Heurich & Landgraf, *WeiPer: OOD Detection using Weight Perturbations of Class Projections*,
NeurIPS 2024, https://arxiv.org/abs/2405.17164 (OpenOOD v1.5's ``weiper_kld`` postprocessor).

With the head ``(W [C, D], b [C])``, ``r = n_repeats`` and ``delta = perturbation``, the perturbed
head ``W~`` ``[r C, D]`` stacks ``r`` copies of ``W`` whose row ``c`` moves by a random direction of
length ``delta ||W_c||``:

    W~_(i, c) = W_c + delta ||W_c|| n_(i, c) / ||n_(i, c)||,   n ~ N(0, I_D),   b~_(i, c) = b_c

drawn once, from a generator seeded with ``seed`` (``torch.randn((r, C, D))`` on the CPU). For
features ``z`` ``[B, D]`` the perturbed logits are ``z~ = z W~^T + b~`` ``[B, r C]``, and

    MSP~(z) = (1/r) sum_i max_c softmax_c(z~_(i, .))             (mean MSP over the r heads)

- ``variant="msp"`` (WeiPer+MSP): ``score(z) = -MSP~(z)``; fit only stores the head.
- ``variant="kld"`` (WeiPer+KLD, default): each sample is read as two empirical distributions, of its
  ``D`` activations and of its ``r C`` perturbed logits. Fit, pass 1: the smallest and largest value
  of each over all in-distribution samples (two scalars each, ``[m, M]``); pass 2: each sample's
  histogram over ``n_bins`` equal bins of ``[m, M)`` (the fraction of its values in each bin; values
  outside fall out), averaged over the samples: ``p`` and ``p~`` ``[n_bins]``. Score: the sample's
  histograms ``q``, ``q~``, smoothed by a moving average of ``smoothing`` bins (replicate padding, as
  PyTorch's ``Conv1d(padding="same", padding_mode="replicate")``: ``(k-1)//2`` bins on the left), then

      KL_s(p, q) = sum_j p'_j log(p'_j / q'_j) + q'_j log(q'_j / p'_j),
      p' = (p + eps) / sum(p + eps),   q' = (smooth(q) + eps) / sum(smooth(q) + eps)

      score(z) = KL_s(p, q) + lambda_1 KL_s(p~, q~) - lambda_2 MSP~(z)

  with ``eps = 0.01`` for the features and ``0.025`` for the perturbed logits (OpenOOD's constants).

Higher = more OOD in both variants (OpenOOD's confidence is the negative score). This follows
OpenOOD v1.5's ``WeiPerKLDivPostprocessor`` with ``exact_minmax=True`` and its defaults
(``n_bins=100, delta=2.1, r=100, s_1 = s_2 = 20, lambda_1 = lambda_2 = 1``); bin edges are float32,
``linspace(m, M + 1e-8, n_bins + 1)`` as there, so a value equal to ``M`` may fall out as it does
there. Deviation: ``p`` is the mean over all fit samples, where OpenOOD averages per-batch means
(the same when every batch has the same size).

Streaming and bounded: both passes read one batch at a time; ``W~`` (``4 r C D`` bytes: 82 MB for
``C = 100, D = 2048``) is the fitted state; the perturbed logits of a batch are formed a few heads at a
time (:data:`LOGIT_BLOCK_BYTES`), never all ``[B, r C]`` at once. Shapes: ``features`` ``[B, D]`` ->
scores ``[B]``.

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`): pass 1's ranges merge by minimum and
maximum (exact), pass 2's histogram sums, over the bin edges of the merged ranges, by addition (float64), and
``W~`` is drawn from ``seed`` on every shard alike; so the fit of the shards merged is that of all the rows.

OpenOOD's repository (v1.5, main) has no WeiPer postprocessor: the leaderboard's ``WeiPer+KLD`` row links the
authors' code (mgranz/weiper, built on OpenOOD), whose ``WeiPerKLDivPostprocessor`` and defaults are those above,
so ``openood_params = {}``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.protocol import Extremes, FitState, Sums
from oodviz.detectors.teaching import Teaching

VARIANTS = ("kld", "msp")
#: OpenOOD's additive constants of the histograms of the features and of the perturbed logits
FEATURE_EPS, PERTURBED_EPS = 0.01, 0.025
#: at most this many bytes of perturbed logits at once
LOGIT_BLOCK_BYTES = 16 * 2**20


def _positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"weiper: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _non_negative(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"weiper: {name} must be a finite number >= 0, got {value!r}")
    return float(value)


def perturbed_head(weight: Tensor, n_repeats: int, perturbation: float, seed: int) -> Tensor:
    """``W~`` ``[r C, D]`` float32: ``r`` copies of ``weight`` ``[C, D]``, row ``c`` moved by ``delta ||W_c||``
    in a random direction (``torch.randn((r, C, D))`` from a CPU generator seeded with ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    w = weight.detach().float().cpu()
    noise = torch.randn((n_repeats, *w.shape), generator=generator)
    noise = noise / noise.norm(dim=2, keepdim=True).clamp_min(1e-12)
    noise.mul_(perturbation * w.norm(dim=1)[None, :, None]).add_(w)
    return noise.reshape(n_repeats * w.shape[0], w.shape[1]).to(weight.device)


def bin_edges(low: float, high: float, n_bins: int, device) -> Tensor:
    """``n_bins + 1`` float32 edges from ``low`` to ``high + 1e-8``, computed as OpenOOD's ``linspace``
    (``low + (j / n_bins) (high + 1e-8 - low)`` in float32)."""
    low_, high_ = (torch.tensor(v, dtype=torch.float32, device=device) for v in (low, high))
    steps = torch.arange(n_bins + 1, dtype=torch.float32, device=device) / n_bins
    return low_ + steps * (high_ + 1e-8 - low_)


def histograms(values: Tensor, edges: Tensor) -> Tensor:
    """Counts ``[B, n_bins]`` (float64) of each row of ``values`` ``[B, K]`` in ``[edges_j, edges_j+1)``;
    values below ``edges[0]`` or from ``edges[-1]`` on are not counted."""
    index = torch.bucketize(values.float(), edges, right=True) - 1  # edges[i] <= v < edges[i + 1] -> i
    n_bins = len(edges) - 1
    index = torch.where((index >= 0) & (index < n_bins), index, n_bins)  # out of range: a spare bin
    counts = torch.zeros(len(values), n_bins + 1, dtype=torch.float64, device=values.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float64))
    return counts[:, :n_bins]


def smooth(densities: Tensor, size: int) -> Tensor:
    """Moving average of ``size`` bins along the last axis of ``[B, n_bins]``, replicate padding
    (``(size - 1) // 2`` bins left, the rest right, as ``Conv1d(padding="same")``)."""
    left = (size - 1) // 2
    padded = torch.cat(
        [densities[:, :1].expand(-1, left), densities, densities[:, -1:].expand(-1, size - 1 - left)], dim=1
    )
    cumulative = torch.nn.functional.pad(padded.cumsum(dim=1), (1, 0))
    return (cumulative[:, size:] - cumulative[:, :-size]) / size


def symmetric_kl(reference: Tensor, densities: Tensor, eps: float) -> Tensor:
    """``KL(p'||q') + KL(q'||p')`` ``[B]`` between ``reference`` ``[n_bins]`` and each row of ``densities``."""
    p = reference + eps
    p = p / p.sum()
    q = densities + eps
    q = q / q.sum(dim=1, keepdim=True)
    log_ratio = p.log()[None, :] - q.log()
    return (p[None, :] * log_ratio).sum(dim=1) - (q * log_ratio).sum(dim=1)


class WeiPer(Detector):
    name = "weiper"
    fitted_shapes = {
        **Detector.fitted_shapes,
        "perturbed_weight_": "RD",
        "feature_edges_": "E",
        "perturbed_edges_": "E",
        "feature_density_": "B",
        "perturbed_density_": "B",
    }
    param_choices = {"variant": VARIANTS}
    summary = "Histogram KL to the training mean of the features and of many randomly perturbed class projections."
    paper = "https://arxiv.org/abs/2405.17164"
    teaching = Teaching(
        formula=r"s(x) = \mathrm{KL}_s(p, q_x) + \lambda_1 \mathrm{KL}_s(\tilde p, \tilde q_x) - \frac{\lambda_2}{r} \sum_{i=1}^{r} m_i(x),\quad m_i(x) = \max_c \operatorname{softmax}(x \tilde W_i^\top + b)_c",
        citation="Granz, Heurich & Landgraf, *WeiPer: OOD Detection using Weight Perturbations of Class Projections*, NeurIPS 2024",
        reads="the features of the fit split (value ranges, mean histograms) and the head, perturbed at random",
        fails_when="Its default 100 bins are too many for narrow features: a histogram of few activations per sample is mostly noise.",
    )
    inputs = ("features",)
    needs_head = True
    fit_passes = 2
    mergeable = True
    #: the default detector list by backbone family is issue 17.4's; until then a run lists it explicitly
    in_defaults = False

    def __init__(
        self,
        variant: str = "kld",
        n_repeats: int = 100,
        perturbation: float = 2.1,
        n_bins: int = 100,
        smoothing: int = 20,
        smoothing_perturbed: int = 20,
        lambda_1: float = 1.0,
        lambda_2: float = 1.0,
        seed: int = 0,
    ):
        if variant not in VARIANTS:
            raise ValueError(f"weiper: variant must be 'kld' (WeiPer+KLD) or 'msp' (WeiPer+MSP), got {variant!r}")
        self.variant = variant
        self.n_repeats = _positive_int(n_repeats, "n_repeats")
        self.perturbation = _non_negative(perturbation, "perturbation")
        self.n_bins = _positive_int(n_bins, "n_bins", 2)
        self.smoothing = _positive_int(smoothing, "smoothing")
        self.smoothing_perturbed = _positive_int(smoothing_perturbed, "smoothing_perturbed")
        self.lambda_1 = _non_negative(lambda_1, "lambda_1")
        self.lambda_2 = _non_negative(lambda_2, "lambda_2")
        self.seed = _positive_int(seed, "seed", 0)

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """``W~`` (float32, ``r = 100`` heads by default) and its float32 noise while it is drawn."""
        return 2 * 4 * 100 * n_classes * n_features + LOGIT_BLOCK_BYTES

    def _logit_blocks(self, features: Tensor):
        """The perturbed logits ``[B, k C]`` of ``features`` ``[B, D]``, a few heads at a time, and their head count."""
        n_classes = len(self.head_bias_)
        per_head = max(1, len(features) * n_classes * 4)
        heads = max(1, min(self.n_repeats, LOGIT_BLOCK_BYTES // per_head))
        x = features.float()
        for start in range(0, self.n_repeats, heads):
            rows = slice(start * n_classes, min(start + heads, self.n_repeats) * n_classes)
            weight = self.perturbed_weight_[rows]
            yield torch.addmm(self.head_bias_.repeat(len(weight) // n_classes), x, weight.T), len(weight) // n_classes

    def _msp(self, features: Tensor) -> Tensor:
        total = torch.zeros(len(features), dtype=torch.float64, device=features.device)
        n_classes = len(self.head_bias_)
        for logits, heads in self._logit_blocks(features):
            p = logits.view(len(features), heads, n_classes).softmax(dim=2)
            total += p.amax(dim=2).double().sum(dim=1)
        return total / self.n_repeats

    def _perturbed_histograms(self, features: Tensor) -> Tensor:
        counts = sum(histograms(logits, self.perturbed_edges_) for logits, _ in self._logit_blocks(features))
        return counts / (self.n_repeats * len(self.head_bias_))

    def _new_parts(self, pass_index: int) -> dict:
        """Pass 0: the ranges ``[m, M]`` of the activations and of the perturbed logits (``Extremes`` of ``[2]``);
        pass 1: the sums of each sample's histograms of both (``[n_bins]`` each)."""
        if pass_index == 0:
            return {"ranges": Extremes()}
        return {"features": Sums(), "perturbed": Sums()}

    def _keep_head(self, state: FitState) -> None:
        """``W~`` (drawn from ``seed``, the same on every shard) and the bias on the fit device: drawn once per head."""
        weight, bias = state.head
        drawn = getattr(self, "_drawn_from", None)
        if drawn is None or drawn.shape != weight.shape or not torch.equal(drawn, weight.to(drawn.device)):
            self.perturbed_weight_ = perturbed_head(weight, self.n_repeats, self.perturbation, self.seed)
            self._drawn_from = weight
        self.perturbed_weight_, self.head_bias_ = self.perturbed_weight_.to(state.device), bias.to(state.device)

    def _update_state(self, state: FitState, batch: Batch) -> None:
        self._keep_head(state)
        x = batch.features
        if state.pass_index == 0:
            if self.variant == "msp":  # nothing to learn: the batches check D against the head
                return
            lows, highs = [x.float().min()], [x.float().max()]
            blocks = [(logits.min(), logits.max()) for logits, _ in self._logit_blocks(x)]
            lows.append(torch.stack([low for low, _ in blocks]).min())
            highs.append(torch.stack([high for _, high in blocks]).max())
            state.parts["ranges"].add(torch.stack(lows), torch.stack(highs))
            return
        state.parts["features"].add((histograms(x, self.feature_edges_) / x.shape[1]).sum(dim=0))
        state.parts["perturbed"].add(self._perturbed_histograms(x).sum(dim=0))

    def _finish_pass(self, state: FitState) -> bool:
        self._keep_head(state)
        if self.variant == "msp":
            return True
        if state.pass_index == 0:
            ranges = state.parts["ranges"]
            self.feature_edges_, self.perturbed_edges_ = (
                bin_edges(float(ranges.low[i]), float(ranges.high[i]), self.n_bins, state.device) for i in (0, 1)
            )
            return False
        self.feature_density_ = state.parts["features"].value / state.rows
        self.perturbed_density_ = state.parts["perturbed"].value / state.rows
        return True

    def _score(self, batch: Batch) -> Tensor:
        x = batch.features
        msp = self._msp(x)
        if self.variant == "msp":
            return -msp
        q = smooth(histograms(x, self.feature_edges_) / x.shape[1], self.smoothing)
        q_perturbed = smooth(self._perturbed_histograms(x), self.smoothing_perturbed)
        return (
            symmetric_kl(self.feature_density_, q, FEATURE_EPS)
            + self.lambda_1 * symmetric_kl(self.perturbed_density_, q_perturbed, PERTURBED_EPS)
            - self.lambda_2 * msp
        )
