"""The app in a real browser: how fast it answers and how much it sends (issue 14, point 5).

Serves the app as ``oodviz app`` does (``python -m oodviz.ui.serve`` with ``oodviz.ui.SERVER_FLAGS``) on a runs
root holding one finished run, drives Debian's Chromium (Playwright, 1000 x 1400 px) and measures, from the
browser:

- **server ready**: from starting the server until it prints that its modules are imported (``oodviz app:
  ready``, :mod:`oodviz.ui.serve`);
- **cold first load**: then a fresh browser, ``goto(/run?run=ID)`` until the metrics table is drawn and the app is
  idle (Streamlit's status widget gone, two animation frames later): the run's files read for the first time;
- **tab switch**: click a tab until its pixels are settled: the later of the server's last websocket frame for
  it and the page's last DOM change (a MutationObserver installed before the page's scripts); the last frame's
  time alone is given beside it (``..._last_frame_s``; median of ``--repeats``);
- **slider step**: one ArrowRight on the shared threshold slider, timed the same way, and the bytes the server
  sent for it over the websocket (median of 20 steps, on the histogram tab and on the failure cases tab);
- **bytes per tab**: what the server sent for a tab switch (its charts and tables), and how many charts;
- **live panel**: a default run started from the page; the websocket bytes per second and per poll
  (every second; the median of 1 s buckets) in its first and its last 10 seconds;
- **live panel by the log's length**: the same figures for a "running" run (no worker; its status says
  running) whose ``events.jsonl`` already holds 100 and then 10,000 events, a progress event appended every
  0.25 s while the browser watches: what a poll sends must not depend on the length.

Usage::

    make bench-app                                   # the default digits run (made by the CLI if missing)
    .venv/bin/python bench/app_bench.py --run DIR    # any finished run directory, e.g. a full Fashion-MNIST run

Prints one JSON object; the figures for ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from oodviz.ui import SERVER_FLAGS
from oodviz.ui.serve import READY

REPO = Path(__file__).resolve().parent.parent
IDLE = "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')"
TABS = ("Score histograms", "ROC / PR", "Failure cases", "Metrics")
TAB_READY = {
    "Metrics": "Best detector per column",
    "Score histograms": "Heights",
    "ROC / PR": "Overlay",
    "Failure cases": "ID images flagged as OOD",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list[str], ready: str, env: dict | None = None) -> tuple[subprocess.Popen, str, float]:
    """``python COMMAND`` as every server of the app is started (:data:`oodviz.ui.SERVER_FLAGS`, headless, on a free
    local port, no file watcher), once it has printed a line containing ``ready``; with its URL and the seconds
    that took. The rest of its output is drained."""
    port = free_port()
    started = time.monotonic()
    server = subprocess.Popen(
        [sys.executable, *command, *SERVER_FLAGS, "--server.headless", "true"]
        + ["--server.port", str(port), "--server.address", "127.0.0.1", "--server.fileWatcherType", "none"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in server.stdout:
        if ready in line:
            break
    else:
        raise RuntimeError(f"the server exited ({server.wait()}) before it was ready")
    ready_s = time.monotonic() - started
    threading.Thread(target=server.stdout.read, daemon=True).start()
    return server, f"http://127.0.0.1:{port}", ready_s


def serve(runs_root: Path) -> tuple[subprocess.Popen, str, float]:
    """A server of the app on ``runs_root``, once it has printed :data:`oodviz.ui.serve.READY` (its modules
    imported, as a user finds it who opens the page after ``oodviz app`` says so); with the seconds that took."""
    return start_server(["-m", "oodviz.ui.serve"], READY, env=dict(os.environ, OODVIZ_RUNS_ROOT=str(runs_root)))


class Wire:
    """Bytes the server sent over the page's websockets (each received frame's payload); with ``keep``, the
    payloads too (for :func:`polls`)."""

    def __init__(self, page, keep: bool = False):
        self.frames: list[tuple[float, int]] = []
        self.payloads: list[tuple[float, bytes]] = []
        self.keep = keep
        page.on("websocket", lambda ws: ws.on("framereceived", self._frame))

    def _frame(self, payload) -> None:
        self.frames.append((time.monotonic(), len(payload)))
        if self.keep:
            self.payloads.append((time.monotonic(), payload))

    def since(self, start: float) -> int:
        return sum(n for t, n in self.frames if t >= start)


def settle(page) -> None:
    page.wait_for_timeout(50)  # the rerun's status widget shows within a frame or two
    page.wait_for_function(IDLE, timeout=120_000)
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


#: Installed in every page before its scripts: the page-clock time of the document's latest change (an element
#: added, removed or restyled, text changed: a chart drawn, a table filled, the "running" indicator gone).
LAST_CHANGE = """
window.__lastChange = performance.now();
new MutationObserver(() => { window.__lastChange = performance.now(); })
    .observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
