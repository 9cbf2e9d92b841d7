"""The ``oodviz`` command: ``run`` a job in the foreground, list ``runs``, start the ``app``."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import NoReturn

from oodviz.models import format_bytes

DEFAULT_RUNS_ROOT = Path("runs")
EXIT_DONE_WITH_FAILURES = 3
#: ``oodviz run``'s exit status by final state (done with failed detectors: :data:`EXIT_DONE_WITH_FAILURES`)
EXIT_CODES = {"done": 0, "failed": 1, "cancelled": 130}
RUN_EXIT_CODES = """exit status:
  0    done: every detector scored, results written
  1    failed: nothing usable (the error says why; every detector failed, a disk full, ...)
  2    bad config or run directory: nothing was started
  3    done with failures: some detectors failed (see detectors.json), the others' results are written
  130  cancelled (Ctrl-C or a cancel request): finished parts are kept"""


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
        elif kind in ("failed", "cancelled"):
            self.stream.write(f"\nrun {kind}: {event.get('message', '')}\n")
        self.stream.flush()


def cmd_run(args) -> int:
    from oodviz.runs.config import ConfigError, RunConfig, preset
    from oodviz.runs.rundir import RunDir
    from oodviz.runs.worker import execute

    try:
        if args.preset:
            config = preset(args.preset)
        else:
            config = RunConfig.load(args.config) if args.config else RunConfig()
        config.validate()
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    try:
        if args.out:
            out = Path(args.out)
            run = RunDir.create(out.parent, config.to_dict(), name=out.name)
        else:
            run = RunDir.create(Path(args.runs_root), config.to_dict())
    except FileExistsError as error:
        print(error, file=sys.stderr)
        return 2
    print(
        f"run {run.path} (in the foreground, alongside queued app runs: it does not wait in their queue)",
        file=sys.stderr,
    )
    started = time.monotonic()
    state = execute(run, echo=TerminalProgress())
    status = run.read_status()
    print(f"{state} in {time.monotonic() - started:.1f}s: {run.path}", file=sys.stderr)
    if state == "failed":
        print(f"error: {status.get('error')}", file=sys.stderr)
    if state != "done":
        return EXIT_CODES.get(state, 1)
    from oodviz.results import group_means, read_result_table

    table = group_means(read_result_table(run.path, "metrics.csv"), values=("auroc", "fpr95"))
    print("\nMean AUROC / FPR95 per near/far group (OOD is positive; FPR95 = ID flagged at 95% OOD recall):")
    print(table.round(3).to_string())
    print(f"\nFull table: {run.path / 'metrics.csv'}")
    failed = status.get("failed_detectors") or []
    if failed:
        print(f"\n{len(failed)} detector(s) failed: {', '.join(failed)} (errors in {run.path / 'detectors.json'})")
        return EXIT_DONE_WITH_FAILURES
    return 0


def cmd_runs(args) -> int:
    """List the runs, read-only: a damaged run is listed as ``damaged: <what>``, a dead job as failed."""
    from oodviz.runs.jobs import list_runs
    from oodviz.runs.summary import summarise

    runs = list_runs(Path(args.runs_root))
    if not runs:
        print(f"no runs under {args.runs_root}")
        return 0
    for run in runs:
        s = summarise(run)
        if s["best_auroc"] is not None:
            outcome = f"best AUROC {s['best_auroc']:.3f} ({s['best_detector']})"
            if s["failed_detectors"]:
                outcome += f"; failed: {', '.join(map(str, s['failed_detectors']))}"
        else:
            outcome = s["error"] or ""
        print(f"{run.run_id}  {s['state']!s:<9}  {s['title']:<40}  {outcome}")
    return 0


def cmd_app(args) -> NoReturn:
    """Serve the app with Streamlit: the entry script inside the installed package, from any directory.

    The process becomes Streamlit's server (exec), so a signal sent to ``oodviz app`` reaches the server.
    No usage statistics, no first-run e-mail prompt.
    """
    from oodviz.ui import APP_SCRIPT

    command = [sys.executable, "-m", "streamlit", "run", str(APP_SCRIPT)]
    command += ["--browser.gatherUsageStats", "false", "--server.showEmailPrompt", "false"]
    if args.port:
        command += ["--server.port", str(args.port)]
    if args.headless:
        command += ["--server.headless", "true"]
    sys.stdout.flush()
    os.execv(sys.executable, command)


def main(argv: list[str] | None = None) -> int:
    from oodviz.runs.config import PRESETS

    parser = argparse.ArgumentParser(prog="oodviz", description="Out-of-distribution detection you can see.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run a job in the foreground (no CONFIG: the bundled offline default)",
        description="Run a job in the foreground, alongside any queued app runs (it does not wait in their queue).",
        epilog=RUN_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chosen = run.add_mutually_exclusive_group()
    chosen.add_argument("config", nargs="?", help="a run config, .json or .toml (see examples/)")
    chosen.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="a ready-made config instead of CONFIG: digits (the default) or fashion-mnist",
    )
    run.add_argument("--out", help="the run directory to create (default: a new one under --runs-root)")
    run.add_argument("--runs-root", default=str(DEFAULT_RUNS_ROOT), help="where runs live (default: ./runs)")
    run.set_defaults(func=cmd_run)
    runs = commands.add_parser("runs", help="list runs with their status and best AUROC")
    runs.add_argument("--runs-root", default=str(DEFAULT_RUNS_ROOT))
    runs.set_defaults(func=cmd_runs)
    app = commands.add_parser("app", help="start the Streamlit app")
    app.add_argument("--port", type=int, help="the port to serve on (default: Streamlit's, 8501)")
    app.add_argument("--headless", action="store_true", help="do not open a browser (a server, CI)")
    app.set_defaults(func=cmd_app)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
