"""A run is a directory: its config, an append-only event log, a status file and the results.

Layout of ``<runs root>/<run id>/``::

    config.json      the RunConfig, written once when the run is created
    status.json      {"state", "stage", "error", "pid", "created", "started", "finished", "exit_code"}
    events.jsonl     one JSON event per line, appended by the worker (progress, memory, warnings)
    cancel           present = the user asked the run to stop
    worker.log       the worker's stdout and stderr
    metrics.csv, scores.parquet, per_class.csv, detectors.json, meta.json   the results (see oodviz.results)

Every file except the event log is written atomically (a temporary file renamed over the old
one), so a reader never sees half a file. The event log is only appended; a reader skips a
last line that is still being written.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)

STATES = ("queued", "running", "done", "failed", "cancelled")
FINAL_STATES = ("done", "failed", "cancelled")


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp creates 0600; results are ordinary files
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, value) -> None:
    write_atomic(path, json.dumps(value, indent=2, default=str))


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

    # -- status ------------------------------------------------------------------------------
    def read_status(self) -> dict:
        try:
            return json.loads(self.status_path.read_text())
        except FileNotFoundError:
            return {"state": "failed", "error": "the run directory has no status.json (not an oodviz run?)"}

    def write_status(self, **changes) -> dict:
        status = self.read_status() if self.status_path.exists() else {}
        status.update(changes)
        write_json(self.status_path, status)
        return status

    def read_config(self) -> dict:
        return json.loads(self.config_path.read_text())

    # -- events ------------------------------------------------------------------------------
    def append_event(self, event: dict) -> None:
        line = json.dumps({"time": time.time(), **event}, default=str) + "\n"
        with open(self.events_path, "a") as f:
            f.write(line)
            f.flush()

    def read_events(self) -> list[dict]:
        try:
            text = self.events_path.read_text()
        except FileNotFoundError:
            return []
        events = []
        for line in text.splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the last line may be mid-write
        return events

    # -- cancel ------------------------------------------------------------------------------
    def request_cancel(self) -> None:
        self.cancel_path.touch()

    def cancel_requested(self) -> bool:
        return self.cancel_path.exists()
