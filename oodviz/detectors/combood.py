"""CombOOD: the k-th nearest-neighbour distance and a Mahalanobis distance combined as one log-density.

Rajasekaran, Sajol, Berglind, Mukhopadhyay & Das, *COMBOOD: A Semiparametric Approach for Detecting
Out-of-distribution Data for Image Classification*, SDM 2024, https://arxiv.org/abs/2602.07042
(code: https://github.com/rmagesh148/combood, ``test_ood.py`` and ``confidenciator.py``)

Both signals read the L2-normalised penultimate features ``z = x / |x|`` ``[D]``.

- **Nearest neighbour** (non-parametric): ``d_k(x)^2``, the squared Euclidean distance from ``z`` to its ``k``-th
  nearest training feature (``k = 50``; the authors' FAISS ``IndexFlatL2``).
- **Mahalanobis** (parametric), on the features made Gaussian-like: each dimension standardised with the training
  mean and (population) deviation, ``u = (z - m) / s``; Yeo-Johnson transformed with its maximum-likelihood
  ``lambda_j`` per dimension, ``v_j = psi(u_j, lambda_j)``; standardised again, ``w = (v - m_v) / s_v``
  (scikit-learn's ``StandardScaler`` then ``PowerTransformer(standardize=True)``, as the authors fit them); then

      M(x)^2 = w^T (Sigma + r I)^{-1} w,     Sigma = cov(w_i) over the training rows (N - 1 in the denominator),
                                              r = reg = 1, the mean taken as 0 (the authors')

Score (higher = more OOD):

    score(x) = sqrt(D) log d_k(x)^2 + M(x)^2                                              [B]

the negation of the authors' ``square_log_probability``, ``-sqrt(n) log(d_k^2) - M^2`` with ``n`` the feature
dimension: a kNN density ``~ d_k^{-D}`` tempered to ``sqrt(D)`` and a Gaussian's ``-M^2``, added as log-densities.

Where this differs from the authors on purpose:

- **The Mahalanobis features.** The paper's headline runs (``test_ood.py``'s active branch, "xood-mahala-pen-knn-
  log-sq") feed the Mahalanobis part the XOOD extreme values: the minimum and maximum of the input of *every*
  activation layer, read with forward hooks, which needs the model run again. This detector reads features only, so
  it uses the penultimate-feature variant the same code carries ("pen-mahala-pen-knn-log-sq": Mahalanobis of the
  normalised penultimate features, as above). A run's leaderboard figures for CombOOD are the XOOD variant's.
- **The Yeo-Johnson lambdas.** scikit-learn finds each ``lambda_j`` by Brent's method, one pass over the column per
  trial; here every dimension's log-likelihood ``-N/2 log var(psi(u_j, lambda)) + (lambda - 1) sum sign(u) log1p|u|``
  is evaluated on a grid of ``LAMBDA_GRID`` values per pass (float64 sums of ``psi`` and ``psi^2``), starting on
  ``[-8, 8]`` and narrowed to the best point's neighbours for ``LAMBDA_PASSES`` passes, then the vertex of the
  parabola through the best three: the same maximum to ~1e-7 for a unimodal likelihood (a column whose likelihood
  is not unimodal may end at another local maximum than Brent's).
- ``d_k^2`` is floored at 1e-12 (a query equal to a training feature; the authors' ``np.log(..., where=...)`` leaves
  that entry unset).

Fit: ``2 + LAMBDA_PASSES`` passes over the in-distribution features (a re-iterable, not a one-shot iterator): the
normalised bank written to disk with the first moments of ``z``; the lambda passes; the moments and scatter of
``v`` (float64). State: ``O(D^2)`` (the precision matrix) plus the bank on disk, searched as knn's
(:mod:`oodviz.detectors.bank`: read once per ``score`` call in chunks, a running top-``k`` per query). Not mergeable:
the bank is every row and each pass needs the previous one's result.

OpenOOD's repository (v1.5, main) has no CombOOD postprocessor: the leaderboard's ``CombOOD`` row links the
authors' code (rmagesh148/combood), whose settings are those above, so ``openood_params = {}``.
"""

