#!/usr/bin/env bash
# The first thing to run on a machine with a CUDA GPU (about 5-9 minutes, never more than CHECK_BUDGET_S):
#
#   bash bench/gpu_check.sh [RESULTS_DIR]        # default: $OUT if set, else bench/gpu-results
#
# Steps, each with its own time limit, each run even when an earlier one failed:
#   setup      .venv (make setup) when it is missing
#   env        nvidia-smi, torch / CUDA / cuDNN versions, CUDA_VISIBLE_DEVICES, /dev/shm, memory, disk
#   devices    oodviz's NVML device list (what the app offers as cuda:N) against torch's own, by name and memory
#   pytest     python -m pytest -m cuda (every CUDA test; junit XML kept; a skipped one fails the step)
#   pipeline   the default run on CUDA: oodviz run with device = "cuda", and its meta.json / metrics.csv
#   bench      bench/extract_gpu.py --n $BENCH_N (default 300000: the GPU benchmark at a size that fits the
#              budget; knn's time is also scaled to 1,281,167 rows; it exits 1 when a target is missed: see
#              extract_gpu.md for which). The acceptance test at full ImageNet scale is the script alone,
#              `python bench/extract_gpu.py --out DIR/extract_gpu.md` (6-9 minutes on one H200).
#   openood    bench/openood_imagenet.py --device cuda --scale $OPENOOD_SCALE (default 3000): OpenOOD v1.5's
#              ImageNet-1k protocol projected by the pre-flight at full size, and a reduced run measured twice
# Everything goes to RESULTS_DIR: one log per step, summary.md (a table for bench/RESULTS.md),
# extract_gpu.md/.json (the benchmark's figures), the run directory of the pipeline step.
# Exit status: 0 when every step passed, 1 when one failed, 2 when there is no GPU (nothing else runs).
set -u -o pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
RESULTS=${1:-${OUT:-bench/gpu-results}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
BUDGET_S=${CHECK_BUDGET_S:-530}
START_S=$(date +%s)
SUMMARY=$RESULTS/summary.md
FAILED=()

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no GPU: nvidia-smi is missing or sees no device; nothing to check here (the CUDA tests skip without one)" |
        tee "$RESULTS/no-gpu.txt"
    exit 2
fi

{
    echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown); results in $RESULTS"
    echo
    echo "| step | status | seconds | limit (s) | log |"
    echo "|---|---|---:|---:|---|"
} >"$SUMMARY"

# step NAME LIMIT_S COMMAND...: runs COMMAND with its output in NAME.log, within LIMIT_S and what is left of
# the budget; records the outcome in summary.md.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - ($(date +%s) - START_S)))
    ((limit > left)) && limit=$left
    if ((limit < 5)); then
        echo "== $name: skipped, the ${BUDGET_S} s budget is spent"
        echo "| $name | SKIPPED (no time left) | 0 | 0 | |" >>"$SUMMARY"
        FAILED+=("$name")
        return
    fi
    echo "== $name (limit ${limit} s)"
    local begin rc status
    begin=$(date +%s)
    # bash -c: the command may be one of the functions below (exported with export -f)
    timeout --kill-after=15 "$limit" bash -c '"$@"' "$name" "$@" >"$RESULTS/$name.log" 2>&1 </dev/null
    rc=$?
    case $rc in
    0) status=PASS ;;
    124 | 137) status="TIMEOUT after ${limit} s" ;;
    *) status="FAIL (exit $rc)" ;;
    esac
    ((rc == 0)) || FAILED+=("$name")
    tail -n 15 "$RESULTS/$name.log"
    echo "-- $name: $status"
    echo "| $name | $status | $(($(date +%s) - begin)) | $limit | $name.log |" >>"$SUMMARY"
}

setup() {
    if [[ -x .venv/bin/python ]]; then
        echo ".venv exists: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
    else
        make .venv/.installed # make setup's venv (without its apt-get of the Fashion-MNIST files)
    fi
}
export -f setup
step setup 300 setup
if [[ -x .venv/bin/python ]]; then
    PY=$REPO/.venv/bin/python
else # no venv (no network?): the system's Python, if it has torch, with this checkout on the path
    PY=$(command -v python3)
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi
export PY REPO RESULTS PYTHONUNBUFFERED=1

environment() {
    nvidia-smi
    nvidia-smi --query-gpu=index,pci.bus_id,uuid,name,memory.total,memory.free,driver_version,compute_cap --format=csv
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>} CUDA_DEVICE_ORDER=${CUDA_DEVICE_ORDER-<unset>}"
    "$PY" - <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version(), "| cuda available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.1f} GiB sm_{p.major}{p.minor} pci {p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x} uuid {p.uuid}")
