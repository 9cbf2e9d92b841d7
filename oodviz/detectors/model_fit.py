"""Model-based detectors that learn from in-distribution inputs (``adascale``, ``gram``).

Like ``odin`` they run the classifier again on ``Batch.inputs``; unlike it they fit statistics from
in-distribution inputs first. The fit is a fixed number of passes (``fit_passes``) over the inputs,
each a stream of steps: ``fit_step(batch)`` looks at one batch (inputs ``[b, ...]`` and labels
``[b]`` on the model's device) and returns one float32 value per sample, which the detector may
fold into its running state right away (a min/max, a sum) or keep: ``end_pass(pass, values)``
gets the ``[N]`` values of the whole pass, in order. The two ways to run it give the same result:

- ``fit(batches, head=None, device=None)``: batches of ``Batch(inputs=..., labels=...)`` (OOD rows,
  label -1, left out; a re-iterable for two passes), the model moved to ``device`` in eval mode for
  the fit and put back afterwards;
- a run (:mod:`oodviz.pipeline.stages`) streams the ID fit split's images with
  :func:`oodviz.engine.score_inputs` (OOM back-off, progress, cancel) once per pass, calling
  ``fit_begin(head)``, then per pass ``fit_step`` on every batch and ``end_pass``, then nothing else.
  A retried batch (out-of-memory back-off) must leave the state as one call would: steps update their
  state only after the forward passes, with idempotent or once-per-row updates.

``head`` is the classifier's final layer (default: the Backbone's ``head``); detectors that need it
(``needs_head``) raise a ValueError naming the fix without one. Two helpers serve every detector that
reads a layer inside the model (``rankfeat``, ``gram``): :func:`check_layers` and :func:`layers_whose_output`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, FitData, ModelDetector
from oodviz.models.placement import model_on_device


class FittedModelDetector(ModelDetector):
    """Base class: subclasses implement ``fit_step`` and ``_end_pass`` (and may extend ``fit_begin``)."""

    needs_fit = True

    def fit_begin(self, head=None) -> None:
        """Check the model and keep ``head`` (``(weight [C, D], bias [C])`` float32 on the fit device, or None)."""
        self._check_fit_model(self._require_model())
        if head is None and self.needs_head:
            raise ValueError(
                f"{self.name} needs the classifier's final linear layer: pass an oodviz Backbone whose head is known "
                "(features from the penultimate layer, layer=None), or call fit(batches, head=(weight [C, D], bias [C]))."
            )
        self.head_weight_, self.head_bias_ = (None, None) if head is None else head

    def fit_step(self, batch: Batch) -> Tensor:
        """One value per sample of ``batch`` ``[b]`` (float32), updating the running state of the pass."""
        raise NotImplementedError

    def end_pass(self, pass_index: int, values: Tensor) -> None:
        """The end of pass ``pass_index``: ``values`` ``[N]`` are those ``fit_step`` returned, in order.
        After the last pass the detector is fitted."""
        self._end_pass(pass_index, values.float().cpu())
        if pass_index == self.fit_passes - 1:
            self.n_features_in_ = None if self.head_weight_ is None else self.head_weight_.shape[1]
            self.n_classes_ = None if self.head_weight_ is None else self.head_weight_.shape[0]

    def _end_pass(self, pass_index: int, values: Tensor) -> None:
        raise NotImplementedError

    def fit(self, batches, head=None, device=None):
        """Fit on in-distribution inputs (``Batch(inputs=..., labels=...)``) and return self."""
        if batches is None:
            raise ValueError(
                f"{self.name} learns from in-distribution inputs: call fit(batches) with Batch(inputs=..., labels=...)"
            )
        self._check_fit_model(self._require_model())
        if head is None and hasattr(self.model, "features_and_logits"):  # a Backbone: its head, if known
            head = self.model.head
        if self.fit_passes == 1 and not isinstance(batches, Batch):
            batches = iter(batches)  # one pass: look at the first batch for the device, then put it back
            first = next((b for b in batches if not isinstance(b, Batch) or len(b)), None)
            batches = [] if first is None else itertools.chain([first], batches)
        else:
            first = batches if isinstance(batches, Batch) else next(iter(batches), None)
        if device is None and isinstance(first, Batch):
            device = first.device
        device = None if device is None else torch.device(device)
        with model_on_device(self.module, device):
            Detector.fit(self, batches, head=head, device=device)
        return self

    def _fit(self, data: FitData) -> None:
        self.fit_begin(data.head)
        for pass_index in range(self.fit_passes):
            self.end_pass(pass_index, torch.cat([self.fit_step(batch).float().cpu() for batch in data]))


def features_and_logits(model, x: Tensor, grad: bool = False) -> tuple[Tensor, Tensor]:
    """``(features [B, D], logits [B, C])`` of ``model`` for ``x``: a Backbone's ``features_and_logits``,
    or a module/callable that returns that pair."""
    if hasattr(model, "features_and_logits"):
        return model.features_and_logits(x, grad=True) if grad else model.features_and_logits(x)
    out = model(x)
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)):
        raise ValueError(
            "the model must be an oodviz Backbone or return (features [B, D], logits [B, C]); it returned "
            f"{type(out).__name__}. Wrap it with oodviz.models.wrap_model(model, transform, head=...)."
        )
    return out[0], out[1]


def check_layers(detector_name: str, module: nn.Module, names: list[str]) -> None:
    """ValueError listing the model's top-level layers when some of ``names`` are not modules of ``module``."""
    modules = dict(module.named_modules())
    missing = [name for name in names if name not in modules]
    if missing:
        top = [name for name in modules if name and "." not in name]
        raise ValueError(
            f"{detector_name}: the model has no layer(s) {', '.join(map(repr, missing))}; its top-level layers: "
            f"{', '.join(top)} (Backbone.layer_names() lists all)"
        )


def check_layer_list(detector_name: str, layers, example: str, none_means: str = "") -> None:
    """ValueError unless ``layers`` is None or a non-empty list of distinct module names (``"penultimate"`` among
    them allowed); ``example`` and ``none_means`` complete the message."""
    if layers is not None and (
        isinstance(layers, str) or not layers or not all(isinstance(n, str) and n for n in layers)
    ):
        raise ValueError(
            f"{detector_name}: layers must be a list of module names and 'penultimate' (e.g. {example}) "
            f"or None{none_means}, got {layers!r}"
        )
    if layers is not None and len(set(layers)) != len(layers):
        raise ValueError(f"{detector_name}: layers names a layer twice: {layers!r}")


def layers_whose_output(
    detector: ModelDetector, x: Tensor, accept: Callable[[object], bool], leaves: bool
) -> list[str]:
    """Names of the modules of ``detector.module`` (only those without children if ``leaves``) whose output passes
    ``accept``, in the order one forward of ``x[:1]`` finishes them, each once."""
    candidates = {
        m: name for name, m in detector.module.named_modules() if name and not (leaves and next(m.children(), None))
    }
    return list(dict.fromkeys(module_calls(detector, x, candidates, accept)))


def module_calls(detector: ModelDetector, x: Tensor, candidates: dict, accept: Callable[[object], bool]) -> list[str]:
    """The names (``candidates``: module -> name) of the modules one forward of ``x[:1]`` calls with an output that
    passes ``accept``, once per call (a module called twice, twice), in the order the calls finish."""
    found: list[str] = []
    hooks = [
        m.register_forward_hook(lambda mod, _, out: found.append(candidates[mod]) if accept(out) else None)
        for m in candidates
    ]
    try:
        detector.logits(x[:1])
    finally:
        for hook in hooks:
            hook.remove()
    return found
