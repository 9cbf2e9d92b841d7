"""Shared fixtures: a small, seeded classification problem with a linear head; the default run; commands and the
app's child processes run in this process where their process is not under test."""

import importlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from filelock import FileLock

from oodviz import Batch


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


@pytest.fixture(scope="session")
def problem() -> Problem:
    return make_problem()


NEEDS_CUDA = "needs a CUDA device"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)


#: Session- or module-scoped fixtures of these tests that do not tie their tests to one xdist worker (every other
#: shared fixture does: see :func:`group_by_shared_fixtures`): cheap to build once per worker, or built once per test
#: session for every worker (:func:`built_once`: the default run).
CHEAP_SHARED_FIXTURES = frozenset(
    {
        "problem",
        "browser_type_launch_args",
        "browser_context_args",
        "scores",
        "relu_problem",
        "positive_problem",
        "default_run",
        "default_results",
    }
)
TESTS_DIR = Path(__file__).resolve().parent
#: Under ``pytest -n N --dist loadgroup``: the file in which the workers leave each test's group for the controller's
#: scheduler (:class:`SharedFixtureScheduling`), set by the controller.
GROUPS_FILE_VARIABLE = "OODVIZ_TEST_GROUPS_FILE"
GROUPS_FILE = pytest.StashKey[str]()


def group_by_shared_fixtures(items) -> dict[str, str]:
    """Mark tests that share an expensive session- or module-scoped fixture of this directory (a Streamlit server,
    a built wheel; used directly or through another fixture) with one ``xdist_group``, so that
    ``pytest -n 2 --dist loadgroup`` (``make test``) builds each such fixture on one worker only, once. Returns
    each grouped test's group by node id.

    Tests are linked through every such fixture they use (union-find): a test using two modules' fixtures puts both
    fixtures' tests into one group. Tests with none stay free, spread one by one."""
    parent: dict = {}

    def root(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        keys = [
            (fixturedef.baseid, name)
            for name in getattr(item, "fixturenames", ())
            if name not in CHEAP_SHARED_FIXTURES
            for fixturedef in (info.name2fixturedefs.get(name, ()) if info else ())[-1:]
            if fixturedef.scope in ("session", "module", "package")
            and Path(str(fixturedef.func.__code__.co_filename)).resolve().is_relative_to(TESTS_DIR)
        ]
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])
        if keys:
            shared[item] = keys[0]
    groups = {}
    for item, key in shared.items():
        group_key = root(key)
        groups[item.nodeid] = f"{Path(group_key[0] or 'conftest').stem}-{group_key[1]}"
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    return groups


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects, and before xdist reads the groups
def pytest_collection_modifyitems(items):
    """Every test that skips without a GPU (a ``skipif`` whose reason is :data:`NEEDS_CUDA`, such as ``cuda``)
    is also marked ``cuda``, so ``pytest -m cuda`` selects all of them. Tests sharing an expensive fixture get one
    ``xdist_group`` (:func:`group_by_shared_fixtures`), also written where the controller's scheduler reads it."""
    for item in items:
        if any(mark.kwargs.get("reason") == NEEDS_CUDA for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)
    groups = group_by_shared_fixtures(items)
    if groups_file := os.environ.get(GROUPS_FILE_VARIABLE):
        scratch = Path(f"{groups_file}.{os.getpid()}")  # every worker writes the same map: each replaces it whole
        scratch.write_text(json.dumps(groups))
        scratch.replace(groups_file)


def pytest_configure(config):
    """The controller of ``--dist loadgroup`` makes the file for :data:`GROUPS_FILE_VARIABLE` (workers inherit it)."""
    if config.pluginmanager.hasplugin("xdist") and config.getvalue("dist") == "loadgroup":
        if not os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("numprocesses"):
            handle, name = tempfile.mkstemp(prefix="oodviz-test-groups-", suffix=".json")
            os.close(handle)
            os.environ[GROUPS_FILE_VARIABLE] = config.stash[GROUPS_FILE] = name


