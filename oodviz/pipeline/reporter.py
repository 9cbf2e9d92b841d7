"""Progress events of a run: stages, done/total, items/s, ETA, device, memory, warnings.

The worker and the CLI report through a :class:`Reporter`; it appends one JSON event per line
to the run's ``events.jsonl`` (at most every ``interval_s`` seconds within a stage, plus every
stage start and end) and, for the CLI, also hands each event to ``echo`` (:class:`TerminalProgress`: one live
line per stage on the terminal).

A stage's ``peak_cpu_rss`` is the kernel's own peak of the worker's resident memory (``VmHWM``), reset
when the stage starts (``/proc/self/clear_refs``), so a temporary that lives between two progress events
is counted; where the reset is not permitted it is the largest RSS sampled at the stage's events
(``peak_cpu_rss_method`` says which). GPU peaks come from the CUDA allocator.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from oodviz.engine import Cancelled
from oodviz.models import format_bytes
from oodviz.runs.rundir import RunDir
from oodviz.runs.telemetry import memory_snapshot, peak_rss_bytes, reset_peak_rss


class Stage:
    """One stage being run: ``progress``, ``note`` and ``failed`` write events tagged with its name."""

    def __init__(self, reporter: Reporter, name: str):
        self.reporter, self.name = reporter, name
        self.started = time.monotonic()
        self.last_emit = 0.0
        self.peak_cpu_rss = 0
        self.kernel_peak = False  # peak_cpu_rss from VmHWM (reset at the start), not only sampled
        self.error: str | None = None
        self.notes_seen: set[str] = set()

    def progress(self, done: int, total: int, info: dict | None = None) -> None:
        """Report ``done`` of ``total`` items; ``info`` may carry ``items_per_s``, ``batch_size``, ``stage`` and a
        ``note`` (e.g. the DataLoader's reduced prefetch), which becomes a warning event once per stage."""
        self.reporter.check_cancel()
        note = (info or {}).get("note")
        if note and note not in self.notes_seen:
            self.notes_seen.add(note)
            self.reporter.warn(note)
        now = time.monotonic()
        if done < total and now - self.last_emit < self.reporter.interval_s:
            return
        self.last_emit = now
        info = info or {}
        elapsed = now - self.started
        rate = info.get("items_per_s") or (done / elapsed if elapsed > 0 else None)
        eta = (total - done) / rate if rate and total >= done else None
        event = {"event": "progress", "done": done, "total": total, "items_per_s": rate, "eta_s": eta}
        for key in ("batch_size", "oom_backoffs", "skipped"):
            if key in info:
                event[key] = info[key]
        if info.get("stage") == "reused":
            event["reused"] = True
        self.reporter.emit(self, event)

    def note(self, message: str) -> None:
        self.reporter.emit(self, {"event": "note", "message": message})

    def failed(self, message: str) -> None:
        """Mark the stage failed; its ``end`` event and summary carry every message, ``"; "``-joined."""
        self.error = message if not self.error else f"{self.error}; {message}"


class Reporter:
    def __init__(self, run: RunDir, echo: Callable[[dict], None] | None = None, interval_s: float = 0.5):
        self.run = run
        self.echo = echo
        self.interval_s = interval_s
        self.device: torch.device | None = None
        self._summary: dict[str, dict] = {}
        self._open: list[Stage] = []  # stages started and not ended, outermost first

    def check_cancel(self) -> None:
        """:class:`oodviz.engine.Cancelled` when the user asked the run to stop."""
        if self.run.cancel_requested():
            raise Cancelled("cancelled by the user")

    def emit(self, stage: Stage | None, event: dict) -> None:
        snapshot = memory_snapshot(self.device)
        if stage is not None:
            stage.peak_cpu_rss = max(stage.peak_cpu_rss, snapshot["cpu_rss"])
        event = {"stage": None if stage is None else stage.name, **event, "device": str(self.device), **snapshot}
        self.run.append_event(event)
        if self.echo is not None:
            self.echo(event)

    def warn(self, message: str, fixes=()) -> None:
        """A warning event; ``fixes``: :class:`~oodviz.problems.Fix` objects that would cure it (the app's buttons)."""
        event = {"event": "warning", "message": message}
        if fixes:
            event["fixes"] = [fix.to_dict() for fix in fixes]
        self.emit(None, event)

    @contextmanager
    def stage(self, name: str) -> Iterator[Stage]:
        self.check_cancel()
        stage = Stage(self, name)
        cuda = self.device is not None and self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.fold_kernel_peak()  # an enclosing stage keeps the peak so far before the reset
        stage.kernel_peak = reset_peak_rss()
        self._open.append(stage)
        self.run.write_status(stage=name)
        self.emit(stage, {"event": "start"})
        try:
            yield stage
        finally:
            self.fold_kernel_peak()
            self._open.remove(stage)
        if cuda:  # the stage's kernels may still be running: its time ends when they do
            torch.cuda.synchronize(self.device)
        summary = {
            "wall_s": time.monotonic() - stage.started,
            "peak_cpu_rss": stage.peak_cpu_rss,
            "peak_cpu_rss_method": "VmHWM" if stage.kernel_peak else "sampled",
        }
        if cuda:
            summary["peak_gpu_allocated"] = torch.cuda.max_memory_allocated(self.device)
        if stage.error:
            summary["error"] = stage.error
        self._summary[name] = summary
        self.emit(stage, {"event": "end", **summary})

    def fold_kernel_peak(self) -> None:
        """Add the kernel's peak RSS since the last reset to every open stage that measures by it."""
        peak = peak_rss_bytes()
        for stage in self._open:
            if stage.kernel_peak and peak is not None:
                stage.peak_cpu_rss = max(stage.peak_cpu_rss, peak)

    def stage_summary(self) -> dict[str, dict]:
        """Wall time and peak memory of every finished stage."""
        return dict(self._summary)


def _progress_line(event: dict) -> str:
    done, total = event.get("done", 0), event.get("total", 0)
    parts = [f"{event['stage']}: {done:,}/{total:,}"]
    if total:
        parts[0] += f" ({100 * done / total:.0f}%)"
    if event.get("items_per_s"):
        parts.append(f"{event['items_per_s']:,.0f}/s")
    if event.get("eta_s") is not None:
        parts.append(f"ETA {event['eta_s']:.0f}s")
    if event.get("batch_size"):
        parts.append(f"batch {event['batch_size']}")
    parts.append(f"RSS {format_bytes(event['cpu_rss'])}")
    if "gpu_allocated" in event:
        parts.append(f"GPU {format_bytes(event['gpu_allocated'])} (peak {format_bytes(event['gpu_peak'])})")
    return " | ".join(parts)


class TerminalProgress:
    """Turns run events into one live status line per stage (carriage returns on a terminal)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr or sys.__stderr__
        self.live = self.stream.isatty()
        self.width = shutil.get_terminal_size((100, 20)).columns - 1

    def __call__(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "progress" and self.live:
            self.stream.write("\r" + _progress_line(event)[: self.width].ljust(self.width))
        elif kind == "end":
            peak = f", peak RSS {format_bytes(event['peak_cpu_rss'])}" if event.get("peak_cpu_rss") else ""
            failed = f" — FAILED: {event['error']}" if event.get("error") else ""
            self.stream.write(
                ("\r" if self.live else "")
                + f"{event['stage']}: {event['wall_s']:.1f}s{peak}{failed}".ljust(self.width if self.live else 0)
                + "\n"
            )
        elif kind in ("warning", "note"):
            prefix = "WARNING " if kind == "warning" else "  "
            lines = "".join(f"{prefix}{line}\n" for line in event["message"].splitlines())
            self.stream.write(("\r" if self.live else "") + lines)
        elif kind == "failed":
            self.stream.write(f"\nrun failed: {event.get('message', '')}\n")
        elif kind == "cancelled" and self.live:  # the live line ends; the command says how the run ended
            self.stream.write("\n")
        self.stream.flush()
