"""The ``oodviz`` command: ``run`` a job in the foreground, ``bench`` a published benchmark, list ``runs``, start the
``app``, check the feature ``store``, ``score`` new images with a run, write its ``report``, ``project`` its features
to 2-D."""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

from oodviz import engine, models
from oodviz.config.catalog import catalog_path, ensure_catalog
from oodviz.config.run import PRESETS, ConfigError, RunConfig, preset
from oodviz.runs.jobs import list_runs
from oodviz.runs.launch import Interrupted, launch, torchrun_argv, wait_for_run_dir
from oodviz.runs.rundir import RunDir
from oodviz.ui import SERVER_FLAGS, streamlit_has_option
from oodviz.ui.access import LOOPBACK_HOSTS, AccessPolicy, is_loopback, machine_host_names

DEFAULT_RUNS_ROOT = Path("runs")
EXIT_DONE_WITH_FAILURES = 3
#: ``oodviz run``'s exit status by final state (done with failed detectors: :data:`EXIT_DONE_WITH_FAILURES`)
EXIT_CODES = {"done": 0, "failed": 1, "cancelled": 130}
RUN_EXIT_CODES = """exit status:
  0    done: every detector scored, results written
  1    failed: nothing usable (the error says why; every detector failed, a disk full, ...)
  2    bad config or run directory, or over this machine's limits (the pre-flight table; --force
       starts anyway): nothing was started
  3    done with failures: some detectors failed (see detectors.json), the others' results are written
  130  cancelled by Ctrl-C (SIGINT) or a cancel request: the run stops at its next batch, status cancelled,
       the feature stores finished so far are kept (the one being written is not)
  143  cancelled by SIGTERM, as by Ctrl-C (SIGKILL stops the process at once: the run then reads failed)"""


def cmd_run(args) -> int:
    try:
        if args.preset:
            config = preset(args.preset)
        else:
            config = RunConfig.load(args.config) if args.config else RunConfig()
        if args.num_workers is not None:
            config.num_workers = int(args.num_workers) if args.num_workers.isdigit() else args.num_workers
        config.validate()
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    code, run = run_in_foreground(config, args)
    if run is None or code != 0:
        return code
    from oodviz.results.tables import group_means, read_result_table

    table = group_means(read_result_table(run.path, "metrics.csv"), values=("auroc", "fpr95"))
    print("\nMean AUROC / FPR95 per near/far group (OOD is positive; FPR95 = ID flagged at 95% OOD recall):")
    print(table.round(3).to_string())
    print(f"\nFull table: {run.path / 'metrics.csv'}")
    return failed_detectors_code(run)


def failed_detectors_code(run: RunDir) -> int:
    """0, or :data:`EXIT_DONE_WITH_FAILURES` (the failed detectors printed) for a done run where some failed."""
    failed = run.read_status().get("failed_detectors") or []
    if not failed:
        return 0
    print(f"\n{len(failed)} detector(s) failed: {', '.join(failed)} (errors in {run.path / 'detectors.json'})")
    return EXIT_DONE_WITH_FAILURES


