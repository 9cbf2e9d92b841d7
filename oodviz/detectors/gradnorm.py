"""GradNorm: the size of the last layer's gradient of the KL divergence to the uniform distribution.

Huang, Geng & Li, *On the Importance of Gradients for Detecting Distributional Shifts in the Wild*,
NeurIPS 2021, https://arxiv.org/abs/2110.00218

For one sample with penultimate features ``x`` ``[D]`` and logits ``z = W x + b`` ``[C]`` (the head
``W`` ``[C, D]``, ``b`` ``[C]``), the paper back-propagates the KL divergence between the uniform
distribution ``u = 1/C`` and the softmax at temperature ``T``, which is the cross-entropy to ``u``
up to the constant ``log C``:

    L(x) = -1/C sum_k log softmax_k(z / T)

and scores with the L1 norm of its gradient with respect to the last layer's weights ``W``. That
gradient is an outer product, ``dL/dW = g x^T`` with ``g = dL/dz = (softmax(z / T) - 1/C) / T``
``[C]``, so its L1 norm factorises, and oodviz computes it in closed form for the whole batch at
once, with no backward pass and no per-sample loop:

    ||dL/dW||_1 = ||g||_1 * ||x||_1 = (1/T) sum_k |softmax_k(z / T) - 1/C| * sum_d |x_d|

    score(x) = -||dL/dW||_1

In-distribution inputs get peaked predictions and large gradients; the paper's score is the norm
itself, its negation is the OOD score (higher = more OOD), as in pytorch-ood 0.4. The paper's code
sums the cross-entropy over the classes instead of averaging (scores ``C`` times larger, same
ranking) and, like oodviz, takes the gradient of the weight only, not of the bias;
pytorch-ood's ``GradNorm(model, param_filter=lambda n: n == "fc.weight")`` computes the same
number with per-sample autograd.

Needs features, logits and the head (a feature detector: the model does not run again). The head
is required because the formula holds only for the features that are the head's input: ``fit``
checks on its first batch that ``features @ W^T + b`` reproduces the logits, then stops reading.
Shapes: ``features`` ``[B, D]``, ``logits`` ``[B, C]`` -> scores ``[B]``.

Its fit checks the head on the first batch: nothing to split over ranks (every rank does it).

OpenOOD v1.5's ``gradnorm`` postprocessor (``openood/postprocessors/gradnorm_postprocessor.py``; its configuration
has no arguments) computes the same norm per sample with autograd at temperature 1, with the paper code's loss: the
cross-entropy to an all-ones target summed over the classes, ``-sum_k log softmax_k(z)``, ``C`` times ``L``. Its
norm is therefore ``C`` times oodviz's at the default ``temperature = 1``: the same ranking, the same AUROC and
FPR@95, so ``openood_params = {}`` (``protocol = "openood"`` changes nothing).
"""

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.stats import row_blocks
from oodviz.detectors.teaching import Teaching

#: ``features @ W^T + b`` may differ from the logits by this fraction of ``1 + max |logit|`` (float16 stores, bf16 runs)
HEAD_TOLERANCE = 0.05


def gradient_norm(features: Tensor, logits: Tensor, temperature: float = 1.0) -> Tensor:
    """``||dL/dW||_1`` ``[B]`` for the KL to uniform at the last layer, in closed form (float32)."""
    n_classes = logits.shape[1]
    g = ((logits.float() / temperature).softmax(dim=1) - 1.0 / n_classes).abs().sum(dim=1) / temperature
    return g * features.float().abs().sum(dim=1)


class GradNorm(Detector):
    name = "gradnorm"
    summary = (
        "Negative L1 norm of the last layer's gradient of the KL to uniform, in closed form from features and logits."
    )
    paper = "https://arxiv.org/abs/2110.00218"
    teaching = Teaching(
        formula=r"s(x) = -\Big\| \frac{\partial L}{\partial W} \Big\|_1,\quad L = \mathrm{KL}\big(u \,\|\, \operatorname{softmax}(z/T)\big)",
        citation="Huang, Geng & Li, *On the Importance of Gradients for Detecting Distributional Shifts in the Wild*, NeurIPS 2021",
        reads="the features, logits and the head (gradient in closed form)",
        fails_when="Scales with the feature norm, so it fails when OOD inputs have larger activations than ID ones.",
    )
    inputs = ("features", "logits")
    needs_head = True

    def __init__(self, temperature: float = 1.0):
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"gradnorm: temperature must be > 0 (the paper uses 1), got {temperature!r}")
        self.temperature = float(temperature)

    def _fit(self, data: FitData) -> None:
        for batch in data:
            weight, bias = data.head
            error, scale = 0.0, 1.0
            for block in row_blocks(len(batch.features), max(weight.shape)):
                logits = batch.logits[block].float()
                predicted = torch.addmm(bias, batch.features[block].float(), weight.T)
                error = max(error, float(predicted.sub_(logits).abs_().max()))
                scale = max(scale, 1.0 + float(logits.abs().max()))
            if error > HEAD_TOLERANCE * scale:
                raise ValueError(
                    f"gradnorm: the head does not map the features to the logits (largest difference {error:.3g} for "
                    f"logits up to {scale - 1:.3g}); GradNorm's closed form needs the penultimate features, the input of "
                    "the final linear layer: extract with layer=None, or pass that layer as head."
                )
            self.head_error_ = error
            break

    def _score(self, batch: Batch) -> Tensor:
        return -gradient_norm(batch.features, batch.logits, self.temperature)
