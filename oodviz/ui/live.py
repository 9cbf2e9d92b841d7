"""What the live panel knows of a running run, read from ``events.jsonl`` incrementally (no streamlit here).

:class:`EventTail` remembers the byte offset it has read up to: each poll reads only the lines appended
since, so a poll costs the same whatever the run's length. It keeps the state the panel draws (finished
stages, the latest progress event, the last warnings) and a memory series bounded to ``2 x max_points``
samples: it keeps every ``stride``-th sample (stride 1 at first); when full, every other kept sample is
dropped and the stride doubles, so the series spans the whole run evenly at the resolution that fits (the
latest sample is always shown too). :meth:`EventTail.series` thins it to a fixed number of points for the chart,
so the chart a poll sends is the same size whatever the run's length.
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

#: Largest chunk one poll reads; a longer backlog is read over the next polls.
MAX_READ_BYTES = 1 << 20
MEMORY_KEYS = ("time", "stage", "event", "cpu_rss", "gpu_allocated", "gpu_reserved", "gpu_peak")
#: what the per-rank table shows of each process of a run on several (its latest value of each)
RANK_KEYS = ("stage", "device", "batch_size", "cpu_rss", "gpu_allocated", "gpu_peak")


class EventTail:
    """The state of one run's event log, brought up to date by :meth:`poll`.

    - ``ended``: ``{stage: its end event}`` in order; ``started``: the first event's time (s since the epoch);
    - ``latest``: the last ``progress`` event; ``last``: the last event with a memory snapshot;
    - ``warnings``: the last ``keep_warnings`` distinct warning messages;
    - ``queued``: the last message of the ``queued`` stage; ``memory``: the bounded memory samples;
    - ``ranks``: ``{rank: its latest RANK_KEYS}`` of a run on several processes (rank 0's from the run's own
      events, the others' from their ``{"event": "rank", "rank": r, "kind": ...}`` events, which stay out of the
      stages, progress and memory series, which are rank 0's); their warnings join ``warnings`` as ``rank r: ...``.
    """

    def __init__(self, path: Path, max_points: int = 300, keep_warnings: int = 5):
        self.path = Path(path)
        self.offset = 0
        self.max_points = max_points
        self.ended: dict[str, dict] = {}
        self.started: float | None = None
        self.latest: dict | None = None
        self.last: dict = {}
        self.queued: str | None = None
        self.warnings: deque[str] = deque(maxlen=keep_warnings)
        self.samples: list[dict] = []  # every stride-th memory sample
        self.stride = 1
        self.seen = 0  # memory samples seen
        self.newest: dict | None = None
        self.ranks: dict[int, dict] = {}

    def poll(self) -> int:
        """Read the complete lines appended since the last poll (a line still being written waits for the
        next poll); returns how many bytes were read."""
        try:
            with self.path.open("rb") as file:
                file.seek(self.offset)
                chunk = file.read(MAX_READ_BYTES)
        except OSError:
            return 0
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # a damaged line (not UTF-8, not JSON): skipped, as RunDir.read_events does
                continue
            if isinstance(event, dict):
                self.add(event)
        return len(complete)

    def _add_rank(self, rank: int, event: dict) -> None:
        entry = self.ranks.setdefault(rank, {})
        entry.update({key: event[key] for key in RANK_KEYS if event.get(key) is not None})

    def add(self, event: dict) -> None:
        kind, stage = event.get("event"), event.get("stage")
        if kind == "rank" and isinstance(event.get("rank"), int):
            self._add_rank(event["rank"], event)
            if event.get("kind") == "warning" and event.get("message"):
                self.add({"event": "warning", "message": f"rank {event['rank']}: {event['message']}"})
            return
        if event.get("device") is not None:
            self._add_rank(0, event)
        if self.started is None and event.get("time") is not None:
            self.started = float(event["time"])
        if kind == "end" and stage:
            self.ended[stage] = event
        elif kind == "progress":
            self.latest = event
        elif kind == "warning" and event.get("message"):
            if event["message"] in self.warnings:
                self.warnings.remove(event["message"])
            self.warnings.append(event["message"])
        if stage == "queued" and event.get("message"):
            self.queued = event["message"]
        if event.get("cpu_rss") is not None and event.get("time") is not None:
            self.last = event
            self.newest = {k: event[k] for k in MEMORY_KEYS if k in event}
            if self.seen % self.stride == 0:
                self.samples.append(self.newest)
                if len(self.samples) > 2 * self.max_points:
                    self.samples, self.stride = self.samples[::2], 2 * self.stride
            self.seen += 1

    @property
    def memory(self) -> list[dict]:
        """The kept memory samples, then the newest one when it was not kept."""
        if self.newest is None or (self.samples and self.samples[-1] is self.newest):
            return list(self.samples)
        return [*self.samples, self.newest]

    def series(self, points: int) -> list[dict]:
        """``points`` of :attr:`memory` evenly spaced by position, the first and the newest included (all of
        them while there are fewer): a chart of a fixed size once the run has ``points`` samples."""
        memory = self.memory
        if len(memory) <= points:
            return memory
        step = (len(memory) - 1) / (points - 1)
        return [memory[round(i * step)] for i in range(points)]

    def elapsed_s(self, now: float | None = None) -> float:
        return 0.0 if self.started is None else max((now or time.time()) - self.started, 0.0)


def stage_position(plan: list[str], ended: dict, current: str | None, latest: dict | None) -> tuple[int, float]:
    """``(k, fraction)``: the current stage's number k (1-based, of ``len(plan)``) and the run's fraction
    done, ``(finished stages + done/total of the current one) / N``; the stages weigh the same."""
    finished = sum(1 for stage in plan if stage in ended)
    within = 0.0
    if latest and current and latest.get("stage") == current and current not in ended:
        within = min(latest.get("done", 0) / max(latest.get("total", 0), 1), 1.0)
    n = max(len(plan), 1)
    return min(finished + 1, n), min((finished + within) / n, 1.0)


def run_eta_s(elapsed_s: float, fraction: float) -> float | None:
    """Seconds left if the rest goes at the pace so far, ``elapsed x (1 - f) / f``; None before any progress."""
    if fraction <= 0.0 or elapsed_s <= 0.0:
        return None
    return elapsed_s * (1.0 - fraction) / fraction


def hms(seconds: float) -> str:
    """``3725`` -> ``"1:02:05"``; under an hour ``"2:05"`` (minutes:seconds)."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
