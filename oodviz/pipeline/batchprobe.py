"""Peak memory of one batch, measured: the extraction forward and every model-based detector of a run.

:func:`batch_peaks` runs in the pre-flight (:func:`oodviz.pipeline.preflight.preflight`), after it has loaded the
backbone and the datasets: in the app, inside the estimate's own process (:mod:`oodviz.pipeline.probe`), which
holds nothing else; in ``oodviz run``, in the command's process before the run starts (as the backbone's probe
forward does), the peak counted from that process's resident memory before each pass.

What is measured, for each pass of a batch through the model (the extraction forward under
``inference_mode``; each detector with ``needs_model``, made as a run makes it, with the run's backbone: its
fit on the batch when it learns from inputs, adascale and gram, then its ``score``, autograd included for odin,
every dropout pass for mcd) on the first images of the ID fit split, transformed by the backbone:

- host: ``peak(b) = VmHWM - RSS`` (bytes), the kernel's high-water mark of resident memory
  (:func:`~oodviz.runs.telemetry.peak_rss_bytes`, reset before the pass) less the resident memory before it,
  with the freed heap handed back to the kernel first (``malloc_trim``) so that an earlier pass's freed memory
  does not hide this one's;
- GPU (a CUDA run): ``max_memory_allocated - memory_allocated`` from the caching allocator, its peak reset.

Passes, in order: one row (``first``: lazy initialisation, a detector's own activation measurement), one row
again, :data:`PROBE_SHORT_ROWS` rows (their time per row), then ``n`` rows twice in a row, ``n`` as close to
the run's batch as the probe affords: at most :data:`PROBE_BYTES` (and a quarter of the available RAM) at the
second one-row peak, and two passes in about :data:`PROBE_SECONDS` at the short pass's speed (CPU seconds of
this process on the CPU, so that a loaded machine does not shrink ``n``). ``peak(n)`` is the peak over both,
as over a run's consecutive batches: once glibc has freed a large block it raises its mmap threshold and serves
the next ones from the heap, where a batch's blocks do not all land in the freed ones of the batch before, so a
lone pass can measure a third less. Then

    per_row = peak(n) / n + the bytes of one input (the batch's inputs exist before the pass)
    fixed   = max(0, first - per_row)

(the first call of a pass pays costs the later ones do not, autograd's first backward, lazily made buffers; a
run pays them too: an upper bound when ``n`` is the whole batch, a proportional scale-up otherwise, which counts
the pass's fixed part once per ``n`` rows, again on the safe side). A model whose first one-row pass takes
over a quarter of :data:`PROBE_SECONDS` (ViT-B on a CPU) is measured by that pass alone: ``per_row = first``,
``fixed = 0``, an upper bound (its fixed part counted once per row) at the cost of one row.

The figure is the batch's peak over this process's heap, and a heap with another history measures differently:
a fresh process scoring the same ODIN batch after a one-row forward took 1.1-1.2 times the probe's figure on one
machine and 1.45 times on another (``tests/pipeline/test_batchprobe.py``). Batches are sized to
``MEMORY_FRACTION`` (a half) of the available memory, which covers that.

Every pass runs under the autocast of the run's ``precision`` (:func:`oodviz.engine.batched.autocast_for`), as
the run's passes do: a bf16 run is measured in bf16.

The batch a run passes at once needs ``fixed + rows x per_row``: ``rows`` = the run's ``batch_size`` for the
extraction; a model-based detector gets a batch size of its own from its measured peak and the memory available
when it runs (:func:`rows_from_memory`),

    rows = min(batch_size, max(1, floor((MEMORY_FRACTION x available - fixed) / per_row)))

over the host's available RAM, and on CUDA the GPU's free memory as well (the smaller), ``MEMORY_FRACTION`` of
:mod:`oodviz.detectors.modelmemory` (a half): the pre-flight sizes it with the machine's limits, and the run
(:class:`ModelBatches`) again when the detector first runs, from the peaks the pre-flight measured in the same
process (``oodviz run``) or measured by the run itself before extracting (:func:`measure_for_run`). The
out-of-memory back-off of :mod:`oodviz.engine.batched` halves it further if a batch still fails.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from oodviz.batch import Batch
from oodviz.config.run import RunConfig
from oodviz.detectors import create, detector_class, modelmemory
from oodviz.detectors.modelmemory import MEMORY_FRACTION, NO_LIMIT, rows_within
from oodviz.engine.batched import autocast_for
from oodviz.models.memory import format_bytes
from oodviz.models.placement import model_on_device, parse_device
from oodviz.runs import telemetry

#: host bytes the probe's batch may take, at the one-row peak (and at most a quarter of the available RAM)
PROBE_BYTES = 2**30
#: seconds the two measured passes of one model pass may take, at the one-row pass's speed
PROBE_SECONDS = 6.0
#: rows of the pass that times the model pass before the measured ones
PROBE_SHORT_ROWS = 8
#: the most rows the probe transforms and passes at once
MAX_PROBE_ROWS = 4096
EXTRACTION = "extraction"


class BatchProbeError(RuntimeError):
    """The batch probe cannot measure on this machine (no ``/proc/self/clear_refs``) or found no image."""


@dataclass
class BatchPeak:
    """The measured memory of one pass (``what``: ``"extraction"`` or a detector's name) and the ``rows`` a run
    passes at once: ``fixed + rows x per_row`` bytes of host memory (GPU: the ``gpu_`` pair, None off CUDA)."""

    what: str
    rows: int
    fixed_bytes: int
    per_row_bytes: int
    gpu_fixed_bytes: int | None = None
    gpu_per_row_bytes: int | None = None

    def bytes_at(self, rows: int) -> int:
        """Host bytes of a batch of ``rows``."""
        return self.fixed_bytes + rows * self.per_row_bytes

    def gpu_bytes_at(self, rows: int) -> int | None:
        """GPU bytes of a batch of ``rows`` (None off CUDA)."""
        return None if self.gpu_per_row_bytes is None else self.gpu_fixed_bytes + rows * self.gpu_per_row_bytes

    def rows_fitting(self, ram: float, gpu: float | None = None) -> int:
        """The most rows whose batch takes at most ``ram`` host bytes and, when the peak was measured on a GPU and
        ``gpu`` is given, at most ``gpu`` device bytes (0 when not even one row fits)."""
        rows = rows_within(self.fixed_bytes, self.per_row_bytes, ram)
        if gpu is not None and self.gpu_per_row_bytes is not None:
            rows = min(rows, rows_within(self.gpu_fixed_bytes, self.gpu_per_row_bytes, gpu))
        return rows

    def describe(self) -> str:
        """One line: ``batch of odin: 256 rows x 1.2 MiB + 3 MiB = 310 MiB``."""

        line = (
            f"batch of {self.what}: {self.rows:,} rows x {format_bytes(self.per_row_bytes)} + "
            f"{format_bytes(self.fixed_bytes)} = {format_bytes(self.bytes_at(self.rows))} RAM"
        )
        gpu = self.gpu_bytes_at(self.rows)
        return line if gpu is None else f"{line}, {format_bytes(gpu)} GPU"


def trim_heap() -> None:
    """Hand the C heap's free memory back to the kernel (glibc ``malloc_trim``; nothing elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def pass_peak(
    work: Callable[[], object], device: torch.device, before_reset: Callable[[], None] | None = None
) -> tuple[int, int | None, float]:
    """(host bytes, GPU bytes or None) that ``work()`` took above what was held before it, at its peak, and the
    seconds it took (this process's CPU seconds on the CPU, wall seconds on CUDA). ``before_reset()`` is called
    before the kernel's peak is reset (a run's stage keeps the peak so far: ``Reporter.fold_kernel_peak``)."""

    gc.collect(1)  # the young generations, where the previous pass's cycles are: a full one takes 0.3 s in a run
    trim_heap()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        gpu_before = torch.cuda.memory_allocated(device)
    before = telemetry.cpu_rss_bytes()
    if before_reset is not None:
        before_reset()
    if not telemetry.reset_peak_rss():
        raise BatchProbeError("the batch probe needs Linux's /proc/self/clear_refs to measure peak memory")
    clock = time.perf_counter if cuda else time.process_time  # CPU time: the same on a loaded machine
    started = clock()
    work()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = clock() - started
    host = max(0, telemetry.peak_rss_bytes() - before)
    return host, (torch.cuda.max_memory_allocated(device) - gpu_before) if cuda else None, seconds


