"""Peak memory of one batch, measured: the extraction forward and every model-based detector of a run.

``python -m oodviz.runs.batchprobe`` reads a run config (JSON) on stdin and prints one JSON line,
``{"batches": [BatchPeak, ...], "failed": {detector: error}}`` or ``{"error": "..."}`` (exit 1);
:func:`batch_peaks_in_subprocess` runs it under a timeout for the pre-flight (:mod:`oodviz.runs.preflight`),
so every figure comes from a process that holds nothing else.

What is measured, for each pass of a batch through the model (the extraction forward under
``inference_mode``; each detector with ``needs_model``, made as a run makes it, with the run's backbone: its
fit on the batch when it learns from inputs, adascale and gram, then its ``score``, autograd included for odin,
every dropout pass for mcd) on the first images of the ID fit split, transformed by the backbone:

- host: ``peak(b) = VmHWM - RSS`` (bytes), the kernel's high-water mark of resident memory
  (:func:`~oodviz.runs.telemetry.peak_rss_bytes`, reset before the pass) less the resident memory before it,
  with the freed heap handed back to the kernel first (``malloc_trim``) so that an earlier pass's freed memory
  does not hide this one's;
- GPU (a CUDA run): ``max_memory_allocated - memory_allocated`` from the caching allocator, its peak reset.

Passes, in order: one row twice (``first``: lazy initialisation, a detector's own activation measurement),
then ``2 b``, ``b`` and ``2 b`` rows, ``b`` chosen so that ``2 b`` rows take at most :data:`PROBE_BYTES` (and a
quarter of the available RAM) at the second one-row peak, and at most half the run's batch. ``peak(2 b)`` is
the larger of its two: once glibc has freed a large block it raises its mmap threshold and serves the next
ones from the heap, handed back to the kernel later, so the first pass of a size can measure a third less
than the ones a long run sees. The bytes grow linearly with the rows:

    per_row = (peak(2 b) - peak(b)) / b
    fixed   = max(0, peak(b) - b x per_row, first - per_row)

(the first call of a pass pays costs the later ones do not, autograd's first backward, lazily made buffers; a
run pays them too), and the batch a run passes at once needs ``fixed + rows x per_row``: ``rows`` = the run's
``batch_size`` for the extraction and for the fits of adascale and gram (a fit step takes the whole batch),
``min(batch_size, rows_that_fit)`` for scoring (``ModelDetector`` scores a batch in chunks sized by
:func:`oodviz.detectors.modelmemory.rows_that_fit` on this machine). Measured in float32 whatever the run's
``precision`` (autocast needs less: an upper bound).
"""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from oodviz.runs.config import RunConfig

#: host bytes the probe's largest batch (``2 b`` rows) may take, at the one-row peak (and at most a quarter of the
#: available RAM)
PROBE_BYTES = 2**30
TIMEOUT_S = 100.0
EXTRACTION = "extraction"


class BatchProbeError(RuntimeError):
    """The probe's process failed, crashed or ran out of time; the message says which."""


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


def pass_peak(work: Callable[[], object], device: torch.device) -> tuple[int, int | None]:
    """(host bytes, GPU bytes or None) that ``work()`` took above what was held before it, at its peak."""
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
    work()
    if cuda:
        torch.cuda.synchronize(device)
    host = max(0, peak_rss_bytes() - before)
    return host, (torch.cuda.max_memory_allocated(device) - gpu_before) if cuda else None


