"""Faults of the runs layer: failing detectors, damaged run directories, killed processes, reused pids,
deleted runs, a full queue, a full disk. Each runs the real processes and files a user would meet; the ``oodviz``
commands whose processes are not the subject (a failing detector, a full disk, the listings) run the command's code
in this process (:func:`conftest.oodviz_in_process`)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from helpers import extraction_started, oodviz_in_process, slow_config, small_config, wait_for

from oodviz.config.run import DatasetChoice, DetectorChoice
from oodviz.engine import STORES_DIRNAME, check_stores
from oodviz.files import write_atomic
from oodviz.results.summary import summarise
from oodviz.runs.jobs import MAX_QUEUED, QueueFull, delete_run, list_runs, refresh, submit
from oodviz.runs.rundir import RunDir, process_alive, process_started

APP = Path(__file__).resolve().parents[2] / "app.py"
MSP = DetectorChoice("msp")
#: fails to fit on digits-cnn, which has no dropout layers (a data-dependent knn k is refused before extraction)
MCD_NO_DROPOUT = DetectorChoice("mcd")
MCD_ERROR = "ValueError: mcd needs dropout layers to sample from, but the model (DigitsCNN) has no nn.Dropout"


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    """One runs root for the CLI runs of this module: they share the feature stores (extracted once)."""
    return tmp_path_factory.mktemp("fault-runs")


def cli_run(runs_root: Path, detectors, name: str) -> tuple[subprocess.CompletedProcess, RunDir]:
    config = small_config(ood=[DatasetChoice("digits-heldout")], detectors=detectors)
    config.save(runs_root.parent / f"{runs_root.name}-{name}.json")
    result = oodviz_in_process("run", runs_root.parent / f"{runs_root.name}-{name}.json", "--out", runs_root / name)
    return result, RunDir(runs_root / name)


# ---- per-detector isolation ------------------------------------------------------------------


def test_a_run_whose_only_detector_fails_ends_failed_exit_1_and_the_list_still_works(runs_root):
    result, run = cli_run(runs_root, [MCD_NO_DROPOUT], "mcd-alone")
    assert result.returncode == 1, result.stderr[-2000:]
    status = run.read_status()
    assert status["state"] == "failed"
    assert status["error"].startswith(f"RuntimeError: every detector failed (mcd: {MCD_ERROR}")
    assert not (run.path / "metrics.csv").exists() and not (run.path / "scores.parquet").exists()
    assert "error: RuntimeError: every detector failed" in result.stderr
    listing = oodviz_in_process("runs", "--runs-root", runs_root)
    assert listing.returncode == 0, listing.stderr
    line = next(line for line in listing.stdout.splitlines() if line.startswith("mcd-alone"))
    assert line.split()[1] == "failed" and "every detector failed" in line
    assert summarise(run)["state"] == "failed"


def test_a_failing_detector_leaves_the_others_results_and_exits_3(runs_root):
    result, run = cli_run(runs_root, [MCD_NO_DROPOUT, MSP], "mcd-and-msp")
    assert result.returncode == 3, result.stderr[-2000:]
    assert "1 detector(s) failed: mcd" in result.stdout
    status = run.read_status()
    assert status["state"] == "done" and status["failed_detectors"] == ["mcd"]
    log = json.loads((run.path / "detectors.json").read_text())
    assert log["mcd"]["error"].startswith(MCD_ERROR)
    metrics = pd.read_csv(run.path / "metrics.csv")
    assert set(metrics.detector) == {"msp"} and metrics.auroc.between(0.5, 1).all()
    assert list(pd.read_parquet(run.path / "scores.parquet").columns[5:]) == ["msp"]
    warnings = [e["message"] for e in run.read_events() if e.get("event") == "warning"]
    assert warnings[-1] == "done, but 1 detector(s) failed: mcd (see detectors.json)"
    assert summarise(run)["failed_detectors"] == ["mcd"]


def test_the_run_page_shows_a_failed_detectors_error_next_to_the_others_results(runs_root, monkeypatch):
    from streamlit.testing.v1 import AppTest

    if not (runs_root / "mcd-and-msp" / "metrics.csv").exists():
        cli_run(runs_root, [MCD_NO_DROPOUT, MSP], "mcd-and-msp")
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(runs_root))
    app = AppTest.from_file(str(APP), default_timeout=120)
    app.query_params["run"] = "mcd-and-msp"
    app.run()
    assert not app.exception
    errors = [e.value for e in app.error]
    assert len(errors) == 1 and errors[0].startswith(f"mcd failed: {MCD_ERROR}")
    assert "msp" in app.dataframe[0].value.to_string()


def test_data_dependent_limits_are_refused_by_the_pre_flight_before_a_run_directory_exists(runs_root):
    """knn's ``k`` above the ID fit rows and vim's ``dim`` not below D: known from the split sizes and the model's
    D before any work, so ``oodviz run`` refuses them (exit 2, no run directory), one line per problem."""
    detectors = [DetectorChoice("knn", {"k": 10**6}), DetectorChoice("vim", {"dim": 64}), MSP]
    result, run = cli_run(runs_root, detectors, "sizes-refused")
    assert result.returncode == 2, result.stderr[-2000:]
    assert not run.path.exists() and "pre-flight skipped" not in result.stderr
    assert result.stderr.splitlines() == [
        "This run cannot start:",
        "- detectors[0] (knn): k=1000000 is more than the 1081 rows of the ID fit set; choose k <= 1081 or fit on "
        "more data",
        "- detectors[1] (vim): dim=64 must be between 1 and D-1 = 63 for the D=64 features of this model and layer; "
        "choose a dim in that range",
        "nothing was started",
    ]


def test_the_run_refuses_data_dependent_limits_itself_before_any_extraction(tmp_path):
    """Started without the pre-flight (a queued run, ``--force`` skips only the machine's limits): the run's load
    data stage refuses the same problems with the same function before anything is extracted."""
    from oodviz.pipeline.worker import execute

    config = small_config(ood=[DatasetChoice("digits-heldout")], detectors=[DetectorChoice("knn", {"k": 10**6})])
    run = RunDir.create(tmp_path, config.to_dict())
    assert execute(run) == "failed"
    status = run.read_status()
    assert status["state"] == "failed" and status["stage"] == "load data"
    assert "detectors[0] (knn): k=1000000 is more than the 1081 rows of the ID fit set" in status["error"]
    assert not any((e.get("stage") or "").startswith("extract") for e in run.read_events())


class _RunsCode:
    """A pickled object whose unpickling would create the file ``marker``: torch.load(weights_only=True) must refuse it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def unreadable_checkpoint(kind: str, folder: Path) -> tuple[str, Path]:
    """``(backbone, file)``: a digits-cnn checkpoint that cannot be used, of ``kind``: a pickle that would run code,
    a state dict with a weight of another shape, a state dict's zip cut in half, a ``torch.export`` program cut in half."""
    import torch

    from oodviz.models.digits import DigitsCNN

    model, path = DigitsCNN().eval(), folder / f"{kind}.pt"
    if kind == "pickle":
        torch.save({"fc.weight": _RunsCode(folder / "code-ran")}, path)
    elif kind == "shapes":
        torch.save({**model.state_dict(), "features.0.weight": torch.zeros(1, 1, 1, 1)}, path)
    elif kind == "truncated":
        torch.save(model.state_dict(), path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        torch.export.save(torch.export.export(model, (torch.zeros(1, 1, 8, 8),)), path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return ("export" if kind == "export" else "digits-cnn"), path


@pytest.mark.process
@pytest.mark.parametrize(
    "kind, why",
    [
        ("pickle", "it pickles objects other than tensors, which are not loaded: unpickling them could run code"),
        (
            "shapes",
            "is not a state dict of the digits-cnn architecture: 1 shape mismatches, file vs model (e.g. "
            "features.0.weight (1, 1, 1, 1) vs",
        ),
        ("truncated", "a damaged zip archive: truncated, or cut short while it was written or copied"),
        ("export", "is not a torch.export program"),
    ],
)
def test_an_unusable_checkpoint_is_refused_before_a_run_directory_exists(tmp_path, kind, why):
    """``oodviz run`` (its own process: torch logs to the real stderr) with a checkpoint that cannot be used: exit 2,
    no run directory, one message naming the file and why, no traceback; the pickle's code never ran."""
    backbone, checkpoint = unreadable_checkpoint(kind, tmp_path)
    config = small_config(ood=[DatasetChoice("digits-heldout")], detectors=[MSP], backbone=backbone)
    config.checkpoint = str(checkpoint)
    config.save(tmp_path / "run.json")
    command = [
        sys.executable,
        "-m",
        "oodviz.cli",
        "run",
        str(tmp_path / "run.json"),
        "--runs-root",
        str(tmp_path / "runs"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "code-ran").exists()
    lines = result.stderr.splitlines()
    assert lines[0] == "This run cannot start:" and lines[2:] == ["nothing was started"], result.stderr
    assert lines[1].startswith(f"- {checkpoint} ") and why in lines[1], lines[1]


def test_non_finite_scores_fail_only_their_detector(runs_root):
    result, run = cli_run(runs_root, [DetectorChoice("energy", {"temperature": 1e-300}), MSP], "energy-tiny-t")
    assert result.returncode == 3, result.stderr[-2000:]
    assert run.read_status()["failed_detectors"] == ["energy"]
    error = json.loads((run.path / "detectors.json").read_text())["energy"]["error"]
    assert error.startswith("ValueError: energy gave ") and " non-finite scores on id_test (of 362)" in error
    assert error.endswith("try another temperature")
    assert set(pd.read_csv(run.path / "metrics.csv").detector) == {"msp"}


# ---- damaged run directories -------------------------------------------------------------------

DAMAGES = {
    "status-truncated": ("status.json", b'{"state": "do'),
    "status-list": ("status.json", b"[]"),
    "status-missing": ("status.json", None),
    "status-bad-state": ("status.json", b'{"state": ["done"]}'),
    "metrics-garbage": ("metrics.csv", b"\x00\xffnot,a\ntable"),
    "metrics-one-byte": ("metrics.csv", b"\n"),
    "config-list": ("config.json", b"[1, 2]"),
    "config-missing": ("config.json", None),
    "config-not-utf8": ("config.json", b'{"backbone": "\xff\xfe"}'),
    "scores-truncated": ("scores.parquet", lambda data: data[: len(data) // 2]),
    "scores-missing": ("scores.parquet", None),
}
EXPECTED = {
    "status-truncated": "damaged: status.json is not valid JSON",
    "status-list": "damaged: status.json holds a list, not an object",
    "status-missing": "damaged: status.json is missing",
    "status-bad-state": "damaged: status.json has no known state",
    "metrics-garbage": "damaged: metrics.csv is missing or not a metrics table",
    "metrics-one-byte": "damaged: metrics.csv is missing or not a metrics table",
    "config-list": "damaged: config.json holds a list, not an object",
    "config-missing": "damaged: config.json is missing",
    "config-not-utf8": "damaged: config.json is not valid JSON",
    "scores-truncated": "damaged: scores.parquet is not a readable Parquet table (truncated or damaged)",
    "scores-missing": "damaged: scores.parquet is missing",
}


@pytest.fixture(scope="module")
def damaged_root(default_run, tmp_path_factory) -> Path:
    """Copies of the default run, each with one file damaged, plus one with bytes that are not UTF-8
    in events.jsonl (its events are skipped, the run itself is fine)."""
    root = tmp_path_factory.mktemp("damaged")
    for name, (file, content) in {**DAMAGES, "events-not-utf8": ("events.jsonl", None)}.items():
        shutil.copytree(default_run.path, root / name)
        target = root / name / file
        if name == "events-not-utf8":
            target.write_bytes(target.read_bytes() + b'{"event": "\xff\xfe"}\n\xc3\x28\n')
        elif content is None:
            target.unlink()
        elif callable(content):  # the file's own bytes, changed
            target.write_bytes(content(target.read_bytes()))
        else:
            target.write_bytes(content)
    return root


def test_damaged_runs_are_listed_as_damaged_by_the_cli_and_summarise_and_listing_never_writes(damaged_root):
    before = {p: p.stat().st_mtime_ns for p in damaged_root.rglob("*")}
    listing = oodviz_in_process("runs", "--runs-root", damaged_root)  # test_runs starts `oodviz runs` itself
    assert listing.returncode == 0, listing.stderr
    assert {p: p.stat().st_mtime_ns for p in damaged_root.rglob("*")} == before  # the listing wrote nothing
    lines = {line.split()[0]: line for line in listing.stdout.splitlines()}
    assert set(lines) == {*DAMAGES, "events-not-utf8"}
    for name, what in EXPECTED.items():
        assert lines[name].split()[1] == "damaged" and lines[name].endswith(what), lines[name]
        assert summarise(RunDir(damaged_root / name))["error"] == what
    assert lines["events-not-utf8"].split()[1] == "done" and "best AUROC" in lines["events-not-utf8"]
    events = RunDir(damaged_root / "events-not-utf8").read_events()
    assert events[-1]["event"] == "done"  # the lines that are not UTF-8 JSON are skipped


@pytest.mark.parametrize("name", ["scores-truncated", "scores-missing"])
def test_report_and_score_name_a_done_runs_unusable_scores_file_and_the_fix(damaged_root, name, tmp_path):
    run = damaged_root / name
    what = EXPECTED[name].removeprefix("damaged: scores.parquet ")
    for command in (("report", run, "-o", tmp_path / "report.html"), ("score", run, tmp_path / "any.png")):
        result = oodviz_in_process(*command)
        assert result.returncode == 2, result.stderr
        assert result.stderr == (
            f"oodviz {command[0]}: the results file {run / 'scores.parquet'} {what}; run the run's config again for "
            f"new results (oodviz run {run / 'config.json'})\n"
        )
    assert not (tmp_path / "report.html").exists()


def test_the_app_lists_damaged_runs_and_can_delete_them(damaged_root, tmp_path, monkeypatch):
    from app_nav import on_page
    from streamlit.testing.v1 import AppTest

    root = tmp_path / "runs"
    shutil.copytree(damaged_root, root)
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(root))
    app = on_page(AppTest.from_file(str(APP), default_timeout=120), "runs")
    assert not app.exception and not [e.value for e in app.error], [e.value for e in app.error]
    table = app.dataframe[0].value
    states = dict(zip(table.run, table.state))
    assert {name: states[name] for name in EXPECTED} == EXPECTED
    for run in list_runs(root):  # what the Delete button does with the selected rows
        delete_run(run)
    assert list(root.iterdir()) == []


def test_opening_a_damaged_run_says_so(damaged_root, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(damaged_root))
    app = AppTest.from_file(str(APP), default_timeout=120)
    app.query_params["run"] = "status-list"
    app.run()
    assert not app.exception
    assert [e.value for e in app.error] == [
        "This run cannot be shown: damaged: status.json holds a list, not an object. Delete it on the Runs page."
    ]


def test_opening_a_done_run_whose_scores_are_missing_names_the_file(damaged_root, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(damaged_root))
    app = AppTest.from_file(str(APP), default_timeout=120)
    app.query_params["run"] = "scores-missing"
    app.run()
    assert not app.exception
    assert [e.value for e in app.error] == [
        "This run's results cannot be shown: scores.parquet is missing. Run its config again for new results "
        "(New run from this one holds its choices: press Start run there)."
    ]


# ---- processes: liveness, kills, delete ---------------------------------------------------------


@pytest.mark.process
def test_a_reused_pid_is_not_taken_for_the_job(tmp_path):
    """A process with the recorded pid and even the run's path on its command line, started at another
    time than the one recorded, is not the job: the run reads failed and does not block the queue."""
    run = RunDir.create(tmp_path, small_config().to_dict())
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run.path.resolve())])
    try:
        started = wait_for(lambda: process_started(stranger.pid))
        run.write_status(state="running", supervisor_pid=stranger.pid, supervisor_started=started - 100.0)
        status = refresh(run)
        assert status["state"] == "failed" and "supervisor was killed" in status["error"]
        assert json.loads(run.status_path.read_text())["state"] == "running"  # refresh only reads
        run.write_status(supervisor_started=started)
        assert refresh(run)["state"] == "running"  # the same pid and start time: alive
    finally:
        stranger.kill()
        stranger.wait()
    assert not process_alive(stranger.pid, started)


@pytest.mark.process
def test_kill_9_of_the_supervisor_stops_its_worker_and_fails_the_run(tmp_path):
    run = submit(slow_config(), tmp_path)
    wait_for(lambda: extraction_started(run, "ood:noise-gaussian"))
    status = run.read_status()
    os.kill(status["supervisor_pid"], signal.SIGKILL)
    wait_for(lambda: not process_alive(status["worker_pid"], status["worker_started"]), timeout=5)
    status = refresh(run)
    assert status["state"] == "failed" and status["error"].startswith("the supervisor was killed")
    assert not run.scratch_path.exists()


@pytest.mark.process
def test_sigterm_of_the_supervisor_kills_the_worker_and_records_why(tmp_path):
    run = submit(slow_config(), tmp_path)
    wait_for(lambda: extraction_started(run, "ood:noise-gaussian"))
    status = run.read_status()
    os.kill(status["supervisor_pid"], signal.SIGTERM)
    wait_for(lambda: not process_alive(status["worker_pid"], status["worker_started"]), timeout=5)
    recorded = wait_for(lambda: (s := run.read_status())["state"] == "failed" and s, timeout=5)
    assert recorded["error"] == "the supervisor was stopped (SIGTERM); its worker was killed"


@pytest.mark.process
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_of_a_foreground_run_cancels_it_at_the_next_batch(tmp_path, signum, code):
    """``oodviz run`` in the foreground, signalled as a terminal's Ctrl-C signals it (its whole process group) while
    it extracts: the run ends cancelled, the stores finished before stay intact, the one being written is not
    committed, and the command says so in one line and exits 128 + the signal's number."""
    slow_config().save(tmp_path / "slow.json")
    run, stderr = RunDir(tmp_path / "runs" / "fg"), tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "oodviz.cli", "run", str(tmp_path / "slow.json"), "--out", str(run.path)]
    with open(stderr, "w") as errors:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True)
    try:
        wait_for(lambda: extraction_started(run, "ood:noise-gaussian"))
        before = stderr.read_text()
        os.killpg(process.pid, signum)
        assert process.wait(timeout=60) == code
    finally:
        process.kill()
    after = stderr.read_text().removeprefix(before)
    assert "Traceback" not in after and after.count("\n") == 1, after
    assert after.startswith(f"cancelled ({signal.Signals(signum).name}) after "), after
    status = run.read_status()
    assert status["state"] == "cancelled" and status["error"].startswith("cancelled by the user"), status
    stores = check_stores(tmp_path / "runs" / STORES_DIRNAME)
    assert [entry["state"] for entry in stores] == ["ok", "ok"], stores  # ID fit and ID test; no noise store
    assert {entry["store"].meta["dataset"]["name"] for entry in stores} == {"digits-train", "digits-test"}


