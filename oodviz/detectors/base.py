"""The detector API shared by every method.

Every detector is made with keyword parameters (``create(name, **params)``), fitted with
``fit(batches, head=None, device=None)`` and applied with ``score(batches, device=None)``.

- ``batches`` is a re-iterable of :class:`oodviz.Batch` (a list, or an object whose ``__iter__``
  starts over), or a single ``Batch``. Fitting reads it as a stream, one batch at a time, and
  keeps only sufficient statistics, so memory does not grow with the number of samples.
- ``head`` is the classifier's final linear layer, ``(weight [C, D], bias [C])`` or an
  ``nn.Linear``.
- ``device=None`` uses the device of the batches; any other device moves each batch there as
  it is consumed. Fitted state is moved to the scoring device, so fitting on one device and
  scoring on another works.
- Scores come back as a CPU float32 tensor ``[N]``; **higher = more OOD** for every detector.

Subclasses set the class attributes describing what they need and implement ``_fit`` (reading
:class:`FitData`, possibly several times) and ``_score`` (one validated batch on the device).
Fitted state lives in attributes ending in ``_``.

A subclass with ``mergeable = True`` implements the state protocol instead of ``_fit``
(:mod:`oodviz.detectors.protocol`): ``_new_parts`` (the accumulators of a pass), ``_update_state`` (one
batch) and ``_finish_pass`` (read the merged state); its users get ``update`` / ``merge`` / ``finalize`` /
``state_dict`` / ``load_state_dict``, and ``fit`` is ``update`` + ``finalize`` once per pass.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Iterator
from typing import ClassVar

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.fitdata import FitData, Shapes, all_finite, iter_batches, row_chunks
from oodviz.detectors.modelmemory import activation_bytes, rows_that_fit
from oodviz.detectors.persist import save
from oodviz.detectors.protocol import FitState
from oodviz.models.placement import model_on_device

__all__ = ["Detector", "FitData", "ModelDetector", "NotFittedError", "all_finite", "check_all_classes_seen"]

Head = tuple[Tensor, Tensor]


class NotFittedError(ValueError, AttributeError):
    """Raised when ``score`` is called on a detector that needs ``fit`` first."""


def _check_head(head) -> Head:
    if isinstance(head, torch.nn.Linear):
        weight, bias = head.weight, head.bias
    elif isinstance(head, (tuple, list)) and len(head) == 2:
        weight, bias = head
    else:
        raise ValueError(
            "head must be the final linear layer as (weight [C, D], bias [C]) or a torch.nn.Linear, "
            f"got {type(head).__name__}"
        )
    weight = torch.as_tensor(weight).detach().to(dtype=torch.float32)
    if weight.ndim != 2:
        raise ValueError(f"head weight must be 2-D [C, D], got shape {tuple(weight.shape)}")
    if bias is None:
        bias = torch.zeros(weight.shape[0], device=weight.device)
    bias = torch.as_tensor(bias).detach().to(device=weight.device, dtype=torch.float32)
    if bias.shape != (weight.shape[0],):
        raise ValueError(
            f"head bias must have shape [C] = ({weight.shape[0]},) to match weight {tuple(weight.shape)}, "
            f"got {tuple(bias.shape)}"
        )
    if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):
        raise ValueError("head weight or bias contains NaN or infinity; pass the trained layer's parameters")
    return weight, bias


class Detector:
    """Base class: parameters in ``__init__``, ``fit`` returns self, fitted state ends in ``_``."""

    #: name in the registry (``oodviz.detectors.create(name)``)
    name: ClassVar[str]
    #: one line a user can read in a menu
    summary: ClassVar[str]
    #: the paper the score follows
    paper: ClassVar[str]
    #: batch fields the detector reads, in fit and score
    inputs: ClassVar[tuple[str, ...]]
    #: batch fields the detector reads when a batch has them (checked like ``inputs`` then)
    optional_inputs: ClassVar[tuple[str, ...]] = ()
    #: fit needs the classifier's final layer as ``head``
    needs_head: ClassVar[bool] = False
    #: fit needs class labels (OOD rows, label -1, are always ignored)
    needs_labels: ClassVar[bool] = False
    #: False for detectors that are a fixed function of the logits
    needs_fit: ClassVar[bool] = True
    #: how many times fit reads the batches (1 = a one-shot iterator is fine)
    fit_passes: ClassVar[int] = 1
    #: runs the classifier again on ``Batch.inputs`` (constructor parameter ``model``); see :class:`ModelDetector`
    needs_model: ClassVar[bool] = False
    #: part of the default detector list of a run (``RunConfig().detectors``)
    in_defaults: ClassVar[bool] = True
    #: the values a run tries for each parameter when it tunes on validation data, ``{parameter: (values, ...)}``
    #: (:mod:`oodviz.pipeline.tuning`; empty: nothing worth tuning). The grid is the cartesian product, tried in order.
    default_grid: ClassVar[dict[str, tuple]] = {}
    #: parameters that only change ``score``: a fitted detector takes new values with :meth:`set_params`, no refit
    #: (tuning fits once per value of the other parameters and rescores for these)
    score_params: ClassVar[tuple[str, ...]] = ()
    #: implements the state protocol (:mod:`oodviz.detectors.protocol`): ``update`` / ``merge`` / ``finalize`` /
    #: ``state_dict``, so its fit can be split over shards and processes; the others fit on all the data at once
    mergeable: ClassVar[bool] = False
    #: the parameters that make it compute OpenOOD v1.5's postprocessor of the same method where that differs from
    #: the paper's formula or oodviz's defaults (``{"variant": "b"}``: OpenOOD's ASH is always ASH-B); ``{}`` where
    #: the two agree. A run with ``protocol = "openood"`` takes them under its own parameters
    #: (:meth:`oodviz.config.run.RunConfig.apply_protocol`); the class docstring says what they change.
    openood_params: ClassVar[dict[str, object]] = {}
    #: the values a string parameter takes, ``{"variant": ("b", "p", "s")}`` (an editor offers them as a choice)
    param_choices: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: each fitted array's axes, a letter an axis (``"CD"``: classes x features): arrays that share a letter share its
    #: size, so a saved detector whose arrays disagree is refused when loaded (:mod:`oodviz.detectors.persist`). The
    #: head's and the per-class means' are here; a detector adds its own arrays.
    fitted_shapes: ClassVar[dict[str, str]] = {
        "head_weight_": "CD",
        "head_bias_": "C",
        "class_means_": "CD",
        "class_counts_": "C",
        "feature_mean_": "D",
    }

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """Host bytes the fit holds at its peak for ``n_samples`` rows of ``D = n_features``, ``C = n_classes``
        (the pre-flight check, :mod:`oodviz.pipeline.preflight`). The default is a state of per-class vectors,
        ``8 x (C x D + D + C)`` (float64), or 0 for detectors with no fit; detectors with a larger state
        (a ``D x D`` covariance, a ``C x C`` table) override it."""
        if not cls.needs_fit:
            return 0
        return 8 * (n_classes * n_features + n_features + n_classes)

    # -- parameters -------------------------------------------------------------------------
    @classmethod
    def param_names(cls) -> list[str]:
        parameters = inspect.signature(cls.__init__).parameters.values()
        return [p.name for p in parameters if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]

    def get_params(self) -> dict:
        """The constructor parameters and their current values."""
        return {name: getattr(self, name) for name in self.param_names()}

    def set_params(self, **params):
        """Change parameters in place and return self; the values are checked (and normalised) by the constructor.
        A fitted detector keeps its fitted state, so only :attr:`score_params` may change after ``fit``
        (ValueError for another: fit again instead)."""
        if hasattr(self, "n_features_in_") and (refit := sorted(set(params) - set(self.score_params))):
            raise ValueError(
                f"{self.name}: {', '.join(refit)} changes what fit learns; make a new detector and fit it "
                f"(only {', '.join(self.score_params) or 'no parameter'} can change after fit)"
            )
        checked = type(self)(**{**self.get_params(), **params})
        for name in params:
            setattr(self, name, getattr(checked, name))
        self._check_fitted_params()
        return self

    def _check_fitted_params(self) -> None:
        """ValueError when a fitted detector's parameters no longer fit its fitted state (knn: ``k`` above the bank)."""

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({params})"

    @classmethod
    def fields_to_read(cls, fitting: bool) -> tuple[str, ...]:
        """The batch fields a fit (``fitting``) or a score can use: ``inputs`` and ``optional_inputs``, and
        ``labels`` for a fit that ``needs_labels``; a run reads only these from the feature store."""
        fields = cls.inputs + tuple(f for f in cls.optional_inputs if f not in cls.inputs)
        return fields + ("labels",) if fitting and cls.needs_labels and "labels" not in fields else fields

    @classmethod
    def fields_of(cls, batch: Batch) -> tuple[str, ...]:
        """The batch fields this detector reads from ``batch``: its inputs and the optional ones present."""
        return cls.inputs + tuple(f for f in cls.optional_inputs if getattr(batch, f) is not None)

    # -- fit / score ------------------------------------------------------------------------
    @torch.no_grad()
    def fit(self, batches, head=None, device=None):
        """Fit on in-distribution batches (OOD rows, label -1, are ignored) and return self.

        :param batches: a re-iterable of :class:`~oodviz.Batch`, or one ``Batch``
        :param head: the final linear layer, ``(weight [C, D], bias [C])`` or ``nn.Linear``
        :param device: where to compute; ``None`` = the device of the batches
        """
        if not self.needs_fit:
            return self
        if self.fit_passes > 1 and not isinstance(batches, Batch) and iter(batches) is batches:
            raise ValueError(
                f"{self.name}.fit reads the batches {self.fit_passes} times but got a one-shot iterator "
                f"({type(batches).__name__}); pass a list, or an object whose __iter__ starts over."
            )
        device = None if device is None else torch.device(device)
        if head is not None:
            head = _check_head(head)
        elif self.needs_head:
            raise ValueError(
                f"{self.name} needs the classifier's final linear layer: call fit(batches, head=(weight [C, D], bias [C]))."
            )
        data = FitData(batches, device, self, head)
        if self.mergeable:  # update + finalize, once per pass, over the same validated stream
            self._fit_state = self._new_state(head, device)
            while self._fit_state is not None:
                self._accumulate(data, self._fit_state)
                self.finalize()
        else:
            self._fit(data)
        self.n_features_in_ = data.n_features
        self.n_classes_ = data.n_classes
        return self

    # -- the state protocol (mergeable detectors) ------------------------------------------------
    @torch.no_grad()
    def update(self, batches, head=None, device=None):
        """Add in-distribution batches (OOD rows, label -1, are ignored) to the fit pass under way; returns self.

        ``batches``, ``head`` and ``device`` as in :meth:`fit`; ``head`` and ``device`` are read by the first
        ``update`` of a fit (later ones use them). A pass may see no row here (an empty shard)."""
        self._require_mergeable("update")
        state = self._fit_state = getattr(self, "_fit_state", None) or self._new_state(head, device)
        shapes = Shapes(self.name, state.n_features, state.n_classes)
        self._accumulate(FitData(batches, state.device, self, state.head, shapes, require_rows=False), state)
        return self

    def merge(self, other):
        """Add the fit state of ``other`` (a detector of the same kind and parameters at the same pass, or its
        :meth:`state_dict`) to this one's: the result is that of one detector that saw the rows of both
        (float64 sums, exact up to rounding). ``other`` keeps its statistics. Returns self."""
        self._require_mergeable("merge")
        if isinstance(other, dict):
            theirs = self._loaded_state(other)
        elif type(other) is type(self) and other.get_params() == self.get_params():
            theirs = getattr(other, "_fit_state", None) or self._new_state(None, None)
        else:
            raise ValueError(f"{self.name}.merge needs a {type(self).__name__} with the same parameters, got {other!r}")
        mine = getattr(self, "_fit_state", None) or self._new_state(None, None)
        self._fit_state = mine.merge(theirs, self.name)
        return self

    @torch.no_grad()
    def finalize(self):
        """End the pass under way: a detector on its last pass is then fitted; one with more passes keeps what
        this pass gave and expects the next pass's ``update``-s over the same rows. Returns self."""
        self._require_mergeable("finalize")
        state = getattr(self, "_fit_state", None)
        if state is None or state.rows == 0:
            raise ValueError(
                f"{self.name}.finalize: the pass saw no in-distribution samples; call update(batches) first."
            )
        if self._finish_pass(state):
            self.n_features_in_, self.n_classes_ = state.n_features, state.n_classes
            self._fit_state = None
        else:
            self._fit_state = FitState(
                state.pass_index + 1, 0, state.n_features, state.n_classes, state.head, state.device,
                self._new_parts(state.pass_index + 1),
            )  # fmt: skip
        return self

    @property
    def fit_in_progress(self) -> bool:
        """A fit has started (``update``, ``merge`` or a finalized pass that is not the last) and is not done."""
        return getattr(self, "_fit_state", None) is not None

    def state_dict(self) -> dict:
        """The fit pass under way as tensors and numbers: ``pass_index``, ``rows``, ``n_features``,
        ``n_classes``, ``head`` and each accumulator's state (``parts``); the results of earlier passes stay
        on the detector (every process that finalized them holds the same)."""
        self._require_mergeable("state_dict")
        state = getattr(self, "_fit_state", None) or self._new_state(None, None)
        return {"detector": self.name, "params": self.get_params(), **state.state_dict()}

    def load_state_dict(self, state: dict):
        """Continue the fit pass ``state`` (a :meth:`state_dict`) describes; returns self."""
        self._require_mergeable("load_state_dict")
        self._fit_state = self._loaded_state(state)
        return self

    def _loaded_state(self, state: dict) -> FitState:
        if state.get("detector") != self.name or state.get("params") != self.get_params():
            raise ValueError(
                f"{self.name}: the state is of {state.get('detector')!r} with {state.get('params')}, "
                f"not of this detector ({self.get_params()})"
            )
        return FitState.from_state_dict(state, self._new_parts(state["pass_index"]))

    def _require_mergeable(self, method: str) -> None:
        if not self.mergeable:
            raise ValueError(
                f"{self.name} has no mergeable fit state ({method}); fit it with fit(batches) on all the data."
            )

    def _new_state(self, head, device) -> FitState:
        head = None if head is None else _check_head(head)
        if head is None and self.needs_head:
            raise ValueError(
                f"{self.name} needs the classifier's final linear layer: pass head=(weight [C, D], bias [C])."
            )
        device = None if device is None else torch.device(device)
        widths = (None, None) if head is None else (head[0].shape[1], head[0].shape[0])
        return FitState(0, 0, *widths, head, device, self._new_parts(0))

    def _accumulate(self, data: FitData, state: FitState) -> None:
        for batch in data:  # the head on the fit device, once it is known; the widths met so far
            state.head, state.device = data.head, data.device
            state.n_features, state.n_classes = data.n_features, data.n_classes
            self._update_state(state, batch)
            state.rows += len(batch)

    def _new_parts(self, pass_index: int) -> dict:
        """The empty accumulators of pass ``pass_index`` (mergeable detectors)."""
        raise NotImplementedError

    def _update_state(self, state: FitState, batch: Batch) -> None:
        """Add one validated in-distribution batch (on the fit device) to ``state.parts``."""
        raise NotImplementedError

    def _finish_pass(self, state: FitState) -> bool:
        """Read the merged ``state`` of a pass: set what it gives; True once the detector is fitted."""
        raise NotImplementedError

    @torch.no_grad()
    def score(self, batches, device=None) -> Tensor:
        """Outlier scores, a CPU float32 tensor ``[N]`` in the order of the batches; higher = more OOD."""
        scores = [self._score(batch).float().cpu() for batch in self.validated_batches(batches, device)]
        if not scores:
            raise ValueError(f"{self.name}.score got no samples: the batches were empty.")
        return torch.cat(scores)

    def validated_batches(self, batches, device=None) -> Iterator[Batch]:
        """The non-empty scoring batches on ``device`` (default: that of the first batch), checked for widths
        and finite values, with the fitted state moved to that device before the first one comes out. A batch
        larger than :meth:`_chunk_bytes` comes out in row chunks, moved to the device one at a time."""
        if self.needs_fit and not hasattr(self, "n_features_in_"):
            raise NotFittedError(
                f"This {self.name} detector is not fitted yet: call fit(batches) with in-distribution data before score."
            )
        device = None if device is None else torch.device(device)
        shapes = Shapes(self.name, getattr(self, "n_features_in_", None), getattr(self, "n_classes_", None))
        moved = False
        for index, whole in enumerate(iter_batches(batches)):
            if not len(whole):
                continue
            if device is None:
                device = whole.device
            if not moved:
                self._move_fitted(device)
                moved = True
            fields = self.fields_of(whole)
            for batch in row_chunks(whole, fields, self._chunk_bytes(whole, device)):  # views: bounded inside a batch
                batch = batch.to(device)
                shapes.check_widths(batch, index, fields)
                shapes.check_finite(batch, index, fields)
                yield batch

    def _chunk_bytes(self, batch: Batch, device: torch.device) -> int | None:
        """The most bytes of ``batch``'s read fields scored at once; None: :data:`oodviz.detectors.fitdata.CHUNK_BYTES`."""
        return None

    def save(self, directory, copy_files: bool = False) -> None:
        """Write the parameters and fitted state to ``directory`` (:mod:`oodviz.detectors.persist`)."""

        save(self, directory, copy_files)

    def _move_fitted(self, device: torch.device) -> None:
        for key, value in vars(self).items():
            if key.endswith("_") and isinstance(value, Tensor) and value.device != device:
                setattr(self, key, value.to(device))

    def _fit(self, data: FitData) -> None:
        raise NotImplementedError

    def _score(self, batch: Batch) -> Tensor:
        raise NotImplementedError


