"""Start, queue, watch and cancel jobs. Each job runs in processes of its own.

``submit`` creates the run directory and starts a small *supervisor* process
(``python -m oodviz.runs.supervise RUN_DIR``, a new session, detached from the caller). The
supervisor waits for its turn (one job runs at a time per runs root, in order of creation),
then starts the *worker* (``python -m oodviz.runs.worker RUN_DIR``) that does the work, and
records how it ended. A host out-of-memory kill or a CUDA fault takes down the worker, never
the app that submitted it; the supervisor, which holds no data, survives to say so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from oodviz.runs.config import RunConfig
from oodviz.runs.rundir import FINAL_STATES, RunDir
from oodviz.runs.telemetry import job_environment

CANCEL_GRACE_S = 10.0  # after a cancel request, a worker that has not stopped by then is killed


def pid_alive(pid: int | None, run: RunDir | None = None) -> bool:
    """Whether process ``pid`` exists (and, given ``run``, was started for that run directory)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if run is not None:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return True  # no /proc (not Linux): trust the pid
        if str(run.path.resolve()).encode() not in cmdline:
            return False  # the pid was reused by another process
        try:  # a zombie has exited; its parent has just not collected it yet
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return False
        except OSError:
            pass
    return True


def _spawn(module: str, run: RunDir, new_session: bool) -> subprocess.Popen:
    log = open(run.log_path, "ab")
    env = job_environment(dict(os.environ, PYTHONUNBUFFERED="1"))  # cuda:N as the app lists it
    return subprocess.Popen(
        [sys.executable, "-m", module, str(run.path.resolve())],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=new_session,
        env=env,
    )


def submit(config: RunConfig, runs_root: Path) -> RunDir:
    """Validate ``config``, create its run directory and start it in the background."""
    config.validate()
    run = RunDir.create(Path(runs_root), config.to_dict())
    # The supervisor forks and its first process exits at once, after recording the pid of the
    # second: waiting for it here leaves no zombie in a long-lived caller such as the app.
    _spawn("oodviz.runs.supervise", run, new_session=True).wait()
    return run


def start_worker(run: RunDir) -> subprocess.Popen:
    """Used by the supervisor: the worker runs in the supervisor's session, so a kill of the group stops both."""
    return _spawn("oodviz.runs.worker", run, new_session=False)


def refresh(run: RunDir) -> dict:
    """The run's status, after checking that an unfinished run still has a live supervisor.

    A run whose supervisor is gone (killed, or the machine restarted) is marked failed.
    """
    status = run.read_status()
    if status.get("state") in FINAL_STATES:
        return status
    if "supervisor_pid" in status:  # a background job
        alive = pid_alive(status["supervisor_pid"], run)
    elif "pid" in status:  # `oodviz run` in the foreground
        alive = pid_alive(status["pid"])
    else:
        return status  # created, not started yet
    if not alive:
        return run.write_status(
            state="failed",
            error="the job's processes are gone (killed, or the machine restarted) before it finished",
            finished=time.time(),
        )
    return status


def cancel(run: RunDir) -> None:
    """Ask the run to stop: the worker stops at its next batch; the supervisor kills it after a grace period."""
    status = run.read_status()
    if status.get("state") in FINAL_STATES:
        return
    run.request_cancel()


def list_runs(runs_root: Path) -> list[RunDir]:
    """Every run under ``runs_root``, newest first."""
    root = Path(runs_root)
    if not root.is_dir():
        return []
    runs = [RunDir(p) for p in root.iterdir() if p.is_dir() and (p / "config.json").exists()]
    return sorted(runs, key=lambda r: r.run_id, reverse=True)


def delete_run(run: RunDir) -> None:
    """Remove a finished run; an unfinished one is cancelled and killed first."""
    status = refresh(run)
    if status.get("state") not in FINAL_STATES:
        pid = status.get("supervisor_pid")
        if pid_alive(pid, run):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)  # the supervisor and its worker
            except (ProcessLookupError, PermissionError):
                pass
    shutil.rmtree(run.path, ignore_errors=True)


def queue_ahead(run: RunDir) -> list[RunDir]:
    """Unfinished runs in the same root created before ``run`` (the ones it waits for)."""
    ahead = []
    for other in list_runs(run.path.parent):
        if other.run_id >= run.run_id:
            continue
        if refresh(other).get("state") in ("queued", "running"):
            ahead.append(other)
    return ahead
