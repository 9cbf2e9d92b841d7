"""Helpers the tests share (not fixtures: those are in conftest.py): a small, seeded classification problem with a
linear head, synthetic scores, reference checks, servers' ports, commands run in this process, the runs' small configs,
a small OpenOOD v1.5 data root and checkpoint, and the ``cuda`` and ``chromium`` skip marks. Test modules import them
by name (``from helpers import make_problem``); no test module imports another."""

import gzip
import importlib
import io
import json
import shutil
import socket
import struct
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from sklearn.metrics import roc_auc_score

from oodviz import Batch
from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
from oodviz.data.openood import benchmark_splits
from oodviz.detectors.persist import MANIFEST, file_sha256
from oodviz.models.openood import build_openood_resnet18_32x32
from oodviz.runs.rundir import RunDir

#: The repository's root (app.py, examples/, assets/).
REPO = Path(__file__).resolve().parent.parent
APP = str(REPO / "app.py")


@dataclass
class Problem:
    """ID fit/test data and an OOD set from one synthetic model: features [N, D], head (W, b)."""

    fit_x: torch.Tensor
    fit_y: torch.Tensor
    test_x: torch.Tensor
    ood_x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor

    @property
    def head(self):
        return self.weight, self.bias

    def logits(self, x):
        return x @ self.weight.T + self.bias

    def batches(self, x, y=None, size=97):
        """``x`` as a list of Batch of (mostly) ``size`` rows, logits from the head."""
        logits = self.logits(x)
        return [
            Batch(x[i : i + size], logits[i : i + size], None if y is None else y[i : i + size])
            for i in range(0, len(x), size)
        ]

    def fit_batches(self, size=97):
        return self.batches(self.fit_x, self.fit_y, size)

    @property
    def eval_x(self):
        """ID test followed by OOD features."""
        return torch.cat([self.test_x, self.ood_x])


def make_problem(n_classes=6, dim=12, n_fit=1200, n_test=300, n_ood=300, seed=0, offset=0.0) -> Problem:
    g = torch.Generator().manual_seed(seed)
    centres = 1.5 * torch.randn(n_classes, dim, generator=g)  # overlapping classes: some errors
    mixing = torch.eye(dim) + 0.3 * torch.randn(dim, dim, generator=g)  # correlated features

    def sample(n, shift=0.0):
        y = torch.arange(n) % n_classes
        x = (torch.randn(n, dim, generator=g) @ mixing) + centres[y] + shift + offset
        return x, y

    fit_x, fit_y = sample(n_fit)
    test_x, _ = sample(n_test)
    ood_x = 1.5 * torch.randn(n_ood, dim, generator=g) @ mixing + offset  # between the classes
    # A head that classifies well: nearest-centre scores as a linear layer, scaled down so the
    # softmax is not saturated.
    weight = 0.05 * centres
    bias = 0.05 * (-0.5 * (centres**2).sum(dim=1) - centres @ torch.full((dim,), offset))
    return Problem(fit_x, fit_y, test_x, ood_x, weight, bias)


NEEDS_CUDA = "needs a CUDA device"
#: Skips a test without a GPU; conftest.py also marks it ``cuda``.
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)


def synthetic_scores(seed=0) -> pd.DataFrame:
    """200 ID rows (classes 0..3) and two OOD sets (150 "far-set", 100 "near-set"); two detectors:
    ``det`` (continuous, float32 like a real run) and ``tied`` (rounded: many ties)."""
    rng = np.random.default_rng(seed)
    n_id, n_a, n_b = 200, 150, 100
    label = np.concatenate([np.arange(n_id) % 4, np.full(n_a + n_b, -1)])
    prediction = label.copy()
    wrong = np.flatnonzero(rng.random(n_id) < 0.15)
    prediction[wrong] = (label[wrong] + 1) % 4
    prediction[n_id:] = rng.integers(0, 4, size=n_a + n_b)
    id_det = rng.normal(0, 1, n_id) + 0.3 * (label[:n_id] == 2)
    det = np.concatenate([id_det, rng.normal(2, 1, n_a), rng.normal(1, 1, n_b)])
    return pd.DataFrame(
        {
            "split": ["id_test"] * n_id + ["ood"] * (n_a + n_b),
            "dataset": ["id-set"] * n_id + ["far-set"] * n_a + ["near-set"] * n_b,
            "index": np.concatenate([np.arange(n_id) * 3, np.arange(n_a), np.arange(n_b) + 1000]),
            "label": label,
            "prediction": prediction,
            "det": det.astype(np.float32),
            "tied": np.round(det).astype(np.float32),
        }
    )