"""


def answered(page, wire: Wire, action, quiet_s: float = 0.3) -> tuple[float, float]:
    """``action()`` (a click, a key), then ``(seconds to the server's last frame, seconds to settled pixels)``:
    the last frame is the last the page's websocket received (no frame for ``quiet_s`` after it, the app idle);
    the pixels are settled at the page's last DOM change after the action or at that frame, whichever is later
    (the canvas of a data grid is drawn in the animation frame after its data: two more are waited for)."""
    page_start = page.evaluate("performance.now()")
    start = time.monotonic()
    action()
    deadline = time.monotonic() + 60
    while not any(t >= start for t, _ in wire.frames) and time.monotonic() < deadline:
        page.wait_for_timeout(10)
    while time.monotonic() - max((t for t, _ in wire.frames), default=start) < quiet_s:
        page.wait_for_timeout(20)
    settle(page)
    last = max((t for t, _ in wire.frames if t >= start), default=start) - start
    changed = (page.evaluate("window.__lastChange") - page_start) / 1000
    return last, max(last, changed)


def charts(page) -> int:
    return page.locator(".js-plotly-plot").count()


def measure_results(url: str, run_id: str, repeats: int) -> dict:
    from playwright.sync_api import sync_playwright

    out: dict = {"tab_switch_s": {}, "tab_switch_bytes": {}, "charts": {}}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium")
        page = browser.new_page(viewport={"width": 1000, "height": 1400})
        page.add_init_script(LAST_CHANGE)
        wire = Wire(page)
        started = time.monotonic()
        page.goto(f"{url}/run?run={run_id}")
        page.get_by_text(TAB_READY["Metrics"]).wait_for(timeout=120_000)
        settle(page)
        out["cold_first_load_s"] = round(time.monotonic() - started, 2)
        out["cold_first_load_bytes"] = wire.since(started)
        times: dict[str, list[tuple[float, float]]] = {tab: [] for tab in TABS}

        def open_tab(tab: str) -> None:
            page.get_by_role("tab", name=tab).click()
            page.get_by_text(TAB_READY[tab]).first.wait_for(timeout=60_000)

        for _ in range(repeats):
            for tab in TABS:
                started = time.monotonic()
                times[tab].append(answered(page, wire, lambda tab=tab: open_tab(tab)))
                out["tab_switch_bytes"][tab] = wire.since(started)  # all of the tab: its charts and tables
                out["charts"][tab] = charts(page)
        out["tab_switch_s"] = {tab: round(statistics.median(s for _, s in v), 3) for tab, v in times.items()}
        out["tab_switch_last_frame_s"] = {tab: round(statistics.median(f for f, _ in v), 3) for tab, v in times.items()}
        for tab in ("Score histograms", "Failure cases"):
            open_tab(tab)
            settle(page)
            slider = page.get_by_role("slider").first
            steps, sent = [], []
            for _ in range(20):
                slider.focus()
                started = time.monotonic()
                steps.append(answered(page, wire, lambda: page.keyboard.press("ArrowRight")))
                sent.append(wire.since(started))
            out[f"slider_step_s ({tab})"] = round(statistics.median(s for _, s in steps), 3)
            out[f"slider_step_last_frame_s ({tab})"] = round(statistics.median(f for f, _ in steps), 3)
            out[f"slider_step_bytes ({tab})"] = int(statistics.median(sent))
            out[f"slider_20_steps_s ({tab})"] = round(sum(s for _, s in steps), 2)
        browser.close()
    return out


def measure_live(url: str, runs_root: Path, seconds: float = 10.0) -> dict:
    """Start the default run from the page; websocket bytes per second and per poll in its first and last
    ``seconds`` (the last window ends when the worker finished, from the run's ``status.json``: the results
    page drawn after it is left out)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium")
        page = browser.new_page(viewport={"width": 1000, "height": 1400})
        wire = Wire(page)
        page.goto(url)
        page.get_by_role("button", name="Run the default").click(timeout=120_000)
        page.wait_for_url("**?run=*", timeout=60_000)
        page.get_by_text("Stage ").first.wait_for(timeout=60_000)
        first = time.monotonic()
        page.get_by_text(TAB_READY["Metrics"]).wait_for(timeout=900_000)
        run_id = page.url.split("run=")[1].split("&")[0]
        browser.close()
    status = json.loads((runs_root / run_id / "status.json").read_text())
    done = status["finished"] - (time.time() - time.monotonic())  # the worker's end, on the frames' clock

    def window(start: float, end: float) -> dict:
        """Bytes per second, and per poll: the median of the 1 s buckets (the panel polls once a second; the
        memory chart, redrawn every 10 s, is in one bucket of ten)."""
        frames = [(t, n) for t, n in wire.frames if start <= t < end]
        buckets = [0] * max(int(end - start), 1)
        for t, n in frames:
            buckets[min(int(t - start), len(buckets) - 1)] += n
        return {
            "bytes_per_s": round(sum(n for _, n in frames) / max(end - start, 1e-9)),
            "bytes_per_poll_median": int(statistics.median(buckets)),
            "bytes_per_second": buckets,
        }

    last_start = max(done - seconds, first + seconds)
    return {
        "run_s": round(done - first, 1),
        "first_window": window(first, first + seconds),
        "last_window": window(last_start, done),
    }


def synthetic_running_run(root: Path, n_events: int) -> Path:
    """``root/live-<n>``: a default run's config, state running with no worker pid (so it stays running), and
    ``n_events`` events: nine stages started and ended, then the tenth stage's progress, one every 0.1 s."""
    from oodviz.config.plan import planned_stages
    from oodviz.config.run import RunConfig
    from oodviz.runs.rundir import RunDir

    config = RunConfig()
    run = RunDir.create(root, config.to_dict(), name=f"live-{n_events}")
    plan, start = planned_stages(config), time.time() - n_events * 0.1
    lines = []
    for i, stage in enumerate(plan[:9]):
        lines.append({"time": start + 0.1 * i, "stage": stage, "event": "end", "wall_s": 0.1, "peak_cpu_rss": 1 << 30,
                      "device": "cpu", "cpu_rss": 1 << 30})  # fmt: skip
    lines += [progress_event(plan[9], start + 0.1 * i, i) for i in range(n_events - len(lines))]
    run.events_path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    run.write_status(state="running", stage=plan[9], started=start)
    return run.path


def progress_event(stage: str, when: float, i: int) -> dict:
    return {"time": when, "stage": stage, "event": "progress", "done": i, "total": 10**6, "items_per_s": 1000.0,
            "eta_s": 1000.0 - i / 1000, "batch_size": 256, "device": "cpu", "cpu_rss": (900 + i % 97) << 20}  # fmt: skip


def polls(payloads: list[tuple[float, bytes]]) -> dict[str, list[int]]:
    """The bytes of each script run in ``payloads`` (Streamlit ForwardMsgs, a run ending at its
    ``script_finished``), by what ran: the fragment's id of its deltas, ``"page"`` for a whole-page run."""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    runs: dict[str, list[int]] = {}
    size, part = 0, None
    for _, payload in payloads:
        message = ForwardMsg.FromString(payload if isinstance(payload, bytes) else payload.encode())
        size += len(payload)
        if message.WhichOneof("type") == "delta":
            part = part or message.delta.fragment_id or "page"
        elif message.WhichOneof("type") == "script_finished":
            runs.setdefault(part or "nothing drawn", []).append(size)
            size, part = 0, None
    return runs


def measure_live_lengths(url: str, runs_root: Path, lengths=(100, 10_000), seconds: float = 15.0) -> dict:
    """Bytes per poll watching a running run whose log holds each of ``lengths`` events (see the module
    docstring): per second, the median and the largest 1 s bucket (the memory chart's poll), after the panel
    has caught up with the log (5 s)."""
    from playwright.sync_api import sync_playwright

    out = {}
    for n in lengths:
        path = synthetic_running_run(runs_root, n)
        stop = threading.Event()

        def append(path=path, stop=stop, n=n):
            stage = json.loads((path / "status.json").read_text())["stage"]
            i = n
            while not stop.wait(0.25):
                with (path / "events.jsonl").open("a") as log:
                    log.write(json.dumps(progress_event(stage, time.time(), i)) + "\n")
                i += 1

        writer = threading.Thread(target=append, daemon=True)
        writer.start()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium")
            page = browser.new_page(viewport={"width": 1000, "height": 1400})
            wire = Wire(page, keep=True)
            page.goto(f"{url}/run?run={path.name}")
            page.get_by_text("Stage 10 of").first.wait_for(timeout=600_000)
            page.wait_for_timeout(5_000)
            start = time.monotonic()
            page.wait_for_timeout(seconds * 1000)
            buckets = [0] * int(seconds)
            for t, size in wire.frames:
                if start <= t < start + int(seconds):
                    buckets[int(t - start)] += size
            browser.close()
        stop.set()
        writer.join()
        shutil.rmtree(path, ignore_errors=True)  # not left "running" in the runs root
        watched = polls([(t, p) for t, p in wire.payloads if start <= t < start + int(seconds)])
        panel, chart = [*sorted(watched.values(), key=len, reverse=True), [0], [0]][:2]  # the panel polls most
        out[f"{n} events"] = {
            "panel_polls": len(panel),
            "panel_bytes_per_poll_median": int(statistics.median(panel)),
            "panel_bytes_per_poll_range": [min(panel), max(panel)],
            "chart_polls": len(chart),
            "chart_bytes_per_poll_median": int(statistics.median(chart)),
            "bytes_per_s": round(sum(buckets) / len(buckets)),
            "bytes_per_poll_median": int(statistics.median(buckets)),
            "largest_bucket": max(buckets),
            "bytes_per_second": buckets,
        }
    return out


def default_run(root: Path) -> Path:
    out = root / "bench-default"
    subprocess.run([sys.executable, "-m", "oodviz.cli", "run", "--out", str(out)], check=True, capture_output=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="a finished run directory (default: a fresh default run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-live", action="store_true", help="skip the live panel measurement")
    parser.add_argument("--live-only", action="store_true", help="only the live panel measurements")
    parser.add_argument("--live-lengths-only", action="store_true", help="only the live panel by the log's length")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="oodviz-app-bench-") as tmp:
        root = Path(tmp) / "runs"
        root.mkdir()
        source = args.run or default_run(Path(tmp))
        shutil.copytree(source, root / "bench")
        server, url, ready_s = serve(root)
        try:
            result = {"run": str(source.name), "server_ready_s": round(ready_s, 2)}
            if not (args.live_only or args.live_lengths_only):
                result.update(measure_results(url, "bench", args.repeats))
            if not args.no_live:
                result["live_by_log_length"] = measure_live_lengths(url, root)
            if not (args.no_live or args.live_lengths_only):
                result["live"] = measure_live(url, root)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
