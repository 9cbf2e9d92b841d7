"""``python -m oodviz.pipeline.worker RUN_DIR``: run the pipeline of one run directory and record the outcome.

Started by the supervisor (:mod:`oodviz.runs.supervise`); ``oodviz run`` calls :func:`execute`
in the foreground instead, and :func:`run` (``oodviz.run(config)``) does the same from Python.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from oodviz.config.run import RunConfig
from oodviz.engine import Cancelled, DiskFullError
from oodviz.engine.batched import is_out_of_memory
from oodviz.pipeline.distributed import World
from oodviz.pipeline.reporter import Reporter, TerminalProgress
from oodviz.pipeline.sharded import RankRunDir, run_rank, stop_on_sigterm
from oodviz.pipeline.stages import run_pipeline
from oodviz.problems import smaller_batch
from oodviz.results.tables import Results, load_results
from oodviz.runs.rundir import RunDir, process_started


def describe_error(error: Exception, run: RunDir) -> str:
    """``"<Type>: <message>"``; a full disk says so with the free space where the run writes."""
    if isinstance(error, DiskFullError):  # the store's own check: it knows what was needed
        stage = run.read_status().get("stage") or "the run"
        return f"disk full during {stage}: {str(error).removeprefix('disk full: ')}"
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        try:
            free = f"{shutil.disk_usage(run.path.parent).free / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        stage = run.read_status().get("stage") or "the run"
        written = f" writing {error.filename}" if error.filename else ""
        return f"disk full during {stage}{written}: {free} on {run.path.parent}; free some space and run again"
    return f"{type(error).__name__}: {error}"


class RunFailed(RuntimeError):
    """A run started from Python (:func:`run`) ended failed or cancelled; ``run_dir`` keeps what was finished."""

    def __init__(self, message: str, run_dir: Path):
        super().__init__(message)
        self.run_dir = run_dir


def run(config: RunConfig, out=None, runs_root="runs", progress: bool = True) -> Results:
    """A whole evaluation of ``config`` in this process, as ``oodviz run`` does it: the run directory ``out`` (a
    new one under ``runs_root`` when None) gets the config, the feature stores, the fitted detectors and the
    result tables; returns them read back (:func:`oodviz.results.tables.load_results`). ``progress``: print each
    stage on stderr.

    :raises ConfigError: what is wrong with ``config`` (every problem), before anything is created
    :raises RunFailed: the run failed (every detector failed, a disk full, ...) or was cancelled; its directory
        keeps its status and whatever finished
    """
    config.validate()
    if out is None:
        run_dir = RunDir.create(Path(runs_root), config.to_dict())
    else:
        run_dir = RunDir.create(Path(out).parent, config.to_dict(), name=Path(out).name)
    state = execute(run_dir, echo=TerminalProgress() if progress else None)
    if state != "done":
        raise RunFailed(f"run {run_dir.path} {state}: {run_dir.read_status().get('error')}", run_dir.path)
    return load_results(run_dir.path)


def execute(run: RunDir, echo: Callable[[dict], None] | None = None, pipeline: Callable | None = None) -> str:
    """Run ``run``'s config; returns and records the final state (done, cancelled or failed).

    A run where some detectors failed ends ``done`` with ``failed_detectors`` in its status and a
    warning event naming them; one where every detector failed ends ``failed``. ``pipeline(config, run,
    reporter)`` defaults to :func:`oodviz.pipeline.stages.run_pipeline` (a rank of a sharded run passes its own)."""

    reporter = Reporter(run, echo=echo)
    run.write_status(
        state="running",
        pid=os.getpid(),
        pid_started=process_started(os.getpid()),
        started=run.read_status().get("started") or time.time(),
    )
    try:
        failed = (pipeline or run_pipeline)(RunConfig.from_dict(run.read_config()), run, reporter)
    except Cancelled:
        run.write_status(
            state="cancelled", finished=time.time(), error="cancelled by the user; finished parts are kept"
        )
        reporter.emit(None, {"event": "cancelled"})
        return "cancelled"
    except Exception as error:
        detail = traceback.format_exc()
        message = describe_error(error, run)
        fixes = []
        if isinstance(error, MemoryError) or is_out_of_memory(error):
            fix = smaller_batch(run.read_config().get("batch_size", 1), "out of memory")
            fixes = [fix.to_dict()] if fix else []
        run.write_status(state="failed", finished=time.time(), error=message, detail=detail, fixes=fixes)
        try:
            reporter.emit(None, {"event": "failed", "message": message, "detail": detail})
        except OSError:  # a full disk: the status says why
            pass
        return "failed"
    finally:
        run.remove_scratch()
    if failed:
        reporter.warn(f"done, but {len(failed)} detector(s) failed: {', '.join(failed)} (see detectors.json)")
    run.write_status(state="done", finished=time.time(), stage=None, failed_detectors=failed)
    reporter.emit(None, {"event": "done"})
    return "done"


#: the signals that cancel a run in the foreground (:func:`cancel_on_signals`): a terminal's Ctrl-C, ``kill``'s default
CANCEL_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def cancel_on_signals(run: RunDir, signals=CANCEL_SIGNALS) -> Iterator[list[signal.Signals]]:
    """While inside, each of ``signals`` (:data:`CANCEL_SIGNALS`) asks ``run`` to stop (:meth:`RunDir.request_cancel`, the
    cancel request of a background run: the pipeline stops at its next batch or stage and :func:`execute` records
    the run ``cancelled``) instead of ending the process. Yields the signals received so far, in order; the
    previous handlers are back on exit. For the process that runs :func:`execute` itself: ``oodviz run``."""
    received: list[signal.Signals] = []

    def cancel(number, frame) -> None:
        received.append(signal.Signals(number))
        try:
            run.request_cancel()
        except OSError:  # the run directory was deleted: the pipeline's next write fails the run
            pass

    previous = {number: signal.signal(number, cancel) for number in signals}
    try:
        yield received
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def exit_with_parent(run: RunDir, poll_s: float = 0.5) -> None:
    """Exit as soon as the process that started this worker (the supervisor) is gone, killed by SIGKILL
    included: a thread polls ``os.getppid()``. The next reader reports the run failed
    (:func:`oodviz.runs.jobs.refresh`); the queue's next run does not start alongside this one."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        run.remove_scratch()
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str]) -> int:
    """``RUN_DIR [--echo]``: one process, or one rank of a torchrun launch (``WORLD_SIZE`` > 1,
    :mod:`oodviz.pipeline.sharded`); ``--echo`` prints rank 0's progress on stdout (``oodviz run --nproc-per-node``)."""

    world = World.from_env()
    if not world.distributed:
        run = RunDir(Path(argv[0]))
        exit_with_parent(run)
        return 0 if execute(run) in ("done", "cancelled") else 1

    run = RankRunDir(Path(argv[0]), world.rank)
    exit_with_parent(run)  # the launcher (torchrun's agent) killed: no rank is left behind
    if world.is_root:
        stop_on_sigterm(run)
    echo = TerminalProgress() if world.is_root and "--echo" in argv[1:] else None
    # Ctrl-C reaches every rank (and the launcher, which passes it on): a cancel request, as in one process
    with cancel_on_signals(run, (signal.SIGINT,)):
        state = execute(run, echo=echo, pipeline=run_rank(world))
    return 0 if state in ("done", "cancelled") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
