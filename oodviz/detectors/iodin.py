"""i-ODIN: ODIN whose input step moves one input element only, the one with the largest gradient magnitude.

Regmi, *Image-based Outlier Synthesis With Training Data* (CVPR 2026; first posted as *Going Beyond Conventional
OOD Detection*), https://arxiv.org/abs/2411.10794, which proposes it next to ASCOOD. The formula here is that of the
author's own postprocessor: OpenOOD v1.5's ``iodin`` (``openood/postprocessors/iodin_postprocessor.py``, contributed
by the author), the same file as in the paper's repository (``sudarshanregmi/ASCOOD``).

Runs the classifier again (a model-based detector, see :class:`~oodviz.detectors.base.ModelDetector`), as
:mod:`~oodviz.detectors.odin`, whose code it shares (a subclass: only the step differs). With model inputs ``x``
``[B, ...]`` (``Batch.inputs``, transformed as the model expects), logits ``f(x)`` ``[B, C]``, temperature ``T`` and
``S(x; T) = softmax(f(x) / T)``:

    y_hat = argmax_k f_k(x)
    g     = grad_x (-log S_y_hat(x; T))                  [B, ...]  (one backward pass)
    j     = argmax_i |g_i|                               over the input elements of each sample (every channel and
                                                         position, flattened; the first one on a tie)
    x'    = x - epsilon * sign(g_j) / std_c(j) * e_j     only element j moves (e_j: its unit vector, c(j): its channel)
    score(x) = -max_k S_k(x'; T)                         (a second forward)

Shapes: ``inputs`` ``[B, C_in, ...]`` -> ``g`` the same shape -> scores ``[B]``. ODIN moves every element by
``epsilon`` against the sign of its gradient (:meth:`~oodviz.detectors.odin.ODIN.perturb`); i-ODIN keeps
that step at the single element where the loss is steepest and leaves the rest of the input as it was. The
confidence ``max_k S_k(x'; T)`` is the author's; its negation is the OOD score (**higher = more OOD**), as odin's.
``epsilon = 0`` skips the backward pass and is temperature-scaled MSP (odin's too). As odin: the gradient is that of
the *sum* of the per-sample losses (a sample's step and score do not depend on the rest of its batch); only the input
gets a gradient (the model's parameters are frozen for the backward pass and put back, they collect no ``.grad``);
the model runs in eval mode; the gradient step runs with autocast off, in the model's own precision; ``norm_std``
(default ``"auto"``: the per-channel std of the model's normalisation when its transform exposes one, so that
``epsilon`` is a step in pixel units) divides the step of the element by the std of its channel (axis 1).

**Parameters and grid.** Defaults ``T = 1000`` and ``epsilon = 0.0014`` are those of OpenOOD's ``iodin.yml`` (ODIN's),
tuned on the benchmark's validation sets over ``T`` in 1, 10, 100, 1000 and ``epsilon`` in 0.0014, 0.0028
(``APS_mode: True``): that grid is ``default_grid`` here, and the leaderboard's i-ODIN figures come from it ("the
same configurations as ODIN"). The paper's repository tries ``epsilon`` from 0.0014 to 0.0098 in steps of 0.0014
(one element moves, so larger steps are worth trying); pass that list as a run's ``grid`` for the wider search.

**Against OpenOOD v1.5** (``iodin``): the same ``x'`` and scores, with two differences that change nothing where the
gradient has a non-zero element: OpenOOD's ``torch.ge(grad, 0)`` maps a zero gradient to +1 where ``sign`` gives 0
(a sample whose whole gradient is zero: OpenOOD moves its first element by ``-epsilon / std``, oodviz leaves it
as it is); its loss is the batch *mean* (a positive factor: the same signs and the same largest element). It divides
by the std of the first three channels (``normalization_dict`` of the benchmark, 0.5 for a dataset it does not
list), which ``norm_std="auto"`` reads from OpenOOD's preprocessing (``preprocessing = "openood:<benchmark>"``) or
torchvision's ImageNet weights, as for odin; its mask picks the largest ``|g|`` with ``torch.argmax`` (the first on
a tie) as here. So ``openood_params = {}``.

**Memory.** odin's (``activation_copies = 2``: one batch's activations and their gradients; the batch sized from
memory, a run's batch probe or :mod:`oodviz.detectors.modelmemory`) and the one-element mask, an input-sized tensor.
**Fit and merging.** Nothing to fit, no statistics: nothing to merge across ranks (a run scores it as odin).
Not in the default detector list (``in_defaults = False``): a backward pass per input, as odin, which the default
list already has.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oodviz.detectors.odin import ODIN
from oodviz.detectors.teaching import Teaching


def largest_element_mask(gradient: Tensor) -> Tensor:
    """A 0/1 mask of ``gradient``'s shape ``[B, ...]`` with one 1 per sample: at the element of largest ``|gradient|``
    over all the sample's elements (the first one on a tie, as ``torch.argmax``)."""
    flat = gradient.reshape(len(gradient), -1)
    largest = flat.abs().argmax(dim=1, keepdim=True)
    return torch.zeros_like(flat).scatter_(1, largest, 1.0).view_as(gradient)


class IODIN(ODIN):
    name = "iodin"
    summary = (
        "ODIN whose input step moves only the input element with the largest gradient magnitude: negative max "
        "softmax at temperature T (runs the model)."
    )
    paper = "https://arxiv.org/abs/2411.10794"
    default_grid = {"temperature": (1.0, 10.0, 100.0, 1000.0), "epsilon": (0.0014, 0.0028)}
    openood_params = {}
    teaching = Teaching(
        formula=(
            r"s(x) = -\max_k S_k(x';T),\quad x' = x - \varepsilon\, \operatorname{sign}(g_j)\, e_j,\quad "
            r"j = \arg\max_i |g_i|,\quad g = -\nabla_x \log S_{\hat y}(x;T),\quad "
            r"S(x;T) = \operatorname{softmax}\big(f(x)/T\big)"
        ),
        citation="Regmi, *Image-based Outlier Synthesis With Training Data*, CVPR 2026",
        reads="the model itself: one backward and two forward passes per input, as ODIN",
        fails_when="One input element moves: on large images the step barely changes the score, which is then close to MSP at T.",
    )
    #: a backward pass per input, as odin (which the default list has): a run lists it explicitly
    in_defaults = False

    def step(self, gradient: Tensor) -> Tensor:
        """odin's step ``sign(g) / std`` kept at one element per sample, that of the largest ``|g|`` (zero elsewhere)."""
        return super().step(gradient) * largest_element_mask(gradient)
