"""Shared fixtures: a small, seeded classification problem with a linear head; the default run; commands and the
app's child processes run in this process where their process is not under test. Plain helpers: helpers.py."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from filelock import FileLock
from helpers import CHROMIUM, NEEDS_CHROMIUM, NEEDS_CUDA, Problem, make_problem, run_in_process


@pytest.fixture(scope="session")
def problem() -> Problem:
    return make_problem()


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


#: Fixtures that start a process (``oodviz run``, the app's server) or drive Chromium: a test that uses one, directly
#: or through another fixture, is marked ``process`` or ``browser`` (``make test-fast`` leaves both out).
PROCESS_FIXTURES = frozenset({"default_run", "app_url"})
BROWSER_FIXTURES = frozenset({"page", "context", "browser"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects, and before xdist reads the groups
def pytest_collection_modifyitems(items):
    """Markers from what a test needs: a ``skipif`` whose reason is :data:`NEEDS_CUDA` (such as ``cuda``) marks it
    ``cuda``, one whose reason is :data:`NEEDS_CHROMIUM` (``chromium``) or a browser fixture marks it ``browser``, a
    fixture of :data:`PROCESS_FIXTURES` marks it ``process``; so ``pytest -m cuda`` selects every test that needs a
    GPU. Tests sharing an expensive fixture get one ``xdist_group`` (:func:`group_by_shared_fixtures`), also written
    where the controller's scheduler reads it."""
    for item in items:
        reasons = {mark.kwargs.get("reason") for mark in item.iter_markers("skipif")}
        fixtures = set(getattr(item, "fixturenames", ()))
        if NEEDS_CUDA in reasons:
            item.add_marker(pytest.mark.cuda)
        if NEEDS_CHROMIUM in reasons or fixtures & BROWSER_FIXTURES:
            item.add_marker(pytest.mark.browser)
        if fixtures & PROCESS_FIXTURES:
            item.add_marker(pytest.mark.process)
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
    #1386), which silently spread every group over the workers.

    Kept rather than plain ``--dist loadgroup`` with ``xdist_group`` marks because those marks do nothing here, as
    measured with pytest 9.2.0 and pytest-xdist 3.8.0: six tests marked ``xdist_group("g")`` under
    ``pytest -n 2 --dist loadgroup`` ran three on gw0 and three on gw1 (xdist's worker appends ``@g`` to
    ``item._nodeid``, which pytest 9.2's ``Node.nodeid``, ``str(self._id)``, no longer reads). Drop this class, and
    mark the groups with ``xdist_group``, once pytest-xdist reads the mark again."""

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


@pytest.fixture
def app_subprocesses_in_process(monkeypatch):
    """The app's child processes run in this process (:func:`run_in_process`): the memory estimate's probe
    (``python -m oodviz.pipeline.probe``, :mod:`oodviz.pipeline.probe`) and the explore tabs' ``oodviz project`` and
    ``oodviz score`` (:mod:`oodviz.ui.explore`). For AppTest tests of what the page does with their answers, not of
    the processes: tests/ui/test_access.py and tests/pipeline/test_batchprobe.py start the probe process, test_browser's
    probe and feature-map views the explore ones. Streamlit's cached estimates are dropped before and after."""
    from oodviz.pipeline import probe
    from oodviz.ui import explore
    from oodviz.ui.new_run import memory_estimate

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