def run_in_foreground(config: RunConfig, args, out: str | None = None) -> tuple[int, RunDir | None]:
    """Run the valid ``config`` in this process, or over torchrun (``args``: ``runs_root``, ``force``, the
    distributed options; ``out``, else ``args.out``: the run directory to create): its pre-flight, then its run
    directory, then the run. ``(exit status, run directory)``: ``(0, run)`` when it is done (failed detectors or
    not), else the status of :data:`RUN_EXIT_CODES` and the run directory, ``None`` when nothing was started."""
    from oodviz.pipeline.reporter import TerminalProgress
    from oodviz.pipeline.worker import cancel_on_signals, execute

    out = out if out is not None else args.out
    report = preflight_report(config, Path(out).parent if out else Path(args.runs_root), args.force)
    if report is False:
        return 2, None
    if args.nproc_per_node > 1 or args.nnodes > 1:
        try:
            torchrun_argv(Path("."), args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint)
        except ValueError as error:
            print(error, file=sys.stderr)
            return 2, None
    if args.node_rank > 0 and not out:
        print(
            "a node other than 0 needs --out: the run directory node 0 creates, on a shared filesystem", file=sys.stderr
        )
        return 2, None
    try:
        if args.node_rank > 0:
            run = wait_for_run_dir(Path(out))
        elif out:
            run = RunDir.create(Path(out).parent, config.to_dict(), name=Path(out).name)
        else:
            run = RunDir.create(Path(args.runs_root), config.to_dict())
    except (FileExistsError, TimeoutError) as error:
        print(error, file=sys.stderr)
        return 2, None
    print(
        f"run {run.path} (in the foreground, alongside queued app runs: it does not wait in their queue)",
        file=sys.stderr,
    )
    started = time.monotonic()
    if args.nproc_per_node > 1 or args.nnodes > 1:
        try:
            state = launch(run, args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint)
        except Interrupted as stop:
            print(
                f"cancelled ({signal.Signals(stop.signum).name}) after {time.monotonic() - started:.1f}s: {run.path} "
                "(every rank stopped; the feature stores finished so far are kept)",
                file=sys.stderr,
            )
            return 128 + stop.signum, run
    else:
        from functools import partial

        from oodviz.pipeline.batchprobe import BatchPeak
        from oodviz.pipeline.stages import run_pipeline

        peaks = [BatchPeak(**peak) for peak in report.estimate["batch_peaks"]] if report else None
        with cancel_on_signals(run) as received:
            state = execute(run, echo=TerminalProgress(), pipeline=partial(run_pipeline, batch_peaks=peaks))
        if state == "cancelled" and received:
            print(
                f"cancelled ({received[0].name}) after {time.monotonic() - started:.1f}s: {run.path} "
                "(the feature stores finished so far are kept: running it again reuses them)",
                file=sys.stderr,
            )
            return 128 + received[0], run
    status = run.read_status()
    print(f"{state} in {time.monotonic() - started:.1f}s: {run.path}", file=sys.stderr)
    if state == "failed":
        print(f"error: {status.get('error')}", file=sys.stderr)
    return (0 if state == "done" else EXIT_CODES.get(state, 1)), run


