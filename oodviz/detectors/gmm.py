"""Class-conditional Gaussian mixture: the negative log-likelihood of the features.

A classical baseline (one Gaussian per class, as in Lee et al.'s Mahalanobis detector but with a
covariance per class and the full mixture instead of the closest class), as pytorch-ood 0.4's
``GMM``; no single paper introduced it. Reference: Lee et al., NeurIPS 2018,
https://arxiv.org/abs/1807.03888 (the class-conditional Gaussian view of the features).

Fit (features ``x`` ``[N, D]``, labels ``y`` in ``0..C-1``), per class ``k`` with ``n_k`` samples:

    mu_k    = 1/n_k sum_{i: y_i = k} x_i                                          [C, D]
    Sigma_k = 1/n_k sum_{i: y_i = k} (x_i - mu_k)(x_i - mu_k)^T + reg I             [C, D, D]
    pi_k    = n_k / N                                                             [C]

streamed in float64 about a per-class shift (the class's first sample, as
:class:`~oodviz.detectors.stats.ClassMoments` does for the pooled scatter). ``reg`` keeps a class
with fewer samples than dimensions invertible. Score, with ``Sigma_k = L_k L_k^T`` (Cholesky):

    score(x) = -log sum_k pi_k N(x | mu_k, Sigma_k)
             = -logsumexp_k ( log pi_k - 1/2 ( |L_k^-1 (x - mu_k)|^2 + log det Sigma_k + D log 2 pi ) )

the negative log-likelihood (higher = more OOD), in float64. The same formula, ``reg`` and float64
as pytorch-ood 0.4 (which inverts the covariances; oodviz keeps ``L_k^-1``, the same numbers to
rounding). Memory: ``C`` float64 ``D x D`` matrices (``8 C D^2`` bytes: 34 GB for ImageNet-1k with
D = 2048; the pre-flight check refuses what does not fit), however many samples there are. Shards merge
exactly (:meth:`ClassScatters.merge`; the state protocol, :mod:`oodviz.detectors.protocol`).

OpenOOD v1.5's ``gmm`` postprocessor is another method, which oodviz does not reproduce (``openood_params`` is
empty: ``protocol = "openood"`` runs this one). Its defaults (``configs/postprocessors/gmm.yml``) score one
layer only (``alpha_list: [0, 0, 1]``): the third entry of the network's ``return_feature_list``, which for its
CIFAR ResNet-18 is the **output of ``layer2``** (128 x 16 x 16), flattened (``flat``: 32,768 values), not the
pooled penultimate features; projected on its 50 first principal components (``pca_50``, sklearn's ``PCA`` on
all the training features); and fitted, **without labels**, by sklearn's
``GaussianMixture(n_components=50, covariance_type="tied", random_state=0)``: 50 components found by EM from a
k-means initialisation, sharing one covariance. Its score is ``log(sum_k w_k exp(-1/2 (f - m_k)^T P (f - m_k)) +
1e-45)`` in float32, ``P`` the shared precision (no normalising constant, the same for every component), so that
inputs far from every component all get ``log(1e-45)``, tied. Streaming that would take a PCA of a 32,768-wide
layer (a 32,768-square covariance, 8.6 GB in float64) and an EM of many passes, and its result would still not
be OpenOOD's, which hangs on sklearn's k-means++ initialisation over all the rows held in memory: not done here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, check_all_classes_seen
from oodviz.detectors.protocol import FitState
from oodviz.detectors.stats import ACCUMULATE, inverse_cholesky_factor, row_blocks
from oodviz.detectors.teaching import Teaching


class ClassScatters:
    """Per-class counts, means and scatter matrices ``sum (x - mu_k)(x - mu_k)^T`` ``[C, D, D]``, float64, streamed.

    Each class keeps a shift ``s_k`` (its first sample), the shifted sum ``t_k = sum (x - s_k)`` and the
    shifted scatter ``S_k = sum (x - s_k)(x - s_k)^T``; then ``mu_k = s_k + t_k / n_k`` and the scatter about
    the mean is ``S_k - t_k t_k^T / n_k`` (no cancellation under a large common offset).
    """

    def __init__(self):
        self.counts: Tensor | None = None  # [C]
        self._shifts: Tensor | None = None  # [C, D]
        self._sums: Tensor | None = None  # [C, D]
        self._scatters: Tensor | None = None  # [C, D, D]

    def _grow(self, classes: int, width: int, device: torch.device) -> None:
        old = 0 if self.counts is None else len(self.counts)
        if classes <= old:
            return
        new = classes - old

        def extend(t: Tensor | None, shape) -> Tensor:
            fresh = torch.zeros((new, *shape), dtype=ACCUMULATE, device=device)
            return fresh if t is None else torch.cat([t, fresh])

        self.counts = extend(self.counts, ())
        self._shifts = extend(self._shifts, (width,))
        self._sums = extend(self._sums, (width,))
        self._scatters = extend(self._scatters, (width, width))

    def update(self, x: Tensor, y: Tensor) -> None:
        self._grow(int(y.max()) + 1, x.shape[1], x.device)
        for label in torch.unique(y).tolist():
            rows = x[y == label]
            if self.counts[label] == 0:
                self._shifts[label] = rows[0].to(ACCUMULATE)
            self.counts[label] += len(rows)
            for block in row_blocks(len(rows), x.shape[1]):
                shifted = rows[block].to(ACCUMULATE) - self._shifts[label]
                self._sums[label] += shifted.sum(dim=0)
                self._scatters[label].addmm_(shifted.T, shifted)

    def merge(self, other: ClassScatters) -> ClassScatters:
        """Add the classes of a shard ``other`` saw: per class its ``n_b`` samples about our shift ``s`` sum to
        ``n_b d`` and their scatter to ``S_b + n_b d d^T`` (``d = mu_b - s``, ``S_b`` about ``mu_b``); a class new
        here takes ``mu_b`` as its shift. Exact, whatever the offset."""
        if other.counts is None:
            return self
        device = other.counts.device if self.counts is None else self.counts.device
        self._grow(len(other.counts), other._shifts.shape[1], device)
        for label in torch.nonzero(other.counts).flatten().tolist():
            n = other.counts[label].to(device)
            mean = other.means[label].to(device)
            if self.counts[label] == 0:
                self._shifts[label] = mean
            delta = mean - self._shifts[label]
            self._sums[label] += n * delta
            self._scatters[label] += other.scatter(label).to(device) + n * torch.outer(delta, delta)
            self.counts[label] += n
        return self

    def state_dict(self) -> dict:
        """``counts`` ``[C]``, ``shifts`` and shifted ``sums`` ``[C, D]``, shifted ``scatters`` ``[C, D, D]``."""
        return {"counts": self.counts, "shifts": self._shifts, "sums": self._sums, "scatters": self._scatters}

    def load_state_dict(self, state: dict) -> ClassScatters:
        self.counts, self._shifts, self._sums, self._scatters = (
            state["counts"], state["shifts"], state["sums"], state["scatters"]
        )  # fmt: skip
        return self

    @property
    def means(self) -> Tensor:
        return self._shifts + self._sums / self.counts.clamp(min=1)[:, None]

    def scatter(self, label: int) -> Tensor:
        """``sum_{y_i = label} (x_i - mu)(x_i - mu)^T`` ``[D, D]`` float64 (a new tensor)."""
        t = self._sums[label]
        return self._scatters[label] - torch.outer(t, t) / self.counts[label]

    @property
    def storage(self) -> Tensor:
        """The ``[C, D, D]`` float64 tensor the shifted scatters are kept in; a caller that has read every
        :meth:`scatter` it needs may overwrite it (saves a second ``C x D x D``)."""
        return self._scatters

    def empty_classes(self) -> list[int]:
        return torch.nonzero(self.counts == 0).flatten().tolist()


class GMM(Detector):
    name = "gmm"
    fitted_shapes = {**Detector.fitted_shapes, "inverse_factors_": "CDD", "log_constants_": "C"}
    summary = "Negative log-likelihood under one Gaussian per class (own covariance), weighted by class frequency."
    paper = "https://arxiv.org/abs/1807.03888"
    teaching = Teaching(
        formula=r"s(x) = -\log \sum_k \pi_k \, \mathcal{N}(x \mid \mu_k, \Sigma_k)",
        citation="Lee et al., *A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial Attacks*, NeurIPS 2018",
        reads="the features and labels of the fit split (class means, one covariance per class, class frequencies)",
        fails_when="A covariance per class needs many samples per class; with few of them (or wide features) it is ruled by its regulariser.",
    )
    inputs = ("features",)
    needs_labels = True
    in_defaults = False  # C x D x D float64: 34 GB for ImageNet-1k at D = 2048

    def __init__(self, reg: float = 1e-6):
        if isinstance(reg, bool) or not isinstance(reg, (int, float)) or not (math.isfinite(reg) and reg >= 0):
            raise ValueError(
                f"gmm: reg must be a finite number >= 0 (added to each covariance's diagonal), got {reg!r}"
            )
        self.reg = float(reg)

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """``8 x (C x D^2 + D^2 + 3 x C x D)``: the per-class scatters (float64), one covariance being
        factorised, the class shifts, sums and means."""
        return 8 * ((n_classes + 1) * n_features**2 + 3 * n_classes * n_features)

    mergeable = True

    def _new_parts(self, pass_index: int) -> dict:
        return {"scatters": ClassScatters()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        state.parts["scatters"].update(batch.features, batch.labels)

    def _finish_pass(self, state: FitState) -> bool:
        scatters = state.parts["scatters"]
        check_all_classes_seen(self.name, scatters.empty_classes())
        counts = scatters.counts
        dim = scatters.means.shape[1]
        identity = torch.eye(dim, dtype=ACCUMULATE, device=counts.device)
        log_dets = torch.empty_like(counts)
        for label in range(len(counts)):
            covariance = scatters.scatter(label).div_(counts[label]).add_(identity, alpha=self.reg)
            inverse_factor = inverse_cholesky_factor(covariance)  # L^-1
            if inverse_factor is None:
                raise ValueError(
                    f"gmm: the covariance of class {label} ({int(counts[label])} samples, D={dim}) is not positive "
                    f"definite; increase reg (now {self.reg:g}) or give the class more samples."
                )
            log_dets[label] = -2 * inverse_factor.diagonal().log().sum()  # log det Sigma = -2 sum log diag(L^-1)
            scatters.storage[label] = inverse_factor  # in place of the class's scatter, read above
        self.class_counts_ = counts.long()
        self.class_means_ = scatters.means  # [C, D] float64
        self.inverse_factors_ = scatters.storage  # [C, D, D] float64, L_k^-1 (lower triangular)
        # log pi_k - 1/2 (log det Sigma_k + D log 2 pi): the constant of each class's log-density
        self.log_constants_ = (counts / counts.sum()).log() - 0.5 * (log_dets + dim * math.log(2 * math.pi))
        return True

    def log_likelihoods(self, features: Tensor) -> Tensor:
        """``log pi_k N(x | mu_k, Sigma_k)`` of each sample and class, ``[B, C]`` float64."""
        x = features.to(ACCUMULATE)
        out = torch.empty(len(x), len(self.class_means_), dtype=ACCUMULATE, device=x.device)
        for label in range(len(self.class_means_)):
            whitened = (x - self.class_means_[label]) @ self.inverse_factors_[label].T
            out[:, label] = whitened.pow(2).sum(dim=1)
        return self.log_constants_ - 0.5 * out

    def _score(self, batch: Batch) -> Tensor:
        return -torch.logsumexp(self.log_likelihoods(batch.features), dim=1)
