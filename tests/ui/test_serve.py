"""``oodviz app`` as a server: it listens on 127.0.0.1 only by default; ``--host 0.0.0.0`` shows a real
browser only the token prompt until it gives the printed token; a websocket whose Host header is not the
server's (DNS rebinding) is refused."""

import base64
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest
from helpers import chromium, free_port, stop_server

pytestmark = pytest.mark.process  # each test starts `oodviz app`


def non_loopback_ipv4() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def reachable(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture
def serve(tmp_path):
    """Start ``oodviz app --headless --port P <args>``; returns (port, its first line of output, the process)."""
    servers = []

    def start(*args):
        port = free_port()
        env = dict(os.environ, OODVIZ_RUNS_ROOT=str(tmp_path / "runs"))
        env.pop("OODVIZ_TOKEN", None)
        server = subprocess.Popen(
            [sys.executable, "-m", "oodviz.cli", "app", "--headless", "--port", str(port), *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        servers.append(server)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not reachable("127.0.0.1", port):
            assert server.poll() is None, server.stdout.read()
            time.sleep(0.3)
        return port, server.stdout.readline(), server

    yield start
    for server in servers:
        stop_server(server)


def websocket_handshake(port: int, host: str, origin: str | None = None) -> str:
    """The status line the server answers a browser-like websocket upgrade with ``Host: host`` from a page of
    ``origin`` (default: ``http://host``, the app's own)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        key = base64.b64encode(os.urandom(16)).decode()
        connection.sendall(
            (
                f"GET /_stcore/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nOrigin: {origin or f'http://{host}'}\r\n"
                "Sec-WebSocket-Protocol: streamlit\r\n\r\n"
            ).encode()
        )
        return connection.recv(4096).decode(errors="replace").split("\r\n")[0]


def test_by_default_the_app_answers_on_loopback_only_and_to_its_own_host_names(serve):
    port, _, _ = serve()
    assert reachable("127.0.0.1", port)
    address = non_loopback_ipv4()
    if address is not None:  # the machine has another address: nobody may connect through it
        assert not reachable(address, port)
    assert websocket_handshake(port, f"127.0.0.1:{port}").endswith("101 Switching Protocols")
    assert websocket_handshake(port, f"localhost:{port}").endswith("101 Switching Protocols")
    # DNS rebinding: a page of attacker.example whose name now resolves to 127.0.0.1
    assert websocket_handshake(port, f"attacker.example:{port}").endswith("403 Forbidden")


def test_the_websocket_opens_only_from_the_apps_own_origin(serve, tmp_path):
    """A page served from another port of this machine (Streamlit lets in any port of localhost, 127.0.0.1 and the
    machine's addresses) may not open the app's websocket; the app's own origin, as each of its names, may, and an
    origin listed whole in ``server.corsAllowedOrigins`` (a reverse proxy's)."""
    (tmp_path / ".streamlit").mkdir()
    (tmp_path / ".streamlit" / "config.toml").write_text('[server]\ncorsAllowedOrigins = ["https://proxy.example"]\n')
    port, _, _ = serve()
    assert websocket_handshake(port, f"localhost:{port}", "https://proxy.example").endswith("101 Switching Protocols")
    assert websocket_handshake(port, f"localhost:{port}", "https://proxy.example:8443").endswith("403 Forbidden")
    for name in ("localhost", "127.0.0.1"):
        assert websocket_handshake(port, f"{name}:{port}", f"http://{name}:{port}").endswith("101 Switching Protocols")
        for other in (f"http://{name}:{port + 1}", f"https://{name}", f"http://{name}", "null"):
            assert websocket_handshake(port, f"{name}:{port}", other).endswith("403 Forbidden"), other


@pytest.mark.skipif(not socket.has_ipv6, reason="needs IPv6")
@pytest.mark.parametrize("host", ["::1", "::"])
def test_the_printed_link_of_an_ipv6_host_is_a_url_that_opens_the_app(tmp_path, host):
    """``--host ::1`` with a token (so the link is printed): the address in brackets (RFC 3986), and the link opens
    the app; ``--host ::`` (every interface, as 0.0.0.0) names the machine."""
    port = free_port()
    options = ["--headless", "--port", str(port), "--host", host, "--token", "t0k"]
    server = subprocess.Popen(
        [sys.executable, "-m", "oodviz.cli", "app", *options],
        cwd=tmp_path,
        env=dict(os.environ, OODVIZ_RUNS_ROOT=str(tmp_path / "runs")),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        link = server.stdout.readline().removeprefix("oodviz app: open ").rstrip("\n")
        shown = "[::1]" if host == "::1" else socket.gethostname()
        assert link == f"http://{shown}:{port}/?token=t0k"
        if host == "::1":
            url = urllib.parse.urlsplit(link)
            deadline = time.monotonic() + 90
            while not reachable(url.hostname, url.port):
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()
                time.sleep(0.3)
            with urllib.request.urlopen(link, timeout=30) as page:
                assert page.status == 200 and b"<title>" in page.read()
    finally:
        stop_server(server)


@chromium
def test_serving_others_needs_the_printed_token(serve, page):
    port, announced, _ = serve("--host", "0.0.0.0")
    found = re.fullmatch(rf"oodviz app: open http://\S+:{port}/\?token=([\w-]+)\n", announced)
    assert found, announced
    token = found.group(1)
    assert len(token) >= 32
    address = non_loopback_ipv4()
    if address is not None:
        assert reachable(address, port)
        assert websocket_handshake(port, f"{address}:{port}").endswith("101 Switching Protocols")
    assert websocket_handshake(port, f"attacker.example:{port}").endswith("403 Forbidden")

    page.goto(f"http://127.0.0.1:{port}/")
    page.get_by_text("needs its access token").wait_for(timeout=60_000)
    page.get_by_label("Access token").wait_for(timeout=30_000)
    page.get_by_role("button", name="Open the app").wait_for(timeout=30_000)  # the script has run to its end
    assert page.get_by_role("button", name="Run the default").count() == 0
    assert page.get_by_role("link", name="Runs").count() == 0  # no page of the app: not even its top bar
    page.goto(f"http://127.0.0.1:{port}/?token=wrong")
    page.get_by_text("That is not this server's access token.").wait_for(timeout=60_000)
    assert page.get_by_role("button", name="Run the default").count() == 0
    page.goto(f"http://127.0.0.1:{port}/?token={token}")
    page.get_by_role("button", name="Run the default").wait_for(timeout=60_000)
    assert page.get_by_label("Access token").count() == 0
    page.get_by_role("link", name="Runs").click()  # another page: the session keeps the token
    page.get_by_role("heading", name="Runs").wait_for(timeout=60_000)
    assert page.get_by_label("Access token").count() == 0


def test_the_server_imports_the_apps_modules_before_any_page_is_opened(serve):
    """:mod:`oodviz.ui.serve`: the pages and the results tabs' torch are imported while the server starts (no
    browser has connected), then "ready" is printed; the first page does not wait for them."""
    from oodviz.ui.serve import READY

    port, first_line, server = serve()
    assert psutil.Process(server.pid).cmdline()[1:3] == ["-m", "oodviz.ui.serve"]  # `oodviz app` became it
    output = queue.Queue()
    threading.Thread(target=lambda: [output.put(line) for line in server.stdout], daemon=True).start()
    lines = [first_line]
    while not lines[-1].startswith(READY):
        lines.append(output.get(timeout=120))  # queue.Empty: not ready in 2 minutes
    assert re.fullmatch(
        rf"{READY} \(the pages, torch, torchvision and scikit-learn imported in \d+\.\d s\)\n", lines[-1]
    )
    mapped = {Path(m.path).name for m in psutil.Process(server.pid).memory_maps()}
    assert "libtorch_cpu.so" in mapped  # torch is loaded in the server, before any session asked for it
    assert websocket_handshake(port, f"127.0.0.1:{port}").endswith("101 Switching Protocols")
