"""The app under test in the browser tests (test_browser*.py): a Streamlit server per test module over its own runs
root, and screenshots."""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from helpers import REPO, free_port, stop_server

from oodviz.ui import SERVER_FLAGS

SCREENSHOTS = REPO / "assets" / "screenshots"

#: The page drawn: no element still a loading skeleton (a first load draws the text first), the script run over
DRAWN = "() => !document.querySelector('[data-testid=stSkeleton], [data-testid=stAppSkeleton], [data-testid=stStatusWidget]')"


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("browser-runs")


@pytest.fixture(scope="module")
def app_url(runs_root):
    runs = runs_root
    port = free_port()
    env = dict(os.environ, OODVIZ_RUNS_ROOT=str(runs))
    if os.environ.get("OODVIZ_UPDATE_SCREENSHOTS"):  # README screenshots: no server paths (this machine's tmp)
        env["OODVIZ_SERVE_OTHERS"] = "1"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oodviz.ui.serve",
            "--server.headless",
            "true",
            "--server.port",
            str(port),
            "--server.address",
            "127.0.0.1",
            *SERVER_FLAGS,
            "--server.fileWatcherType",
            "none",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.3)
    yield f"http://127.0.0.1:{port}"
    stop_server(server)


def shoot(page, tmp_path, name):
    """The page as shown now, to ``tmp_path/name.png`` (what a failing test saw); with OODVIZ_UPDATE_SCREENSHOTS=1
    also to the README's assets/screenshots/, once the data grids (canvas) and charts have finished drawing."""
    if os.environ.get("OODVIZ_UPDATE_SCREENSHOTS"):  # a settled picture for the README (the tests wait on conditions)
        page.wait_for_function(DRAWN, timeout=120_000)
        page.wait_for_timeout(1500)
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), timeout=90_000)  # a loaded machine draws slowly
    if os.environ.get("OODVIZ_UPDATE_SCREENSHOTS"):
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, SCREENSHOTS / f"{name}.png")
    return path
