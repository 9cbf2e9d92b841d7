"""Safe by default (issue 12): the token gate, path confinement, ``?run=`` names, hidden server details,
and the memory estimate's user code kept out of the app's process. The server itself: test_serve.py."""

import json
import os
import socket
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from oodviz.config.run import DatasetChoice, RunConfig, preset
from oodviz.pipeline.probe import ProbeError, estimate_for_config, estimate_in_subprocess
from oodviz.ui.access import NOT_ALLOWED, AccessPolicy, PathRefused, cut_paths, run_path

APP = str(Path(__file__).resolve().parents[2] / "app.py")
TOKEN = "t0ken-for-the-tests"


@pytest.fixture
def runs_root(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    root.mkdir()
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(root))
    return root


@pytest.fixture
def serving_others(monkeypatch, tmp_path):
    """The environment ``oodviz app --host 0.0.0.0 --token ... --data-dir <tmp>/allowed`` gives the page."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    policy = AccessPolicy(token=TOKEN, serve_others=True, data_dirs=(allowed.resolve(),))
    for key, value in policy.to_env().items():
        monkeypatch.setenv(key, value)
    return allowed


def texts(app) -> str:
    parts = [e.value for e in [*app.error, *app.info, *app.caption, *app.markdown, *app.warning, *app.title]]
    return "\n".join(str(p) for p in parts)


# --- the token gate -------------------------------------------------------------------------------------


def test_without_the_token_the_page_is_only_the_token_prompt(runs_root, serving_others):
    app = AppTest.from_file(APP, default_timeout=60).run()
    assert not app.exception
    assert [t.label for t in app.text_input] == ["Access token"]
    assert [b.label for b in app.button] == ["Open the app"]  # no form, no runs, no page of the app
    assert not app.selectbox and not app.multiselect and [t.value for t in app.title] == ["oodviz"]
    assert not app.dataframe
    app.query_params["token"] = "wrong"
    app.run()
    assert "not this server's access token" in texts(app) and not [b for b in app.button if b.label == "Start run"]


def test_the_token_in_the_url_or_the_prompt_opens_the_app(runs_root, serving_others):
    app = AppTest.from_file(APP, default_timeout=60)
    app.query_params["token"] = TOKEN
    app.run()
    assert not app.exception
    assert sorted(b.label for b in app.button if b.label in ("Run the default", "Start run")) == [
        "Run the default",
        "Start run",
    ]
    typed = AppTest.from_file(APP, default_timeout=60).run()
    typed.text_input[0].input(TOKEN)
    typed.button[0].click().run()
    assert [b.label for b in typed.button if b.label == "Run the default"]
    typed.run()  # the session remembers the token
    assert [b.label for b in typed.button if b.label == "Run the default"]


def test_on_loopback_there_is_no_gate(runs_root):
    app = AppTest.from_file(APP, default_timeout=60).run()
    assert [b.label for b in app.button if b.label == "Run the default"]
    assert not [t for t in app.text_input if t.label == "Access token"]


def test_token_comparison():
    policy = AccessPolicy(token=TOKEN, serve_others=True, data_dirs=())
    assert policy.token_ok(TOKEN)
    assert not policy.token_ok(TOKEN[:-1]) and not policy.token_ok("") and not policy.token_ok(None)
    assert AccessPolicy().token_ok(None)  # loopback: nothing to give


# --- path confinement -----------------------------------------------------------------------------------


def folder_config(fit: str, test: str = "", ood: str = "") -> RunConfig:
    config = RunConfig(
        id_fit=DatasetChoice("folder", {"path": fit}), id_test=DatasetChoice("folder", {"path": test or fit})
    )
    if ood:
        config.ood = [DatasetChoice("folder", {"path": ood}, group="far")]
    return config


def test_typed_paths_inside_the_data_dirs_are_resolved(tmp_path):
    allowed = (tmp_path / "allowed").resolve()
    (allowed / "cats").mkdir(parents=True)
    (allowed / "model.pt").write_bytes(b"x")
    policy = AccessPolicy(serve_others=True, token=TOKEN, data_dirs=(allowed,))
    config = folder_config(str(allowed / "cats"), "cats", ood=str(allowed / "x" / ".." / "cats"))
    config.checkpoint, config.backbone = "model.pt", "torchscript"
    confined = policy.confine_config(config)
    cats = str(allowed / "cats")
    assert (confined.id_fit.params["path"], confined.id_test.params["path"], confined.ood[0].params["path"]) == (
        cats,
        cats,
        cats,
    )
    assert confined.checkpoint == str(allowed / "model.pt")
    assert config.id_test.params["path"] == "cats"  # the form's config is not changed in place


@pytest.mark.parametrize("where", ["fit folder", "ood folder", "checkpoint", "data root", "openood root", "download"])
def test_typed_paths_outside_the_data_dirs_are_refused_without_naming_them(tmp_path, where):
    allowed = (tmp_path / "allowed").resolve()
    (allowed / "ok").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (allowed / "escape").symlink_to(outside, target_is_directory=True)  # a link inside leading out
    policy = AccessPolicy(serve_others=True, token=TOKEN, data_dirs=(allowed,))
    config = folder_config(str(allowed / "ok"))
    label = {"fit folder": "ID fit folder", "ood folder": "OOD folder", "checkpoint": "checkpoint"}.get(
        where, "data root"
    )
    if where == "fit folder":
        config.id_fit.params["path"] = str(allowed / "escape")
    elif where == "ood folder":
        config.ood = [DatasetChoice("folder", {"path": "../outside"}, group="far")]
    elif where == "checkpoint":
        config.checkpoint = "/etc/passwd"
    elif where == "data root":
        config = preset("fashion-mnist")  # reads the data root
        config.data_root = str(outside)
    elif where == "openood root":  # OpenOOD's list files and images are read from the data root
        config.ood = [DatasetChoice("openood", {"benchmark": "cifar10", "split": "far/svhn"}, group="far")]
        config.data_root = str(outside)
    else:  # downloads write into the data root, whatever the datasets
        config.download, config.data_root = True, "/tmp"
    with pytest.raises(PathRefused) as refused:
        policy.confine_config(config)
    assert str(refused.value) == f"{label}: {NOT_ALLOWED}"
    assert str(tmp_path) not in str(refused.value)


def test_serving_others_without_data_dirs_allows_only_the_bundled_data(tmp_path):
    policy = AccessPolicy(serve_others=True, token=TOKEN, data_dirs=())
    assert policy.confine_config(RunConfig()) == RunConfig()  # digits and generated sets: no path used
    with pytest.raises(PathRefused, match="data root: .*only the bundled data"):
        policy.confine_config(preset("fashion-mnist"))
    with pytest.raises(PathRefused, match="ID fit folder: .*ID test folder: "):
        policy.confine_config(folder_config(str(tmp_path)))


def test_on_loopback_paths_are_not_confined(tmp_path):
    config = folder_config("/anywhere/at/all")
    assert AccessPolicy().confine_config(config) is config


def test_the_form_refuses_a_folder_outside_the_data_dirs_before_any_run(runs_root, serving_others):
    app = AppTest.from_file(APP, default_timeout=60)
    app.query_params["token"] = TOKEN
    app.run()
    [preset_box] = [s for s in app.selectbox if s.label == "In-distribution"]
    preset_box.select("image folders (your own)").run()
    for label, value in (
        ("ID fit folder (image folders only)", "/etc"),
        ("ID test folder (image folders only)", "../x"),
    ):
        [box] = [t for t in app.text_input if t.label == label]
        box.input(value)
    [start] = [b for b in app.button if b.label == "Start run"]
    start.click().run()
    assert not app.exception
    errors = [e.value for e in app.error]  # one under each folder's field, then the count beside Start
    assert errors == [NOT_ALLOWED, NOT_ALLOWED, "Fix first: 2 problem(s), shown under their fields."]
    assert list(runs_root.iterdir()) == []  # nothing was submitted


# --- ?run= ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["..", ".", "../outside", "/etc", "a/b", "a\\b", "x\x00y"])
def test_run_names_that_are_paths_are_refused(tmp_path, name):
    with pytest.raises(PathRefused, match="not a run name"):
        run_path(tmp_path, name)


def test_a_run_name_is_a_child_of_the_runs_root(tmp_path):
    assert run_path(tmp_path, "r1") == tmp_path / "r1"  # it need not exist yet
    (tmp_path / "r2").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "r2")  # a link that stays inside is fine
    assert run_path(tmp_path, "alias") == tmp_path / "alias"


def outside_run(tmp_path) -> Path:
    """A run-like folder outside the runs root, whose status a refresh would rewrite (a dead pid)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    RunConfig().save(outside / "config.json")
    (outside / "status.json").write_text(json.dumps({"state": "running", "pid": 2**22 + 12345}))
    (outside / "label.json").write_text(json.dumps({"name": "a name outside", "notes": ""}))
    return outside


