"""Simplified Hopfield energy (SHE).

Zhang et al., *Out-of-Distribution Detection based on In-Distribution Data Patterns
Memorization with Modern Hopfield Energy*, ICLR 2023, https://openreview.net/forum?id=KkazG4lgKL

Fit: for each class ``k`` a stored pattern ``m_k`` ``[D]``, the mean feature of the
in-distribution samples of class ``k`` that the model classifies correctly.

Score, with features ``x`` ``[B, D]`` and the model's prediction ``k_hat = argmax z(x)``:

    score(x) = -<x, m_{k_hat}>

The paper's energy ``<x, m_k_hat>`` is high for in-distribution inputs, so it is negated:
higher = more OOD. Predictions come from the batch's logits when present, otherwise from
the head ``(W, b)`` given to ``fit``, as ``argmax(x W^T + b)``. Fit keeps per-class sums
``[C, D]`` (float64), which merge exactly across shards (:mod:`oodviz.detectors.protocol`).

OpenOOD v1.5's ``she`` postprocessor computes this score (negated) with ``metric: inner_product``, the paper's,
from the correctly classified samples of the training split: ``openood_params`` is empty.
"""

from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, check_all_classes_seen
from oodviz.detectors.protocol import FitState
from oodviz.detectors.stats import ClassMeans
from oodviz.detectors.teaching import Teaching


class SHE(Detector):
    name = "she"
    fitted_shapes = {**Detector.fitted_shapes, "patterns_": "CD"}
    summary = "Inner product of the features with the mean correct feature of the predicted class."
    paper = "https://openreview.net/forum?id=KkazG4lgKL"
    teaching = Teaching(
        formula=r"s(x) = -\langle x, m_{\hat y(x)} \rangle",
        citation="Zhang et al., *Out-of-Distribution Detection based on In-Distribution Data Patterns Memorization with Modern Hopfield Energy*, ICLR 2023",
        reads="the features, logits and labels of the fit split (mean feature of the correct samples per class)",
        fails_when="An inner product grows with the feature norm, so OOD inputs with large activations look familiar.",
    )
    inputs = ("features",)
    optional_inputs = ("logits",)  # the model's predictions, when the batches carry them
    needs_labels = True

    def _predictions(self, batch: Batch) -> Tensor:
        if batch.logits is not None:
            return batch.logits.argmax(dim=1)
        if self.head_weight_ is None:
            raise ValueError(
                "she needs the model's predictions: give the batches logits, or call fit(batches, head=(W, b))."
            )
        return (batch.features.float() @ self.head_weight_.T + self.head_bias_).argmax(dim=1)

    mergeable = True

    def _new_parts(self, pass_index: int) -> dict:
        return {"patterns": ClassMeans()}

    def _update_state(self, state: FitState, batch: Batch) -> None:
        self.head_weight_, self.head_bias_ = state.head or (None, None)  # on the fit device
        sums = state.parts["patterns"]
        sums.n_classes = state.n_classes
        sums.update(batch.features, batch.labels, mask=self._predictions(batch) == batch.labels)

    def _finish_pass(self, state: FitState) -> bool:
        sums = state.parts["patterns"]
        if sums.counts is None:
            raise ValueError("she cannot fit: no in-distribution sample is classified correctly; check the labels.")
        check_all_classes_seen(self.name, sums.empty_classes(state.n_classes), "correctly classified samples")
        self.patterns_ = sums.means.float()  # [C, D]
        self.head_weight_, self.head_bias_ = state.head or (None, None)
        return True

    def _score(self, batch: Batch) -> Tensor:
        predicted = self._predictions(batch)
        if int(predicted.max()) >= len(self.patterns_):
            raise ValueError(
                f"she: the model predicts class {int(predicted.max())} but was fitted on {len(self.patterns_)} classes."
            )
        return -(batch.features.float() * self.patterns_[predicted]).sum(dim=1)
