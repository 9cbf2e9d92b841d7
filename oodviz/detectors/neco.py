"""NECO: neural-collapse based OOD detection.

Ammar, Belkhir, Popescu, Manzanera & Franchi, *NECO: NEural Collapse Based Out-of-distribution detection*,
ICLR 2024, https://arxiv.org/abs/2310.06823 (code: https://github.com/mamadouba/neco)

Under neural collapse the in-distribution features lie in the span of the few principal directions of the ID
features, and OOD features stray from it. Fit, one streaming pass over the in-distribution features ``x``
``[N, D]``: the mean ``mu`` ``[D]``, the standard deviations ``sigma`` ``[D]`` (population, as scikit-learn's
``StandardScaler``; a constant feature gets ``sigma = 1``) and the covariance of the standardised features
``z = (x - mu) / sigma``, i.e. the correlation matrix ``[D, D]`` (float64); ``P`` ``[D, dim]`` holds its ``dim``
leading eigenvectors (the principal components). Score (higher = more OOD):

    score(x) = - |z P| / |z|                          (max_logit=False: the paper's score for CNNs)
    score(x) = - |z P| / |z| * max_k f_k(x)           (max_logit=True: for ViT-like models, as the paper uses)

``|z P| / |z|`` ``[B]`` is the fraction of the standardised feature's norm in the principal subspace, the paper's
NECO (eq. 6), a confidence in [0, 1]; its negative is the OOD score. A feature equal to the mean (``z = 0``) is given
the ratio 1 (the norm is then 0 / 0: it lies in every subspace). With ``max_logit=True`` the logits ``f`` are the
batch's own when it carries them, else ``x W^T + b`` from the head given to ``fit``. The paper tunes ``dim`` on
held-out data and gives no rule; ``dim=None`` takes ViM's (:func:`~oodviz.detectors.vim.default_dim`: 1000 for
``D >= 2048``, 512 for ``D >= 768``, otherwise ``D // 2``).

Differences from the authors' code, on purpose: it projects with scikit-learn's ``PCA.transform``, which subtracts
the mean of the standardised training features first, zero up to rounding (here exactly zero); for DeiT and Swin
it divides by the norm of the raw, not the standardised, feature (here always the standardised one, as eq. 6).

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`): the mean and the scatter are streamed
about a shift and merged exactly (:class:`~oodviz.detectors.stats.Moments`).
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.protocol import FitState
from oodviz.detectors.stats import Moments, symmetric_eigh
from oodviz.detectors.teaching import Teaching
from oodviz.detectors.vim import batch_logits, default_dim, principal_dim


class NECO(Detector):
    name = "neco"
    fitted_shapes = {**Detector.fitted_shapes, "components_": "Dk", "mean_": "D", "deviations_": "D"}
    summary = "Share of the standardised feature's norm in the ID principal subspace (neural collapse), negated."
    paper = "https://arxiv.org/abs/2310.06823"
    default_grid = {"dim": (10, 50, 100, 200, 500, 1000)}
    teaching = Teaching(
        formula=r"s(x) = -\frac{\| z P \|}{\| z \|} \,\left[\max_k f_k(x)\right],\quad z = (x - \mu) / \sigma",
        citation="Ammar et al., *NECO: NEural Collapse Based Out-of-distribution detection*, ICLR 2024",
        reads="the features of the fit split (mean, deviations, principal components); the logits or head with max_logit",
        fails_when="Needs collapsed ID features: on a weakly trained model the ID features fill many directions too.",
    )
    inputs = ("features",)
    optional_inputs = ("logits",)
    mergeable = True
    in_defaults = False  # issue 29: not in the default run

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """``8 x (D^2 + 1.5 x D x d)``: the scatter (float64), decomposed in place, and the leading eigenvectors
        ``[D, d]`` in float64 and float32 (``d`` the default, :func:`~oodviz.detectors.vim.default_dim`)."""
        return int(8 * (n_features**2 + 1.5 * n_features * default_dim(n_features)))

    def __init__(self, dim: int | None = None, max_logit: bool = False):
        if dim is not None and (int(dim) != dim or dim < 1):
            raise ValueError(f"neco: dim (principal subspace dimension) must be a positive integer or None, got {dim}")
        if not isinstance(max_logit, bool):
            raise ValueError(f"neco: max_logit must be True or False, got {max_logit!r}")
        self.dim = None if dim is None else int(dim)
        self.max_logit = max_logit

    def _subspace_dim(self, n_features: int) -> int:
        return principal_dim(self.name, self.dim, n_features, " (at D every ratio is 1)")

    def _new_parts(self, pass_index: int) -> dict:
        return {"moments": Moments()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        if self.max_logit and state.head is None:
            raise ValueError(
                "neco with max_logit=True multiplies by the maximum logit: pass the classifier's final linear layer, "
                "fit(batches, head=(weight [C, D], bias [C]))."
            )
        self._subspace_dim(batch.features.shape[1])  # a dim of D or more is refused before the pass
        state.parts["moments"].update(batch.features)

    def _finish_pass(self, state: FitState) -> bool:
        moments = state.parts["moments"].release()
        covariance = moments.scatter.div_(moments.total)
        deviations = covariance.diagonal().sqrt()
        deviations[deviations == 0] = 1.0  # a constant feature: StandardScaler's scale of 1
        correlation = covariance.div_(deviations[:, None]).div_(deviations[None, :])
        # the dim largest eigenpairs are the dim smallest of the negated matrix (only those are computed)
        _, eigenvectors = symmetric_eigh(
            correlation.neg_(), overwrite=True, smallest=self._subspace_dim(len(deviations))
        )
        self.components_ = eigenvectors.float()  # [D, dim]
        self.mean_, self.deviations_ = moments.mean.clone(), deviations  # float64: see _score
        if self.max_logit:
            self.head_weight_, self.head_bias_ = state.head
        state.parts.clear()
        return True

    def _score(self, batch: Batch) -> Tensor:
        # standardised in float64: x - mu cancels when the features sit far from the origin (a large offset)
        z = ((batch.features.to(self.mean_.dtype) - self.mean_) / self.deviations_).float()
        full = torch.linalg.vector_norm(z, dim=1)
        principal = torch.linalg.vector_norm(z @ self.components_, dim=1)
        ratio = torch.where(full > 0, principal / full, 1.0)
        if self.max_logit:
            ratio = ratio * batch_logits(batch, self.head_weight_, self.head_bias_).amax(dim=1)
        return -ratio