@pytest.mark.parametrize("name", ["../outside", "/etc", "a/b", "linked"])
def test_the_url_cannot_open_a_run_outside_the_runs_root(runs_root, tmp_path, name):
    outside = outside_run(tmp_path)
    (runs_root / "linked").symlink_to(outside, target_is_directory=True)
    before = (outside / "status.json").read_bytes()
    app = AppTest.from_file(APP, default_timeout=60)
    app.query_params["run"] = name if name != "/etc" else str(outside)
    app.run()
    assert not app.exception
    [error] = [e.value for e in app.error]
    assert error.startswith("The run in the URL cannot be opened: ")
    assert str(tmp_path) not in error and "outside" not in error.replace("leads outside the runs root", "")
    assert (outside / "status.json").read_bytes() == before  # nothing outside was read as a run or rewritten
    assert not app.tabs
    [picker] = [s for s in app.selectbox if s.label == "Run"]  # the Run page's picker names it as it was asked
    assert not [o for o in picker.options if "a name outside" in o]


def test_serving_others_hides_server_paths_and_tracebacks(runs_root, serving_others):
    from oodviz.runs.rundir import RunDir

    failed = runs_root / "r-failed"
    failed.mkdir()
    RunConfig().save(failed / "config.json")
    RunDir(failed).write_status(state="failed", error="ValueError: bad", detail="Traceback: /srv/secret/file.py")
    app = AppTest.from_file(APP, default_timeout=60)
    app.query_params["token"] = TOKEN
    app.query_params["run"] = "r-failed"
    app.run()
    assert not app.exception
    assert "The run failed: ValueError: bad" in texts(app)
    assert str(runs_root.resolve()) not in texts(app) and "/srv/secret" not in texts(app)
    assert not [x for x in app.expander if x.label == "Details"]
    app.query_params["run"] = "no-such-run"
    app.run()
    assert "There is no run 'no-such-run'; it may have been deleted." in texts(app)


