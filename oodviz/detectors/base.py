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
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import Tensor

from oodviz.batch import FIELDS, OOD_LABEL, Batch
from oodviz.detectors.stats import row_blocks
from oodviz.models.placement import model_on_device

Head = tuple[Tensor, Tensor]


class NotFittedError(ValueError, AttributeError):
    """Raised when ``score`` is called on a detector that needs ``fit`` first."""


def _iter_batches(batches: Batch | Iterable[Batch]) -> Iterator[Batch]:
    if isinstance(batches, Batch):
        yield batches
        return
    try:
        iterator = iter(batches)
    except TypeError:
        raise ValueError(
            f"batches must be an oodviz.Batch or an iterable of them, got {type(batches).__name__}"
        ) from None
    for i, batch in enumerate(iterator):
        if not isinstance(batch, Batch):
            raise ValueError(
                f"batches must yield oodviz.Batch objects; item {i} is a {type(batch).__name__}. "
                "Wrap your tensors: Batch(features=..., logits=..., labels=...)."
            )
        yield batch


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


def all_finite(t: Tensor) -> bool:
    """Whether every element of ``t`` is finite, without a full-size temporary.

    ``torch.isfinite(t).all()`` makes several ``t``-sized temporaries (a 4096 x 1024 float32
    batch costs ~28 MiB). A sum is finite when every element is (a NaN or an infinity makes it
    NaN or infinite), so one reduction settles the usual case; only a non-finite sum, which an
    overflow of large finite values can also give, is checked element by element, in row blocks.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return True
    wide = torch.float32 if t.element_size() < 4 else None  # float16 sums overflow at 65504
    if bool(torch.isfinite(t.sum(dtype=wide))):
        return True
    rows = t.reshape(len(t), -1)
    return all(bool(torch.isfinite(rows[block]).all()) for block in row_blocks(len(rows), rows.shape[1]))


def _in_distribution(batch: Batch, known: Tensor) -> Batch:
    """The rows of ``batch`` where ``known`` [B] is True: a host sync (the row count depends on the data)."""
    return Batch(*(None if (t := getattr(batch, field)) is None else t[known] for field in FIELDS))


class _Shapes:
    """D and C seen so far; every later batch (and the head) must agree."""

    def __init__(self, detector_name: str, n_features: int | None = None, n_classes: int | None = None):
        self.detector_name = detector_name
        self.n_features = n_features
        self.n_classes = n_classes

    def check_widths(self, batch: Batch, index: int, inputs: tuple[str, ...]) -> None:
        for field in inputs:
            if getattr(batch, field) is None:
                raise ValueError(
                    f"{self.detector_name} needs {field} but batch {index} has none; "
                    f"extract {field} for every batch (Batch({field}=...))."
                )
        for field, attr, letter in (("features", "n_features", "D"), ("logits", "n_classes", "C")):
            value = getattr(batch, field)
            if value is None or field not in inputs:
                continue
            width = value.shape[1]
            known = getattr(self, attr)
            if known is None:
                setattr(self, attr, width)
            elif width != known:
                raise ValueError(
                    f"{self.detector_name}: batch {index} has {field} with {letter}={width}, expected {letter}={known} "
                    f"(from earlier batches, the head or the fit); every batch must come from the same model layer."
                )

    def check_finite(self, batch: Batch, index: int, inputs: tuple[str, ...]) -> None:
        for field in inputs:
            value = getattr(batch, field)
            if not all_finite(value):
                bad = int((~torch.isfinite(value)).reshape(len(value), -1).any(dim=1).sum())
                raise ValueError(
                    f"{self.detector_name}: batch {index} has {bad} sample(s) with NaN or infinite {field}; "
                    "check the model and its input normalisation, or drop those samples."
                )


class FitData:
    """The fit input as a stream: each ``iter()`` is one validated pass over the batches.

    Batches come out on ``device`` with OOD rows (label ``-1``) removed. With ``device=None``
    the device is that of the first batch, known once the first pass has started (the head is
    moved there then). Shapes are checked against each other and against the head; labels
    against ``0..C-1`` where ``C`` is known; values for NaN and infinity.

    The checks that read the values (labels in range, finiteness) run on the first full pass
    only. A multi-pass fit (tempscale reads the data once per Newton step, up to 50 times) would
    otherwise re-read every batch for them on every pass. That is sound because the batches must
    be a re-iterable that yields the same data on every pass (a list, a store reader), and a stream
    that changed is caught by the row count each later pass must repeat. Widths (free: shapes
    only) are checked on every pass. A pass stopped early (a fit that reads one batch) leaves the
    next pass validating again. Host syncs (budget held by ``tests/test_gpu_path.py``): one per batch on
    the validating pass (the checks' device-side flags read at once), none later; a batch with OOD rows
    costs one more on every pass (dropping them gives a data-dependent row count).
    """

    def __init__(self, batches, device: torch.device | None, detector: Detector, head: Head | None):
        self._batches = batches
        self.device = device
        self._head = head
        self._detector = detector
        self._shapes = _Shapes(
            detector.name,
            n_features=None if head is None else head[0].shape[1],
            n_classes=None if head is None else head[0].shape[0],
        )
        self._rows_per_pass: int | None = None
        self._seen: dict[int, tuple[int, bool]] = {}  # batch index -> (rows, has OOD rows), from the validating pass

    @property
    def head(self) -> Head | None:
        """``(weight [C, D], bias [C])`` float32 on ``device``, or None."""
        if self._head is not None and self.device is not None:
            self._head = tuple(t.to(self.device) for t in self._head)
        return self._head

    @property
    def n_features(self) -> int | None:
        return self._shapes.n_features

    @property
    def features_on_disk(self):
        """The batches' ``features_on_disk`` (an ``[N, D]`` memory map of exactly the features they
        yield, e.g. :meth:`oodviz.engine.FeatureStore.batches`), or None."""
        return getattr(self._batches, "features_on_disk", None)

    @property
    def rows_per_pass(self) -> int | None:
        """In-distribution rows of a full pass, once one is done."""
        return self._rows_per_pass

    @property
    def n_classes(self) -> int | None:
        return self._shapes.n_classes

    def __iter__(self) -> Iterator[Batch]:
        detector = self._detector
        validate = self._rows_per_pass is None  # no full pass yet: this one checks the values
        rows, seen = 0, {}  # batch index -> (rows, has OOD rows), of this pass
        for index, batch in enumerate(_iter_batches(self._batches)):
            if not len(batch):
                continue
            if self.device is None:
                self.device = batch.device
            batch = batch.to(self.device)
            fields = detector.fields_of(batch)
            self._shapes.check_widths(batch, index, fields)
            if batch.labels is None and detector.needs_labels:
                raise ValueError(
                    f"{detector.name} fits on class labels but batch {index} has none; "
                    "pass Batch(labels=...) with the in-distribution class of each sample."
                )
            known = None if batch.labels is None else batch.labels != OOD_LABEL
            if validate:
                has_ood = self._validate(batch, known, index, fields)
            else:  # as the validating pass found (no host sync), unless it saw another batch here
                found = self._seen.get(index)
                same = found is not None and found[0] == len(batch)
                has_ood = known is not None and (found[1] if same else not bool(known.all()))
            seen[index] = (len(batch), has_ood)
            batch = _in_distribution(batch, known) if has_ood else batch
            if not len(batch):
                continue
            rows += len(batch)
            yield batch
        if rows == 0:
            raise ValueError(
                f"{detector.name}.fit got no in-distribution samples: the batches were empty or every label was -1 (OOD)."
            )
        if self._rows_per_pass is not None and rows != self._rows_per_pass:
            raise ValueError(
                f"{detector.name}.fit reads the batches {detector.fit_passes} times, but a later pass gave {rows} "
                f"samples instead of {self._rows_per_pass}; pass a list or an iterable whose __iter__ restarts "
                "the same data."
            )
        self._rows_per_pass, self._seen = rows, seen

    def _validate(self, batch: Batch, known: Tensor | None, index: int, fields: tuple[str, ...]) -> bool:
        """Labels and finiteness as device-side flags read at once; a raised one costs a closer look (for the
        message). Returns whether the batch has OOD rows."""
        flags = []
        labels, n_classes = batch.labels, self.n_classes
        if labels is not None:
            flags += [(labels < OOD_LABEL).any(), ~known.all()]
            if n_classes is not None:
                flags.append((labels >= n_classes).any())
        checked = [v for field in fields if (v := getattr(batch, field)).is_floating_point() and v.numel()]
        for value in checked:
            # A row whose sum is finite has only finite values; float16 sums overflow at 65504.
            sums = value.reshape(len(value), -1).sum(dim=1, dtype=torch.float32 if value.element_size() < 4 else None)
            flags.append((~torch.isfinite(sums) if known is None else ~torch.isfinite(sums) & known).any())
        if not flags:
            return False
        read = torch.stack(flags).tolist()  # the one host sync of the batch
        if labels is not None and read[0]:
            raise ValueError(
                f"batch {index} has labels below -1 (min {int(labels.min())}); labels are class indices 0..C-1, "
                "or -1 for OOD samples."
            )
        if labels is not None and n_classes is not None and read[2]:
            raise ValueError(
                f"batch {index} has label {int(labels.max())} but the model has C={n_classes} classes; "
                f"labels must be 0..{n_classes - 1} (or -1 for OOD)."
            )
        has_ood = labels is not None and read[1]
        if any(read[len(read) - len(checked) :]):  # non-finite, or a sum that overflowed: look closer
            kept = _in_distribution(batch, known) if has_ood else batch
            self._shapes.check_finite(kept, index, fields)
        return has_ood


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

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """Host bytes the fit holds at its peak for ``n_samples`` rows of ``D = n_features``, ``C = n_classes``
        (the pre-flight check, :mod:`oodviz.runs.preflight`). The default is a state of per-class vectors,
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

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({params})"

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
        self._fit(data)
        self.n_features_in_ = data.n_features
        self.n_classes_ = data.n_classes
        return self

    @torch.no_grad()
    def score(self, batches, device=None) -> Tensor:
        """Outlier scores, a CPU float32 tensor ``[N]`` in the order of the batches; higher = more OOD."""
        scores = [self._score(batch).float().cpu() for batch in self.validated_batches(batches, device)]
        if not scores:
            raise ValueError(f"{self.name}.score got no samples: the batches were empty.")
        return torch.cat(scores)

    def validated_batches(self, batches, device=None) -> Iterator[Batch]:
        """The non-empty scoring batches on ``device`` (default: that of the first batch), checked for widths
        and finite values, with the fitted state moved to that device before the first one comes out."""
        if self.needs_fit and not hasattr(self, "n_features_in_"):
            raise NotFittedError(
                f"This {self.name} detector is not fitted yet: call fit(batches) with in-distribution data before score."
            )
        device = None if device is None else torch.device(device)
        shapes = _Shapes(self.name, getattr(self, "n_features_in_", None), getattr(self, "n_classes_", None))
        moved = False
        for index, batch in enumerate(_iter_batches(batches)):
            if not len(batch):
                continue
            if device is None:
                device = batch.device
            if not moved:
                self._move_fitted(device)
                moved = True
            batch = batch.to(device)
            shapes.check_widths(batch, index, self.fields_of(batch))
            shapes.check_finite(batch, index, self.fields_of(batch))
            yield batch

    def save(self, directory, copy_files: bool = False) -> None:
        """Write the parameters and fitted state to ``directory`` (:mod:`oodviz.detectors.persist`)."""
        from oodviz.detectors.persist import save

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
        iterator = _iter_batches(batches)
        first = next((b for b in iterator if len(b)), None)
        if first is None:
            raise ValueError(f"{self.name}.score got no samples: the batches were empty.")
        device = first.device if device is None else torch.device(device)
        with model_on_device(self.module, device), self._scoring(device):
            return Detector.score(self, itertools.chain([first], iterator), device=device)

    def _scoring(self, device: torch.device):
        """A context manager around one ``score`` call, entered after the model is on ``device`` in eval mode."""
        return contextlib.nullcontext()


def _check_model_object(model):
    if model is not None and not callable(model):
        raise ValueError(
            f"model must be an oodviz Backbone, an nn.Module or a callable returning logits, got {type(model).__name__}"
        )
    return model