def check_all_classes_seen(detector_name: str, empty: list[int], what: str = "samples") -> None:
    """Raise if some class in ``0..C-1`` had no fitting samples (its statistics would be NaN)."""
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (" ..." if len(empty) > 10 else "")
        raise ValueError(
            f"{detector_name} cannot fit: class(es) {shown} have no {what} in the fit data "
            f"({len(empty)} of them). Every class 0..C-1 needs at least one; use more (or stratified) "
            "in-distribution data, or relabel the classes contiguously."
        )


class ModelDetector(Detector):
    """Base of the detectors that run the classifier again on the model inputs (``odin``, ``mcd``).

    - The model is the constructor parameter ``model``: an :class:`oodviz.models.Backbone` (its
      ``features_and_logits`` is used), an ``nn.Module`` or any callable mapping inputs
      ``[B, ...]`` to logits ``[B, C]`` or to ``(features [B, D], logits [B, C])``. A run passes
      its backbone; ``create(name)`` without one is fine for checking parameters.
    - The batches carry ``inputs`` (``Batch(inputs=x)``, ``x`` already transformed as the model
      expects); ``labels`` may come along and are ignored.
    - ``fit`` needs no data: it checks the model and returns self (it accepts the usual
      ``fit(batches, head=None, device=None)``).
    - ``score`` runs batch by batch on ``device`` (default: the device of the batches). An
      ``nn.Module`` is moved there in eval mode for the call and put back afterwards exactly as
      it was (device of every tensor, train/eval flag of every submodule), also after an error.
    """

    inputs = ("inputs",)
    needs_fit = False
    needs_model = True
    #: copies of one input's activations alive at once while scoring (see :mod:`oodviz.detectors.modelmemory`)
    activation_copies: ClassVar[int] = 1
    #: inputs scored at once, set by a run from its batch probe (:class:`oodviz.pipeline.batchprobe.ModelBatches`);
    #: None: from the activation estimate (:meth:`_chunk_bytes`)
    batch_rows: int | None = None

    def __init__(self, model=None):
        self.model = _check_model_object(model)

    # -- the model ---------------------------------------------------------------------------
    def _require_model(self):
        if self.model is None:
            raise ValueError(
                f"{self.name} runs the classifier again and has no model: create it with "
                f"create({self.name!r}, model=...) passing an oodviz Backbone, an nn.Module or a callable that "
                "returns logits [B, C] (a run passes its backbone itself)."
            )
        return self.model

    @property
    def module(self) -> torch.nn.Module | None:
        """The ``nn.Module`` behind ``model`` (a Backbone's ``model``), or None for a plain callable."""
        model = self.model
        if not isinstance(model, torch.nn.Module) and hasattr(model, "features_and_logits"):
            model = getattr(model, "model", None)
        return model if isinstance(model, torch.nn.Module) else None

    def logits(self, x: Tensor, grad: bool = False) -> Tensor:
        """Logits ``[B, C]`` (float32) of the model for inputs ``x`` ``[B, ...]`` on the model's device.

        ``grad=True`` keeps the graph (for gradients with respect to ``x``).
        """
        model = self._require_model()
        context = torch.enable_grad() if grad else torch.no_grad()
        with context:
            if hasattr(model, "features_and_logits"):
                out = model.features_and_logits(x, grad=True) if grad else model.features_and_logits(x)
            else:
                out = model(x)
        if isinstance(out, (tuple, list)) and len(out) == 2:
            out = out[1]
        if not isinstance(out, Tensor) or out.ndim != 2 or len(out) != len(x):
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"{self.name}: the model returned {shape} for {len(x)} inputs; it must return logits [B, C] "
                "or (features [B, D], logits [B, C])"
            )
        return out.float()

    # -- fit / score ---------------------------------------------------------------------------
    def fit(self, batches=None, head=None, device=None):
        """Nothing to learn: checks the model (see :meth:`_check_fit_model`) and returns self."""
        self._check_fit_model(self._require_model())
        return self

    def _check_fit_model(self, model) -> None:
        """Raise a ValueError when this method cannot work with ``model``."""

    def score(self, batches, device=None) -> Tensor:
        """Outlier scores of the batches' ``inputs``, a CPU float32 tensor ``[N]``; higher = more OOD."""
        self._check_fit_model(self._require_model())
        iterator = iter_batches(batches)
        first = next((b for b in iterator if len(b)), None)
        if first is None:
            raise ValueError(f"{self.name}.score got no samples: the batches were empty.")
        device = first.device if device is None else torch.device(device)
        with model_on_device(self.module, device), self._scoring(device):
            return Detector.score(self, itertools.chain([first], iterator), device=device)

    def _chunk_bytes(self, batch: Batch, device: torch.device) -> int | None:
        """Inputs scored at once: :attr:`batch_rows` when set, else as many as fit in the memory share at the
        activation cost of one input, measured once per input shape and device (:mod:`oodviz.detectors.modelmemory`);
        a plain callable (no module to measure) gets the default."""
        if batch.inputs is None:
            return None
        rows = self.batch_rows
        if rows is None:
            if self.module is None:
                return None
            key = (tuple(batch.inputs.shape[1:]), batch.inputs.dtype, str(device))
            if getattr(self, "_rows_measured", (None,))[0] != key:
                per_input = activation_bytes(self.module, self.logits, batch.inputs[:1].to(device))
                self._rows_measured = (key, rows_that_fit(per_input, self.activation_copies, device))
            rows = self._rows_measured[1]
        return rows * batch.inputs[0].numel() * batch.inputs.element_size()

    def _scoring(self, device: torch.device):
        """A context manager around one ``score`` call, entered after the model is on ``device`` in eval mode."""
        return contextlib.nullcontext()


def _check_model_object(model):
    if model is not None and not callable(model):
        raise ValueError(
            f"model must be an oodviz Backbone, an nn.Module or a callable returning logits, got {type(model).__name__}"
        )
    return model
