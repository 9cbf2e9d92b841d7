"""CARef: class-aware relative feature error (the relative-error part of CADRef).

Ling et al., *CADRef: Robust Out-of-Distribution Detection via Class-Aware Decoupled Relative Feature Leveraging*,
CVPR 2025, https://arxiv.org/abs/2503.00325 (code: https://github.com/LingAndZero/CADRef)

Fit, one streaming pass over the in-distribution features ``x`` ``[N, D]``: the predicted class of each row,
``c(x) = argmax_k z_k(x)``, and per class the mean feature of the rows predicted as it,
``mu_c = mean_{i: c(x_i) = c} x_i`` ``[C, D]`` (float64). Score, with the predicted class ``c = c(x)``
(higher = more OOD):

    score(x) = |x - mu_c|_1 / |x|_1                                                       [B]

the L1 error of the feature relative to its predicted class's mean, relative to the feature's own L1 norm (the
paper's CARef, whose confidence is its negative). The logits ``z`` ``[B, C]`` are the batch's own when it carries
them (the model's output, as the authors' code uses), else ``x W^T + b`` from the head given to ``fit``. Labels are
not read: the rows are grouped by the model's prediction, not by their label, as in the authors' code (the paper
writes "class"; its code's class means are those of the predicted classes). Every class needs at least one fit row
predicted as it (fit raises otherwise, naming the classes: the authors' code leaves such a mean NaN). ``x - mu_c``
and the norms are float64 (features far from the origin would otherwise cancel); ``|x|_1`` is floored at 1e-8, as
fdbd's distance, so an all-zero feature scores large but finite (the authors divide by zero).

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`): the per-class counts and sums merge by
addition (:class:`~oodviz.detectors.stats.ClassMeans`).
"""

from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, check_all_classes_seen
from oodviz.detectors.fdbd import MIN_DISTANCE
from oodviz.detectors.protocol import FitState
from oodviz.detectors.stats import ACCUMULATE, ClassMeans
from oodviz.detectors.teaching import Teaching
from oodviz.detectors.vim import batch_logits


class CARef(Detector):
    name = "caref"
    summary = "L1 error of the feature from its predicted class's mean, relative to the feature's L1 norm."
    paper = "https://arxiv.org/abs/2503.00325"
    teaching = Teaching(
        formula=r"s(x) = \frac{\| x - \mu_{c} \|_1}{\| x \|_1},\quad c = \arg\max_k z_k(x)",
        citation=(
            "Ling et al., *CADRef: Robust Out-of-Distribution Detection via Class-Aware Decoupled Relative Feature "
            "Leveraging*, CVPR 2025"
        ),
        reads="the features of the fit split (mean feature per predicted class) and the logits or the head",
        fails_when="OOD inputs whose features sit near some class's mean (near-OOD) look as familiar as ID ones.",
    )
    inputs = ("features",)
    optional_inputs = ("logits",)  # the model's predictions, when the batches carry them
    needs_head = True
    mergeable = True
    in_defaults = False  # issue 29: not in the default run

    def _new_parts(self, pass_index: int) -> dict:
        return {"class_sums": ClassMeans()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        sums = state.parts["class_sums"]
        sums.n_classes = state.n_classes
        sums.update(batch.features, batch_logits(batch, *state.head).argmax(dim=1))

    def _finish_pass(self, state: FitState) -> bool:
        sums = state.parts["class_sums"]
        check_all_classes_seen(self.name, sums.empty_classes(state.n_classes), "fit samples predicted as them")
        self.class_means_ = sums.means  # [C, D] float64
        self.head_weight_, self.head_bias_ = state.head
        state.parts.clear()
        return True

    def relative_offsets(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """``(x - mu_c) / |x|_1`` ``[B, D]`` (float64), the predicted classes ``c`` ``[B]`` and the logits ``[B, C]``."""
        logits = batch_logits(batch, self.head_weight_, self.head_bias_)
        predicted = logits.argmax(dim=1)
        x = batch.features.to(ACCUMULATE)
        norms = x.abs().sum(dim=1, keepdim=True).clamp_(min=MIN_DISTANCE)
        return (x - self.class_means_[predicted]).div_(norms), predicted, logits

    def _score(self, batch: Batch) -> Tensor:
        offsets, _, _ = self.relative_offsets(batch)
        return offsets.abs().sum(dim=1)