import math

import numpy as np
import torch
from torch import Tensor

from oodviz.detectors.bank import FeatureBank, _normalise, check_chunk_size
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.stats import ACCUMULATE, Moments
from oodviz.detectors.teaching import Teaching

#: Yeo-Johnson lambdas tried per dimension in each narrowing pass, and the passes
LAMBDA_GRID, LAMBDA_PASSES = 17, 4
#: the first bracket of the lambdas
LAMBDA_RANGE = (-8.0, 8.0)
#: floor of the squared k-th neighbour distance before its logarithm
MIN_SQUARED_DISTANCE = 1e-12
_EPS = float(np.spacing(1.0))


def yeo_johnson(u: Tensor, lambdas: Tensor) -> Tensor:
    """``psi(u, lambda)`` elementwise (float64), ``lambdas`` (one per column, or one) broadcast against ``u``:
    ``((u + 1)^l - 1) / l`` for ``u >= 0`` (``log1p(u)`` at ``l = 0``), ``-((1 - u)^(2 - l) - 1) / (2 - l)`` for
    ``u < 0`` (``-log1p(-u)`` at ``l = 2``), scikit-learn's ``_yeo_johnson_transform``."""
    return yeo_johnson_of_logs(torch.log1p(u.abs()), (u < 0).to(u.dtype), lambdas)


def yeo_johnson_of_logs(logs: Tensor, negative: Tensor, lambdas: Tensor) -> Tensor:
    """:func:`yeo_johnson` from ``logs = log1p(|u|)`` and ``negative = (u < 0)`` as 0/1 (which do not depend on
    lambda): with ``a = lambda`` where ``u >= 0`` and ``2 - lambda`` elsewhere, ``psi = +-expm1(a logs) / a``
    (``+-logs`` at ``a = 0``): one ``expm1`` per element and no branch unless a lambda is 0 or 2."""
    lambdas = torch.as_tensor(lambdas, dtype=logs.dtype, device=logs.device)
    exponents = torch.addcmul(lambdas.expand_as(logs), negative, 2 - 2 * lambdas)  # lambda, or 2 - lambda
    signs = 1 - 2 * negative
    if bool(((lambdas.abs() < _EPS) | ((lambdas - 2).abs() < _EPS)).any()):  # a log branch somewhere
        near_zero = exponents.abs() < _EPS
        safe = torch.where(near_zero, torch.ones_like(exponents), exponents)
        return torch.where(near_zero, logs, torch.expm1(safe * logs).div_(safe)).mul_(signs)
    return torch.expm1(exponents * logs).div_(exponents).mul_(signs)


def _scale(variance: Tensor) -> Tensor:
    """Deviations from variances, 1 where a dimension is constant (scikit-learn's ``_handle_zeros_in_scale``)."""
    deviation = variance.clamp(min=0).sqrt()
    return torch.where(deviation < 10 * _EPS, torch.ones_like(deviation), deviation)


class _FirstMoments:
    """Count, mean and variance per dimension (float64), about the first row (shifted sums)."""

    def __init__(self):
        self.n, self.shift, self.sums, self.squares = 0, None, None, None

    def update(self, x: Tensor) -> None:
        x = x.to(ACCUMULATE)
        if self.shift is None:
            self.shift = x[0].clone()
            self.sums, self.squares = torch.zeros_like(self.shift), torch.zeros_like(self.shift)
        shifted = x - self.shift
        self.sums += shifted.sum(dim=0)
        self.squares += shifted.square().sum(dim=0)
        self.n += len(x)

    def mean_and_variance(self) -> tuple[Tensor, Tensor]:
        offset = self.sums / self.n
        return self.shift + offset, self.squares / self.n - offset.square()


