"""The app on several GPUs: the "all N GPUs" device choice, the supervisor's torchrun launch, per-rank telemetry."""

import json
import sys
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from oodviz.runs import jobs
from oodviz.runs.launch import main as launch_main
from oodviz.runs.rundir import RunDir
from oodviz.ui.form import ALL_GPUS, FormValues, config_from_form, processes_of

APP = str(Path(__file__).resolve().parents[2] / "app.py")
GIB = 2**30


def fake_devices(gpus: int) -> list[dict]:
    cpu = {"device": "cpu", "name": "cpu", "total": 16 * GIB, "free": 8 * GIB}
    return [cpu] + [{"device": f"cuda:{i}", "name": "H200", "total": 140 * GIB, "free": 130 * GIB} for i in range(gpus)]


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_all_gpus_is_offered_when_more_than_one_gpu_is_visible(gpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(tmp_path))
    monkeypatch.setattr("oodviz.ui.new_run.device_facts", lambda: fake_devices(gpus))
    st.cache_data.clear()  # the New run page caches the devices for 30 s
    app = AppTest.from_file(APP, default_timeout=60)
    app.run()
    assert not app.exception
    device = [s for s in app.selectbox if s.label == "Device"][0]
    every = [f"all {gpus} GPUs — one process each (torchrun)"] if gpus > 1 else []
    gpu_labels = [f"cuda:{i} — H200 (130 GiB free of 140 GiB)" for i in range(gpus)]
    assert device.options == ["auto — first GPU if any, else CPU", *every, "cpu — cpu", *gpu_labels]
    st.cache_data.clear()


def test_all_gpus_is_a_cuda_run_on_one_process_per_gpu():
    values = FormValues(device=ALL_GPUS)
    assert config_from_form(values).device == "cuda" and processes_of(values, 4) == 4
    assert processes_of(FormValues(device="cuda:1"), 4) == 1 and config_from_form(FormValues()).device == "auto"


def test_the_supervisor_starts_torchruns_launcher_for_a_run_on_several_processes(tmp_path, monkeypatch):
    started = []

    class Recorded:
        def __init__(self, argv, **kwargs):
            started.append(argv)

    monkeypatch.setattr(jobs.subprocess, "Popen", Recorded)
    one, several = RunDir.create(tmp_path, {}), RunDir.create(tmp_path, {})
    several.write_status(nproc_per_node=4)
    jobs.start_worker(one)
    jobs.start_worker(several)
    path = str(several.path.resolve())
    assert started[0] == [sys.executable, "-m", "oodviz.pipeline.worker", str(one.path.resolve())]
    assert started[1] == [sys.executable, "-m", "oodviz.runs.launch", path, "4"]
    assert launch_main([path]) == 2 and launch_main([path, "0"]) == 2  # usage: RUN_DIR N with N >= 1


def test_the_live_panel_keeps_each_ranks_device_batch_size_and_memory_apart(tmp_path):
    from oodviz.ui.live import EventTail
    from oodviz.ui.watch import rank_table

    own = {"stage": "extract id_fit", "event": "progress", "device": "cuda:0", "batch_size": 256}
    events = [
        {**own, "time": 1.0, "cpu_rss": 100 * 2**20, "gpu_allocated": GIB, "gpu_peak": 2 * GIB},
        {**own, "event": "rank", "rank": 1, "kind": "progress", "device": "cuda:1", "batch_size": 128,
         "time": 1.5, "cpu_rss": 300 * 2**20, "gpu_allocated": 3 * GIB, "gpu_peak": 4 * GIB},
        {"event": "rank", "rank": 1, "kind": "warning", "message": "OOM: batch size halved"},
        {**own, "time": 2.0, "cpu_rss": 110 * 2**20, "batch_size": 512},
    ]  # fmt: skip
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    tail = EventTail(log)
    tail.poll()
    assert [m["cpu_rss"] for m in tail.memory] == [100 * 2**20, 110 * 2**20]  # rank 0's series only
    assert list(tail.warnings) == ["rank 1: OOM: batch size halved"]
    table = rank_table(tail.ranks)
    assert table.to_dict("records") == [
        {"rank": 0, "stage": "extract id_fit", "device": "cuda:0", "batch size": 512, "CPU RSS": "110 MiB",
         "GPU allocated": "1 GiB", "GPU peak": "2 GiB"},
        {"rank": 1, "stage": "extract id_fit", "device": "cuda:1", "batch size": 128, "CPU RSS": "300 MiB",
         "GPU allocated": "3 GiB", "GPU peak": "4 GiB"},
    ]  # fmt: skip
