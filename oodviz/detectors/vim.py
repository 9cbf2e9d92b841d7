"""Virtual-logit matching (ViM).

Wang et al., *ViM: Out-Of-Distribution with Virtual-logit Matching*, CVPR 2022,
https://arxiv.org/abs/2203.10807

With the head ``(W [C, D], b [C])``, features are moved to the origin ``u = -W^+ b`` (where every
logit is zero). Fit, two streaming passes over the in-distribution features ``x``:

1. the uncentred second moment ``S = 1/N sum_i (x_i - u)(x_i - u)^T`` ``[D, D]`` (float64);
   ``R`` ``[D, D - dim]`` spans the eigenvectors of ``S`` outside the ``dim`` largest (the
   residual space);
2. ``alpha = mean_i max_k z_ik / mean_i |(x_i - u) R|``, matching the virtual logit's scale to the
   real logits' (``z = x W^T + b``).

Score (higher = more OOD):

    score(x) = alpha |(x - u) R| - logsumexp_k z_k(x)

i.e. the virtual logit minus the energy of the real logits, the negated confidence of the
paper. The logits ``z`` are the batch's own when it carries them (the model's output, as the
paper uses), else ``x W^T + b`` from the head. The origin is computed from the
``min(C, D)``-square Gram matrix of ``W`` (equal to ``pinv`` for a full-rank head), and every
float64 copy of a batch is made a block of rows at a time.
``dim=None`` applies the paper's rule: 1000 for ``D >= 2048``, 512 for ``D >= 768``,
otherwise ``D // 2``. Labels are not needed.

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`): pass 1's ``S`` and pass 2's two
sums are float64 sums that merge by addition; pass 2 runs after pass 1's merged state is finalized (every
shard then projects on the same ``R``).

OpenOOD v1.5's ``vim`` postprocessor computes this score (its confidence is the negation), fitted on the ID
training split, with ``dim = 256`` whatever ``D`` (``configs/postprocessors/vim.yml``; its automatic search tries
256 and 1000 on the validation sets): ``openood_params = {"dim": 256}`` (``protocol = "openood"``). For
OpenOOD's CIFAR ResNet-18 (``D = 512``) that is the paper's rule too; for a ResNet-50 (``D = 2048``) the paper's
rule takes 1000. For ``D <= 256`` it leaves no residual space: OpenOOD's scores are then NaN (``alpha`` divides
by a zero mean norm), oodviz's fit refuses the ``dim`` with a ValueError.
"""

from typing import ClassVar

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.protocol import FitState, Sums
from oodviz.detectors.stats import ACCUMULATE, Scratch, add_gram, row_blocks, symmetric_eigh, torch_on_one_thread
from oodviz.detectors.teaching import Teaching


def linear_origin(weight: Tensor, bias: Tensor) -> Tensor:
    """``u = -W^+ b`` ``[D]`` (float64): the minimum-norm point where every logit ``W u + b`` is 0
    (or closest to it, when ``C > D``). Solved through the ``min(C, D)``-square Gram matrix, which
    needs far less memory than the SVD behind ``pinv``; ``pinv`` only when ``W`` is rank-deficient."""
    w, b = weight.to(ACCUMULATE), bias.to(ACCUMULATE)
    try:
        if w.shape[0] <= w.shape[1]:
            return -(w.T @ torch.linalg.solve(w @ w.T, b))
        return -torch.linalg.solve(w.T @ w, w.T @ b)
    except torch.linalg.LinAlgError:
        return -(torch.linalg.pinv(w) @ b)


def default_dim(n_features: int) -> int:
    """The principal-space dimension the ViM paper uses for feature dimension ``D``."""
    if n_features >= 2048:
        return 1000
    if n_features >= 768:
        return 512
    return n_features // 2


