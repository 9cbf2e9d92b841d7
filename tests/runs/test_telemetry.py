"""Honest telemetry (issue 13.8): a stage's recorded peak RSS is the worker's real peak (VmHWM), within 5%."""

import mmap

import numpy as np
import pytest

from oodviz.config.run import RunConfig
from oodviz.pipeline.reporter import Reporter
from oodviz.runs.rundir import RunDir
from oodviz.runs.telemetry import peak_rss_bytes, reset_peak_rss

MiB = 2**20


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.skipif(not reset_peak_rss(), reason="the kernel's peak RSS cannot be reset here (/proc/self/clear_refs)")
def test_a_temporary_between_two_events_is_in_the_stage_peak(tmp_path):
    reporter = Reporter(RunDir.create(tmp_path, RunConfig().to_dict()))
    with reporter.stage("outer"):
        with reporter.stage("fit") as stage:
            stage.progress(1, 2)
            # 300 MiB touched, freed before the next event. An anonymous map of its own: fresh pages whatever
            # the allocator holds (in a long-lived test worker malloc may serve it from already resident heap).
            temporary = mmap.mmap(-1, 300 * MiB)
            np.frombuffer(temporary, dtype=np.uint8).fill(1)
            true_peak = peak_rss_bytes()
            temporary.close()
            stage.progress(2, 2)
        after_fit = _rss()
        with reporter.stage("small"):
            pass
    summary = reporter.stage_summary()
    fit = summary["fit"]
    assert fit["peak_cpu_rss_method"] == "VmHWM"
    assert abs(fit["peak_cpu_rss"] - true_peak) <= 0.05 * true_peak
    assert fit["peak_cpu_rss"] > after_fit + 250 * MiB  # the sampled RSS never saw it
    assert summary["small"]["peak_cpu_rss"] < after_fit + 100 * MiB  # reset at the start of the stage
    assert summary["outer"]["peak_cpu_rss"] >= fit["peak_cpu_rss"]  # an enclosing stage keeps its inner peaks