def test_serving_others_a_runs_error_and_warnings_name_files_without_their_server_folders(runs_root, serving_others):
    """What a run says about the server's files (its error, its warnings) reaches others with each absolute path cut to
    its last name; a URL or a relative path stays as it is."""
    from oodviz.runs.rundir import RunDir

    failed = runs_root / "r-failed-path"
    failed.mkdir()
    RunConfig().save(failed / "config.json")
    error = "FileNotFoundError: [Errno 2] No such file or directory: '/srv/secret/data/cifar-10-batches-py/test_batch'"
    RunDir(failed).write_status(state="failed", error=error)
    RunDir(failed).append_event(
        {"event": "warning", "message": "id_test: /srv/secret/images/a.png unreadable, skipped"}
    )
    app = AppTest.from_file(APP, default_timeout=60)
    app.query_params["token"] = TOKEN
    app.query_params["run"] = "r-failed-path"
    app.run()
    assert not app.exception
    shown = texts(app)
    assert "No such file or directory: '.../test_batch'" in shown and "id_test: .../a.png unreadable" in shown
    assert "/srv/secret" not in shown
    assert cut_paths("see https://example.org/a/b or ./rel/dir, 3/4 of /opt/x/y.") == (
        "see https://example.org/a/b or ./rel/dir, 3/4 of .../y."
    )