def pytest_unconfigure(config):
    if name := config.stash.get(GROUPS_FILE, None):
        Path(name).unlink(missing_ok=True)
        os.environ.pop(GROUPS_FILE_VARIABLE, None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups of :func:`group_by_shared_fixtures` (:class:`SharedFixtureScheduling`)."""
    if config.stash.get(GROUPS_FILE, None):
        return SharedFixtureScheduling(config, log)
    return None


try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:  # no xdist: nothing to schedule
    LoadGroupScheduling = object


class SharedFixtureScheduling(LoadGroupScheduling):
    """xdist's ``loadgroup`` scheduler reading each test's group from the workers' map, not from a suffix of its node
    id: pytest 9.2 makes node ids structured, and xdist 3.8's ``@group`` suffix no longer takes (pytest-xdist issue
    #1386), which silently spread every group over the workers."""

    groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self.groups is None:
            text = Path(self.config.stash[GROUPS_FILE]).read_text()
            self.groups = json.loads(text) if text else {}
        return self.groups.get(nodeid) or super()._split_scope(nodeid)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the machine's cores: one torch thread each, not one per core each; so do the processes the
    # tests start (a run, the app's server and its runs), which read OMP_NUM_THREADS when they start torch.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


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
chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (apt-get install chromium)")


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


@pytest.fixture
def app_subprocesses_in_process(monkeypatch):
    """The app's child processes run in this process (:func:`run_in_process`): the memory estimate's probe
    (``python -m oodviz.pipeline.probe``, :mod:`oodviz.pipeline.probe`) and the explore tabs' ``oodviz project`` and
    ``oodviz score`` (:mod:`oodviz.ui.explore`). For AppTest tests of what the page does with their answers, not of
    the processes: tests/test_security.py and tests/test_batchprobe.py start the probe process, test_browser's
    probe and feature-map views the explore ones. Streamlit's cached estimates are dropped before and after."""
    from oodviz.pipeline import probe
    from oodviz.ui import explore
    from oodviz.ui.sidebar import memory_estimate

    here = SimpleNamespace(**{**vars(subprocess), "run": run_in_process})  # the module, but its run
    for module in (probe, explore):
        monkeypatch.setattr(module, "subprocess", here)
    memory_estimate.clear()
    yield
    memory_estimate.clear()


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    return {
        **browser_type_launch_args,
        "executable_path": CHROMIUM,
        "args": [
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
        ],
    }


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1400, "height": 1000}}


@dataclass
class DefaultRun:
    """The finished run directory ``path`` of ``oodviz run --out PATH`` and what the command printed."""

    path: Path
    stdout: str
    stderr: str


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The directory ``name`` that ``build(directory)`` fills, built once per test session: under pytest-xdist by
    the first worker that asks, while the others wait for it (a lock) and then read the same directory."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's base directory, above each worker's own
    directory, done = base / name, base / f"{name}.done"
    with FileLock(base / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # a build that failed in another worker
            directory.mkdir()
            build(directory)
            done.touch()
    return directory


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> DefaultRun:
    """``oodviz run --out DIR`` with no config: the bundled offline default (digits-cnn, 8x8 digits vs
    6 OOD sets, every default detector), run once per test session (:func:`built_once`, for every xdist worker)
    as a user would run it.

    Tests only read it; one that changes a run works on a copy (``shutil.copytree``) with a name of its own.
    """

    def run(root: Path) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "oodviz.cli", "run", "--out", str(root / "r1")],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=str(root),
        )
        assert result.returncode == 0, result.stderr[-3000:]
        (root / "stdout.txt").write_text(result.stdout)
        (root / "stderr.txt").write_text(result.stderr)

    root = built_once(tmp_path_factory, "default-run", run)
    return DefaultRun(root / "r1", (root / "stdout.txt").read_text(), (root / "stderr.txt").read_text())


@pytest.fixture
def default_run_copy(default_run, tmp_path):
    """A copy of the default run beside the stores it references, removed afterwards (a test writes into it)."""
    # tmp_path's parent: one name per xdist worker too (the default run's directory is shared by the workers)
    copy = default_run.path.parent / f"copy-{tmp_path.parent.name}-{tmp_path.name}"
    shutil.copytree(default_run.path, copy)
    yield copy
    shutil.rmtree(copy)


@pytest.fixture(scope="session")
def default_results(default_run):
    """:func:`oodviz.results.tables.load_results` of :func:`default_run` (shared: copy what you change)."""
    from oodviz.results.tables import load_results

    return load_results(default_run.path)


def brute_force_threshold(ood_scores, recall=0.95) -> float:
    """The highest OOD score ``t`` with ``mean(ood_scores >= t) >= recall``, found by trying every one
    (float64; an independent reference for ``threshold_at_recall`` and FPR95)."""
    ood = np.asarray(ood_scores, dtype=np.float64)
    candidates = np.unique(ood)[::-1]  # highest first
    recall_at = (ood[None, :] >= candidates[:, None]).mean(axis=1)
    return float(candidates[np.flatnonzero(recall_at >= recall)[0]])
