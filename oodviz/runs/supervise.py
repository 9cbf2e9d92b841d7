"""``python -m oodviz.runs.supervise RUN_DIR``: wait for the run's turn, run the worker, record the end.

The supervisor holds no data, so when the worker is killed (the kernel's out-of-memory killer
picks the largest process) it survives to write why the run ended.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from oodviz.problems import smaller_batch
from oodviz.runs.jobs import CANCEL_GRACE_S, queue_ahead, start_worker
from oodviz.runs.rundir import FINAL_STATES, RunDir, process_alive, process_started

POLL_S = 0.2


def _wait_for_turn(run: RunDir) -> bool:
    """Block until no earlier unfinished run is left; False if the run was cancelled meanwhile."""
    announced = None
    while True:
        if run.cancel_requested() or not run.path.is_dir():
            return False
        ahead = queue_ahead(run)
        if not ahead:
            return True
        if [r.run_id for r in ahead] != announced:
            announced = [r.run_id for r in ahead]
            run.append_event(
                {"stage": "queued", "message": f"waiting for {len(ahead)} earlier run(s): {', '.join(announced)}"}
            )
        time.sleep(POLL_S)


def _describe_exit(code: int) -> str:
    if code < 0:
        number = -code
        name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
        hint = " — likely out of memory (the kernel's OOM killer)" if number == signal.SIGKILL else ""
        return f"worker was killed by signal {number} ({name}){hint}"
    return f"worker exited with code {code} without finishing the run"


def stop_on_sigterm(run: RunDir, worker) -> None:
    """On SIGTERM, kill the worker, record why the run ended and exit (a SIGKILL of the supervisor
    cannot be caught: the worker notices its parent is gone, :func:`oodviz.pipeline.worker.exit_with_parent`)."""

    def stop(number, frame):
        worker.kill()
        deadline = time.monotonic() + 5.0
        while process_alive(worker.pid, None) and time.monotonic() < deadline:  # not worker.wait(): the
            time.sleep(0.05)  # handler may interrupt Popen.poll while it holds the lock wait() needs
        run.remove_scratch()
        reason = "the supervisor was stopped (SIGTERM); its worker was killed"
        try:
            run.write_status(only_if=lambda s: s.get("state") not in FINAL_STATES, state="failed", error=reason)
            run.append_event({"stage": "failed", "message": reason})
        except OSError:
            pass  # the run was deleted
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)


def supervise(run: RunDir) -> int:
    if not _wait_for_turn(run):
        if run.path.is_dir():  # else the run was deleted while it waited
            run.write_status(state="cancelled", finished=time.time(), error="cancelled while queued")
        return 0
    worker = start_worker(run)
    stop_on_sigterm(run, worker)
    run.write_status(
        state="running", worker_pid=worker.pid, worker_started=process_started(worker.pid), started=time.time()
    )
    cancel_seen = None
    while worker.poll() is None:
        if run.cancel_requested():
            cancel_seen = cancel_seen or time.monotonic()
            if time.monotonic() - cancel_seen > CANCEL_GRACE_S:
                worker.kill()  # the worker did not stop at a batch boundary in time
        time.sleep(POLL_S)
    code = worker.returncode
    run.remove_scratch()  # a killed worker could not clean up after itself
    status = run.read_status()
    if status.get("state") not in FINAL_STATES:
        if run.cancel_requested():
            run.write_status(
                state="cancelled", exit_code=code, finished=time.time(), error="cancelled (worker stopped)"
            )
        else:
            fixes = []
            if code == -signal.SIGKILL:  # likely the kernel's OOM killer: a smaller batch may get through
                fix = smaller_batch(run.read_config().get("batch_size", 1), "killed by the OOM killer")
                fixes = [fix.to_dict()] if fix else []
            run.write_status(
                state="failed", exit_code=code, finished=time.time(), error=_describe_exit(code), fixes=fixes
            )
        run.append_event({"stage": run.read_status()["state"], "message": run.read_status()["error"]})
    else:
        run.write_status(exit_code=code)
    return 0


def main(run: RunDir) -> int:
    recorded, done = os.pipe()
    if os.fork():  # the process `submit` waits for: it exits once the supervisor has recorded itself
        os.read(recorded, 1)
        os._exit(0)
    # before anything else writes the status
    run.write_status(supervisor_pid=os.getpid(), supervisor_started=process_started(os.getpid()))
    os.write(done, b"1")
    try:
        return supervise(run)
    except FileNotFoundError:  # the run was deleted (its deleter killed the worker): nothing left to record
        return 0


if __name__ == "__main__":
    sys.exit(main(RunDir(Path(sys.argv[1]))))