@pytest.mark.parametrize("state", ["failed", "running"])
def test_serving_others_the_run_headline_names_an_ood_folder_without_its_server_path(runs_root, serving_others, state):
    """The headline above a finished run (and the live panel of a running one) names an OOD image folder by its
    last name only when serving others; on loopback by its path."""
    from oodviz.config.run import DatasetChoice
    from oodviz.runs.rundir import RunDir

    run = runs_root / "r-folder"
    run.mkdir()
    RunConfig(ood=[DatasetChoice("folder", {"path": "/srv/secret/ood-images"})]).save(run / "config.json")
    RunDir(run).write_status(state=state, error="ValueError: bad" if state == "failed" else None)
    app = AppTest.from_file(APP, default_timeout=60)
    app.query_params["token"] = TOKEN
    app.query_params["run"] = "r-folder"
    app.run()
    assert not app.exception
    assert "OOD folder ood-images · " in texts(app) and "/srv/secret" not in texts(app)


@pytest.mark.parametrize("others", [True, False])
def test_the_run_details_config_shows_no_server_path_to_others(runs_root, default_run, monkeypatch, tmp_path, others):
    """The Run details tab's config: serving others, every path entry (data root, checkpoint, an image folder's
    path) cut to its last name; on loopback, as written."""
    import json
    import shutil

    if others:
        policy = AccessPolicy(token=TOKEN, serve_others=True, data_dirs=(tmp_path.resolve(),))
        for key, value in policy.to_env().items():
            monkeypatch.setenv(key, value)
    run = runs_root / "r-paths"
    shutil.copytree(default_run.path, run)
    config = json.loads((run / "config.json").read_text())
    config["data_root"] = "/srv/secret/data"
    config["ood"][0] = {**config["ood"][0], "name": "folder", "params": {"path": "/srv/secret/ood-images"}}
    (run / "config.json").write_text(json.dumps(config))
    app = AppTest.from_file(APP, default_timeout=60)
    app.query_params["token"] = TOKEN
    app.query_params["run"] = "r-paths"
    app.run()
    app.session_state["results-tab"] = "Run details"
    app.run()
    assert not app.exception
    [shown] = [json.loads(j.value) for j in app.json]
    if others:
        assert shown["data_root"] == ".../data" and shown["ood"][0]["params"]["path"] == ".../ood-images"
        assert "/srv/secret" not in json.dumps(shown) and "server paths cut" in texts(app)
    else:
        assert (
            shown["data_root"] == "/srv/secret/data" and shown["ood"][0]["params"]["path"] == "/srv/secret/ood-images"
        )


def test_serving_others_a_link_with_the_token_opens_the_view_and_keeps_the_token(
    runs_root, serving_others, default_run
):
    """The token stays in the URL beside the run's view: a link with both opens the view, and a change of the view
    rewrites the view's parameters only."""
    import shutil

    shutil.copytree(default_run.path, runs_root / "r-view")
    app = AppTest.from_file(APP, default_timeout=60)
    app.query_params.update(token=TOKEN, run="r-view", tab="score-histograms", detector="energy")
    app.run()
    assert not app.exception
    assert [s.value for s in app.selectbox if s.label.startswith("Detector")] == ["energy"] and app.slider
    [s for s in app.selectbox if s.label.startswith("Detector")][0].select("msp").run()
    assert dict(app.query_params) == {"token": TOKEN, "run": "r-view", "tab": "score-histograms", "detector": "msp"}
    wrong = AppTest.from_file(APP, default_timeout=60)
    wrong.query_params.update(token="wrong", run="r-view", tab="score-histograms")
    wrong.run()
    assert not wrong.exception and not wrong.tabs and not wrong.slider  # the view of a run is no way around the token


