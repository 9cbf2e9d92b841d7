"""The state protocol of detectors whose fit can be split over shards: ``update`` / ``merge`` / ``finalize``.

In the shape of torchmetrics' metrics. A detector whose class sets ``mergeable = True`` keeps its fit as a
:class:`FitState`: named accumulators (:class:`~oodviz.detectors.stats.ClassMoments`,
:class:`~oodviz.detectors.stats.ClassMeans`, :class:`Sums`, :class:`Extremes`, ...) each with ``update``-like methods, an exact
``merge(other)`` (float64 sums; Chan-style shifted sums for scatters) and ``state_dict()`` /
``load_state_dict()`` of tensors.

- ``detector.update(batches, head=None, device=None)`` adds in-distribution batches to the pass under way;
- ``detector.merge(other)`` adds the state of ``other`` (the same detector, same parameters, same pass, that
  saw other rows; or its ``state_dict()``); the result is that of one detector that saw both;
- ``detector.finalize()`` ends the pass: a one-pass detector is then fitted; a detector with more passes
  (``fit_passes``) keeps what the pass gave (e.g. vim's principal subspace) and expects the next pass's
  ``update``-s over the *same* rows, then ``finalize()`` again, until ``fitted`` is True;
- ``detector.state_dict()`` / ``load_state_dict(d)``: the pass under way, as tensors.

``fit(batches)`` is exactly ``update(batches)`` + ``finalize()``, once per pass. A fit split over processes
(:func:`oodviz.pipeline.distributed.fit_across_ranks`) is: each rank updates on its rows, the states are gathered and
merged in rank order on every rank, and every rank finalizes the same merged state (so every rank holds the
same fitted detector, bit for bit). Detectors without the protocol fit on the whole data (their docstrings
say why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from oodviz.detectors.stats import ACCUMULATE


class Sums:
    """Float64 sums that merge by addition (row counts, sums of scores, a second-moment matrix)."""

    def __init__(self, value: Tensor | None = None):
        self.value = value

    def add(self, value: Tensor) -> None:
        """``sums += value`` (float64; the first call sets the shape and device)."""
        value = value.to(ACCUMULATE)
        self.value = value.clone() if self.value is None else self.value.add_(value)

    def merge(self, other: Sums) -> Sums:
        if other.value is not None:
            self.add(other.value.to(self.value.device if self.value is not None else other.value.device))
        return self

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> Sums:
        self.value = state["value"]
        return self


class Extremes:
    """The smallest and largest values seen, elementwise (float64 ``[K]`` each; weiper's value ranges): a merge
    takes the minimum and the maximum, which is exact."""

    def __init__(self, low: Tensor | None = None, high: Tensor | None = None):
        self.low, self.high = low, high

    def add(self, low: Tensor, high: Tensor) -> None:
        """Widen the ranges to ``low`` and ``high`` (the first call sets the shape and device)."""
        low, high = low.to(ACCUMULATE), high.to(ACCUMULATE)
        if self.low is None:
            self.low, self.high = low.clone(), high.clone()
        else:
            torch.minimum(self.low, low.to(self.low.device), out=self.low)
            torch.maximum(self.high, high.to(self.high.device), out=self.high)

    def merge(self, other: Extremes) -> Extremes:
        if other.low is not None:
            self.add(other.low, other.high)
        return self

    def state_dict(self) -> dict:
        return {"low": self.low, "high": self.high}

    def load_state_dict(self, state: dict) -> Extremes:
        self.low, self.high = state["low"], state["high"]
        return self


@dataclass
class FitState:
    """A mergeable fit under way: the pass (0-based), the rows it has seen, the widths and head met so far
    (head: ``(weight [C, D], bias [C])`` float32 on ``device``) and the pass's named accumulators."""

    pass_index: int = 0
    rows: int = 0
    n_features: int | None = None
    n_classes: int | None = None
    head: tuple[Tensor, Tensor] | None = None
    device: torch.device | None = None
    parts: dict = field(default_factory=dict)

    def merge(self, other: FitState, detector_name: str) -> FitState:
        if other.pass_index != self.pass_index:
            raise ValueError(
                f"{detector_name}.merge: the states are at different fit passes ({self.pass_index} and "
                f"{other.pass_index}); finalize both after the same passes"
            )
        for attr in ("n_features", "n_classes"):
            mine, theirs = getattr(self, attr), getattr(other, attr)
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(f"{detector_name}.merge: the states saw different {attr} ({mine} and {theirs})")
            setattr(self, attr, mine if mine is not None else theirs)
        if self.head is None:
            self.head = other.head
        for name, part in self.parts.items():
            part.merge(other.parts[name])
        self.rows += other.rows
        return self

    def state_dict(self) -> dict:
        return {
            "pass_index": self.pass_index,
            "rows": self.rows,
            "n_features": self.n_features,
            "n_classes": self.n_classes,
            "head": self.head,
            "parts": {name: part.state_dict() for name, part in self.parts.items()},
        }

    @classmethod
    def from_state_dict(cls, state: dict, parts: dict) -> FitState:
        """The state ``state`` describes; ``parts`` are the pass's empty accumulators, loaded from it."""
        for name, part in parts.items():
            part.load_state_dict(state["parts"][name])
        head = state["head"]
        return cls(
            pass_index=state["pass_index"],
            rows=state["rows"],
            n_features=state["n_features"],
            n_classes=state["n_classes"],
            head=head,
            device=None if head is None else head[0].device,
            parts=parts,
        )


def on_device(value, device):
    """``value`` (a state dict: dicts, lists and tuples of tensors and plain values) with its tensors on ``device``."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: on_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(item, device) for item in value)
    return value


def load_merged(detector, states: list[dict]):
    """Make ``detector``'s pass under way the merge of ``states`` (``state_dict()``-s of the same pass, e.g. one per
    shard), in their order: ``states[0]`` loaded (its tensors taken over, not copied), the others merged in.
    Every process that loads the same states in the same order holds the same float64 state. Returns ``detector``."""
    detector.load_state_dict(states[0])
    for state in states[1:]:
        detector.merge(state)
    return detector
