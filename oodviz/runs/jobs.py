"""Start, queue, watch and cancel jobs. Each job runs in processes of its own.

``submit`` creates the run directory and starts a small *supervisor* process
(``python -m oodviz.runs.supervise RUN_DIR``, a new session, detached from the caller). The
supervisor waits for its turn (one job runs at a time per runs root, in order of creation),
then starts the *worker* (``python -m oodviz.pipeline.worker RUN_DIR``) that does the work, and
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

from oodviz.runs.rundir import FINAL_STATES, RunDir, process_alive
from oodviz.runs.telemetry import job_environment

# Nothing here imports torch at module level: the supervisor imports this module and waits its turn
# as a small process (the config, the telemetry's environment and the worker come in lazily).

CANCEL_GRACE_S = 10.0  # after a cancel request, a worker that has not stopped by then is killed
MAX_QUEUED = 20  # runs waiting in one runs root; each holds a small supervisor process
STOP_WAIT_S = 10.0  # how long deleting a run waits for its processes to exit


class QueueFull(ValueError):
    """``submit`` when :data:`MAX_QUEUED` runs are already waiting."""


def _spawn(module: str, run: RunDir, new_session: bool, args: tuple[str, ...] = ()) -> subprocess.Popen:

    log = open(run.log_path, "ab")
    env = job_environment(dict(os.environ, PYTHONUNBUFFERED="1"))  # cuda:N as the app lists it
    return subprocess.Popen(
        [sys.executable, "-m", module, str(run.path.resolve()), *args],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=new_session,
        env=env,
    )


def submit(config, runs_root: Path, nproc_per_node: int = 1) -> RunDir:
    """Validate ``config`` (a RunConfig), create its run directory and start it in the background, on
    ``nproc_per_node`` processes of this machine (torchrun, :mod:`oodviz.runs.launch`; one per GPU) when above 1.

    :class:`QueueFull` when :data:`MAX_QUEUED` runs under ``runs_root`` are already waiting."""
    config.validate()
    if int(nproc_per_node) != nproc_per_node or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be a positive integer, got {nproc_per_node!r}")
    queued = [run for run in list_runs(runs_root) if refresh(run).get("state") == "queued"]
    if len(queued) >= MAX_QUEUED:
        raise QueueFull(
            f"{len(queued)} runs are already queued under {runs_root} (the limit is {MAX_QUEUED}); "
            "wait for some to finish or cancel some"
        )
    run = RunDir.create(Path(runs_root), config.to_dict())
    if nproc_per_node > 1:
        run.write_status(nproc_per_node=int(nproc_per_node))
    # The supervisor forks and its first process exits at once, after recording the pid of the
    # second: waiting for it here leaves no zombie in a long-lived caller such as the app.
    _spawn("oodviz.runs.supervise", run, new_session=True).wait()
    return run


def start_worker(run: RunDir) -> subprocess.Popen:
    """Used by the supervisor: the worker runs in the supervisor's session, so a kill of the group stops both.
    A run submitted on several processes (``nproc_per_node`` in its status) gets torchrun's launcher instead."""
    processes = int(run.read_status().get("nproc_per_node") or 1)
    if processes > 1:
        return _spawn("oodviz.runs.launch", run, new_session=False, args=(str(processes),))
    return _spawn("oodviz.pipeline.worker", run, new_session=False)


#: each process of a job, as ``status.json`` records it: (pid key, start time key)
JOB_PROCESSES = (("supervisor_pid", "supervisor_started"), ("worker_pid", "worker_started"), ("pid", "pid_started"))


def live_processes(status: dict) -> list[int]:
    """The pids recorded in ``status`` whose process still runs (same pid and start time)."""
    return [status[pid] for pid, started in JOB_PROCESSES if process_alive(status.get(pid), status.get(started))]


def gone_reason(status: dict) -> str:
    if "supervisor_pid" in status:
        return "the supervisor was killed (or the machine restarted) before the run finished; its worker is gone too"
    return "the job's processes are gone (killed, or the machine restarted) before it finished"


def refresh(run: RunDir) -> dict:
    """The run's status as it stands, read-only: an unfinished run none of whose processes is alive
    (pid and start time, :func:`oodviz.runs.rundir.process_alive`) is reported ``failed``, with why.

    Listing never writes (a full disk, a read-only copy of the runs, a damaged run cannot make it fail);
    the supervisor records a dead job of its queue for good with :func:`settle`. Never raises."""
    status = run.read_status()
    if status.get("state") in (*FINAL_STATES, "damaged") or not any(pid in status for pid, _ in JOB_PROCESSES):
        return status  # finished, unreadable, or created and not started yet
    if live_processes(status):
        return status
    return {**status, "state": "failed", "error": gone_reason(status)}


def settle(run: RunDir) -> dict:
    """:func:`refresh`, and a dead job's ``failed`` written into its ``status.json`` (under the run's lock,
    rechecked there); a write that fails (a deleted run, a full disk) leaves the file as it was."""
    status = refresh(run)
    if status.get("state") != "failed" or run.read_status().get("state") == "failed":
        return status

    def still_dead(current: dict) -> bool:
        return current.get("state") in ("queued", "running") and not live_processes(current)

    try:
        return run.write_status(only_if=still_dead, state="failed", error=status["error"], finished=time.time())
    except OSError:  # TimeoutError included
        return status


def cancel(run: RunDir) -> None:
    """Ask the run to stop: the worker stops at its next batch; the supervisor kills it after a grace period."""
    status = run.read_status()
    if status.get("state") in FINAL_STATES:
        return
    run.request_cancel()


def list_runs(runs_root: Path) -> list[RunDir]:
    """Every run under ``runs_root``, newest first: each directory (not hidden, such as the feature
    stores' ``.features``) that holds a ``config.json``, ``status.json`` or ``events.jsonl``. Never raises."""
    root = Path(runs_root)
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    marks = ("config.json", "status.json", "events.jsonl")
    runs = []
    for path in entries:
        try:
            if not path.name.startswith(".") and path.is_dir() and any((path / m).exists() for m in marks):
                runs.append(RunDir(path))
        except OSError:
            continue
    return sorted(runs, key=lambda r: r.run_id, reverse=True)


def stop_processes(status: dict) -> None:
    """Kill the job's processes (the supervisor's process group holds its worker) and wait until they are gone."""
    for pid in live_processes(status):
        try:
            if pid == status.get("supervisor_pid"):
                os.killpg(os.getpgid(pid), signal.SIGKILL)  # the supervisor's session: it and its worker
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + STOP_WAIT_S
    while live_processes(status) and time.monotonic() < deadline:
        time.sleep(0.05)


def delete_run(run: RunDir) -> None:
    """Remove a run, whatever its state or damage: its processes are killed first and waited for, so
    that none can write into (and re-create) the directory afterwards."""
    status = run.read_status()
    if status.get("state") not in FINAL_STATES:
        stop_processes(status)
    shutil.rmtree(run.path, ignore_errors=True)


def queue_ahead(run: RunDir) -> list[RunDir]:
    """Unfinished runs in the same root created before ``run`` (the ones it waits for)."""
    ahead = []
    for other in list_runs(run.path.parent):
        if other.run_id >= run.run_id:
            continue
        if settle(other).get("state") in ("queued", "running"):
            ahead.append(other)
    return ahead
