"""Pre-flight of one batch through the model (issue 13.1): the extraction's and each model-based detector's peak
memory, measured by a one-batch probe (in the estimate's own process in the app), scaled to the run's batch, refused over the limit."""

import json
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch
from kernels import assert_kernel_close

import oodviz.pipeline.preflight
from oodviz.cli import main
from oodviz.config.run import DetectorChoice, RunConfig
from oodviz.models.memory import format_bytes
from oodviz.pipeline.batchprobe import BatchPeak
from oodviz.pipeline.preflight import assess, preflight
from oodviz.ui.form import FormValues, form_fixes

MiB = 2**20
BATCH = 256
# fashion-cnn (28 x 28 greyscale) on generated noise: ODIN's autograd batch is ~100 MiB at 256 rows
FASHION_ODIN = {
    "backbone": "fashion-cnn",
    "device": "cpu",
    "batch_size": BATCH,
    "id_fit": {"name": "noise-uniform", "params": {"n": 512, "size": 28}},
    "id_test": {"name": "noise-uniform", "params": {"n": 64, "size": 28}},
    "ood": [{"name": "noise-gaussian", "params": {"n": 64, "size": 28}}],
    "detectors": ["msp", "odin"],
}

# One ODIN batch of BATCH rows in a fresh process, measured without the probe's code: the process's lifetime peak
# RSS (VmHWM, never reset: getrusage's ru_maxrss would carry the pytest parent's peak across fork and exec) after
# scoring the batch twice, less the RSS before it. One plain forward first, as in a run's worker, whose
# extraction has run the model before ODIN's first batch.
DIRECT_ODIN = textwrap.dedent(
    f"""
    import json, sys
    import psutil, torch
    from oodviz.batch import Batch
    from oodviz.detectors import create
    from oodviz.config.run import RunConfig
    from oodviz.config.splits import load_split

    config = RunConfig.from_dict(json.loads(sys.stdin.read()))
    backbone = config.load_backbone()
    dataset = load_split(config, config.id_fit, False, backbone.classes)
    items = [dataset[i] for i in range({BATCH})]
    batch = Batch(inputs=torch.stack([backbone.transform(item[0]) for item in items]),
                  labels=torch.tensor([int(item[1]) for item in items]))
    odin = create("odin", model=backbone)
    with torch.inference_mode():
        backbone.features_and_logits(batch.inputs[:1])
    before = psutil.Process().memory_info().rss
    def lifetime_peak():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

    peak_before = lifetime_peak()
    for _ in range(2):
        odin.score(batch, device="cpu")
    peak = lifetime_peak()
    print(json.dumps({{"rss_before": before, "peak_before": peak_before, "peak": peak}}))
    """
)


# The same batch on a GPU: the caching allocator's peak above what was allocated before it (model on the device).
DIRECT_ODIN_CUDA = textwrap.dedent(
    f"""
    import json, sys
    import torch
    from oodviz.batch import Batch
    from oodviz.detectors import create
    from oodviz.config.run import RunConfig
    from oodviz.config.splits import load_split

    config = RunConfig.from_dict(json.loads(sys.stdin.read()))
    backbone = config.load_backbone()
    backbone.model.to("cuda")
    dataset = load_split(config, config.id_fit, False, backbone.classes)
    items = [dataset[i] for i in range({BATCH})]
    batch = Batch(inputs=torch.stack([backbone.transform(item[0]) for item in items]).cuda(),
                  labels=torch.tensor([int(item[1]) for item in items]).cuda())
    odin = create("odin", model=backbone)
    with torch.inference_mode():
        backbone.features_and_logits(batch.inputs[:1])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        odin.score(batch, device="cuda")
    torch.cuda.synchronize()
    print(json.dumps({{"peak": torch.cuda.max_memory_allocated() - before}}))
    """
)


