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

``normalize=True`` is Mahalanobis++ (OpenOOD v1.5's MDS++; Mueller & Hein, *Mahalanobis++: Improving
OOD Detection via Feature Normalization*, 2025, https://arxiv.org/abs/2505.18032): every feature vector
is L2-normalised, ``x <- x / |x|``, before the fit and before the score; the formulas above then read
the normalised features. Feature norms vary a lot between samples of a pre-trained backbone, which
breaks the Gaussian assumption; on the unit sphere it holds much better (the paper's figures: most
gains on transformers).

OpenOOD v1.5's ``mds`` postprocessor computes the plain method (``normalize=False``) with no parameter: class means
and the tied covariance of the training split (sklearn's ``EmpiricalCovariance`` on the class-centred features,
its ``precision_`` a pseudo-inverse), confidence ``max_k -(x - mu_k)^T P (x - mu_k)``, the negated score:
``openood_params`` is empty.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, check_all_classes_seen
from oodviz.detectors.protocol import FitState
from oodviz.detectors.stats import BLOCK_BYTES, ClassMoments, inverse_cholesky_factor, row_blocks, symmetric_eigh
from oodviz.detectors.teaching import Teaching
from oodviz.detectors.widefit import ClassGaussianStream, FewRows


def inverse_sqrt(covariance: Tensor, overwrite: bool = False) -> Tensor:
    """``S`` ``[D, k]`` with ``S S^T = covariance^+`` (pseudo-inverse), from a float64 ``[D, D]`` matrix.

    The pseudo-inverse keeps the eigen-directions with eigenvalue above ``D * eps(float64) *
    lambda_max``. When ``trace(A) trace(A^-1) < 1 / (D * eps)`` (``A`` = ``covariance``) every
    eigenvalue is above that cutoff (``lambda_max / lambda_min`` is at most the product), so
    ``A^+ = A^-1`` and ``S = L^-T`` from the Cholesky factor ``A = L L^T`` (``k = D``, upper
    triangular): the usual case, without an eigendecomposition. Otherwise (rank-deficient or
    badly conditioned, e.g. dead ReLU units) ``S = V_k diag(lambda_k)^(-1/2)`` from the kept
    eigenpairs. ``overwrite=True`` may destroy ``covariance``; otherwise (``covariance`` then holds both
    triangles) the eigendecomposition runs in place and restores it. Beyond ``covariance`` and the result,
    either path holds at most one more ``D x D`` float64 matrix.
    """
    d, eps = covariance.shape[0], torch.finfo(covariance.dtype).eps
    inverse_factor = inverse_cholesky_factor(covariance)  # L^-1, or None
    if inverse_factor is not None:
        trace_inverse = float(torch.linalg.vector_norm(inverse_factor)) ** 2  # trace(A^-1) = |L^-1|_F^2
        if float(covariance.diagonal().sum()) * trace_inverse * d * eps < 1:
            return inverse_factor.T
        del inverse_factor
    eigenvalues, eigenvectors = symmetric_eigh(covariance, overwrite=overwrite, symmetric=not overwrite)
    cutoff = eigenvalues.amax().clamp(min=0) * d * eps
    first = int((eigenvalues <= cutoff).sum())  # ascending: the dropped eigenpairs come first
    return eigenvectors[:, first:].div_(eigenvalues[first:].sqrt())  # a view: no copy of the kept columns


def squared_distances(x: Tensor, points: Tensor, point_norms: Tensor) -> Tensor:
    """``|x_i - p_k|^2`` ``[B, K]`` from ``x`` ``[B, d]``, ``points`` ``[K, d]`` and ``|p_k|^2`` ``[K]``."""
    d = (x * x).sum(dim=1, keepdim=True) - 2 * x @ points.T + point_norms
    return d.clamp(min=0)


#: the fitted attributes :func:`tied_gaussian` gives (``covariance_`` only when the covariance was streamed)
GAUSSIAN_STATE = (
    "class_counts_",
    "class_means_",
    "covariance_",
    "center_",
    "whitening_",
    "whitened_means_",
    "whitened_norms_",
)


def tied_gaussian(moments: ClassMoments | FewRows) -> dict[str, Tensor]:
    """The fitted state of Gaussians with class means and one tied covariance, from a fit stream's statistics
    (:meth:`ClassGaussianStream.release <oodviz.detectors.widefit.ClassGaussianStream.release>`), by attribute name:

    - ``class_counts_`` ``[C]`` (int64) and ``class_means_`` ``[C, D]`` (float64);
    - ``covariance_`` ``[D, D]`` float64, ``Sigma = W / N`` (the within-class scatter divided in place: no copy),
      when it was streamed (``N > D / 2``); the Gram path (``N <= D / 2``) whitens from the ``N x N`` Gram matrix
      and never forms it (``Sigma = S (S^T S)^-2 S^T`` from the whitening ``S`` if one needs it);
    - ``center_`` ``[D]`` (the grand mean), ``whitening_`` ``S`` ``[D, k]`` with ``S S^T = Sigma^+``
      (:func:`inverse_sqrt`), ``whitened_means_`` ``(mu_c - center) S`` ``[C, k]`` and ``whitened_norms_`` ``[C]``
      (float32).

    What mahalanobis fits, and every detector that reads its Gaussians (mahalanobis_odin, mds_ensemble)."""
    state = {"class_counts_": moments.counts.long(), "class_means_": moments.means}  # [C], [C, D] float64
    center = moments.grand_mean
    if isinstance(moments, FewRows):
        whitening = moments.inverse_sqrt_within()
    else:
        state["covariance_"] = moments.within.div_(moments.total)  # [D, D] float64, in place: no copy
        whitening = inverse_sqrt(state["covariance_"]).float()  # the float64 result freed at once
    state["center_"] = center.float()
    state["whitening_"] = whitening = whitening.float()  # [D, k]
    means = state["class_means_"]
    # (mu_c - mu) S, the difference in float64 (no cancellation), a block of classes at a time
    whitened_means = torch.empty(len(means), whitening.shape[1], device=center.device)
    for block in row_blocks(len(means), whitening.shape[1]):
        torch.mm((means[block] - center).float(), whitening, out=whitened_means[block])
    state["whitened_means_"] = whitened_means  # [C, k]
    state["whitened_norms_"] = whitened_means.pow(2).sum(dim=1)  # [C]
    return state


def nearest_distance(whitened: Tensor, whitened_means: Tensor, whitened_norms: Tensor) -> Tensor:
    """``min_k |x' - mu_k'|^2`` ``[B]`` of whitened features ``x'`` ``[B, k]`` and whitened class means ``[C, k]``.

    The expanded form of :func:`squared_distances` picks the closest class; its distance is then recomputed as
    ``|x' - mu_k'|^2`` directly, which does not cancel when ``x'`` lies far from the grand mean but close to its
    class (float32 would lose digits there), and is differentiable in ``x'`` (the closest class held fixed)."""
    nearest = squared_distances(whitened, whitened_means, whitened_norms).argmin(dim=1)
    return (whitened - whitened_means[nearest]).pow(2).sum(dim=1)


def l2_normalised(features: Tensor) -> Tensor:
    """``x / |x|`` row by row, float32 ``[B, D]`` (an all-zero row stays zero)."""
    return F.normalize(features.float(), dim=1)


class Mahalanobis(Detector):
    name = "mahalanobis"
    fitted_shapes = {
        **Detector.fitted_shapes,
        "covariance_": "DD",
        "center_": "D",
        "whitening_": "DW",
        "whitened_means_": "CW",
        "whitened_norms_": "C",
    }
    summary = (
        "Squared Mahalanobis distance to the closest class mean (shared covariance); "
        "normalize=True: of the L2-normalised features (MDS++)."
    )
    paper = "https://arxiv.org/abs/1807.03888"
    default_grid = {"normalize": (False, True)}
    teaching = Teaching(
        formula=r"s(x) = \min_k (x - \mu_k)^\top \Sigma^{-1} (x - \mu_k)",
        citation="Lee et al., *A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial Attacks*, NeurIPS 2018",
        reads="the features and labels of the fit split (class means, shared covariance)",
        fails_when="Near-OOD images share the dominant directions of the ID features; the shared-Gaussian assumption misses them.",
    )
    inputs = ("features",)
    needs_labels = True
    #: ``D x D`` float64 matrices alive at the fit's peak: the covariance, the Cholesky factor (or the
    #: eigenvectors) and the float32 whitening (half of one)
    square_copies = 2.5

    def __init__(self, normalize: bool = False):
        if not isinstance(normalize, bool):
            raise ValueError(f"{self.name}: normalize must be True or False, got {normalize!r}")
        self.normalize = normalize

    #: whitenings ``[D, <= N]`` (float32) of the Gram path alive at once: rmd holds its first during the second
    gram_whitenings = 1
    #: measured peak over the Gram path's own count (``bench/wide_fit.py``: 50.7 MiB where the count gives 31 MiB at
    #: N = 1,000, D = 2,048: BLAS/LAPACK workspaces and the heap's slack), rounded up: the pre-flight's bound
    GRAM_SLACK = 2.0

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """Bytes of the fit's peak beyond the features, ``N`` rows of ``D`` features in ``C`` classes:

        - streamed (``N > D / 2``): ``8 x (square_copies x D^2 + 2 x C x D)``, the covariance and its inverse square
          root (float64), the class sums and means;
        - the Gram path (``N <= D / 2``, :mod:`oodviz.detectors.widefit`): the kept rows, ``G`` and ``U`` ``[N, N]``
          float64, then ``U`` and the whitening, and two 4 MiB blocks, ``4 N D + max(16 N^2, 8 N^2 + 4 N D) +
          4 N D (gram_whitenings - 1) + 8 MiB``, times :data:`GRAM_SLACK`, plus the class sums and means: at
          ``N = D / 2`` less than the streamed path's, and far less for few rows (50 rows of ``D = 151,296``:
          0.15 GiB, where the ``D x D`` covariance alone is 171 GiB)."""
        n, d, c = n_samples, n_features, n_classes
        classes = 8 * 2 * c * d
        if 0 < n <= d // 2:
            gram = 4 * n * d + max(16 * n * n, 8 * n * n + 4 * n * d) + 4 * n * d * (cls.gram_whitenings - 1)
            return int(cls.GRAM_SLACK * (gram + 2 * BLOCK_BYTES) + classes)
        return int(8 * cls.square_copies * d**2 + classes)

    mergeable = True

    def _new_parts(self, pass_index: int) -> dict:
        # The classes are those of the labels, 0..max label: a 2-class image folder under a 1000-class
        # ImageNet head has 2 class means, not 998 empty ones.
        return {"gaussians": ClassGaussianStream()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        features = l2_normalised(batch.features) if self.normalize else batch.features
        state.parts["gaussians"].update(features, batch.labels)

    def _finish_pass(self, state: FitState) -> bool:
        """Every class in ``0..max label`` must occur; up to ``D / 2`` samples the Gram path (:class:`FewRows`)."""
        moments = state.parts["gaussians"].release()
        check_all_classes_seen(self.name, moments.empty_classes())
        self._fit_gaussians(moments)
        return True

    def _fit_gaussians(self, moments: ClassMoments | FewRows) -> None:
        """Class means, and the whitening of the tied covariance (:func:`tied_gaussian`), set as fitted attributes."""
        for key, value in tied_gaussian(moments).items():
            setattr(self, key, value)

    def prepared(self, features: Tensor) -> Tensor:
        """The features the Gaussians describe: float32, L2-normalised with ``normalize``."""
        return l2_normalised(features) if self.normalize else features.float()

    def _whiten(self, features: Tensor) -> Tensor:
        return (self.prepared(features) - self.center_) @ self.whitening_

    def class_distances(self, features: Tensor) -> Tensor:
        """Squared Mahalanobis distance of each sample to each class mean, ``[B, C]``."""
        return squared_distances(self._whiten(features), self.whitened_means_, self.whitened_norms_)

    def min_distance(self, features: Tensor) -> Tensor:
        """``min_k`` squared Mahalanobis distance, ``[B]`` (:func:`nearest_distance`)."""
        return nearest_distance(self._whiten(features), self.whitened_means_, self.whitened_norms_)

    def _score(self, batch: Batch) -> Tensor:
        return self.min_distance(batch.features)
