"""Relative Mahalanobis distance (RMD).

Ren et al., *A Simple Fix to Mahalanobis Distance for Improving Near-OOD Detection*, 2021,
https://arxiv.org/abs/2106.09022

Fit: as :mod:`~oodviz.detectors.mahalanobis` (class means ``mu_k``, shared covariance
``Sigma``), plus a background Gaussian over all in-distribution features regardless of class:
``mu_0`` (grand mean) and ``Sigma_0 = 1/N sum_i (x_i - mu_0)(x_i - mu_0)^T``. ``Sigma_0`` needs no
second pass: the total scatter is the within-class scatter plus the between-class scatter
``sum_k n_k (mu_k - mu_0)(mu_k - mu_0)^T``.

Score, with ``MD_k(x) = (x - mu_k)^T Sigma^+ (x - mu_k)`` and ``MD_0(x) = (x - mu_0)^T Sigma_0^+ (x - mu_0)``:

    score(x) = min_k RMD_k(x) = min_k MD_k(x) - MD_0(x)

The paper's confidence is ``-min_k RMD_k``; higher score = more OOD. pytorch-ood 0.4 uses
unnormalised scatter matrices for both covariances, which scales the score by ``1/N`` (same
ranking); oodviz follows the paper.

``normalize=True`` is RMDS++ (OpenOOD v1.5; Mueller & Hein 2025, https://arxiv.org/abs/2505.18032):
the features are L2-normalised before the fit and the score, both Gaussians included (see
:mod:`~oodviz.detectors.mahalanobis`).

OpenOOD v1.5's ``rmds`` postprocessor computes the plain method (``normalize=False``) with no parameter, both
covariances from the training split: ``openood_params`` is empty.
"""

from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.mahalanobis import Mahalanobis, inverse_sqrt
from oodviz.detectors.stats import ClassMoments
from oodviz.detectors.teaching import Teaching
from oodviz.detectors.widefit import FewRows


class RelativeMahalanobis(Mahalanobis):
    name = "rmd"
    fitted_shapes = {**Mahalanobis.fitted_shapes, "background_whitening_": "DV"}
    summary = (
        "Mahalanobis distance minus the distance under one Gaussian over all classes; "
        "normalize=True: of the L2-normalised features (RMDS++)."
    )
    paper = "https://arxiv.org/abs/2106.09022"
    default_grid = {"normalize": (False, True)}
    teaching = Teaching(
        formula=r"s(x) = \min_k \mathrm{MD}_k(x) - \mathrm{MD}_0(x)",
        citation="Ren et al., *A Simple Fix to Mahalanobis Distance for Improving Near-OOD Detection*, 2021",
        reads="the features and labels of the fit split (class Gaussians and one background Gaussian)",
        fails_when="Subtracting the background distance can hide far-OOD inputs that are far from everything.",
    )
    #: the within-class and the total scatter, the factor (or eigenvectors) of one, and a float32 whitening
    square_copies = 3.5
    gram_whitenings = 2

    def _fit_gaussians(self, moments: ClassMoments | FewRows) -> None:
        # Before the class part, which turns the within-class scatter into Sigma in place.
        if isinstance(moments, FewRows):
            background = moments.inverse_sqrt_total()
        else:
            background = inverse_sqrt(moments.total_scatter().div_(moments.total), overwrite=True)
        self.background_whitening_ = background.float()  # [D, k0]
        del background
        super()._fit_gaussians(moments)

    def _score(self, batch: Batch) -> Tensor:
        background = ((self.prepared(batch.features) - self.center_) @ self.background_whitening_).pow(2).sum(dim=1)
        return self.min_distance(batch.features) - background
