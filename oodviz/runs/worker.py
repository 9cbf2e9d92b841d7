"""``python -m oodviz.runs.worker RUN_DIR``: run the pipeline of one run directory and record the outcome.

Started by the supervisor (:mod:`oodviz.runs.supervise`); ``oodviz run`` calls :func:`execute`
in the foreground instead.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from oodviz.engine import Cancelled
from oodviz.runs.config import RunConfig
from oodviz.runs.reporter import Reporter
from oodviz.runs.rundir import RunDir


def execute(run: RunDir, echo: Callable[[dict], None] | None = None) -> str:
    """Run ``run``'s config; returns and records the final state (done, cancelled or failed)."""
    from oodviz.runs.pipeline import run_pipeline

    reporter = Reporter(run, echo=echo)
    run.write_status(state="running", pid=os.getpid(), started=run.read_status().get("started") or time.time())
    try:
        run_pipeline(RunConfig.from_dict(run.read_config()), run, reporter)
    except Cancelled:
        run.write_status(
            state="cancelled", finished=time.time(), error="cancelled by the user; finished parts are kept"
        )
        reporter.emit(None, {"event": "cancelled"})
        return "cancelled"
    except Exception as error:
        detail = traceback.format_exc()
        run.write_status(state="failed", finished=time.time(), error=f"{type(error).__name__}: {error}", detail=detail)
        reporter.emit(None, {"event": "failed", "message": str(error), "detail": detail})
        return "failed"
    finally:
        run.remove_scratch()
    run.write_status(state="done", finished=time.time(), stage=None)
    reporter.emit(None, {"event": "done"})
    return "done"


if __name__ == "__main__":
    state = execute(RunDir(Path(sys.argv[1])))
    sys.exit(0 if state in ("done", "cancelled") else 1)