@pytest.mark.process
def test_deleting_a_running_run_stops_its_processes_and_it_never_reappears(tmp_path):
    run = submit(slow_config(), tmp_path)
    wait_for(lambda: extraction_started(run, "ood:noise-gaussian"))
    status = run.read_status()
    delete_run(run)
    for pid, started in ((status["supervisor_pid"], status["supervisor_started"]), (status["worker_pid"], None)):
        assert not process_alive(pid, started)
    time.sleep(2)  # the worker reported progress every 0.5 s
    assert not run.path.exists() and list_runs(tmp_path) == []


def test_a_write_into_a_deleted_run_fails_instead_of_recreating_it(tmp_path):
    run = RunDir.create(tmp_path, small_config().to_dict())
    shutil.rmtree(run.path)
    with pytest.raises(FileNotFoundError):
        run.write_status(state="running")
    with pytest.raises(FileNotFoundError):
        write_atomic(run.path / "metrics.csv", "detector\n")
    assert not run.path.exists()


@pytest.mark.process
def test_concurrent_status_changes_are_not_lost(tmp_path):
    """Two processes each record 40 keys in status.json: the run's lock keeps all 80."""
    run = RunDir.create(tmp_path, small_config().to_dict())
    code = (
        "import sys; from pathlib import Path; from oodviz.runs.rundir import RunDir\n"
        "run = RunDir(Path(sys.argv[1]))\n"
        "for i in range(40): run.write_status(**{f'{sys.argv[2]}{i}': i})\n"
    )
    writers = [subprocess.Popen([sys.executable, "-c", code, str(run.path), tag]) for tag in ("a", "b")]
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    status = run.read_status()
    assert {f"{tag}{i}" for tag in "ab" for i in range(40)} <= set(status) and status["state"] == "queued"


