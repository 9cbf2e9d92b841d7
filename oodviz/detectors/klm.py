"""KL matching.

Hendrycks et al., *Scaling Out-of-Distribution Detection for Real-World Settings*, ICML 2022,
https://arxiv.org/abs/1911.11132

Fit: for each class ``k`` a template posterior ``d_k`` ``[C]``, the mean softmax of the
in-distribution samples the model *predicts* as ``k`` (labels are not needed):

    d_k = mean_{x: argmax p(x) = k} p(x),     p = softmax(z)

Score, with ``z`` the logits ``[B, C]``:

    score(x) = min_k KL(p(x) || d_k) = min_k sum_j p_j (log p_j - log d_kj)

computed for all ``k`` at once as ``sum_j p_j log p_j - p @ log(d)^T``. Higher = more OOD.
The minimum runs over the classes predicted at least once in the fit data (as in the paper and
pytorch-ood); classes never predicted are listed in ``unmatched_classes_`` and reported by a
warning. Fit keeps per-class sums ``[C, C]`` in float64, whatever the number of samples; they merge
exactly across shards (the state protocol, :mod:`oodviz.detectors.protocol`).

OpenOOD v1.5's ``klm`` postprocessor computes this score (negated), with no parameter: ``openood_params`` is
empty. Its templates come from the ID validation split (``id_loader_dict['val']``), oodviz's from the fit data it
is given (``id_fit``); a class never predicted gets a one-hot template there, whose KL divergence is infinite
for any softmax with another non-zero entry, so it is left out of the minimum in effect, as here.
"""

import warnings

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector
from oodviz.detectors.protocol import FitState
from oodviz.detectors.stats import ClassMeans, row_blocks
from oodviz.detectors.teaching import Teaching


class KLMatching(Detector):
    name = "klm"
    fitted_shapes = {**Detector.fitted_shapes, "templates_": "KC", "template_classes_": "K"}
    summary = "KL divergence of the softmax to the mean softmax of its predicted class."
    paper = "https://arxiv.org/abs/1911.11132"
    teaching = Teaching(
        formula=r"s(x) = \min_k \mathrm{KL}\big(p(x) \,\|\, d_k\big),\quad d_k = \mathbb{E}[p \mid \hat y = k]",
        citation="Hendrycks et al., *Scaling Out-of-Distribution Detection for Real-World Settings*, ICML 2022",
        reads="the logits of the fit split (one mean posterior per predicted class)",
        fails_when="Classes the model never predicts on the fit data have no template, and their OOD look-alikes slip through.",
    )
    inputs = ("logits",)

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """``8 x 2 x C^2``: the per-class sums of the softmax and their means (float64)."""
        return 8 * 2 * n_classes**2

    mergeable = True

    def _new_parts(self, pass_index: int) -> dict:
        return {"posteriors": ClassMeans()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        sums = state.parts["posteriors"]
        sums.n_classes = batch.logits.shape[1]
        for block in row_blocks(len(batch.logits), batch.logits.shape[1]):
            p = batch.logits[block].float().softmax(dim=1)
            sums.update(p, p.argmax(dim=1))

    def _finish_pass(self, state: FitState) -> bool:
        sums = state.parts["posteriors"]
        matched = sums.counts > 0
        self.unmatched_classes_ = torch.nonzero(~matched).flatten().tolist()
        if self.unmatched_classes_:
            warnings.warn(
                f"klm: the model predicts none of the fit samples as class(es) {self.unmatched_classes_[:10]}"
                f"{' ...' if len(self.unmatched_classes_) > 10 else ''}; they get no template. "
                "More in-distribution data gives every class one.",
                stacklevel=3,
            )
        self.templates_ = sums.means[matched].float()  # [K, C], K = classes predicted at least once
        self.template_classes_ = torch.nonzero(matched).flatten()
        return True

    def _score(self, batch: Batch) -> Tensor:
        z = batch.logits.float()
        log_p = z.log_softmax(dim=1)
        p = log_p.exp()
        # A template entry of exactly 0 gives KL = +inf for any p_j > 0; keep it finite and huge.
        log_d = self.templates_.log().clamp(min=torch.finfo(torch.float32).min)
        kl = (p * log_p).sum(dim=1, keepdim=True) - p @ log_d.T
        return kl.amin(dim=1)
