"""The fit input as a validated stream (:class:`FitData`), and the checks and row chunks it shares with scoring.

Bounded inside a batch: a batch is consumed in row chunks of at most ``CHUNK_BYTES`` over the fields a
detector reads (:func:`row_chunks`, views: no copy), each moved to the device and checked on its own, so
one 50k-row ``Batch`` costs a fit or a score no more device memory or temporaries than 4096-row batches;
dropping OOD rows (label ``-1``) copies the in-distribution rows of one chunk at a time, never a whole
tensor. (Moved out of :mod:`oodviz.detectors.base`, which re-exports :class:`FitData`.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from oodviz.batch import FIELDS, OOD_LABEL, Batch
from oodviz.detectors.stats import row_blocks

if TYPE_CHECKING:
    from oodviz.detectors.base import Detector, Head

#: the most bytes of a batch's read fields a detector gets at once (a larger batch comes in row chunks)
CHUNK_BYTES = 32 * 2**20


def row_chunks(batch: Batch, fields: tuple[str, ...], chunk_bytes: int | None = None) -> Iterator[Batch]:
    """``batch`` as row slices (views) whose ``fields`` take at most ``chunk_bytes`` (default ``CHUNK_BYTES``;
    at least one row each); the batch itself when it is that small."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    row_bytes = sum(t[0].numel() * t.element_size() for f in fields if (t := getattr(batch, f)) is not None and len(t))
    rows = max(1, chunk_bytes // max(row_bytes, 1))
    if len(batch) <= rows:
        yield batch
        return
    for start in range(0, len(batch), rows):
        yield Batch(*(None if (t := getattr(batch, f)) is None else t[start : start + rows] for f in FIELDS))


def iter_batches(batches: Batch | Iterable[Batch]) -> Iterator[Batch]:
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


def in_distribution(batch: Batch, known: Tensor) -> Batch:
    """The rows of ``batch`` where ``known`` [B] is True (a copy of them: give it a chunk, not a whole batch);
    a host sync (the row count depends on the data)."""
    return Batch(*(None if (t := getattr(batch, field)) is None else t[known] for field in FIELDS))


class Shapes:
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

    ``shapes`` carries the widths of earlier calls (a detector's ``update``-s); ``require_rows=False`` lets a
    pass see no in-distribution row (an empty shard) instead of raising.

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

    def __init__(
        self,
        batches,
        device: torch.device | None,
        detector: Detector,
        head: Head | None,
        shapes: Shapes | None = None,
        require_rows: bool = True,
    ):
        self._batches = batches
        self.device = device
        self._head = head
        self._detector = detector
        self._shapes = shapes or Shapes(
            detector.name,
            n_features=None if head is None else head[0].shape[1],
            n_classes=None if head is None else head[0].shape[0],
        )
        self._require_rows = require_rows  # False: a pass may see no row (a detector's update on an empty shard)
        self._rows_per_pass: int | None = None
        self._seen: dict[tuple[int, int], tuple[int, bool]] = {}  # (batch index, chunk) -> (rows, has OOD rows)

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
        rows, seen = 0, {}  # (batch index, chunk) -> (rows, has OOD rows), of this pass
        for index, whole in enumerate(iter_batches(self._batches)):
            if not len(whole):
                continue
            fields = detector.fields_of(whole)
            for chunk, batch in enumerate(row_chunks(whole, fields + ("labels",))):
                if self.device is None:
                    self.device = batch.device
                batch = batch.to(self.device)
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
                    found = self._seen.get((index, chunk))
                    same = found is not None and found[0] == len(batch)
                    has_ood = known is not None and (found[1] if same else not bool(known.all()))
                seen[index, chunk] = (len(batch), has_ood)
                batch = in_distribution(batch, known) if has_ood else batch
                if not len(batch):
                    continue
                rows += len(batch)
                yield batch
        if rows == 0 and self._require_rows:
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
            kept = in_distribution(batch, known) if has_ood else batch
            self._shapes.check_finite(kept, index, fields)
        return has_ood