def assert_same_ranking(ours, theirs, n_id: int) -> None:
    """Parity with a reference library: scores of ID (first ``n_id``) then OOD samples rank alike
    (Spearman > 0.9999) and give the same AUROC (to 1e-5), on an OOD set that is detectable."""
    from scipy.stats import spearmanr

    from oodviz.results.metrics import ood_metrics

    assert spearmanr(ours, theirs).statistic > 0.9999
    ours_auroc = ood_metrics(ours[:n_id], ours[n_id:])["auroc"]
    theirs_auroc = ood_metrics(theirs[:n_id], theirs[n_id:])["auroc"]
    assert abs(ours_auroc - theirs_auroc) < 1e-5
    assert 0.5 < ours_auroc <= 1.0  # the synthetic OOD set is detectable: the comparison is not vacuous


# Browser tests drive Debian's Chromium through pytest-playwright (it cannot download its own browser here).
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
NEEDS_CHROMIUM = "needs Debian's chromium (apt-get install chromium)"
#: Skips a test without Chromium; conftest.py also marks it ``browser``.
chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=NEEDS_CHROMIUM)


def free_port() -> int:
    """A TCP port free on this machine now, for a test's server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(server: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a test's server process: SIGTERM, then SIGKILL when it has not exited ``grace_s`` seconds later
    (Streamlit's graceful shutdown can take 20 s and more on a loaded machine; no test checks what it does)."""
    server.terminate()
    try:
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=20)


def run_in_process(command: list[str], input: str | None = None, cwd=None, **_) -> subprocess.CompletedProcess:
    """``[python, -m, MODULE, *ARGS]`` (as :func:`subprocess.run` takes it, its other options ignored) run by
    ``MODULE.main()`` in this process, with those ``sys.argv``, ``input`` on stdin and ``cwd``: its exit code and what it
    printed on stdout and stderr, as the finished process would give them. For tests whose subject is what the
    command does, not its process (kills, signals, a fresh interpreter): each saves a new interpreter's imports
    (torch, pandas: ~3 s of CPU)."""
    assert command[:2] == [sys.executable, "-m"], command
    module = importlib.import_module(command[2])
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(stdout), redirect_stderr(stderr):
        patch.setattr(sys, "argv", [module.__file__, *command[3:]])
        patch.setattr(sys, "stdin", io.StringIO(input or ""))
        if cwd is not None:
            patch.chdir(cwd)
        try:
            code = module.main()
        except SystemExit as stopped:  # argparse's usage errors
            code = stopped.code if isinstance(stopped.code, int) else 1
    return subprocess.CompletedProcess(command, code, stdout.getvalue(), stderr.getvalue())


def oodviz_in_process(*args, cwd=None) -> subprocess.CompletedProcess:
    """``oodviz ARGS`` run by the command's own code in this process (:func:`run_in_process`)."""
    return run_in_process([sys.executable, "-m", "oodviz.cli", *map(str, args)], cwd=cwd)


def brute_force_threshold(ood_scores, recall=0.95) -> float:
    """The highest OOD score ``t`` with ``mean(ood_scores >= t) >= recall``, found by trying every one
    (float64; an independent reference for ``threshold_at_recall`` and FPR95)."""
    ood = np.asarray(ood_scores, dtype=np.float64)
    candidates = np.unique(ood)[::-1]  # highest first
    recall_at = (ood[None, :] >= candidates[:, None]).mean(axis=1)
    return float(candidates[np.flatnonzero(recall_at >= recall)[0]])