# --- the memory estimate runs elsewhere ------------------------------------------------------------------


@pytest.mark.process
def test_the_estimate_runs_no_model_code_in_the_app_process(runs_root, monkeypatch):
    """A tripwire: loading a model in this (the app's) process raises; the estimate still appears, from
    the probe process, equal to computing it here (the measured batch peaks vary run to run: the same batches
    are listed)."""
    import streamlit as st
    import torch

    import oodviz.models

    expected = estimate_for_config(RunConfig())  # before the tripwire
    st.cache_data.clear()

    def tripwire(*args, **kwargs):
        raise AssertionError("model code ran in the app's process")

    monkeypatch.setattr(oodviz.models, "load_backbone", tripwire)
    monkeypatch.setattr(torch.jit, "load", tripwire)
    app = AppTest.from_file(APP, default_timeout=120).run()
    [estimate] = [b for b in app.button if b.label == "Estimate memory"]
    estimate.click().run()
    assert not app.exception
    assert not [e.value for e in app.error]
    [shown] = [c.value for c in app.code]  # under "How the estimate was made"
    assert counted_and_batches(shown) == counted_and_batches(expected.description)
    assert counted_and_batches(shown)[1] == ["batch of extraction", "batch of odin"]


def counted_and_batches(description: str) -> tuple[list[str], list[str]]:
    """An estimate's description without the measured batch peaks (they vary run to run): its counted lines,
    and which batches were measured."""
    lines = description.splitlines()
    measured = [line.split(":")[0] for line in lines if line.startswith("batch of ")]
    return [line for line in lines if not line.startswith("batch of ")], measured


def without_batch_peaks(estimate: dict) -> dict:
    """An estimate without its measured batch peaks' bytes: what was measured, at how many rows."""
    peaks = [(peak["what"], peak["rows"]) for peak in estimate["batch_peaks"]]
    return {**estimate, "batch_peaks": peaks}


@pytest.mark.process
def test_the_probe_process_gives_the_in_process_estimate_or_a_clear_error(tmp_path):
    config = RunConfig(ood=RunConfig().ood[:2])
    answer = estimate_in_subprocess(json.dumps(config.to_dict()))
    expected = estimate_for_config(config)
    estimate = answer.estimate
    assert without_batch_peaks(estimate) == without_batch_peaks(json.loads(json.dumps(expected.estimate)))
    assert counted_and_batches(answer.description) == counted_and_batches(expected.description)
    assert (answer.refusal, answer.table, answer.fixes) == (expected.refusal, expected.table, expected.fixes)
    assert estimate["splits"]["id_fit"]["n_samples"] == 1081  # digits classes 0-7, the fit split
    missing = RunConfig(backbone="torchscript", checkpoint=str(tmp_path / "none.pt"))
    with pytest.raises(ProbeError, match="FileNotFoundError: .*none.pt"):
        estimate_in_subprocess(json.dumps(missing.to_dict()))
    with pytest.raises(ProbeError, match="longer than 0 s and was stopped"):
        estimate_in_subprocess(json.dumps(config.to_dict()), timeout_s=0.2)


@pytest.mark.process
def test_the_probe_reports_a_crash(tmp_path, monkeypatch):
    """A child that dies without answering (here: killed by its own code) is an error, not a hang."""
    sitecustomize = tmp_path / "sitecustomize.py"
    sitecustomize.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with pytest.raises(ProbeError, match=r"ended without an answer \(exit code -9; crashed\?\)"):
        estimate_in_subprocess(json.dumps(RunConfig().to_dict()))


