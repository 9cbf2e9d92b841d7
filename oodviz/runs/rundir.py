"""A run is a directory: its config, an append-only event log, a status file and the results.

Layout of ``<runs root>/<run id>/``::

    config.json      the RunConfig, written once when the run is created
    status.json      {"state", "stage", "error", "created", "started", "finished", "exit_code", "failed_detectors",
                      "supervisor_pid"/"worker_pid"/"pid" each with its process start time "..._started"}
    .lock            the lock held while status.json is read, changed and written
    events.jsonl     one JSON event per line, appended by the worker (progress, memory, warnings)
    cancel           present = the user asked the run to stop
    worker.log       the worker's stdout and stderr
    metrics.csv, scores.parquet, per_class.csv, detectors.json, meta.json   the results (see oodviz.results.tables)

Every file except the event log is written atomically (a temporary file renamed over the old
one), so a reader never sees half a file. The event log is only appended; a reader skips a
last line that is still being written.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from oodviz.files import FILE_MODE, read_json_object, write_json

STATES = ("queued", "running", "done", "failed", "cancelled")
FINAL_STATES = ("done", "failed", "cancelled")
#: what readers show for a run whose files cannot be read (never written: a reader's verdict)
DAMAGED = "damaged"
LOCK_TIMEOUT_S = 30.0
START_TIME_TOLERANCE_S = 0.05  # psutil derives start times from clock ticks since boot


def process_started(pid: int) -> float | None:
    """When process ``pid`` started (``psutil.Process(pid).create_time()``), None when there is no such process.

    Recorded next to a pid in ``status.json``: a process with that pid but another start time is not ours."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def process_alive(pid: int | None, started: float | None) -> bool:
    """Whether ``pid`` is a running (not zombie) process that started at ``started`` (as recorded by
    :func:`process_started`; None: any start time, for records older than this check)."""
    if not pid:
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # it has exited; its parent has not collected it yet
            return False
        return started is None or abs(process.create_time() - started) < START_TIME_TOLERANCE_S
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def new_run_id() -> str:
    """Sortable by creation time (UTC, microseconds), unique across processes."""
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f"{int(now * 1e6) % 1_000_000:06d}"
    return f"{stamp}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class RunDir:
    """Paths and file access of one run directory."""

    path: Path

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def status_path(self) -> Path:
        return self.path / "status.json"

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def cancel_path(self) -> Path:
        return self.path / "cancel"

    @property
    def log_path(self) -> Path:
        return self.path / "worker.log"

    @property
    def scratch_path(self) -> Path:
        """Working files of the worker (e.g. a knn bank that could not be the feature store itself): removed
        when the worker ends, however it ends."""
        return self.path / "scratch"

    def remove_scratch(self) -> None:
        shutil.rmtree(self.scratch_path, ignore_errors=True)

    @classmethod
    def create(cls, root: Path, config: dict, name: str | None = None) -> RunDir:
        """A new run directory ``root/name`` (default: a fresh sortable id) holding ``config``, state queued.

        A given ``name`` may already exist only as an empty directory.
        """
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        if name is not None:
            path = root / name
            path.mkdir(exist_ok=True)
            if any(path.iterdir()):
                raise FileExistsError(f"{path} is not empty; choose a new run directory")
        else:
            while True:  # a clash is astronomically unlikely, but two sessions may submit in the same microsecond
                path = root / new_run_id()
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    continue
        run = cls(path)
        write_json(run.config_path, config)
        run.write_status(state="queued", created=time.time())
        return run

    @property
    def lock_path(self) -> Path:
        return self.path / ".lock"

    @contextmanager
    def locked(self, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
        """Hold the run's lock (``flock`` on ``.lock``; TimeoutError after ``timeout_s``). Not
        ``filelock``: it creates missing directories, and a run deleted meanwhile must stay deleted
        (FileNotFoundError here). The lock is released when the holder exits, however it exits."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{self.lock_path} is held by another process for over {timeout_s:.0f}s"
                        ) from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    # -- status ------------------------------------------------------------------------------
    def read_status(self) -> dict:
        """``status.json``; never raises: a missing or unreadable one gives state ``damaged`` and says why."""
        status, problem = read_json_object(self.status_path)
        return status if problem is None else {"state": DAMAGED, "error": f"damaged: {problem}"}

    def write_status(self, only_if: Callable[[dict], bool] | None = None, **changes) -> dict:
        """Apply ``changes`` to ``status.json`` under the run's lock (``.lock``), so that two processes
        (supervisor, worker, the queue settling a dead job) never lose each other's changes; a damaged
        status is replaced. ``only_if(status)`` false: nothing is written. Returns the status in force.
        Raises OSError (FileNotFoundError when the run was deleted)."""
        with self.locked():
            status, problem = read_json_object(self.status_path)
            status = {} if problem else status
            if only_if is not None and not only_if(status):
                return status
            status.update(changes)
            try:
                write_json(self.status_path, status)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                # a full disk has no room for a second copy: rewrite the file in place, so that the run's
                # end is still recorded (a reader may see it damaged for that instant); no traceback
                with open(self.status_path, "w") as f:
                    f.write(json.dumps({k: v for k, v in status.items() if k != "detail"}, default=str))
            return status

    def read_config(self) -> dict:
        """``config.json`` as a dict; ValueError saying what is wrong with it."""
        config, problem = read_json_object(self.config_path)
        if problem is not None:
            raise ValueError(problem)
        return config

    # -- events ------------------------------------------------------------------------------
    def append_event(self, event: dict) -> None:
        line = json.dumps({"time": time.time(), **event}, default=str) + "\n"
        with open(self.events_path, "a") as f:
            f.write(line)
            f.flush()

    def read_events(self) -> list[dict]:
        """The events (JSON objects) of ``events.jsonl``; a line that is not one (mid-write, damaged, not
        UTF-8) is skipped; ``[]`` when the file cannot be read."""
        try:
            lines = self.events_path.read_bytes().splitlines()
        except OSError:
            return []
        events = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:  # the last line may be mid-write; bytes that are not UTF-8
                continue
            if isinstance(event, dict):
                events.append(event)
        return events

    # -- cancel ------------------------------------------------------------------------------
    def request_cancel(self) -> None:
        self.cancel_path.touch()

    def cancel_requested(self) -> bool:
        return self.cancel_path.exists()
