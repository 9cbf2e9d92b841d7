"""The memory estimate, in a process of its own: ``python -m oodviz.pipeline.probe [RUNS_ROOT]`` reads a run config (JSON)
on stdin and prints one JSON line, :class:`ProbeAnswer` (``{"estimate": {...}, "description": "...", "refusal": ...,
"table": ..., "fixes": [...]}``),
``{"refused": [problem, ...]}`` (exit 1: the config's problems, :class:`~oodviz.config.validation.ConfigError`, such as
an unreadable checkpoint or a knn ``k`` above the fit rows) or ``{"error": "..."}`` (exit 1).

The estimate loads the backbone and runs one batch through it (``feature_shape``), i.e. the checkpoint's
own code (a TorchScript ``forward``), and walks the image folders. The app asks for it with
:func:`estimate_in_subprocess`, under a timeout, so that no user code runs in the server's process and a
stuck model or folder cannot hang the page.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import NamedTuple

from oodviz.config.run import RunConfig
from oodviz.config.validation import INVALID_CONFIG, ConfigError
from oodviz.problems import Fix, fixes_from

TIMEOUT_S = 120.0


class ProbeAnswer(NamedTuple):
    """What the estimate found: the estimate (:func:`oodviz.models.estimate_memory`'s, with the pre-flight's
    measurements), its description, and when the run does not fit the refusal (the pre-flight's message), its
    needs table and the fixes (:class:`~oodviz.problems.Fix`) as data; ``needs``: every row of the pre-flight's
    table as data (:meth:`~oodviz.pipeline.preflight.Need.to_dict`), whether the run fits or not."""

    estimate: dict
    description: str
    refusal: str | None = None
    table: str = ""
    fixes: list[Fix] = []
    needs: list[dict] = []


class ProbeError(RuntimeError):
    """The estimate's process failed, crashed or ran out of time; the message says which."""


def estimate_for_config(config: RunConfig, runs_root="runs") -> ProbeAnswer:
    """The :class:`ProbeAnswer` for ``config``, in this process: loads the model and counts each
    split's samples; the refusal is the pre-flight's (:mod:`oodviz.pipeline.preflight`: the needs against the
    machine's disk, RAM and GPU, with the fixes) when the run does not fit, else None. The description has a
    line per split, with model-based detectors a line per measured batch through the model (the extraction's and
    each such detector's, :mod:`oodviz.pipeline.batchprobe`), and for a run over several layers the needs table
    (every layer's stores and fits)."""

    # torch: only in the probe's own process (the app imports this module for estimate_in_subprocess)
    from oodviz.models.memory import describe_memory
    from oodviz.pipeline.batchprobe import BatchPeak
    from oodviz.pipeline.preflight import preflight

    report = preflight(config, runs_root)
    batches = [BatchPeak(**peak).describe() for peak in report.estimate["batch_peaks"]]
    failed = [f"not measured, {name}: {why}" for name, why in report.estimate["batch_probe_failed"].items()]
    description = "\n".join([describe_memory(report.estimate), *batches, *failed])
    if "layers" in report.estimate:  # each layer's D x D fit states too, not only when over the limits
        description += "\n\n" + report.table()
    needs = [need.to_dict() for need in report.needs]
    if report.fits:
        return ProbeAnswer(report.estimate, description, needs=needs)
    return ProbeAnswer(report.estimate, description, report.message(), report.table(), report.fixes, needs)


def estimate_in_subprocess(config_json: str, timeout_s: float = TIMEOUT_S, runs_root="runs") -> ProbeAnswer:
    """:func:`estimate_for_config` run by ``python -m oodviz.pipeline.probe RUNS_ROOT``; raises the child's
    :class:`~oodviz.config.validation.ConfigError` (no run of this config can start), or :class:`ProbeError` with the
    child's message, or on a timeout or crash."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "oodviz.pipeline.probe", str(runs_root)],
            input=config_json,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise ProbeError(
            f"the estimate took longer than {timeout_s:.0f} s and was stopped (a slow model, or a very large "
            "image folder?)"
        ) from None
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        raise ProbeError(f"the estimate's process ended without an answer (exit code {done.returncode}; crashed?)")
    if "refused" in answer:
        raise ConfigError(answer["refused"], answer.get("heading", INVALID_CONFIG))
    if "error" in answer:
        raise ProbeError(answer["error"])
    return ProbeAnswer(**{**answer, "fixes": fixes_from(answer.get("fixes"))})


def main() -> int:
    try:
        config = RunConfig.from_dict(json.loads(sys.stdin.read()))
        answer = estimate_for_config(config, *sys.argv[1:2])
    except ConfigError as error:
        print(json.dumps({"refused": error.problems, "heading": error.heading}))
        return 1
    except Exception as error:  # the caller shows it: one line, no traceback
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        return 1
    print(json.dumps({**answer._asdict(), "fixes": [fix.to_dict() for fix in answer.fixes]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