def fit_line(peak_b: int, peak_2b: int, b: int) -> tuple[int, int]:
    """(fixed, per_row) of the line through ``(b, peak_b)`` and ``(2 b, peak_2b)``, both at least 0."""
    per_row = max(0, (peak_2b - peak_b) // b)
    return max(0, peak_b - b * per_row), per_row


def measure(what: str, run: Callable[[torch.Tensor, torch.Tensor], object], x, y, rows: int, device) -> BatchPeak:
    """:class:`BatchPeak` of ``run(inputs, labels)`` (see the module's docstring), for batches of ``rows``."""
    import psutil

    first, gpu_first = pass_peak(lambda: run(x[:1], y[:1]), device)
    one, _ = pass_peak(lambda: run(x[:1], y[:1]), device)
    budget = min(PROBE_BYTES, psutil.virtual_memory().available // 4)
    b = max(1, min(rows // 2, budget // max(2 * one, 1), len(x) // 2))
    first_2b, (host_b, gpu_b), (host_2b, gpu_2b) = (
        pass_peak(lambda n=n: run(x[:n], y[:n]), device) for n in (2 * b, b, 2 * b)
    )
    host_2b = max(host_2b, first_2b[0])
    gpu_2b = None if gpu_2b is None else max(gpu_2b, first_2b[1])
    fixed, per_row = fit_line(host_b, host_2b, b)
    gpu_fixed, gpu_per_row = (None, None) if gpu_b is None else fit_line(gpu_b, gpu_2b, b)
    fixed = max(fixed, first - per_row)  # the first call's own costs (autograd's first backward, lazy buffers)
    gpu_fixed = None if gpu_first is None else max(gpu_fixed, gpu_first - gpu_per_row)
    return BatchPeak(what, rows, fixed, per_row, gpu_fixed, gpu_per_row)


def probe_inputs(backbone, dataset, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` transformed inputs and their labels: the dataset's first readable items, repeated when it has fewer."""
    xs, ys = [], []
    for i in range(len(dataset)):
        item = dataset[i]
        if item is not None:
            xs.append(backbone.transform(item[0]))
            ys.append(int(item[1]))
        if len(xs) == n:
            break
    if not xs:
        raise BatchProbeError(f"the batch probe found no readable image in {dataset.name!r}")
    order = torch.arange(n) % len(xs)
    return torch.stack(xs)[order], torch.tensor(ys, dtype=torch.long)[order]


def model_detector_pass(name: str, params: dict, backbone, device: torch.device, batch_size: int, x):
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
    per_input = activation_bytes(module, detector.logits, x[:1].to(device))
    return run, min(batch_size, rows_that_fit(per_input, detector.activation_copies, device))


def batch_peaks(config: RunConfig) -> tuple[list[BatchPeak], dict[str, str]]:
    """The :class:`BatchPeak` of the extraction and of every model-based detector of ``config``, in this process,
    and ``{detector: error}`` for those that cannot run on this model (the run's own stage reports them too)."""
    from oodviz.detectors import detector_class
    from oodviz.models.placement import model_on_device
    from oodviz.runs.pipeline import resolve_device
    from oodviz.runs.splits import load_split

    device = resolve_device(config.device)
    backbone = config.load_backbone()
    dataset = load_split(config, config.id_fit, False, backbone.classes)
    x, y = probe_inputs(backbone, dataset, min(max(config.batch_size, 2), 4096))
    module = backbone.model if isinstance(backbone.model, torch.nn.Module) else None

    def extraction(inputs: torch.Tensor, _labels) -> None:
        with torch.inference_mode():
            backbone.features_and_logits(inputs.to(device))

    peaks, failed = [], {}
    with model_on_device(module, device):
        peaks.append(measure(EXTRACTION, extraction, x, y, config.batch_size, device))
        for choice in config.detectors:
            if detector_class(choice.name).needs_model:
                try:
                    run, rows = model_detector_pass(choice.name, choice.params, backbone, device, config.batch_size, x)
                    peaks.append(measure(choice.name, run, x, y, rows, device))
                except (ValueError, TypeError, RuntimeError) as error:  # e.g. mcd on a model without dropout
                    failed[choice.name] = f"{type(error).__name__}: {error}"
    return peaks, failed


def batch_peaks_in_subprocess(
    config: RunConfig, timeout_s: float = TIMEOUT_S
) -> tuple[list[BatchPeak], dict[str, str]]:
    """:func:`batch_peaks` run by ``python -m oodviz.runs.batchprobe``; raises :class:`BatchProbeError` with the
    child's message, or on a timeout or crash."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "oodviz.runs.batchprobe"],
            input=json.dumps(config.to_dict()),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise BatchProbeError(f"the batch probe took longer than {timeout_s:.0f} s and was stopped") from None
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        raise BatchProbeError(f"the batch probe ended without an answer (exit code {done.returncode}; crashed?)")
    if "error" in answer:
        raise BatchProbeError(answer["error"])
    return [BatchPeak(**peak) for peak in answer["batches"]], answer["failed"]


def main() -> int:
    try:
        peaks, failed = batch_peaks(RunConfig.from_dict(json.loads(sys.stdin.read())))
    except Exception as error:  # the caller shows it: one line, no traceback
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        return 1
    print(json.dumps({"batches": [asdict(peak) for peak in peaks], "failed": failed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