class CombOOD(FeatureBank):
    name = "combood"
    summary = "sqrt(D) log of the squared k-th neighbour distance plus a Mahalanobis distance of Gaussianised features."
    paper = "https://arxiv.org/abs/2602.07042"
    teaching = Teaching(
        formula=(
            r"s(x) = \sqrt{D} \log d_k(x)^2 + w^\top (\Sigma + r I)^{-1} w,\quad d_k(x) = \| z - z_{(k)} \|,\quad "
            r"w = \mathrm{std}(\psi_\lambda(\mathrm{std}(z))),\quad z = x / \|x\|"
        ),
        citation=(
            "Rajasekaran, Sajol, Berglind, Mukhopadhyay & Das, *COMBOOD: A Semiparametric Approach for Detecting "
            "Out-of-distribution Data for Image Classification*, SDM 2024"
        ),
        reads="the features of the fit split (all of them: the bank; and their Yeo-Johnson-Gaussianised moments)",
        fails_when=f"Fit reads the data {2 + LAMBDA_PASSES} times; the two terms' scales are fixed, so one can swamp the other.",
    )
    fitted_shapes = {
        **Detector.fitted_shapes,
        "bank_": "ND",
        "z_mean_": "D",
        "z_scale_": "D",
        "lambdas_": "D",
        "v_mean_": "D",
        "v_scale_": "D",
        "precision_": "DD",
    }
    fit_passes = 2 + LAMBDA_PASSES
    score_params = ("k",)
    in_defaults = False  # issue 29: not in the default run

    def __init__(self, k: int = 50, reg: float = 1.0, chunk_size: int = 16384, bank_dir: str | None = None):
        if isinstance(k, bool) or int(k) != k or k < 1:
            raise ValueError(f"combood: k must be a positive integer, got {k!r}")
        if isinstance(reg, bool) or not isinstance(reg, (int, float)) or not reg > 0:
            raise ValueError(f"combood: reg (added to the covariance's diagonal) must be a number > 0, got {reg!r}")
        self.k = int(k)
        self.reg = float(reg)
        self.chunk_size = check_chunk_size(self.name, chunk_size)
        self.bank_dir = bank_dir

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """The scatter and the precision (float64 ``2 x D^2``) and the lambda grid's sums (``2 x LAMBDA_GRID x D``)."""
        return 8 * (2 * n_features**2 + 2 * LAMBDA_GRID * n_features) + super().fit_memory_bytes(
            n_features, n_classes, n_samples
        )

    def _check_bank(self, rows: int) -> None:
        if rows < max(self.k, 2):
            raise ValueError(
                f"combood: k={self.k} needs at least max(k, 2) in-distribution samples, got {rows}; choose k <= {rows}."
            )

    def _check_fitted_params(self) -> None:
        if hasattr(self, "bank_"):
            self._check_bank(len(self.bank_))

    # -- fit ---------------------------------------------------------------------------------
    def _fit(self, data: FitData) -> None:
        self._moments = _FirstMoments()
        try:
            self._write_bank(data)  # pass 1: the bank, and the moments of z
            mean, variance = self._moments.mean_and_variance()
        finally:
            del self._moments
        self.z_mean_, self.z_scale_ = mean, _scale(variance)
        self.lambdas_ = self._fit_lambdas(data)
        transformed = Moments()
        for batch in data:  # last pass: the moments and scatter of v
            transformed.update(self._transformed(batch.features))
        transformed.release()
        n = transformed.total
        self.v_mean_ = transformed.mean
        self.v_scale_ = _scale(transformed.scatter.diagonal() / n)
        covariance = transformed.scatter / (n - 1) / torch.outer(self.v_scale_, self.v_scale_)  # cov(w), ddof 1
        covariance.diagonal().add_(self.reg)
        self.precision_ = torch.linalg.inv(covariance)

    def _bank_rows(self, features: Tensor, data: FitData, batch, rows: slice) -> Tensor:
        z = _normalise(features)
        self._moments.update(z)
        return z

    def _standardised(self, features: Tensor) -> Tensor:
        """``u = (z - m) / s`` ``[B, D]`` float64."""
        return (_normalise(features).to(ACCUMULATE) - self.z_mean_) / self.z_scale_

    def _transformed(self, features: Tensor) -> Tensor:
        """``v = psi(u, lambda)`` ``[B, D]`` float64."""
        return yeo_johnson(self._standardised(features), self.lambdas_)

    def _fit_lambdas(self, data: FitData) -> Tensor:
        """Each dimension's maximum-likelihood Yeo-Johnson lambda ``[D]`` (float64): grids narrowed pass by pass, then
        the vertex of the parabola through the best three (module docstring)."""
        dim = data.n_features
        low, high = LAMBDA_RANGE
        steps = torch.linspace(0, 1, LAMBDA_GRID, dtype=ACCUMULATE, device=self.z_mean_.device)[:, None]
        low = torch.full((dim,), low, dtype=ACCUMULATE, device=self.z_mean_.device)
        high = torch.full_like(low, high)
        signed_logs = None  # sum sign(u) log1p|u|, [D]
        for _ in range(LAMBDA_PASSES):
            grid = low + steps * (high - low)  # [G, D]
            sums, squares, n = torch.zeros_like(grid), torch.zeros_like(grid), 0
            first_pass = signed_logs is None
            signed_logs = torch.zeros_like(low) if first_pass else signed_logs
            for batch in data:
                u = self._standardised(batch.features)
                logs, negative = torch.log1p(u.abs()), (u < 0).to(u.dtype)
                if first_pass:
                    signed_logs += (u.sign() * logs).sum(dim=0)
                for g in range(LAMBDA_GRID):
                    psi = yeo_johnson_of_logs(logs, negative, grid[g])
                    sums[g] += psi.sum(dim=0)
                    squares[g] += psi.square().sum(dim=0)
                n += len(u)
            variance = squares / n - (sums / n).square()
            loss = n / 2 * variance.log() - (grid - 1) * signed_logs  # the negative log-likelihood, [G, D]
            loss = torch.where(variance < np.finfo(np.float64).tiny, math.inf, loss)
            best = loss.argmin(dim=0)  # [D]
            columns = torch.arange(dim, device=grid.device)
            low = grid[(best - 1).clamp(min=0), columns]
            high = grid[(best + 1).clamp(max=LAMBDA_GRID - 1), columns]
        # the parabola through the best point and its neighbours (interior, finite ones only)
        inner = best.clamp(1, LAMBDA_GRID - 2)
        left, middle, right = (loss[inner + d, columns] for d in (-1, 0, 1))
        spacing = grid[1] - grid[0]
        curvature = left - 2 * middle + right
        shift = 0.5 * spacing * (left - right) / curvature
        usable = (best == inner) & torch.isfinite(shift) & (curvature > 0) & (shift.abs() <= spacing)
        return torch.where(usable, grid[inner, columns] + shift, grid[best, columns])

    # -- score -------------------------------------------------------------------------------
    def _query_extra(self, batch) -> Tensor:
        """``M(x)^2`` ``[B]`` (float64, on the CPU)."""
        w = (self._transformed(batch.features) - self.v_mean_) / self.v_scale_
        return ((w @ self.precision_) * w).sum(dim=1).cpu()

    @torch.no_grad()
    def score(self, batches, device=None) -> Tensor:
        """Outlier scores ``[N]`` (CPU float32, order of the batches): ``sqrt(D) log d_k^2 + M^2``; higher = more OOD.
        One pass over the bank for all the batches (module docstring); a one-shot iterable is fine."""
        with self._staged_queries(batches, device) as (queries, device, mahalanobis):
            best = torch.full((len(queries), self.k), -math.inf, device=device)  # top-k cosine similarities so far
            for rows, z, chunk, _, buffer in self._sweep(queries, device):
                block = torch.mm(z, chunk.T, out=buffer[: len(z) * len(chunk)].view(len(z), len(chunk)))
                top = torch.topk(block, k=min(self.k, len(chunk)), dim=1).values
                best[rows] = torch.topk(torch.cat([best[rows], top], dim=1), k=self.k, dim=1).values
            squared = (2 - 2 * best[:, -1].double().cpu()).clamp(min=MIN_SQUARED_DISTANCE)  # d_k^2
            return (math.sqrt(self.n_features_in_) * squared.log() + mahalanobis).float()