@pytest.mark.process
def test_the_supervisor_does_not_import_torch():
    code = (
        "import sys, oodviz.runs.supervise; print(sorted(m for m in ('torch', 'numpy', 'pandas') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_queue_refuses_a_run_beyond_its_limit(tmp_path):
    for _ in range(MAX_QUEUED):
        RunDir.create(tmp_path, small_config().to_dict())  # queued, waiting for their supervisor
    with pytest.raises(QueueFull, match=f"20 runs are already queued under .* \\(the limit is {MAX_QUEUED}\\)"):
        submit(small_config(), tmp_path)
    assert len(list_runs(tmp_path)) == MAX_QUEUED


# ---- a full disk -----------------------------------------------------------------------------------


def mounted_tmpfs(tmp_path: Path, size: str):
    """A tmpfs of ``size`` (``"6m"``) mounted at ``tmp_path/disk`` while the test runs (root only: mount)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]).returncode
    ):
        pytest.skip("needs root and tmpfs to fill a disk")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs."""
    yield from mounted_tmpfs(tmp_path, "6m")


@pytest.fixture
def ten_mib_disk(tmp_path):
    """A 10 MiB tmpfs."""
    yield from mounted_tmpfs(tmp_path, "10m")


@pytest.mark.process
def test_the_pre_flight_refuses_what_the_runs_own_disk_check_would(ten_mib_disk):
    """About 6.5 MiB of new stores on a disk with 10 MiB free: the pre-flight asks for the stores and the head room,
    as the run's own check does, so it refuses (exit 2, nothing written) instead of accepting a run that then
    fails; started anyway, the run's check names the same number."""
    from oodviz.models.memory import format_bytes
    from oodviz.pipeline.preflight import preflight

    config = small_config(ood=[DatasetChoice("noise-uniform", params={"n": 20_000})], detectors=[MSP])
    config.save(ten_mib_disk.parent / "run.json")
    runs = ten_mib_disk / "runs"
    (disk,) = [need for need in preflight(config, runs).needs if need.resource == "disk"]
    assert 6 << 20 < disk.needed - (16 << 20) < psutil.disk_usage(str(ten_mib_disk)).free < disk.needed
    refused = oodviz_in_process("run", ten_mib_disk.parent / "run.json", "--runs-root", runs)
    assert refused.returncode == 2, refused.stderr[-2000:]
    row = next(line for line in refused.stderr.splitlines() if line.startswith("disk "))
    assert format_bytes(disk.needed) in row and row.endswith("OVER") and not runs.exists()
    result = oodviz_in_process("run", ten_mib_disk.parent / "run.json", "--runs-root", runs, "--force")
    assert result.returncode == 1, result.stderr[-2000:]
    (run,) = list_runs(runs)
    assert run.read_status()["error"].startswith(f"disk full during load data: needed ~{format_bytes(disk.needed)}, ")


@pytest.mark.process
def test_a_full_disk_fails_the_run_with_the_cause_and_leaves_no_temporary_file(small_disk):
    config = small_config(ood=[DatasetChoice("noise-uniform", params={"n": 200})], detectors=[MSP])
    config.save(small_disk.parent / "run.json")
    filler = small_disk / "filler"
    with open(filler, "wb") as f:  # leave ~200 KB: the run's files fit, the 500 KiB of feature stores do not
        f.write(b"\0" * (psutil.disk_usage(str(small_disk)).free - 200_000))
    refused = oodviz_in_process("run", small_disk.parent / "run.json", "--runs-root", small_disk / "runs")
    assert refused.returncode == 2 and "OVER" in refused.stderr, refused.stderr[-2000:]  # the CLI's pre-flight
    assert not (small_disk / "runs").exists()
    # --force skips the CLI's refusal: the run's own check before extraction fails it
    result = oodviz_in_process("run", small_disk.parent / "run.json", "--runs-root", small_disk / "runs", "--force")
    assert result.returncode == 1, result.stderr[-2000:]
    (run,) = list_runs(small_disk / "runs")
    status = run.read_status()
    assert status["state"] == "failed", status
    # the pre-flight check refuses before any extraction, with what the stores need and what is free
    assert status["error"].startswith("disk full during load data: needed ~"), status["error"]
    assert " free under " in status["error"]
    assert "error: disk full during load data" in result.stderr
    assert not (small_disk / "runs" / ".features").exists() or not any((small_disk / "runs" / ".features").iterdir())
    assert not [p for p in run.path.iterdir() if p.name.endswith(".tmp")]
