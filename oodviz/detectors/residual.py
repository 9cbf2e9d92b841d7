"""Residual: the norm of the feature outside the principal subspace (the ViM paper's baseline).

Wang et al., *ViM: Out-Of-Distribution with Virtual-logit Matching*, CVPR 2022 (its "Residual" baseline),
https://arxiv.org/abs/2203.10807

With the head ``(W [C, D], b [C])``, features ``x`` ``[B, D]`` are moved to the origin ``u = -W^+ b`` ``[D]`` (where
every logit is zero), as ViM does. Fit, one streaming pass over the in-distribution features: the uncentred second
moment ``S = 1/N sum_i (x_i - u)(x_i - u)^T`` ``[D, D]`` (float64); ``R`` ``[D, D - dim]`` spans the eigenvectors of
``S`` outside the ``dim`` largest (the residual space). Score (higher = more OOD):

    score(x) = |(x - u) R|                                                                  [B]

the norm of the feature's projection onto the principal subspace's complement. The paper's (and OpenOOD's
``residual`` postprocessor's) confidence is its negative. ``dim=None`` applies the ViM paper's rule (1000 for
``D >= 2048``, 512 for ``D >= 768``, otherwise ``D // 2``); labels and logits are not needed. It is ViM's virtual
logit without the energy and without ``alpha`` (a constant factor, which changes no ranking), and shares ViM's origin,
``dim`` rule and residual space (:class:`~oodviz.detectors.vim.ResidualSpaceDetector`).

The residual is a small remainder of a large vector: with features far from ``u`` (an offset of 1e3, say), float32
rounding of ``R`` and of ``x - u`` leaks ~1e-7 of the principal part into it, about 1e-4 of the score, and two fits
that differ only in rounding then rank some samples differently. So ``u``, ``R`` and the score are float64 (ViM
keeps float32: there the energy dominates the score); scoring costs a float64 ``[B, D] x [D, D - dim]`` product.
For the same reason ``S`` is not summed about ``u`` as ViM's pass does, but streamed as the mean ``mu`` and the
scatter about it (shifted sums, :class:`~oodviz.detectors.stats.Moments`) and formed once at the end as
``S = scatter / N + (mu - u)(mu - u)^T``: sums of squares of ``x - u`` (~1e6 at that offset) round differently
when the rows come in another order or from other shards, enough to move ``R`` by ~1e-9; the scatter does not.

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`): the mean and the scatter merge exactly
(Chan's shifted sums).

OpenOOD v1.5's ``residual`` postprocessor computes this score (negated) with ``dim = 512`` whatever ``D``
(``configs/postprocessors/residual.yml``, no automatic search): ``openood_params = {"dim": 512}``
(``protocol = "openood"``); the paper's rule gives 1000 for a ResNet-50 (``D = 2048``). For ``D <= 512``
(OpenOOD's CIFAR ResNet-18 has ``D = 512``) that leaves no residual space: every OpenOOD score is 0 (an AUROC of
50%), and oodviz's fit refuses the ``dim`` with a ValueError. OpenOOD fits it on the ID validation split
(``id_loader_dict['val']``), oodviz on the fit data it is given (``id_fit``).
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.protocol import FitState
from oodviz.detectors.stats import Moments
from oodviz.detectors.teaching import Teaching
from oodviz.detectors.vim import ResidualSpaceDetector


class Residual(ResidualSpaceDetector):
    name = "residual"
    summary = "Norm of the feature outside the principal subspace of the ID features (ViM's residual, alone)."
    paper = "https://arxiv.org/abs/2203.10807"
    teaching = Teaching(
        formula=r"s(x) = \| (x - u) R \|,\quad u = -W^{+} b",
        citation="Wang et al., *ViM: Out-Of-Distribution with Virtual-logit Matching*, CVPR 2022",
        reads="the features of the fit split and the classifier's head (its origin u; principal subspace, residual)",
        fails_when="Blind to OOD inputs that stay inside the ID principal subspace, and needs D well above dim.",
    )
    in_defaults = False  # issue 29: not in the default run
    openood_params = {"dim": 512}
    residual_dtype = torch.float64

    def _new_parts(self, pass_index: int) -> dict:
        return {"moments": Moments()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        self._subspace_dim(batch.features.shape[1])  # a dim that leaves no residual is refused before the pass
        state.parts["moments"].update(batch.features)

    def _finish_pass(self, state: FitState) -> bool:
        moments = state.parts["moments"].release()
        offset = moments.mean - self._origin(state)  # mu - u
        second_moment = moments.scatter.div_(moments.total).addr_(offset, offset)  # in place: S about u
        self._fit_residual_space(state, second_moment)
        self._head_origin = None
        return True

    def _score(self, batch: Batch) -> Tensor:
        return self._residual_norms(batch.features)