def measure(
    what: str,
    run: Callable[[torch.Tensor, torch.Tensor], object],
    inputs,
    rows: int,
    device,
    precision: str = "fp32",
    before_reset: Callable[[], None] | None = None,
) -> BatchPeak:
    """:class:`BatchPeak` of ``run(inputs, labels)`` (see the module's docstring) on :class:`ProbeInputs`, for
    batches of ``rows``, under the autocast of ``precision`` (``before_reset``: as for :func:`pass_peak`)."""
    import psutil

    def passes(n: int, times: int = 1) -> tuple[int, int | None, float]:
        x, y = inputs.take(n)

        def work() -> None:
            with autocast_for(precision, device):
                for _ in range(times):
                    run(x, y)

        return pass_peak(work, device, before_reset)

    x1 = inputs.take(1)[0]
    input_row = x1.numel() * x1.element_size()  # the batch's own inputs, made before each pass: added per row
    first, gpu_first, first_seconds = passes(1)
    if first_seconds > PROBE_SECONDS / 4 or rows == 1:  # a slow model: its one-row peak, all of it per row
        return BatchPeak(what, rows, 0, first + input_row, None if gpu_first is None else 0, gpu_first)
    one, _, seconds = passes(1)
    largest = min(rows, MAX_PROBE_ROWS, min(PROBE_BYTES, psutil.virtual_memory().available // 4) // max(one, 1))
    # the seconds per row, from a few rows (one row's time is mostly the call's own)
    few = max(1, min(largest, PROBE_SHORT_ROWS, int(PROBE_SECONDS / max(4 * seconds, 1e-6))))
    seconds_per_row = passes(few)[2] / few
    n = max(few, min(largest, int(PROBE_SECONDS / max(2 * seconds_per_row, 1e-9))))
    # A full collection once, before the pass that sets the figure: a collection of the old generation inside it
    # would free earlier passes' tensors for it to reuse, and the peak would read low (111 vs 163 MiB once in CI).
    gc.collect()
    host, gpu, _ = passes(n, times=2)
    per_row = -(-host // n) + input_row
    gpu_per_row = None if gpu is None else -(-gpu // n)
    fixed = max(0, first - per_row)  # the first call's own costs (autograd's first backward, lazy buffers)
    gpu_fixed = None if gpu_first is None else max(0, gpu_first - gpu_per_row)
    return BatchPeak(what, rows, fixed, per_row, gpu_fixed, gpu_per_row)


class ProbeInputs:
    """The first readable images of a dataset, transformed by the backbone as they are first asked for (a slow
    model's probe needs one): :meth:`take` gives ``(inputs [n, ...], labels [n])``, the images repeated in turn
    when the dataset has fewer than ``n``."""

    def __init__(self, backbone, dataset):
        self.backbone, self.dataset = backbone, dataset
        self.inputs: list[torch.Tensor] = []
        self.labels: list[int] = []
        self.next_index = 0

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.inputs) < n and self.next_index < len(self.dataset):
            item = self.dataset[self.next_index]
            self.next_index += 1
            if item is not None:
                self.inputs.append(self.backbone.transform(item[0]))
                self.labels.append(int(item[1]))
        if not self.inputs:
            raise BatchProbeError(f"the batch probe found no readable image in {self.dataset.name!r}")
        order = [i % len(self.inputs) for i in range(n)]
        return torch.stack([self.inputs[i] for i in order]), torch.tensor([self.labels[i] for i in order])


def model_detector_pass(name: str, params: dict, backbone, device: torch.device):
    """The pass ``run(inputs, labels)`` of detector ``name`` made as a run makes it: its fit on the batch when it
    learns from inputs, then its score."""

    detector = create(name, **{**params, "model": backbone})
    detector.batch_rows = NO_LIMIT  # the whole batch at once: the probe measures what one batch of it takes

    def run(inputs: torch.Tensor, labels: torch.Tensor) -> None:
        batch = Batch(inputs=inputs.to(device), labels=labels.to(device))
        if detector.needs_fit:
            detector.fit(batch, device=device)
        detector.score(batch, device=device)

    return run


def batch_peaks(
    config: RunConfig,
    backbone,
    dataset,
    extraction: bool = True,
    names: list[str] | None = None,
    before_reset: Callable[[], None] | None = None,
) -> tuple[list[BatchPeak], dict[str, str]]:
    """The :class:`BatchPeak` of the extraction (unless not ``extraction``) and of every model-based detector of
    ``config`` (those in ``names`` when given), at ``config.batch_size`` rows (``backbone`` loaded, ``dataset``
    the ID fit split), in this process, and ``{detector: error}`` for those that cannot run on this model (the
    run's own stage reports them too). ``before_reset``: as for :func:`pass_peak`."""

    device = parse_device(config.device)
    inputs = ProbeInputs(backbone, dataset)
    module = backbone.model if isinstance(backbone.model, torch.nn.Module) else None

    def extract(inputs: torch.Tensor, _labels) -> None:
        with torch.inference_mode():
            backbone.features_and_logits(inputs.to(device))

    peaks, failed = [], {}
    with model_on_device(module, device):
        if extraction:
            peaks.append(
                measure(EXTRACTION, extract, inputs, config.batch_size, device, config.precision, before_reset)
            )
        for choice in config.detectors:
            if detector_class(choice.name).needs_model and (names is None or choice.name in names):
                try:
                    run = model_detector_pass(choice.name, choice.params, backbone, device)
                    peaks.append(
                        measure(choice.name, run, inputs, config.batch_size, device, config.precision, before_reset)
                    )
                except (ValueError, TypeError, RuntimeError) as error:  # e.g. mcd on a model without dropout
                    failed[choice.name] = f"{type(error).__name__}: {error}"
    return peaks, failed


def rows_from_memory(peak: BatchPeak, batch_size: int, ram: int, gpu: int | None = None) -> int:
    """The rows a model-based detector passes at once (the module's docstring): at most ``batch_size``, at least
    one, and as many as fit ``MEMORY_FRACTION`` of ``ram`` (available host bytes) and, when the peak was measured on
    a GPU, of ``gpu`` (free device bytes)."""
    rows = peak.rows_fitting(MEMORY_FRACTION * ram, None if gpu is None else MEMORY_FRACTION * gpu)
    return min(batch_size, max(1, rows))


def sized(peaks: list[BatchPeak], limits: dict[str, int]) -> list[BatchPeak]:
    """``peaks`` with each model-based detector's ``rows`` the batch size it gets within ``limits`` (``ram``, and
    ``gpu`` on CUDA; :func:`rows_from_memory`); the extraction's stay the run's batch size."""
    return [
        peak
        if peak.what == EXTRACTION
        else replace(peak, rows=rows_from_memory(peak, peak.rows, limits["ram"], limits.get("gpu")))
        for peak in peaks
    ]


class ModelBatches:
    """The batch size of each model-based detector of a run (the run's ``Job.model_batches``): ``peaks`` by
    detector name, from the pre-flight or :func:`measure_for_run`; :meth:`rows` chooses a detector's batch size
    the first time it runs (:func:`rows_from_memory`, the memory available then) and keeps it for the run's
    later passes; :attr:`records` is what ``detectors.json`` shows under ``batch``."""

    def __init__(self, peaks: list[BatchPeak] | None = None):
        self.peaks = {peak.what: peak for peak in peaks or [] if peak.what != EXTRACTION}
        self.records: dict[str, dict] = {}
        self.not_measured: dict[str, str] = {}

    def rows(self, detector, batch_size: int, device: torch.device) -> int:
        """The rows ``detector`` passes at once; without a measured peak, ``batch_size`` (the detector then
        scores it in chunks of its own activation estimate, :mod:`oodviz.detectors.modelmemory`)."""
        name = detector.name
        if name not in self.records:
            peak = self.peaks.get(name)
            if peak is None:
                why = self.not_measured.get(name, "no batch probe ran")
                self.records[name] = {"rows": batch_size, "run_batch_size": batch_size, "measured": False, "why": why}
            else:
                ram = modelmemory.available_bytes(torch.device("cpu"))
                gpu = modelmemory.available_bytes(device) if device.type == "cuda" else None
                record = {
                    "rows": rows_from_memory(peak, batch_size, ram, gpu),
                    "run_batch_size": batch_size,
                    "measured": True,
                    "per_row_bytes": peak.per_row_bytes,
                    "fixed_bytes": peak.fixed_bytes,
                    "available_ram_bytes": ram,
                    "memory_fraction": MEMORY_FRACTION,
                }
                if gpu is not None:
                    record.update(
                        gpu_per_row_bytes=peak.gpu_per_row_bytes,
                        gpu_fixed_bytes=peak.gpu_fixed_bytes,
                        available_gpu_bytes=gpu,
                    )
                self.records[name] = record
            self.records[name].update(in_force=self.records[name]["rows"], oom_backoffs=0)
        record = self.records[name]
        detector.batch_rows = record["rows"] if record["measured"] else None
        return record["rows"]

    def ran(self, name: str, batch_size_in_force: int, oom_backoffs: int) -> None:
        """After a pass of detector ``name``: the smallest batch size in force so far and the back-offs in all."""
        record = self.records[name]
        record["in_force"] = min(record["in_force"], batch_size_in_force)
        record["oom_backoffs"] += oom_backoffs


def measure_for_run(job, stage) -> list[BatchPeak]:
    """Measure, in the run's process before it extracts anything, the model-based detectors of ``job`` whose peak
    the pre-flight did not hand over (``job.model_batches``); each measured line is a note of ``stage``, and a
    detector that cannot be measured keeps the run's batch size (why, in ``detectors.json``). Returns every
    detector's peak."""

    batches = job.model_batches
    missing = [
        c.name for c in job.config.detectors if detector_class(c.name).needs_model and c.name not in batches.peaks
    ]
    if missing:
        try:  # the probe resets the kernel's peak before each pass: the stage folds in its peak so far first
            peaks, failed = batch_peaks(
                job.config, job.backbone, job.datasets["id_fit"], False, missing, job.reporter.fold_kernel_peak
            )
        except BatchProbeError as error:
            peaks, failed = [], dict.fromkeys(missing, str(error))
        batches.peaks.update((peak.what, peak) for peak in peaks)
        batches.not_measured.update(failed)
        for peak in peaks:
            stage.note(f"measured {peak.describe()}")
    return list(batches.peaks.values())