@pytest.fixture(scope="module")
def fashion_odin(tmp_path_factory):
    path = tmp_path_factory.mktemp("odin") / "odin.json"
    path.write_text(json.dumps(FASHION_ODIN))
    return str(path)


@pytest.mark.process
def test_the_probe_figure_for_odin_matches_a_direct_peak_rss_measurement(tmp_path):
    from oodviz.pipeline.probe import estimate_in_subprocess

    # In a fresh process, as the app runs it: in a long-lived test worker malloc serves the batch from heap that
    # is resident already, so the peak rises less (103 vs 152 MiB in CI) and the probe would read low.
    answer = estimate_in_subprocess(json.dumps(FASHION_ODIN), runs_root=tmp_path / "runs")
    estimate, description, refusal = answer.estimate, answer.description, answer.refusal
    peaks = {peak["what"]: BatchPeak(**peak) for peak in estimate["batch_peaks"]}
    assert set(peaks) == {"extraction", "odin"} and estimate["batch_probe_failed"] == {}
    odin = peaks["odin"]
    assert odin.rows == BATCH  # fashion-cnn's activations: ODIN's chunk is the whole batch on any machine here
    assert odin.describe() in description and peaks["extraction"].describe() in description  # the app shows it
    assert refusal is None
    # the needs as data (what the app's table draws): the batch of ODIN among them, under its limit
    [odin_need] = [n for n in answer.needs if n["kind"] == "batch" and "odin" in n["what"] and n["resource"] == "ram"]
    assert odin_need["needed"] == odin.bytes_at(BATCH) and odin_need["over"] is False
    assert not any(n["over"] for n in answer.needs)

    done = subprocess.run(
        [sys.executable, "-c", DIRECT_ODIN], input=json.dumps(FASHION_ODIN), capture_output=True, text=True, check=True
    )
    direct = json.loads(done.stdout.strip().splitlines()[-1])
    assert direct["peak"] > direct["peak_before"]  # the batch set the process's peak: the difference is its own
    measured = direct["peak"] - direct["rss_before"]
    assert measured > 50 * MiB  # autograd over 256 inputs: far above the allocator's noise
    # Two heaps with different histories: the probe's process has run the extraction's and ODIN's smaller passes,
    # the direct one only a one-row forward. Probe / direct seen: 0.83-0.93 on the development machine (direct
    # 123-138 MiB over seven runs), 0.68-0.69 in CI (113 vs 163, 111 vs 163 MiB), the same code and packages. A
    # probe that measured a forward without autograd (the extraction's 64 MiB) or missed the per-row scale would not.
    assert 0.6 * measured <= odin.bytes_at(BATCH) <= 1.3 * measured
    assert odin.per_row_bytes > peaks["extraction"].per_row_bytes  # activations and gradients kept vs streamed


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_probe_measures_in_the_runs_precision(precision):
    """Every pass the probe measures (the extraction's and ODIN's) runs under the autocast of the run's precision,
    as the run's own passes do (a bf16 run's batches were measured in float32 before: its extraction batch of 512
    fashion-cnn rows measured 116 MiB in float32, 61 in bf16). ODIN turns autocast off for its gradient step
    itself (odin.py), so its second forward is the one in the run's precision."""
    from oodviz.config.splits import load_split
    from oodviz.pipeline.batchprobe import batch_peaks

    config = RunConfig.from_dict({**FASHION_ODIN, "batch_size": 16, "precision": precision})
    backbone = config.load_backbone()
    seen = []
    forward = backbone.features_and_logits

    def recording(x, **kwargs):
        autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        seen.append(("extraction" if torch.is_inference_mode_enabled() else "odin", autocast))
        return forward(x, **kwargs)

    backbone.features_and_logits = recording
    peaks, failed = batch_peaks(config, backbone, load_split(config, config.id_fit, False, backbone.classes))
    assert [peak.what for peak in peaks] == ["extraction", "odin"] and failed == {}
    run_autocast = (True, torch.bfloat16) if precision == "bf16" else (False, torch.get_autocast_dtype("cpu"))
    extraction = [autocast for what, autocast in seen if what == "extraction"]
    odin = [autocast for what, autocast in seen if what == "odin"]
    assert len(extraction) >= 5 and set(extraction) == {run_autocast}  # five passes or more
    assert odin.count(run_autocast) >= 5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_probe_figure_for_odin_matches_the_allocator_peak_of_one_batch(tmp_path):
    from oodviz.pipeline.probe import estimate_for_config

    config = {**FASHION_ODIN, "device": "cuda"}
    estimate = estimate_for_config(RunConfig.from_dict(config), tmp_path / "runs").estimate
    (odin,) = [BatchPeak(**peak) for peak in estimate["batch_peaks"] if peak["what"] == "odin"]
    done = subprocess.run(
        [sys.executable, "-c", DIRECT_ODIN_CUDA], input=json.dumps(config), capture_output=True, text=True, check=True
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])["peak"]
    assert measured > 10 * MiB
    assert odin.gpu_bytes_at(BATCH) == pytest.approx(measured, rel=0.3)