def principal_dim(detector: str, dim: int | None, n_features: int, why: str = "") -> int:
    """The principal-subspace dimension ``detector`` uses for ``n_features`` = D features: ``dim``, or
    :func:`default_dim` for ``None``; a ValueError naming the fix unless ``0 < dim < D`` (``why``: what a dim of D
    would mean for that detector, said in the error)."""
    dim = default_dim(n_features) if dim is None else dim
    if not 0 < dim < n_features:
        raise ValueError(
            f"{detector}: dim={dim} must be between 1 and D-1 = {n_features - 1} for D={n_features} features{why}; "
            "choose a smaller principal subspace."
        )
    return dim


class ResidualSpaceDetector(Detector):
    """Base of ``vim`` and ``residual``: parameter ``dim``, the head's origin ``u`` and, from the uncentred second
    moment ``S`` about it, ``origin_`` ``[D]`` and the residual space ``residual_space_`` ``[D, D - dim]`` (in
    :attr:`residual_dtype`), the eigenvectors of ``S`` outside its ``dim`` largest."""

    inputs = ("features",)
    needs_head = True
    mergeable = True
    #: the dtype of ``origin_``, ``residual_space_`` and of the residual norms computed from them
    residual_dtype: ClassVar[torch.dtype] = torch.float32
    fitted_shapes = {**Detector.fitted_shapes, "residual_space_": "Dk", "origin_": "D"}

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """``8 x (D^2 + 1.5 x D x (D - d))``: the second moment (float64), decomposed in place, and the residual
        eigenvectors ``[D, D - d]`` in float64 and float32 (``d`` the default, :func:`default_dim`)."""
        return int(8 * (n_features**2 + 1.5 * n_features * (n_features - default_dim(n_features))))

    def __init__(self, dim: int | None = None):
        if dim is not None and (int(dim) != dim or dim < 1):
            raise ValueError(
                f"{self.name}: dim (principal subspace dimension) must be a positive integer or None, got {dim}"
            )
        self.dim = None if dim is None else int(dim)

    def _origin(self, state: FitState) -> Tensor:
        """``u`` (float64) of ``state.head``, solved once per head."""
        weight = state.head[0]
        if getattr(self, "_head_origin", (None,))[0] is not weight:
            self._head_origin = (weight, linear_origin(*state.head))
        return self._head_origin[1]

    def _subspace_dim(self, n_features: int) -> int:
        return principal_dim(self.name, self.dim, n_features)

    def _fit_residual_space(self, state: FitState, second_moment: Tensor) -> None:
        """``residual_space_`` from ``second_moment``, ``1/N sum_i (x_i - u)(x_i - u)^T`` ``[D, D]`` float64 (lower
        triangle read, destroyed), and ``origin_``; ``state``'s accumulators are dropped."""
        n_features = state.n_features
        # only the D - dim smallest eigenpairs: the residual space, without the D x D matrix of all eigenvectors
        smallest = n_features - self._subspace_dim(n_features)
        _, eigenvectors = symmetric_eigh(second_moment, overwrite=True, smallest=smallest)
        state.parts.clear()  # the second moment, destroyed by the decomposition
        self.residual_space_ = eigenvectors.to(self.residual_dtype)  # [D, D - dim]
        del eigenvectors
        self.origin_ = self._origin(state).to(self.residual_dtype)

    def _residual_norms(self, features: Tensor) -> Tensor:
        """``|(x - u) R|`` ``[B]`` of the features ``x`` ``[B, D]``, in :attr:`residual_dtype`."""
        x = features.to(self.residual_dtype)
        return ((x - self.origin_) @ self.residual_space_).norm(dim=1)


def batch_logits(batch: Batch, weight: Tensor, bias: Tensor, rows: slice = slice(None), scratch=None) -> Tensor:
    """The batch's own logits when it has them, else ``x W^T + b`` from the head ``(weight [C, D], bias [C])``
    (float32, into ``scratch``'s buffer if given)."""
    if batch.logits is not None:
        return batch.logits[rows].float()
    x = batch.features[rows].float()
    out = None if scratch is None else scratch.get("logits", (len(x), len(bias)), torch.float32, x.device)
    return torch.addmm(bias, x, weight.T, out=out)