def write_idx(path, array: np.ndarray, gz: bool = False) -> None:
    """MNIST's idx format: magic 0x0000 08 <ndim>, big-endian int32 dims, then uint8 data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)


def small_config(**changes) -> RunConfig:
    config = RunConfig(
        ood=[DatasetChoice("digits-heldout"), DatasetChoice("noise-uniform", params={"n": 200})],
        detectors=[DetectorChoice("msp"), DetectorChoice("mahalanobis"), DetectorChoice("vim", {"dim": 16})],
        batch_size=128,
    )
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def slow_config() -> RunConfig:
    """Extraction of 300,000 noise images: long enough to cancel or kill it midway."""
    return small_config(ood=[DatasetChoice("noise-gaussian", params={"n": 300_000})], batch_size=64)


def wait_for(predicate, timeout=120.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("timed out waiting")


def extraction_started(run: RunDir, split: str) -> bool:
    return any(e.get("stage") == f"extract {split}" and e.get("event") == "progress" for e in run.read_events())


def sklearn_auroc(id_scores, ood_scores) -> float:
    return roc_auc_score(np.r_[np.zeros(len(id_scores)), np.ones(len(ood_scores))], np.r_[id_scores, ood_scores])


def rehash_with(directory, key: str, array: np.ndarray) -> None:
    """Replace fitted state ``key`` of the detector saved in ``directory`` by ``array``, its SHA-256 and shape
    updated in detector.json to match (a tampering every per-file check accepts)."""
    manifest = json.loads((directory / MANIFEST).read_text())
    entry = manifest["state"][key]
    np.save(directory / entry["file"], array)
    entry.update(shape=list(array.shape), sha256=file_sha256(directory / entry["file"]))
    (directory / MANIFEST).write_text(json.dumps(manifest))


# -- OpenOOD v1.5: a small data root in its exact layout, and a checkpoint ------------------------------------
#: images per set of :func:`write_cifar10_root`: ID lists, and every OOD list
ID_IMAGES = {"id_train": 40, "id_val": 10, "id_test": 30}
OOD_IMAGES = 12


def write_cifar10_root(root) -> dict[str, int]:
    """Every cifar10 set under ``root`` with random 32 x 32 images (each set its own brightness, so that the sets
    differ): split -> its number of images."""
    rng = np.random.default_rng(0)
    sizes = {}
    for position, s in enumerate(benchmark_splits("cifar10")):
        n = ID_IMAGES.get(s.role, OOD_IMAGES)
        subdir = s.list_file.rsplit("/", 1)[1].split("_", 1)[0]
        lines = []
        for i in range(n):
            path = f"{s.archive}/{subdir}/{s.name}_{i}.png"
            pixels = rng.integers(0, 256, (32, 32, 3)) * (0.3 + 0.06 * position)
            target = root / s.image_dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(target)
            lines.append(f"{path} {i % 10}\n")
        (root / s.list_file).parent.mkdir(parents=True, exist_ok=True)
        (root / s.list_file).write_text("".join(lines))
        sizes[s.split] = n
    return sizes


def checkpoint(path, seed: int) -> str:
    """A randomly initialised OpenOOD ``ResNet18_32x32`` (10 classes, seed ``seed``) saved at ``path`` as OpenOOD
    saves its checkpoints (a state dict with its key names)."""
    torch.manual_seed(seed)
    torch.save(build_openood_resnet18_32x32(10).state_dict(), path)  # OpenOOD's key names (tests/models)
    return str(path)


#: The pooling choices the form offers on a ViT encoder block (a token layer), as it labels them: the model's own
#: (its class token) first
VIT_BLOCK_POOLINGS = [
    "model's own (cls)",
    "avg",
    "max",
    "cls (the class token)",
    "mean (of the patch tokens)",
    "none (flattened)",
]