def fake_probe(peaks):
    """A stand-in for :func:`oodviz.pipeline.batchprobe.batch_peaks` that "measures" ``peaks`` (copies)."""

    def batch_peaks(config, backbone, dataset, extraction=True, names=None):
        found = [p for p in peaks if (extraction if p.what == "extraction" else names is None or p.what in names)]
        return [BatchPeak(**vars(p)) for p in found], {}

    return batch_peaks


def small_ram(monkeypatch, ram):
    real_limits = oodviz.pipeline.preflight.machine_limits
    monkeypatch.setattr(
        oodviz.pipeline.preflight,
        "machine_limits",
        lambda store_root, device, disk_cap=None: {**real_limits(store_root, device, disk_cap), "ram": ram},
    )


def test_the_cli_refuses_naming_the_batch_size_that_fits_and_the_app_proposes_that_size(
    tmp_path, capsys, fashion_odin, monkeypatch
):
    """RAM 100 MiB. Extraction: 20 MiB + 256 x 1 MiB is over; (100 - 20) / 1 = 80 rows fit: batch_size=80. ODIN
    sizes its own batch, max(1, floor((0.5 x 100 - 99) / 2)) = 1 row, 99 + 2 = 101 MiB: over even at one row."""
    import oodviz.pipeline.batchprobe

    peaks = [
        BatchPeak("extraction", BATCH, fixed_bytes=20 * MiB, per_row_bytes=MiB),
        BatchPeak("odin", BATCH, fixed_bytes=99 * MiB, per_row_bytes=2 * MiB),
    ]
    monkeypatch.setattr(oodviz.pipeline.batchprobe, "batch_peaks", fake_probe(peaks))
    small_ram(monkeypatch, 100 * MiB)
    runs_root = tmp_path / "runs"
    code = main(["run", fashion_odin, "--runs-root", str(runs_root)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not runs_root.exists()  # nothing written
    (line,) = [line for line in err.splitlines() if "batch of odin (1 rows at once)" in line]
    assert line.endswith("OVER") and format_bytes(101 * MiB) in line
    assert "a smaller batch: batch_size=80 or less fits one batch through the model (now 256 rows)" in err
    assert "leave out odin" in err
    assert "pool the features" not in err  # the store and the fits are not what is over
    form = FormValues(detectors=["msp", "odin"], batch_size=BATCH)
    fixes = [fix.label for fix in form_fixes(preflight(RunConfig.load(fashion_odin), runs_root).fixes, form)]
    assert fixes == ["Batch size 256 → 80", "Leave out odin"]  # the size the pre-flight names, not a quarter
    # ODIN at 20 MiB + 2 MiB per row fits its own batch: (50 - 20) / 2 = 15 rows; only the extraction is over
    peaks[1] = BatchPeak("odin", BATCH, fixed_bytes=20 * MiB, per_row_bytes=2 * MiB)
    assert main(["run", fashion_odin, "--runs-root", str(runs_root)]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "batch of odin (15 rows at once)" in line]
    assert not line.endswith("OVER") and format_bytes(50 * MiB) in line
    assert "leave out odin" not in err
    assert [fix.label for fix in form_fixes(preflight(RunConfig.load(fashion_odin), runs_root).fixes, form)] == [
        "Batch size 256 → 80"
    ]


def odin_scores_of_the_images(config: dict, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ODIN on every image of ``split`` (``id_test`` or an OOD set's name) directly: all rows at once, and one row
    at a time."""
    from oodviz.batch import Batch
    from oodviz.config.splits import load_split
    from oodviz.detectors import create

    run_config = RunConfig.from_dict(config)
    backbone = run_config.load_backbone()
    choice = run_config.id_test if split == "id_test" else next(c for c in run_config.ood if c.name == split)
    dataset = load_split(run_config, choice, split != "id_test", backbone.classes)
    images = torch.stack([backbone.transform(dataset[i][0]) for i in range(len(dataset))])
    whole = create("odin", model=backbone)
    whole.batch_rows = len(images)
    one = create("odin", model=backbone)
    one.batch_rows = 1
    return whole.score(Batch(inputs=images)), one.score(Batch(inputs=images))


def batch_sizes_in_events(run_path, stage: str) -> set[int]:
    events = [json.loads(line) for line in (run_path / "events.jsonl").read_text().splitlines()]
    return {e["batch_size"] for e in events if e.get("stage") == stage and e.get("event") == "progress"}


@pytest.mark.kernels
def test_the_run_takes_odins_batch_size_from_the_preflights_probe_with_the_same_scores(
    tmp_path, capsys, fashion_odin, monkeypatch
):
    """``oodviz run`` hands the pre-flight's measured peaks to the run (no second probe): with 1 MiB + 1 MiB per
    row and 17 MiB available, ODIN passes max(1, floor((0.5 x 17 - 1) / 1)) = 7 rows at once, recorded in
    detectors.json; its scores equal ODIN's over the whole split at once and one row at a time."""
    import oodviz.pipeline.batchprobe
    from oodviz.detectors import modelmemory

    peaks = [
        BatchPeak("extraction", BATCH, fixed_bytes=MiB, per_row_bytes=MiB // 64),
        BatchPeak("odin", BATCH, fixed_bytes=MiB, per_row_bytes=MiB),
    ]
    monkeypatch.setattr(oodviz.pipeline.batchprobe, "batch_peaks", fake_probe(peaks))
    monkeypatch.setattr(modelmemory, "available_bytes", lambda device: 17 * MiB)
    out = tmp_path / "runs" / "odin"
    assert main(["run", fashion_odin, "--out", str(out)]) == 0, capsys.readouterr().err
    record = json.loads((out / "detectors.json").read_text())["odin"]["batch"]
    assert record == {
        "rows": 7,
        "run_batch_size": BATCH,
        "measured": True,
        "per_row_bytes": MiB,
        "fixed_bytes": MiB,
        "available_ram_bytes": 17 * MiB,
        "memory_fraction": 0.5,
        "in_force": 7,
        "oom_backoffs": 0,
    }
    assert batch_sizes_in_events(out, "score id_test with odin") == {7}
    scores = pd.read_parquet(out / "scores.parquet")
    whole, one_by_one = odin_scores_of_the_images(FASHION_ODIN, "id_test")
    ran = torch.tensor(scores[scores.split == "id_test"]["odin"].to_numpy())
    assert_kernel_close(ran, whole)  # batches of 7 against one batch and against batches of one: other kernels
    assert_kernel_close(ran, one_by_one)


@pytest.mark.kernels
def test_a_run_without_a_preflight_measures_odin_itself_and_sizes_its_batch_from_that(tmp_path, monkeypatch):
    """``run_pipeline`` alone (the app's worker, the Python API): the run measures ODIN's batch before extracting
    and passes ``min(256, max(1, floor((0.5 x available - fixed) / per_row)))`` rows at once."""
    from oodviz.detectors import modelmemory
    from oodviz.pipeline.reporter import Reporter
    from oodviz.pipeline.stages import run_pipeline
    from oodviz.runs.rundir import RunDir

    available = 128 * MiB
    monkeypatch.setattr(modelmemory, "available_bytes", lambda device: available)
    config = RunConfig.from_dict(FASHION_ODIN)
    run = RunDir.create(tmp_path, config.to_dict())
    run_pipeline(config, run, Reporter(run))
    record = json.loads((run.path / "detectors.json").read_text())["odin"]["batch"]
    assert record["measured"] and record["per_row_bytes"] > 10 * 1024  # autograd over a 28 x 28 image
    expected = min(BATCH, max(1, (available // 2 - record["fixed_bytes"]) // record["per_row_bytes"]))
    assert record["rows"] == expected and 1 < expected < BATCH
    assert batch_sizes_in_events(run.path, "score ood:noise-gaussian with odin") == {expected}
    notes = [json.loads(line) for line in (run.path / "events.jsonl").read_text().splitlines()]
    assert any(e.get("stage") == "load data" and "measured batch of odin" in e.get("message", "") for e in notes)
    scores = pd.read_parquet(run.path / "scores.parquet")
    whole, _ = odin_scores_of_the_images(FASHION_ODIN, "noise-gaussian")
    ran = torch.tensor(scores[scores.split == "ood"]["odin"].to_numpy())
    assert_kernel_close(ran, whole)


def test_rows_from_memory_is_the_arithmetic_of_the_measured_peak():
    from oodviz.pipeline.batchprobe import ModelBatches, rows_from_memory, sized

    peak = BatchPeak(
        "odin", BATCH, fixed_bytes=10 * MiB, per_row_bytes=3 * MiB, gpu_fixed_bytes=MiB, gpu_per_row_bytes=MiB
    )
    assert rows_from_memory(peak, BATCH, ram=200 * MiB) == (100 - 10) // 3 == 30
    assert rows_from_memory(peak, BATCH, ram=200 * MiB, gpu=41 * MiB) == int((20.5 - 1) // 1) == 19  # the GPU's
    assert rows_from_memory(peak, 16, ram=200 * MiB) == 16  # never above the run's batch size
    assert rows_from_memory(peak, BATCH, ram=10 * MiB) == 1  # at least one row (the pre-flight says if it is over)
    extraction = BatchPeak("extraction", BATCH, fixed_bytes=10 * MiB, per_row_bytes=3 * MiB)
    assert [p.rows for p in sized([extraction, peak], {"ram": 200 * MiB})] == [BATCH, 30]

    class Odin:
        name = "odin"
        batch_rows = None

    odin, batches = Odin(), ModelBatches([extraction, peak])
    assert set(batches.peaks) == {"odin"}
    assert (
        batches.rows(odin, BATCH, torch.device("cpu"))
        == odin.batch_rows
        == rows_from_memory(peak, BATCH, ram=batches.records["odin"]["available_ram_bytes"])
    )
    batches.ran("odin", 4, 2)
    batches.ran("odin", 8, 0)
    assert (batches.records["odin"]["in_force"], batches.records["odin"]["oom_backoffs"]) == (4, 2)
    unmeasured = Odin()
    unmeasured.name = "mcd"
    assert ModelBatches().rows(unmeasured, BATCH, torch.device("cpu")) == BATCH and unmeasured.batch_rows is None


def test_batch_rows_scale_the_measured_line_and_name_the_batch_that_fits():
    """Needs are ``fixed + rows x per_row`` at the rows each batch has (a model-based detector's: those it chose,
    :func:`~oodviz.pipeline.batchprobe.sized`); the batch size fix is the largest whose extraction batch fits; a
    detector over at its rows is left out; the extraction is never "left out"."""
    estimate = {
        "feature_dim": 64,
        "num_classes": 10,
        "pooled_dim": 64,
        "raw_feature_shape": None,
        "pooling": "avg",
        "feature_dtype": "float32",
        "splits": {s: {"n_samples": 100, "total_bytes": 100 * (64 * 4 + 40 + 24)} for s in ("id_fit", "id_test")},
    }
    batches = [
        BatchPeak("extraction", 256, fixed_bytes=20 * MiB, per_row_bytes=MiB // 4),  # 84 MiB
        BatchPeak("odin", 256, fixed_bytes=10 * MiB, per_row_bytes=MiB, gpu_fixed_bytes=MiB, gpu_per_row_bytes=MiB),
        BatchPeak("mcd", 64, fixed_bytes=MiB, per_row_bytes=MiB // 2),  # its own chunk: 33 MiB
    ]
    config = RunConfig(detectors=[DetectorChoice("odin"), DetectorChoice("mcd")])
    report = assess(config, estimate, {"disk": 10**12, "ram": 100 * MiB, "gpu": 200 * MiB}, batches=batches)
    rows = {(need.resource, need.what): need.needed for need in report.needs if need.kind == "batch"}
    assert rows == {
        ("ram", "batch of extraction (256 rows at once)"): 84 * MiB,
        ("ram", "batch of odin (256 rows at once)"): 266 * MiB,
        ("gpu", "batch of odin (256 rows at once)"): 257 * MiB,
        ("ram", "batch of mcd (64 rows at once)"): 33 * MiB,
    }
    assert [(need.resource, need.what.split()[2]) for need in report.over] == [("ram", "odin"), ("gpu", "odin")]
    # odin chooses its own batch size: no batch_size fix for it, only leaving it out
    assert [fix.text for fix in report.fixes] == [
        "fewer detectors: leave out odin (one batch of it is over the memory)"
    ]
    assert [(fix.kind, fix.value) for fix in report.fixes] == [("drop_detectors", ("odin",))]
    only_extraction = assess(config, estimate, {"disk": 10**12, "ram": 50 * MiB}, batches=batches[:1])
    assert [fix.text for fix in only_extraction.fixes] == [
        "a smaller batch: batch_size=120 or less fits one batch through the model (now 256 rows)"
    ]
    assert [(fix.kind, fix.value) for fix in only_extraction.fixes] == [("batch_size", 120)]


def test_a_runs_own_probe_hands_each_peak_to_the_stage_before_resetting_it(monkeypatch):
    """The probe resets the kernel's peak (VmHWM) before every pass; in a run the stage's peak so far is folded in
    first (``Reporter.fold_kernel_peak``), so the load data stage's recorded peak still covers every pass."""
    from types import SimpleNamespace

    import oodviz.runs.telemetry
    from oodviz.config.splits import load_split
    from oodviz.pipeline.batchprobe import ModelBatches, measure_for_run

    order = []
    reset = oodviz.runs.telemetry.reset_peak_rss
    monkeypatch.setattr(oodviz.runs.telemetry, "reset_peak_rss", lambda: order.append("reset") or reset())
    config = RunConfig.from_dict({**FASHION_ODIN, "batch_size": 16})
    backbone = config.load_backbone()
    job = SimpleNamespace(
        config=config,
        backbone=backbone,
        datasets={"id_fit": load_split(config, config.id_fit, False, backbone.classes)},
        model_batches=ModelBatches(),
        reporter=SimpleNamespace(fold_kernel_peak=lambda: order.append("fold")),
    )
    notes = []
    (peak,) = measure_for_run(job, SimpleNamespace(note=notes.append))
    assert peak.what == "odin" and notes == [f"measured {peak.describe()}"]
    assert len(order) >= 2 * 4 and order == ["fold", "reset"] * (len(order) // 2)  # four passes or more