# --- what `oodviz app` serves with ------------------------------------------------------------------------


def app_policy(argv, monkeypatch, token_env=None):
    """The policy ``oodviz app ARGV`` would serve with (everything up to its exec into Streamlit)."""
    from oodviz import cli

    captured = {}
    if token_env is None:
        monkeypatch.delenv("OODVIZ_TOKEN", raising=False)
    else:
        monkeypatch.setenv("OODVIZ_TOKEN", token_env)
    monkeypatch.setattr(cli, "cmd_app", lambda args: captured.setdefault("policy", cli.access_policy(args)))
    cli.main(["app", *argv])
    return captured["policy"]


def test_oodviz_app_policies(monkeypatch, tmp_path):
    loopback = app_policy([], monkeypatch)
    assert (loopback.token, loopback.serve_others, loopback.data_dirs) == (None, False, None)
    assert set(loopback.allowed_hosts) == {"localhost", "127.0.0.1", "::1"}
    others = app_policy(
        ["--host", "0.0.0.0", "--data-dir", str(tmp_path), "--allowed-host", "OOD.example"], monkeypatch
    )
    assert others.serve_others and len(others.token) >= 32 and others.data_dirs == (tmp_path.resolve(),)
    assert {"127.0.0.1", "ood.example", socket.gethostname().lower()} <= set(others.allowed_hosts)
    assert app_policy(["--host", "0.0.0.0"], monkeypatch, token_env="from-env").token == "from-env"
    assert app_policy(["--host", "0.0.0.0", "--token", "given"], monkeypatch, token_env="env").token == "given"
    assert app_policy(["--data-dir", str(tmp_path)], monkeypatch).data_dirs == (tmp_path.resolve(),)  # opt-in
    with pytest.raises(SystemExit, match="--data-dir .*missing is not a directory"):
        app_policy(["--host", "0.0.0.0", "--data-dir", str(tmp_path / "missing")], monkeypatch)
    round_trip = AccessPolicy.from_env(others.to_env())
    assert (round_trip.token, round_trip.serve_others, round_trip.data_dirs) == (
        others.token,
        True,
        others.data_dirs,
    )


def test_streamlit_options_are_looked_up_in_the_installed_streamlit():
    from oodviz.ui import streamlit_has_option

    assert streamlit_has_option("server.address") and not streamlit_has_option("server.noSuchOption")


def test_an_empty_path_is_not_taken_for_the_data_dir(tmp_path):
    """Nothing typed stays nothing (the folder dataset says it needs a path), not the whole data directory."""
    policy = AccessPolicy(serve_others=True, token=TOKEN, data_dirs=(tmp_path.resolve(),))
    assert policy.confine_config(folder_config(" ")).id_fit.params["path"] == " "


def test_a_failing_estimate_is_a_clear_message_in_the_page(runs_root, tmp_path):
    import streamlit as st

    st.cache_data.clear()
    app = AppTest.from_file(APP, default_timeout=120).run()
    [preset_box] = [s for s in app.selectbox if s.label == "In-distribution"]
    preset_box.select("image folders (your own)").run()
    for label in ("ID fit folder (image folders only)", "ID test folder (image folders only)"):
        [box] = [t for t in app.text_input if t.label == label]
        box.input(str(tmp_path / "no-such-folder"))
    [estimate] = [b for b in app.button if b.label == "Estimate memory"]
    estimate.click().run()
    assert not app.exception  # the form's check finds the folders missing before any estimate is tried
    missing = f"Image folder {tmp_path / 'no-such-folder'} does not exist".replace("_", "\\_")  # markdown-escaped
    assert [e.value for e in app.error] == [
        missing,
        missing,
        "Fix first: 2 problem(s), shown under their fields.",
    ]