class ViM(ResidualSpaceDetector):
    name = "vim"
    summary = "Norm of the feature residual outside the principal subspace, as a virtual logit against the energy."
    paper = "https://arxiv.org/abs/2203.10807"
    teaching = Teaching(
        formula=r"s(x) = \alpha \,\| (x - u) R \| - \log \sum_k e^{z_k(x)}",
        citation="Wang et al., *ViM: Out-Of-Distribution with Virtual-logit Matching*, CVPR 2022",
        reads="the features of the fit split and the classifier's head (principal subspace, residual)",
        fails_when="Needs a feature width D well above the classes; with small D the residual space is too thin to see OOD.",
    )
    optional_inputs = ("logits",)
    fit_passes = 2
    openood_params = {"dim": 256}

    def _new_parts(self, pass_index: int) -> dict:
        """Pass 0: the uncentred second moment (lower triangle); pass 1: [sum of max logits, sum of residual norms]."""
        return {"second_moment": Sums()} if pass_index == 0 else {"scale_sums": Sums()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        if getattr(self, "_scratch", None) is None:
            self._scratch = Scratch()
        if state.pass_index == 0:
            self._add_second_moment(state.parts["second_moment"], batch, self._origin(state))
        else:
            self._add_scale_sums(state.parts["scale_sums"], batch)

    def _add_second_moment(self, second_moment: Sums, batch: Batch, origin: Tensor) -> None:
        n_features = batch.features.shape[1]
        self._subspace_dim(n_features)
        if second_moment.value is None:
            second_moment.value = torch.zeros(n_features, n_features, dtype=ACCUMULATE, device=batch.device)
        with torch_on_one_thread(batch.device):
            for block in row_blocks(len(batch.features), n_features):
                x = batch.features[block]
                centred = self._scratch.get("centred", tuple(x.shape), ACCUMULATE, x.device).copy_(x)
                centred -= origin
                add_gram(second_moment.value, centred)  # the lower triangle is what symmetric_eigh reads

    def _add_scale_sums(self, scale_sums: Sums, batch: Batch) -> None:
        # [sum of max logits, sum of residual norms]: each block's float32 sums are added in float64 on the
        # device, as a Python float would add them, and read once after the pass (no host sync per block)
        if scale_sums.value is None:
            scale_sums.value = torch.zeros(2, dtype=ACCUMULATE, device=batch.device)
        n_features, residual = batch.features.shape[1], self.residual_space_
        scratch = self._scratch
        for block in row_blocks(len(batch.features), max(n_features, len(self.head_bias_))):
            x = batch.features[block].float()
            centred = torch.sub(x, self.origin_, out=scratch.get("centred32", tuple(x.shape), torch.float32, x.device))
            projected = torch.mm(
                centred, residual, out=scratch.get("residual", (len(x), residual.shape[1]), torch.float32, x.device)
            )
            scale_sums.value[1] += torch.linalg.vector_norm(projected, dim=1).sum()
            logits = batch_logits(batch, self.head_weight_, self.head_bias_, block, scratch)
            scale_sums.value[0] += logits.amax(dim=1).sum()

    def _finish_pass(self, state: FitState) -> bool:
        self._scratch = None  # each pass has buffers of its own
        if state.pass_index == 0:
            self._fit_residual_space(state, state.parts["second_moment"].value.div_(state.rows))
            self.head_weight_, self.head_bias_ = state.head
            return False
        max_logit_sum, norm_sum = state.parts["scale_sums"].value.tolist()
        if norm_sum == 0:
            raise ValueError(
                f"vim: the features have no component outside the top {self._subspace_dim(state.n_features)} "
                "principal directions; choose a smaller dim."
            )
        self.alpha_ = (max_logit_sum / state.rows) / (norm_sum / state.rows)
        self._head_origin = None
        return True

    def _score(self, batch: Batch) -> Tensor:
        virtual_logit = self.alpha_ * self._residual_norms(batch.features)
        return virtual_logit - torch.logsumexp(batch_logits(batch, self.head_weight_, self.head_bias_), dim=1)
