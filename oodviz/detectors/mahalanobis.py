"""Mahalanobis distance to the closest class mean, with a shared covariance.

Lee et al., *A Simple Unified Framework for Detecting Out-of-Distribution Samples and
Adversarial Attacks*, NeurIPS 2018, https://arxiv.org/abs/1807.03888

Fit (features ``x`` ``[N, D]``, labels ``y`` in ``0..C-1``): class means ``mu_k`` ``[C, D]`` and
the shared, tied covariance

    Sigma = 1/N sum_k sum_{i: y_i = k} (x_i - mu_k)(x_i - mu_k)^T        [D, D]

streamed in float64 about per-class shifts (:class:`~oodviz.detectors.stats.ClassMoments`).

Score: the squared distance to the closest class,

    score(x) = min_k (x - mu_k)^T Sigma^+ (x - mu_k)

The paper's confidence is the negated distance; the distance itself is the OOD score (higher =
more OOD). ``Sigma^+`` is the pseudo-inverse: directions without in-distribution variance
(eigenvalues below ``D * eps * lambda_max``, e.g. dead ReLU units) are dropped instead of
dividing by zero. Scoring whitens once, ``x' = (x - mu) S`` with ``S S^T = Sigma^+``, and
computes all ``C`` distances with one matrix product, ``|x'|^2 - 2 x' mu_k'^T + |mu_k'|^2``,
rather than a loop over classes.

pytorch-ood 0.4 uses the unnormalised scatter plus ``1e-6 I`` as ``Sigma`` and reports half the
distance: the ranking is the same, the scale is not; oodviz follows the paper.
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, FitData, check_all_classes_seen
from oodviz.detectors.stats import ClassMoments, inverse_cholesky_factor, row_blocks, symmetric_eigh
from oodviz.detectors.teaching import Teaching


def inverse_sqrt(covariance: Tensor, overwrite: bool = False) -> Tensor:
    """``S`` ``[D, k]`` with ``S S^T = covariance^+`` (pseudo-inverse), from a float64 ``[D, D]`` matrix.

    The pseudo-inverse keeps the eigen-directions with eigenvalue above ``D * eps(float64) *
    lambda_max``. When ``trace(A) trace(A^-1) < 1 / (D * eps)`` (``A`` = ``covariance``) every
    eigenvalue is above that cutoff (``lambda_max / lambda_min`` is at most the product), so
    ``A^+ = A^-1`` and ``S = L^-T`` from the Cholesky factor ``A = L L^T`` (``k = D``, upper
    triangular): the usual case, without an eigendecomposition. Otherwise (rank-deficient or
    badly conditioned, e.g. dead ReLU units) ``S = V_k diag(lambda_k)^(-1/2)`` from the kept
    eigenpairs. ``overwrite=True`` may destroy ``covariance`` (saves a copy of it).
    """
    d, eps = covariance.shape[0], torch.finfo(covariance.dtype).eps
    inverse_factor = inverse_cholesky_factor(covariance)  # L^-1, or None
    if inverse_factor is not None:
        trace_inverse = float(torch.linalg.vector_norm(inverse_factor)) ** 2  # trace(A^-1) = |L^-1|_F^2
        if float(covariance.diagonal().sum()) * trace_inverse * d * eps < 1:
            return inverse_factor.T
        del inverse_factor
    eigenvalues, eigenvectors = symmetric_eigh(covariance, overwrite=overwrite)
    cutoff = eigenvalues.amax().clamp(min=0) * d * eps
    keep = eigenvalues > cutoff
    if not bool(keep.all()):
        eigenvectors = eigenvectors[:, keep]
    return eigenvectors.div_(eigenvalues[keep].sqrt())


def squared_distances(x: Tensor, points: Tensor, point_norms: Tensor) -> Tensor:
    """``|x_i - p_k|^2`` ``[B, K]`` from ``x`` ``[B, d]``, ``points`` ``[K, d]`` and ``|p_k|^2`` ``[K]``."""
    d = (x * x).sum(dim=1, keepdim=True) - 2 * x @ points.T + point_norms
    return d.clamp(min=0)


def fit_class_moments(detector: Detector, data: FitData) -> ClassMoments:
    """Stream the fit data into per-class means and the within-class scatter; every class in
    ``0..max label`` must occur."""
    # The classes are those of the labels, 0..max label: a 2-class image folder under a 1000-class
    # ImageNet head has 2 class means, not 998 empty ones.
    moments = ClassMoments()
    for batch in data:
        moments.update(batch.features, batch.labels)
    check_all_classes_seen(detector.name, moments.empty_classes())
    return moments.release()


class Mahalanobis(Detector):
    name = "mahalanobis"
    summary = "Squared Mahalanobis distance to the closest class mean (shared covariance)."
    paper = "https://arxiv.org/abs/1807.03888"
    teaching = Teaching(
        formula=r"s(x) = \min_k (x - \mu_k)^\top \Sigma^{-1} (x - \mu_k)",
        citation="Lee et al., *A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial Attacks*, NeurIPS 2018",
        reads="the features and labels of the fit split (class means, shared covariance)",
        fails_when="Near-OOD images share the dominant directions of the ID features; the shared-Gaussian assumption misses them.",
    )
    inputs = ("features",)
    needs_labels = True
    #: ``D x D`` float64 matrices alive at the fit's peak: the scatter, the eigendecomposition's copy and vectors
    square_copies = 3

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """``8 x (square_copies x D^2 + 2 x C x D)``: the covariance and its inverse square root (float64),
        the class sums and means."""
        return 8 * (cls.square_copies * n_features**2 + 2 * n_classes * n_features)

    def _fit(self, data: FitData) -> None:
        self._fit_gaussians(fit_class_moments(self, data))

    def _fit_gaussians(self, moments: ClassMoments) -> None:
        self.class_counts_ = moments.counts.long()
        self.class_means_ = moments.means  # [C, D] float64
        self.covariance_ = moments.within.div_(moments.total)  # [D, D] float64, in place: no copy
        self._set_whitening(moments.grand_mean)

    def _set_whitening(self, center: Tensor) -> None:
        self.center_ = center.float()
        self.whitening_ = inverse_sqrt(self.covariance_).float()  # [D, k]
        # (mu_c - mu) S, the difference in float64 (no cancellation), a block of classes at a time
        whitened_means = torch.empty(len(self.class_means_), self.whitening_.shape[1], device=center.device)
        for block in row_blocks(len(self.class_means_), self.whitening_.shape[1]):
            torch.mm((self.class_means_[block] - center).float(), self.whitening_, out=whitened_means[block])
        self.whitened_means_ = whitened_means  # [C, k]
        self.whitened_norms_ = whitened_means.pow(2).sum(dim=1)  # [C]

    def _whiten(self, features: Tensor) -> Tensor:
        return (features.float() - self.center_) @ self.whitening_

    def class_distances(self, features: Tensor) -> Tensor:
        """Squared Mahalanobis distance of each sample to each class mean, ``[B, C]``."""
        return squared_distances(self._whiten(features), self.whitened_means_, self.whitened_norms_)

    def min_distance(self, features: Tensor) -> Tensor:
        """``min_k`` squared Mahalanobis distance, ``[B]``.

        The expanded form of :meth:`class_distances` picks the closest class; its distance is then
        recomputed as ``|x' - mu_k'|^2`` directly, which does not cancel when ``x'`` lies far from
        the grand mean but close to its class (float32 would lose digits there).
        """
        x = self._whiten(features)
        nearest = squared_distances(x, self.whitened_means_, self.whitened_norms_).argmin(dim=1)
        return (x - self.whitened_means_[nearest]).pow(2).sum(dim=1)

    def _score(self, batch: Batch) -> Tensor:
        return self.min_distance(batch.features)
