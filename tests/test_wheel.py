"""`oodviz app` from a wheel: build it, install it into a fresh virtual environment, serve the app from an
empty directory, and open it in Chromium.

The fresh environment borrows the test environment's third-party packages (torch, streamlit, ...) through a
plain path line in a .pth file. Such a line adds that site-packages to ``sys.path`` without running the .pth
files inside it, so the editable oodviz install there stays off and ``import oodviz`` can only find the wheel.
PYTHONPATH is dropped from every process started here: it would put a checkout ahead of the installed package.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from helpers import chromium, free_port, stop_server

pytestmark = pytest.mark.process  # builds a wheel, installs it in a fresh venv, serves the app

REPO = Path(__file__).resolve().parent.parent
BUILD_INPUTS = ("pyproject.toml", "README.md", "oodviz")  # all that setuptools reads to build the wheel
SKIP_IN_COPY = shutil.ignore_patterns("__pycache__", "*.pyc")


def environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def package_files(root: Path) -> set[str]:
    """The files of the ``oodviz`` package under ``root``, as archive names (``oodviz/ui/app.py``)."""
    return {
        path.relative_to(root).as_posix()
        for path in (root / "oodviz").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the build inputs: setuptools builds in the source tree (build/, *.egg-info), not in the repo's."""
    root = tmp_path_factory.mktemp("source")
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, root / name, ignore=SKIP_IN_COPY)
        else:
            shutil.copy2(REPO / name, root / name)
    return root


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--wheel-dir", str(out), str(source)],
        check=True,
        env=environment(),
    )
    (built,) = out.glob("oodviz-*.whl")
    return built


@dataclass
class Venv:
    root: Path
    site_packages: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Venv:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, env=environment())
    python = root / "bin" / "python"
    # The wheel goes in before the .pth exists: pip sees an empty environment, not the borrowed editable oodviz.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index"]
        + [str(wheel)],
        check=True,
        env=environment(),
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
        env=environment(),
    ).stdout.strip()
    site_packages = Path(purelib).resolve()
    borrowed = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site_packages / "borrowed-packages.pth").write_text("".join(f"{path}\n" for path in borrowed))
    return Venv(root, site_packages)


@pytest.fixture(scope="module")
def empty_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("empty")


@dataclass
class Served:
    url: str
    port: int
    pid: int


@pytest.fixture(scope="module")
def served(venv, empty_dir, tmp_path_factory):
    """``oodviz app --headless --port N`` run by the fresh environment's console script in an empty directory."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [str(venv.root / "bin" / "oodviz"), "app", "--headless", "--port", str(port)],
            cwd=empty_dir,
            env=environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None:
                pytest.fail(f"oodviz app exited with {server.returncode}:\n{log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"oodviz app did not answer within 60 s:\n{log_path.read_text()}")
                time.sleep(0.3)
        yield Served(url, port, server.pid)
    finally:
        stop_server(server)


def test_the_wheel_ships_every_file_of_the_package(source, wheel):
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if name.startswith("oodviz/")}
        expected = package_files(source)
        # The non-Python files the app needs: its entry script, the bundled backbones of the offline presets, KaTeX.
        assert {"oodviz/ui/app.py", "oodviz/weights/digits-cnn.pt", "oodviz/weights/fashion-cnn.json"} <= expected
        assert {"oodviz/katex/katex.min.js", "oodviz/katex/fonts/KaTeX_Main-Regular.woff2"} <= expected  # the report
        assert {f"oodviz/results/data/openood_v1_5.{kind}" for kind in ("csv", "json")} <= expected  # the leaderboard
        assert shipped == expected
        assert all(archive.read(name) == (source / name).read_bytes() for name in shipped)
        (entry_points,) = [name for name in archive.namelist() if name.endswith(".dist-info/entry_points.txt")]
        assert "oodviz = oodviz.cli:main" in archive.read(entry_points).decode()


def test_oodviz_is_imported_from_the_fresh_environment(venv, empty_dir):
    found = subprocess.run(
        [str(venv.python), "-c", "import oodviz, oodviz.ui, streamlit; print(oodviz.__file__, oodviz.ui.APP_SCRIPT)"],
        cwd=empty_dir,
        check=True,
        capture_output=True,
        text=True,
        env=environment(),
    ).stdout.split()
    package, app_script = (Path(path).resolve() for path in found)
    assert package == venv.site_packages / "oodviz" / "__init__.py"
    assert app_script == venv.site_packages / "oodviz" / "ui" / "app.py"
    assert app_script.is_file()
    assert not package.is_relative_to(REPO)


def test_oodviz_app_serves_the_installed_entry_from_an_empty_directory(served, venv, empty_dir):
    with urllib.request.urlopen(f"{served.url}/_stcore/health", timeout=10) as health:
        assert (health.status, health.read()) == (200, b"ok")
    with urllib.request.urlopen(served.url, timeout=10) as index:
        assert index.status == 200
        assert b'<div id="root">' in index.read()
    # `oodviz app` became Streamlit's server (exec): the fresh interpreter running the package's entry script.
    server = psutil.Process(served.pid)
    command = server.cmdline()
    assert Path(command[0]) == venv.python
    assert command[1:3] == ["-m", "oodviz.ui.serve"]  # Streamlit's `run` on the package's entry script
    options = dict(zip(command[3::2], command[4::2], strict=True))
    assert options["--browser.gatherUsageStats"] == "false"
    assert options["--runner.postScriptGC"] == "false"  # no full collection holding the GIL after every click
    assert options["--server.port"] == str(served.port)
    assert options["--server.headless"] == "true"
    assert Path(server.cwd()) == empty_dir


@chromium
def test_the_installed_app_renders_in_chromium(page, served, tmp_path):
    page.goto(served.url)
    title = page.get_by_role("heading", name="New run")
    title.wait_for(timeout=60_000)
    run_default = page.get_by_role("button", name="Run the default")
    run_default.wait_for(timeout=30_000)
    assert run_default.is_enabled()
    assert page.locator('[data-testid="stException"]').count() == 0
    assert "Something went wrong" not in page.inner_text("body")
    # another page's script, from the wheel's oodviz/ui/app_pages/ (package data)
    page.get_by_role("link", name="Detectors", exact=True).click()
    page.get_by_role("heading", name="Detectors").wait_for(timeout=60_000)
    assert page.locator('[data-testid="stException"]').count() == 0
    page.screenshot(path=str(tmp_path / "installed-app.png"))
