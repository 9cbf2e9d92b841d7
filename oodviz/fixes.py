"""A fix: a typed change of a run config that would cure a problem the pre-flight or a failed run found.

The pre-flight (:mod:`oodviz.pipeline.preflight`) and the worker (:mod:`oodviz.pipeline.worker`, a run that ran out
of memory) say what would help as :class:`Fix` objects, never only as sentences: ``kind`` says what to change,
``value`` what to change it to, ``text`` how the CLI and the app say it. The CLI prints ``text``; the app turns each
fix into a button from ``kind`` and ``value`` (:func:`oodviz.ui.form.form_fixes`), so rewording a message cannot
break a button. Fixes travel through JSON (the estimate's process, ``status.json``, the event log) as
:meth:`Fix.to_dict`.

Kinds (:data:`FIX_KINDS`) and their values:

- ``"pooling"``: the pooling to use (``"avg"``);
- ``"drop_layer"``: the layer to leave out of ``layers`` (the widest);
- ``"drop_detectors"``: the detector names to leave out;
- ``"subsample"``: at most this many images in every split;
- ``"feature_dtype"``: ``"float16"``;
- ``"batch_size"``: the batch size to use;
- ``"advice"``: no value, a change only the user can make (another layer, a narrower model): text only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oodviz.config.run import RunConfig

FIX_KINDS = ("pooling", "drop_layer", "drop_detectors", "subsample", "feature_dtype", "batch_size", "advice")


@dataclass(frozen=True)
class Fix:
    """One change that would cure a problem: ``kind`` (one of :data:`FIX_KINDS`), its ``value`` and the sentence
    ``text`` that says it."""

    kind: str
    text: str
    value: object = None

    def __post_init__(self):
        if self.kind not in FIX_KINDS:
            raise ValueError(f"unknown fix kind {self.kind!r}; one of {', '.join(FIX_KINDS)}")
        if self.kind == "drop_detectors":
            object.__setattr__(self, "value", tuple(self.value))

    def to_dict(self) -> dict:
        """A JSON object: ``{"kind", "text", "value"}`` (detector names as a list)."""
        entry = asdict(self)
        if isinstance(entry["value"], tuple):
            entry["value"] = list(entry["value"])
        return entry

    @classmethod
    def from_dict(cls, entry: dict) -> Fix:
        """The fix :meth:`to_dict` wrote."""
        return cls(entry["kind"], entry["text"], entry.get("value"))

    def apply(self, config: RunConfig) -> RunConfig | None:
        """``config`` with this change made (a new config; ``config`` is left as it is), or None for ``"advice"``,
        which names no change that can be made for the user."""
        if self.kind == "advice":
            return None
        if self.kind == "pooling":
            return replace(config, pooling=self.value)
        if self.kind == "drop_layer":
            return replace(config, layers=[layer for layer in config.layers if layer != self.value])
        if self.kind == "drop_detectors":
            return replace(config, detectors=[c for c in config.detectors if c.name not in self.value])
        if self.kind == "feature_dtype":
            return replace(config, feature_dtype=self.value)
        if self.kind == "batch_size":
            return replace(config, batch_size=self.value)
        cap = self.value  # subsample: every split at most cap images
        splits = {
            "id_fit": config.id_fit,
            "id_test": config.id_test,
            "id_val": config.id_val,
            "ood_val": config.ood_val,
        }
        capped = {
            key: replace(choice, subsample=min(choice.subsample or cap, cap))
            for key, choice in splits.items()
            if choice is not None
        }
        ood = [replace(choice, subsample=min(choice.subsample or cap, cap)) for choice in config.ood]
        return replace(config, **capped, ood=ood)


def fixes_from(entries) -> list[Fix]:
    """The fixes of a JSON list of :meth:`Fix.to_dict` objects; entries that are not fixes (a file written by
    another version) are left out."""
    found = []
    for entry in entries if isinstance(entries, list) else []:
        try:
            found.append(Fix.from_dict(entry))
        except (KeyError, TypeError, ValueError):
            continue
    return found


def smaller_batch(batch_size: int, why: str) -> Fix | None:
    """The fix of a run that ran out of memory (``why`` says how it ended): a quarter of its ``batch_size``;
    None when the batch is already one row."""
    smaller = max(int(batch_size) // 4, 1)
    if smaller >= batch_size:
        return None
    return Fix("batch_size", f"a smaller batch: batch_size={smaller:,} ({why} at {batch_size:,})", smaller)
