"""Peak memory of one batch, measured: the extraction forward and every model-based detector of a run.

:func:`batch_peaks` runs in the pre-flight (:func:`oodviz.runs.preflight.preflight`), after it has loaded the
backbone and the datasets: in the app, inside the estimate's own process (:mod:`oodviz.runs.probe`), which
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

The batch a run passes at once needs ``fixed + rows x per_row``: ``rows`` = the run's
``batch_size`` for the extraction and for the fits of adascale and gram (a fit step takes the whole batch),
``min(batch_size, rows_that_fit)`` for scoring (``ModelDetector`` scores a batch in chunks sized by
:func:`oodviz.detectors.modelmemory.rows_that_fit` on this machine). Measured in float32 whatever the run's
``precision`` (autocast needs less: an upper bound).
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from oodviz.runs.config import RunConfig

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

    def describe(self) -> str:
        """One line: ``batch of odin: 256 rows x 1.2 MiB + 3 MiB = 310 MiB``."""
        from oodviz.models.memory import format_bytes

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


def pass_peak(work: Callable[[], object], device: torch.device) -> tuple[int, int | None, float]:
    """(host bytes, GPU bytes or None) that ``work()`` took above what was held before it, at its peak, and the
    seconds it took (this process's CPU seconds on the CPU, wall seconds on CUDA)."""
    from oodviz.runs.telemetry import cpu_rss_bytes, peak_rss_bytes, reset_peak_rss

    gc.collect()
    trim_heap()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        gpu_before = torch.cuda.memory_allocated(device)
    before = cpu_rss_bytes()
    if not reset_peak_rss():
        raise BatchProbeError("the batch probe needs Linux's /proc/self/clear_refs to measure peak memory")
    clock = time.perf_counter if cuda else time.process_time  # CPU time: the same on a loaded machine
    started = clock()
    work()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = clock() - started
    host = max(0, peak_rss_bytes() - before)
    return host, (torch.cuda.max_memory_allocated(device) - gpu_before) if cuda else None, seconds


def measure(what: str, run: Callable[[torch.Tensor, torch.Tensor], object], inputs, rows: int, device) -> BatchPeak:
    """:class:`BatchPeak` of ``run(inputs, labels)`` (see the module's docstring) on :class:`ProbeInputs`, for
    batches of ``rows``."""
    import psutil

    def passes(n: int, times: int = 1) -> tuple[int, int | None, float]:
        x, y = inputs.take(n)
        return pass_peak(lambda: [run(x, y) for _ in range(times)], device)

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


def model_detector_pass(name: str, params: dict, backbone, device: torch.device, batch_size: int, inputs):
    """(the pass ``run(inputs, labels)`` of detector ``name``, the rows a run gives it at once)."""
    from oodviz.batch import Batch
    from oodviz.detectors import create
    from oodviz.detectors.modelmemory import activation_bytes, rows_that_fit

    detector = create(name, **{**params, "model": backbone})

    def run(inputs: torch.Tensor, labels: torch.Tensor) -> None:
        batch = Batch(inputs=inputs.to(device), labels=labels.to(device))
        if detector.needs_fit:
            detector.fit(batch, device=device)
        detector.score(batch, device=device)

    module = detector.module
    if detector.needs_fit or module is None:
        return run, batch_size
    per_input = activation_bytes(module, detector.logits, inputs.take(1)[0].to(device))
    return run, min(batch_size, rows_that_fit(per_input, detector.activation_copies, device))


def batch_peaks(config: RunConfig, backbone, dataset) -> tuple[list[BatchPeak], dict[str, str]]:
    """The :class:`BatchPeak` of the extraction and of every model-based detector of ``config`` (``backbone``
    loaded, ``dataset`` the ID fit split), in this process, and ``{detector: error}`` for those that cannot run
    on this model (the run's own stage reports them too)."""
    from oodviz.detectors import detector_class
    from oodviz.models.placement import model_on_device
    from oodviz.runs.pipeline import resolve_device

    device = resolve_device(config.device)
    inputs = ProbeInputs(backbone, dataset)
    module = backbone.model if isinstance(backbone.model, torch.nn.Module) else None

    def extraction(inputs: torch.Tensor, _labels) -> None:
        with torch.inference_mode():
            backbone.features_and_logits(inputs.to(device))

    peaks, failed = [], {}
    with model_on_device(module, device):
        peaks.append(measure(EXTRACTION, extraction, inputs, config.batch_size, device))
        for choice in config.detectors:
            if detector_class(choice.name).needs_model:
                try:
                    run, rows = model_detector_pass(
                        choice.name, choice.params, backbone, device, config.batch_size, inputs
                    )
                    peaks.append(measure(choice.name, run, inputs, rows, device))
                except (ValueError, TypeError, RuntimeError) as error:  # e.g. mcd on a model without dropout
                    failed[choice.name] = f"{type(error).__name__}: {error}"
    return peaks, failed