def preflight_report(config, runs_root: Path, force: bool):
    """The pre-flight's report (:func:`oodviz.pipeline.preflight.preflight`; the run takes its measured batches), or
    False (the table and the fixes printed) when the run's needs are over this machine's limits, or the model's
    classes are not the ID labels (:mod:`oodviz.pipeline.classifier_check`), and not ``force``; with ``force`` they
    are printed as a warning. False too (each problem printed, ``force`` or
    not) for what no run of ``config`` gets past: an unreadable checkpoint, a detector parameter the data's sizes
    rule out. A pre-flight that cannot load the model or the data otherwise refuses nothing (None): the run's own
    stages report that."""
    from oodviz.pipeline.preflight import preflight

    try:
        report = preflight(config, runs_root)
    except ConfigError as error:
        print(f"{error}\nnothing was started", file=sys.stderr)
        return False
    except Exception as error:  # the run reports the same problem with its stage and context
        print(f"pre-flight skipped: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    if report.startable:
        for note in report.fixes:  # wide features that fit: which detectors hold a D x D state (advice)
            print(f"note: {note.text}", file=sys.stderr)
        return report
    if report.classifier_problem is not None:
        print(report.classifier_problem, file=sys.stderr)
    if not report.fits:
        print(report.message(), file=sys.stderr)
    if force:
        print("--force: running anyway", file=sys.stderr)
        return report
    print("nothing was started; run with --force to start anyway", file=sys.stderr)
    return False


def cmd_runs(args) -> int:
    """List the runs, read-only: a damaged run is listed as ``damaged: <what>``, a dead job as failed."""
    from oodviz.results.summary import summarise

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


def access_policy(args) -> AccessPolicy:
    """The access rules ``oodviz app`` serves with (see :mod:`oodviz.ui.access`): loopback needs nothing; any
    other ``--host`` needs a token (``--token``, ``$OODVIZ_TOKEN``, else a new random one) and confines typed
    paths to the ``--data-dir`` directories (none: only the bundled data)."""

    serve_others = not is_loopback(args.host)
    token = args.token or os.environ.get("OODVIZ_TOKEN") or (secrets.token_urlsafe(24) if serve_others else None)
    dirs = [Path(d).expanduser().resolve() for d in args.data_dir]
    for directory in dirs:
        if not directory.is_dir():
            raise SystemExit(f"oodviz app: --data-dir {directory} is not a directory")
    hosts = machine_host_names() if serve_others else list(LOOPBACK_HOSTS)
    hosts += [h.lower() for h in args.allowed_host] + ([args.host.lower()] if args.host != "0.0.0.0" else [])
    return AccessPolicy(
        token=token,
        serve_others=serve_others,
        data_dirs=tuple(dirs) if (serve_others or dirs) else None,
        allowed_hosts=tuple(dict.fromkeys(hosts)),
    )


def link_host(host: str) -> str:
    """The host of the link ``oodviz app`` prints for ``--host host``: the machine's name for an address that
    listens on every interface (0.0.0.0, ::), an IPv6 address in brackets (RFC 3986; a zone's ``%`` as ``%25``),
    else ``host`` as given (a name, an IPv4 address)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name
        return host
    if address.is_unspecified:
        return socket.gethostname()
    return f"[{host.replace('%', '%25')}]" if address.version == 6 else host


def cmd_app(args) -> NoReturn:
    """Serve the app with Streamlit: the entry script inside the installed package, from any directory.

    The process becomes Streamlit's server (exec), so a signal sent to ``oodviz app`` reaches the server.
    It listens on ``--host`` (127.0.0.1 by default); the access policy travels in the environment.
    Streamlit's ``run`` through :mod:`oodviz.ui.serve` (the pages imported while the server starts), with
    :data:`oodviz.ui.SERVER_FLAGS`.
    """

    policy = access_policy(args)
    if not catalog_path().is_file():  # the form's catalog, read from the code once per version of it
        print(
            "oodviz app: reading the detectors, backbones and datasets the form offers (once per version)",
            file=sys.stderr,
        )
    ensure_catalog()
    command = [sys.executable, "-m", "oodviz.ui.serve", *SERVER_FLAGS]
    command += ["--server.address", args.host, "--server.enableCORS", "true", "--server.enableXsrfProtection", "true"]
    if streamlit_has_option("server.allowedHosts"):
        for host in policy.allowed_hosts:  # Streamlit refuses a websocket whose Host is not one of these
            command += ["--server.allowedHosts", host]
    else:
        print(
            "oodviz app: WARNING this Streamlit cannot check Host headers (no server.allowedHosts): a web page "
            "could reach the app by DNS rebinding; upgrade Streamlit (pip install -U streamlit)",
            file=sys.stderr,
        )
    if policy.serve_others:
        command += ["--client.showErrorDetails", "none"]  # (the viewer's toolbar: SERVER_FLAGS, for every server)
    if args.port:
        command += ["--server.port", str(args.port)]
    if args.headless:
        command += ["--server.headless", "true"]
    if policy.token:
        print(f"oodviz app: open http://{link_host(args.host)}:{args.port or 8501}/?token={policy.token}", flush=True)
    if policy.data_dirs is not None:
        named = ", ".join(str(d) for d in policy.data_dirs) or "none (only the bundled data)"
        print(f"oodviz app: paths typed in the page must lie under: {named}", flush=True)
    sys.stdout.flush()
    os.execve(sys.executable, command, {**os.environ, **policy.to_env()})


def _store_root(args) -> Path:

    return Path(args.store_root) if args.store_root else Path(args.runs_root) / engine.STORES_DIRNAME


def cmd_store(args) -> int:
    """``store verify``: rehash every store under the root, exit 1 when one is damaged (each named with
    its files and what is wrong); ``--remove`` removes damaged, outdated and stale unfinished ones.
    ``store list``: the stores, their size and the runs that use them."""

    root = _store_root(args)
    checked = engine.check_stores(root, full=args.store_command == "verify")
    if not checked:
        print(f"no feature stores under {root}")
        return 0
    if args.store_command == "list":
        users = engine.store_users(args.runs_root)
        for entry in checked:
            store = entry["store"]
            if store is None:
                print(f"{entry['name']}  {entry['state']}: {'; '.join(entry['problems'])}")
                continue
            size = sum(p.stat().st_size for p in store.path.iterdir())
            runs = users.get(entry["name"], [])
            print(
                f"{entry['name']}  {store.meta.get('backbone', {}).get('name', '?')} on "
                f"{store.meta.get('dataset', {}).get('name', '?')}: {store.n:,} x {store.feature_dim} "
                f"{store.feature_dtype}, {models.format_bytes(size)}, used by {len(runs)} run(s)"
            )
        return 0
    damaged = [entry for entry in checked if entry["state"] == "damaged"]
    for entry in checked:
        if entry["state"] == "damaged":
            for problem in entry["problems"]:
                print(f"DAMAGED  {entry['name']}: {problem}")
        else:
            print(f"{entry['state']:<8} {entry['name']}" + (f": {entry['problems'][0]}" if entry["problems"] else ""))
    ok = sum(entry["state"] == "ok" for entry in checked)
    print(f"{ok} intact, {len(damaged)} damaged of {len(checked)} under {root}", file=sys.stderr)
    if args.remove:
        for entry in checked:
            if entry["state"] in ("damaged", "outdated"):
                print(f"removed  {engine.remove_store(root, entry['name'])}")
        for path in engine.clean_stale_tmp(root, min_age_s=0):
            print(f"removed  {path}")
    elif damaged:
        print(
            "damaged stores are never reused: the next run that needs one extracts it again "
            "(remove them now with oodviz store verify --remove)",
            file=sys.stderr,
        )
    return 1 if damaged else 0


def shown_path(path: str) -> str:
    """A path from the command line as printed: the bytes of a name that is not UTF-8 (surrogate escapes in
    ``path``, :func:`os.fsdecode`) as ``\\xNN``, the rest as it is."""
    return os.fsencode(path).decode(errors="backslashreplace")


def cmd_score(args) -> int:
    """Score image files with a run's model and saved detectors (:func:`oodviz.pipeline.scoring.score_images`): a table
    on stdout (or ``--out`` CSV); exit 1 when some file could not be read or some detector could not be
    loaded (the others scored, the reasons on stderr), 2 when the run cannot score."""
    from oodviz.pipeline.scoring import RunNotScorableError, score_images

    try:
        scored = score_images(Path(args.run), args.images, detector=args.detector, device=args.device)
    except (RunNotScorableError, ValueError) as error:
        print(f"oodviz score: {error}", file=sys.stderr)
        return 2
    for path, why in scored.unreadable.items():
        print(f"unreadable: {shown_path(path)}: {why}", file=sys.stderr)
    for name, why in scored.not_loaded.items():
        print(f"not loaded: {name}: {why} (scored with the others)", file=sys.stderr)
    table = scored.table
    if args.out:
        table.to_csv(args.out, index=False)
        print(
            f"{table.file.nunique()} image(s) x {table.detector.nunique()} detector(s) -> {args.out}", file=sys.stderr
        )
    elif len(table):
        shown = table.assign(id_percentile=table.id_percentile.round(1), confidence=table.confidence.round(3))
        print(shown.to_string(index=False))
    print(
        "score: higher = more OOD; id_percentile: share of the run's ID test scores <= the score; "
        "verdict OOD when score >= the threshold that flags 95% of the run's OOD samples",
        file=sys.stderr,
    )
    return 1 if scored.unreadable or scored.not_loaded else 0


def cmd_bench(args) -> int:
    """``oodviz bench openood-v1.5 BENCHMARK``: one run per checkpoint (:mod:`oodviz.pipeline.openood`), then the
    figures beside the leaderboard's."""
    from oodviz.pipeline.openood import bench_summary, bench_table, benchmark_config, benchmark_problems

    checkpoints = args.checkpoint or [None]
    if args.weights != "random" and not args.checkpoint:
        print(
            "oodviz bench needs --checkpoint: the network's weights the figures are of (OpenOOD's checkpoints: "
            "python scripts/download/download.py --contents checkpoints --checkpoints ood_v1.5 in a checkout of "
            "OpenOOD; ImageNet-1k: torchvision's resnet50 IMAGENET1K_V1 file), or --weights random for a dry run",
            file=sys.stderr,
        )
        return 2
    detectors = [name.strip() for name in args.detectors.split(",") if name.strip()] if args.detectors else None
    settings = {"device": args.device, "batch_size": args.batch_size, "protocol": args.protocol}
    try:
        configs = [
            benchmark_config(
                args.benchmark,
                args.data_root,
                checkpoint,
                weights=args.weights,
                detectors=detectors,
                tune=args.tune,
                **settings,
            ).validate()
            for checkpoint in checkpoints
        ]
    except (ConfigError, ValueError) as error:
        print(error, file=sys.stderr)
        return 2
    problems = benchmark_problems(configs[0])
    if problems:
        for problem in problems:
            print(f"- {problem}", file=sys.stderr)
        print(
            f"the data root {args.data_root} is not complete for {args.benchmark}: nothing was started", file=sys.stderr
        )
        return 2
    runs = []
    for index, config in enumerate(configs):
        if len(configs) > 1:
            print(f"checkpoint {index + 1} of {len(configs)}: {config.checkpoint}", file=sys.stderr)
        code, run = run_in_foreground(config, args)
        if code != 0:
            return code
        runs.append(run.path)
    table = bench_table(runs, args.benchmark, args.arch)
    ours = "one run" if len(runs) == 1 else f"mean ± std over {len(runs)} runs"
    print(
        f"\nOpenOOD v1.5 {args.benchmark}: oodviz's figures ({ours}) beside the "
        "leaderboard's (mean ± std over its seeds), in percent; the leaderboard publishes no FPR@95 (oodviz's is in "
        "--csv, with the leaderboard's other methods):"
    )
    print(bench_summary(table).to_string(index=False))
    if args.csv:
        table.to_csv(args.csv, index=False)
        print(f"\nthe whole table: {args.csv}")
    print("\nruns: " + ", ".join(str(path) for path in runs))
    return 0


def cmd_report(args) -> int:
    """Write a run's self-contained HTML report (:func:`oodviz.figures.report.write_report`); exit 2 when it cannot."""
    from oodviz.figures.report import write_report

    try:
        path = write_report(Path(args.run), args.output, args.detector or None, args.gallery, args.figure_files)
    except (ValueError, OSError, RuntimeError) as error:  # RuntimeError: kaleido could not draw the figures
        print(f"oodviz report: {error}", file=sys.stderr)
        return 2
    print(f"report: {path} ({models.format_bytes(path.stat().st_size)}; opens offline in any browser)", file=sys.stderr)
    return 0


def cmd_project(args) -> int:
    """Compute a run's 2-D feature projection (:func:`oodviz.figures.projection.project_run`); exit 2 when it cannot."""
    from oodviz.figures.projection import project_run, projection_path

    try:
        frame = project_run(Path(args.run), args.method, max_points=args.max_points, seed=args.seed)
    except (ValueError, OSError) as error:
        print(f"oodviz project: {error}", file=sys.stderr)
        return 2
    print(f"{len(frame):,} points -> {projection_path(args.run, args.method)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
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
    chosen.add_argument(  # one of PRESETS, checked after parsing (no import of the run config for other commands)
        "--preset",
        help="a ready-made config instead of CONFIG: digits (the default) or fashion-mnist",
    )
    run.add_argument("--out", help="the run directory to create (default: a new one under --runs-root)")
    run.add_argument("--runs-root", default=str(DEFAULT_RUNS_ROOT), help="where runs live (default: ./runs)")
    run.add_argument(
        "--num-workers",
        metavar="N|auto",
        help="DataLoader workers for image folders and torchvision sets (overrides the config's num_workers; "
        "auto: from the CPU cores, 0 for the in-memory datasets)",
    )
    run.add_argument(
        "--force",
        action="store_true",
        help="start even when the pre-flight check finds the run over this machine's disk, RAM or GPU memory",
    )
    distributed = run.add_argument_group(
        "several processes or machines (torch.distributed through torchrun; NCCL on GPUs, gloo on the CPU)"
    )
    distributed.add_argument("--nproc-per-node", type=int, default=1, help="processes on this machine (one per GPU)")
    distributed.add_argument("--nnodes", type=int, default=1, help="machines taking part (each runs this command)")
    distributed.add_argument("--node-rank", type=int, default=0, help="this machine's rank, 0..NNODES-1")
    distributed.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0 for the rendezvous (several machines)")
    run.set_defaults(func=cmd_run)
    runs = commands.add_parser("runs", help="list runs with their status and best AUROC")
    runs.add_argument("--runs-root", default=str(DEFAULT_RUNS_ROOT))
    runs.set_defaults(func=cmd_runs)
    app = commands.add_parser("app", help="start the Streamlit app")
    app.add_argument("--port", type=int, help="the port to serve on (default: Streamlit's, 8501)")
    app.add_argument("--headless", action="store_true", help="do not open a browser (a server, CI)")
    app.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1: this machine only); any other, e.g. 0.0.0.0, "
        "serves others: it needs the access token and confines paths to --data-dir",
    )
    app.add_argument("--token", help="the access token (default: $OODVIZ_TOKEN, else a new one printed at start)")
    app.add_argument(
        "--data-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory whose folders, checkpoints and data root the page may use (repeatable); serving "
        "others without any allows only the bundled data",
    )
    app.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another host name browsers reach the app by (a DNS name, a proxy's); the machine's own names "
        "and addresses are allowed already (repeatable)",
    )
    app.set_defaults(func=cmd_app)
    score = commands.add_parser(
        "score",
        help="score image files with a finished run's model and saved detectors",
        description="Per image and detector: the prediction, the score (higher = more OOD), its percentile among "
        "the run's ID test scores and the verdict at the run's threshold (95%% of its OOD samples flagged).",
        epilog="exit status: 0 every image scored; 1 some file unreadable or some detector not loaded (the others scored); 2 the run cannot score",
    )
    score.add_argument("run", help="a finished run directory")
    score.add_argument("images", nargs="+", help="image files")
    score.add_argument(
        "--detector",
        help="only this detector, as the run's scores name it (msp, knn@features.4, mahalanobis@combined; "
        "default: every detector of the run)",
    )
    score.add_argument("--out", help="write the table as CSV here instead of printing it")
    score.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N, auto")
    score.set_defaults(func=cmd_score)
    bench = commands.add_parser(
        "bench",
        help="run a published benchmark's protocol and set the figures beside its leaderboard (OpenOOD v1.5)",
        description="OpenOOD v1.5's benchmark BENCHMARK (cifar10, cifar100, imagenet200, imagenet) over a data root "
        "in OpenOOD's layout: one run per checkpoint (the detectors fitted on the ID training list, scored on the ID "
        "test list and every near- and far-OOD list), then each detector's mean figures beside the leaderboard's.",
        epilog=RUN_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("suite", choices=["openood-v1.5"], help="the benchmark suite")
    bench.add_argument("benchmark", help="cifar10, cifar100, imagenet200 or imagenet")
    bench.add_argument(
        "--data-root", required=True, help="the folder holding benchmark_imglist/, images_classic/, images_largescale/"
    )
    bench.add_argument(
        "--checkpoint", nargs="+", metavar="CKPT", help="the network's checkpoint, one per training seed (one run each)"
    )
    bench.add_argument("--weights", choices=["default", "random"], default="default", help="random: a dry run")
    bench.add_argument("--detectors", help="comma-separated detector names (default: the backbone family's)")
    bench.add_argument("--tune", action="store_true", help="tune each detector's grid on OpenOOD's validation lists")
    bench.add_argument(
        "--protocol",
        choices=["paper", "openood"],
        default="paper",
        help="paper (default): each detector's paper's formula and oodviz's defaults; openood: OpenOOD's variants and "
        "defaults where they differ (each detector's openood_params)",
    )
    bench.add_argument("--arch", help="the leaderboard's model to compare with (default: the benchmark's network)")
    bench.add_argument("--csv", help="write the whole comparison table (every metric and status) as CSV here")
    bench.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    bench.add_argument("--batch-size", type=int, default=256)
    bench.add_argument("--runs-root", default=str(DEFAULT_RUNS_ROOT), help="where runs live (default: ./runs)")
    bench.add_argument("--force", action="store_true", help="start even over this machine's limits")
    bench.add_argument("--nproc-per-node", type=int, default=1, help="processes on this machine (one per GPU)")
    bench.set_defaults(func=cmd_bench, out=None, nnodes=1, node_rank=0, rdzv_endpoint=None)
    report = commands.add_parser(
        "report", help="write a run's report: one self-contained HTML file (plots, tables, galleries; no network)"
    )
    report.add_argument("run", help="a finished run directory")
    report.add_argument("-o", "--output", default="report.html", help="the HTML file to write (default: report.html)")
    report.add_argument(
        "--detector", action="append", metavar="NAME", help="a detector to give a section (repeatable; default: all)"
    )
    report.add_argument("--gallery", type=int, default=8, help="images per failure gallery (default: 8)")
    report.add_argument(
        "--figure-files",
        action="store_true",
        help="also offer each figure as PNG and SVG downloads in the report (kaleido 1.x and Chromium: "
        "pip install 'oodviz[export]'; slower, larger file)",
    )
    report.set_defaults(func=cmd_report)
    project = commands.add_parser(
        "project", help="compute a run's 2-D map of the ID test and OOD features (PCA, or t-SNE/UMAP on a subsample)"
    )
    project.add_argument("run", help="a finished run directory (its feature stores must still exist)")
    methods = "pca (default: every sample), tsne or umap (umap-learn installed) on a seeded subsample"
    project.add_argument("--method", choices=["pca", "tsne", "umap"], default="pca", help=methods)
    project.add_argument(
        "--max-points", type=int, default=2000, help="t-SNE's or UMAP's seeded subsample (default: 2000)"
    )
    project.add_argument("--seed", type=int, default=0, help="t-SNE's or UMAP's seed and subsample seed (default: 0)")
    project.set_defaults(func=cmd_project)
    store = commands.add_parser("store", help="check or list the feature stores the runs share")
    store_commands = store.add_subparsers(dest="store_command", required=True)
    for name, text in (
        ("verify", "rehash every store against its checksums; exit 1 when one is damaged"),
        ("list", "the stores, their size and how many runs use each"),
    ):
        sub = store_commands.add_parser(name, help=text)
        sub.add_argument("--runs-root", default=str(DEFAULT_RUNS_ROOT), help="where runs live (default: ./runs)")
        sub.add_argument("--store-root", help="the store directory (default: RUNS_ROOT/.features)")
        sub.set_defaults(func=cmd_store, remove=False)
    store_commands.choices["verify"].add_argument(
        "--remove",
        action="store_true",
        help="remove damaged and outdated stores and unfinished ones whose writer is gone",
    )
    args = parser.parse_args(argv)
    if getattr(args, "preset", None) is not None:  # checked here: the other commands need no run config
        if args.preset not in PRESETS:
            run.error(f"argument --preset: invalid choice: {args.preset!r} (choose from {', '.join(PRESETS)})")
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside a run's own handler: the pre-flight, a report, a score, ...
        print(f"oodviz {args.command}: interrupted (Ctrl-C) before it finished", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