PYEOF
    echo "nproc $(nproc)"
    free -g
    df -h /dev/shm "$REPO" /tmp
    local shm_mb
    shm_mb=$(df -Pm /dev/shm | awk 'NR == 2 { print $4 }')
    if [[ -n $shm_mb ]] && ((shm_mb < 2048)); then
        echo "WARNING: /dev/shm has ${shm_mb} MB free: DataLoader workers with prefetch may die with 'Bus error' (issue 18.3)"
    fi
    "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA device")'
}
export -f environment
step env 60 environment

devices() {
    # The app's list (NVML, in the order a job numbers them) must be torch's cuda:0..N-1, GPU by GPU.
    "$PY" - <<'PYEOF'
import os, sys, torch
from oodviz.runs.telemetry import device_facts, job_environment, memory_snapshot
os.environ.update(job_environment(dict(os.environ)))  # as a job started by the app (set before CUDA starts)
facts = [f for f in device_facts() if f["device"] != "cpu"]
ours = [(f["device"], f["name"], f["total"]) for f in facts]
theirs = [(f"cuda:{i}", torch.cuda.get_device_properties(i).name, torch.cuda.get_device_properties(i).total_memory)
          for i in range(torch.cuda.device_count())]
for row in ours:
    print("app   ", row)
for row in theirs:
    print("torch ", row)
snapshot = memory_snapshot(torch.device("cuda:0"))
print("memory_snapshot(cuda:0):", snapshot)
problems = []
if [(d, n) for d, n, _ in ours] != [(d, n) for d, n, _ in theirs]:
    problems.append("the app's cuda:N are not torch's")
if any(abs(a[2] - b[2]) > 2**30 for a, b in zip(ours, theirs)):  # NVML counts memory CUDA reserves, within 1 GiB
    problems.append("the totals differ by more than 1 GiB")
if "gpu_util" not in snapshot:
    problems.append("no utilisation: the worker found no NVML handle for cuda:0")
sys.exit("; ".join(problems) or None)
PYEOF
}
export -f devices
step devices 60 devices

cuda_tests() {
    "$PY" -m pytest -m cuda -q -p no:cacheprovider -rs --junitxml="$RESULTS/pytest-cuda.xml" || return 1
    # on a GPU machine a skipped CUDA test is a failure of this check
    "$PY" - "$RESULTS/pytest-cuda.xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot().iter("testsuite").__next__()
print(f"{suite.get('tests')} CUDA tests, {suite.get('skipped')} skipped")
sys.exit(None if int(suite.get("skipped")) == 0 else "CUDA tests were skipped on a GPU machine")
PYEOF
}
export -f cuda_tests
step pytest 220 cuda_tests

pipeline() {
    local out=$RESULTS/run-cuda
    rm -rf "$out"
    printf '# the bundled offline default run, on the GPU\ndevice = "cuda"\n' >"$RESULTS/run-cuda.toml"
    "$PY" -m oodviz.cli run "$RESULTS/run-cuda.toml" --out "$out" || return 1
    "$PY" - "$out" <<'PYEOF'
import json, sys
from pathlib import Path
import pandas as pd
out = Path(sys.argv[1])
meta = json.loads((out / "meta.json").read_text())
print("device", meta["device"])
for name, stage in meta["stages"].items():
    print(f"  {name}: {stage['wall_s']:.2f} s", {k: v for k, v in stage.items() if k.startswith("peak_gpu")})
metrics = pd.read_csv(out / "metrics.csv")
print(metrics[metrics.ood_dataset.str.endswith("(mean)")].to_string(index=False))
sys.exit(None if meta["device"].startswith("cuda") else f"the run ran on {meta['device']}")
PYEOF
}
export -f pipeline
step pipeline 150 pipeline

bench() {
    # extract_gpu.py skips (exit 0) without CUDA, and exits 1 when a target is missed (rows FAIL/OVER/BELOW)
    "$PY" -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() else "torch sees no CUDA device")' &&
        "$PY" bench/extract_gpu.py --n "${BENCH_N:-300000}" --out "$RESULTS/extract_gpu.md"
}
export -f bench
step bench 330 bench

openood() {
    # OpenOOD v1.5's ImageNet-1k protocol: the pre-flight's projection at full size, and a reduced run on the GPU
    "$PY" bench/openood_imagenet.py --device cuda --scale "${OPENOOD_SCALE:-3000}"
}
export -f openood
step openood 150 openood

{
    echo
    echo "total $(($(date +%s) - START_S)) s; failed: ${FAILED[*]:-none}"
    [[ -f $RESULTS/extract_gpu.md ]] && { echo; cat "$RESULTS/extract_gpu.md"; }
} >>"$SUMMARY"
echo "== summary ($SUMMARY)"
cat "$SUMMARY"
((${#FAILED[@]} == 0))
