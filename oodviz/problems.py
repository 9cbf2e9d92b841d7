"""Problems and fixes as data: what is wrong with a run config (:class:`Problem`: its message and the config field
it is about), and a typed change of a config that would cure it (:class:`Fix`).

A :class:`Problem` is the message itself (a ``str``, so that every caller that prints or joins problems is
unchanged) carrying ``field``, the path of the config field it is about (``"backbone"``, ``"ood[1]"``,
``"detectors[0]"``, ``"detectors[0].grid"``, ``""`` for the config as a whole), and ``detail``, the message without
the field's name. The checks of :mod:`oodviz.config` set both where they find the problem; the app's form places
each problem under its field from ``field`` (:func:`oodviz.ui.form.problem_field`), never from the words.

The pre-flight (:mod:`oodviz.pipeline.preflight`) and the worker (:mod:`oodviz.pipeline.worker`, a run that ran out
of memory) say what would help as :class:`Fix` objects, never only as sentences: ``kind`` says what to change,
``value`` what to change it to, ``text`` how the CLI and the app say it. The CLI prints ``text``; the app turns each
fix into a button from ``kind`` and ``value`` (:func:`oodviz.ui.form.form_fixes`), so rewording a message cannot
break a button. Fixes travel through JSON (the estimate's process, ``status.json``, the event log) as
:meth:`Fix.to_dict`.

Kinds (:data:`FIX_KINDS`) and their values:

- ``"pooling"``: the pooling to use where the config has ``"none"`` (``None``: the model's own, :func:`pooled`);
- ``"drop_layer"``: the layer to leave out of ``layers`` (the widest);
- ``"drop_detectors"``: the detector names to leave out;
- ``"subsample"``: at most this many images in every split;
- ``"feature_dtype"``: ``"float16"``;
- ``"batch_size"``: the batch size to use;
- ``"advice"``: no value, a change only the user can make (another layer, a narrower model): text only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


class Problem(str):
    """A problem with a run config: the message (this string), the config ``field`` it is about and the ``detail``
    (the message less the field's name; the message itself when it names none)."""

    field: str
    detail: str

    def __new__(cls, message: str, field: str = "", detail: str | None = None):
        problem = super().__new__(cls, message)
        problem.field, problem.detail = field, message if detail is None else detail
        return problem

    @classmethod
    def at(cls, where: str, detail: str) -> Problem:
        """``"<where>: <detail>"`` about field ``where`` (``where`` empty: ``detail`` alone, about the config)."""
        return cls(f"{where}: {detail}" if where else detail, where, detail)


def problems_at(field: str, messages) -> list[Problem]:
    """``messages`` (each already saying where, e.g. a parameter check's ``"ood[0]: n must be ..."``) as problems
    about ``field``."""
    return [Problem(message, field) for message in messages]


def detector_problem(message: str, named: str, where: str, name: str) -> Problem:
    """``message`` (which starts with ``named``, ``"detectors[i] (<name>)"``: the check that wrote it put it there)
    about field ``where``; its detail names the
    detector once, as the app's form says it: ``"<name>: k must ..."`` (a detector's own message often starts with
    its name already)."""
    rest = message.removeprefix(f"{named}: ")
    if rest == message:  # "<named> has no parameter(s) ...": the message says it whole
        return Problem(message, where)
    return Problem(message, where, rest if rest.startswith(f"{name}: ") else f"{name}: {rest}")


def pooled(pooling, value):
    """``pooling`` (a run config's or the form's: a name, a table layer -> name, or None, the model's own) with every
    ``"none"`` (unpooled) made ``value``; a table's entry made None is left out (a layer a table does not name takes
    the model's own), and a table left empty is None. The other entries are kept."""
    if isinstance(pooling, dict):
        table = {layer: value if how == "none" else how for layer, how in pooling.items()}
        return {layer: how for layer, how in table.items() if how is not None} or None
    return value if pooling == "none" else pooling


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

    def apply(self, config):
        """``config`` (a :class:`~oodviz.config.run.RunConfig`, a layer above this module: not imported here) with
        this change made (a new config; ``config`` is left as it is), or None for ``"advice"``, which names no change
        that can be made for the user."""
        if self.kind == "advice":
            return None
        if self.kind == "pooling":
            return replace(config, pooling=pooled(config.pooling, self.value))
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
