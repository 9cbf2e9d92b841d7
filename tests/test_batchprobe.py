"""Pre-flight of one batch through the model (issue 13.1): the extraction's and each model-based detector's peak
memory, measured by a one-batch probe (in the estimate's own process in the app), scaled to the run's batch, refused over the limit."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import oodviz.runs.preflight
from oodviz.cli import main
from oodviz.models.memory import format_bytes
from oodviz.runs.batchprobe import BatchPeak
from oodviz.runs.config import DetectorChoice, RunConfig
from oodviz.runs.preflight import assess
from oodviz.ui.form import FormValues, suggested_fixes

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
    from oodviz.runs.config import RunConfig
    from oodviz.runs.splits import load_split

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
    from oodviz.runs.config import RunConfig
    from oodviz.runs.splits import load_split

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


def test_the_probe_figure_for_odin_matches_a_direct_peak_rss_measurement(tmp_path):
    from oodviz.runs.probe import estimate_in_subprocess

    # In a fresh process, as the app runs it: in a long-lived test worker malloc serves the batch from heap that
    # is resident already, so the peak rises less (103 vs 152 MiB in CI) and the probe would read low.
    estimate, description, refusal = estimate_in_subprocess(json.dumps(FASHION_ODIN), runs_root=tmp_path / "runs")
    peaks = {peak["what"]: BatchPeak(**peak) for peak in estimate["batch_peaks"]}
    assert set(peaks) == {"extraction", "odin"} and estimate["batch_probe_failed"] == {}
    odin = peaks["odin"]
    assert odin.rows == BATCH  # fashion-cnn's activations: ODIN's chunk is the whole batch on any machine here
    assert odin.describe() in description and peaks["extraction"].describe() in description  # the app shows it
    assert refusal is None

    done = subprocess.run(
        [sys.executable, "-c", DIRECT_ODIN], input=json.dumps(FASHION_ODIN), capture_output=True, text=True, check=True
    )
    direct = json.loads(done.stdout.strip().splitlines()[-1])
    assert direct["peak"] > direct["peak_before"]  # the batch set the process's peak: the difference is its own
    measured = direct["peak"] - direct["rss_before"]
    assert measured > 50 * MiB  # autograd over 256 inputs: far above the allocator's noise
    assert odin.bytes_at(BATCH) == pytest.approx(measured, rel=0.3)  # the direct figure varies by ~15% run to run
    assert odin.per_row_bytes > peaks["extraction"].per_row_bytes  # activations and gradients kept vs streamed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_probe_figure_for_odin_matches_the_allocator_peak_of_one_batch(tmp_path):
    from oodviz.runs.probe import estimate_for_config

    config = {**FASHION_ODIN, "device": "cuda"}
    estimate, _, _ = estimate_for_config(RunConfig.from_dict(config), tmp_path / "runs")
    (odin,) = [BatchPeak(**peak) for peak in estimate["batch_peaks"] if peak["what"] == "odin"]
    done = subprocess.run(
        [sys.executable, "-c", DIRECT_ODIN_CUDA], input=json.dumps(config), capture_output=True, text=True, check=True
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])["peak"]
    assert measured > 10 * MiB
    assert odin.gpu_bytes_at(BATCH) == pytest.approx(measured, rel=0.3)


def test_the_cli_refuses_when_one_odin_batch_is_over_the_available_ram(tmp_path, capsys, fashion_odin, monkeypatch):
    ram = 64 * MiB
    real_limits = oodviz.runs.preflight.machine_limits

    def small_ram(store_root, device, disk_cap=None):
        return {**real_limits(store_root, device, disk_cap), "ram": ram}

    monkeypatch.setattr(oodviz.runs.preflight, "machine_limits", small_ram)
    runs_root = tmp_path / "runs"
    code = main(["run", fashion_odin, "--runs-root", str(runs_root)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not runs_root.exists()  # nothing written
    (line,) = [line for line in err.splitlines() if "batch of odin (256 rows at once)" in line]
    assert line.endswith("OVER") and format_bytes(ram) in line
    assert "a smaller batch: batch_size=" in err and "leave out odin" in err
    assert "pool the features" not in err  # the store and the fits are not what is over
    fixes = [fix.label for fix in suggested_fixes(err, FormValues(detectors=["msp", "odin"], batch_size=BATCH))]
    assert fixes == ["Leave out odin", "Batch size 256 → 64"]


def test_batch_rows_scale_the_measured_line_and_name_the_batch_that_fits():
    """Needs are ``fixed + rows x per_row``; the batch size fix is the largest whose every batch fits; the
    extraction is never "left out"."""
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
    # odin: (100 - 10) MiB / 1 MiB = 90 rows of RAM, (200 - 1) / 1 = 199 of GPU
    assert report.fixes == [
        "a smaller batch: batch_size=90 or less fits one batch through the model (now 256 rows)",
        "fewer detectors: leave out odin (one batch of it is over the memory)",
    ]
    only_extraction = assess(config, estimate, {"disk": 10**12, "ram": 50 * MiB}, batches=batches[:1])
    assert only_extraction.fixes == [
        "a smaller batch: batch_size=120 or less fits one batch through the model (now 256 rows)"
    ]
