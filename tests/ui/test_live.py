"""The live panel sends the same bytes per poll whatever the run's length (issue 14.5): measured on the
ForwardMsgs (Streamlit's wire messages) of one script run of the panel over an event log of 100 and one of
10,000 events."""

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest, local_script_runner

from oodviz.config.plan import planned_stages
from oodviz.config.run import RunConfig
from oodviz.runs.rundir import RunDir
from oodviz.ui.live import MAX_READ_BYTES

FINISHED_STAGES = 9


def running_run(root: Path, n_events: int) -> RunDir:
    """A running default run whose log holds ``n_events``: the first stages started and ended, then the tenth
    stage's progress events (one every 0.1 s, each with a memory snapshot), so logs of any length end in the
    same place."""
    config = RunConfig()
    run = RunDir.create(root, config.to_dict(), name=f"live-{n_events}")
    plan = planned_stages(config)
    events, t = [], 1000.0
    for stage in plan[:FINISHED_STAGES]:
        events.append({"time": t, "stage": stage, "event": "start", "device": "cpu", "cpu_rss": 900 << 20})
        events.append({"time": t + 0.05, "stage": stage, "event": "end", "wall_s": 0.05,
                       "peak_cpu_rss": 950 << 20, "device": "cpu", "cpu_rss": 940 << 20})  # fmt: skip
        t += 0.1
    stage, progress = plan[FINISHED_STAGES], n_events - len(events)
    for i in range(progress):
        events.append({"time": t + 0.1 * i, "stage": stage, "event": "progress", "done": i + 1, "total": progress,
                       "items_per_s": 1234.5, "eta_s": 0.1 * (progress - i - 1), "batch_size": 256,
                       "device": "cpu", "cpu_rss": (900 + i % 97) << 20})  # fmt: skip
    run.events_path.write_text("".join(json.dumps(e) + "\n" for e in events))
    run.write_status(state="running", stage=stage, started=1000.0)  # no worker pid: refresh keeps it running
    return run


def panel_script(path: str) -> None:
    from pathlib import Path

    from oodviz.runs.rundir import RunDir
    from oodviz.ui.watch import job_panel

    job_panel(RunDir(Path(path)))


def sent_per_part(run: RunDir, monkeypatch) -> tuple[AppTest, dict[str, int]]:
    """The panel drawn until it has read the whole log (a poll reads at most 1 MiB of a backlog), and the bytes
    of the deltas its last script run sent: ``"page"`` (drawn once), then one entry per fragment in order (the
    polled panel, then the memory chart), each what one of its polls sends."""
    sent: list = []

    def capture(messages):
        sent[:] = messages
        return parse(messages)

    parse = local_script_runner.parse_tree_from_messages
    monkeypatch.setattr(local_script_runner, "parse_tree_from_messages", capture)
    app = AppTest.from_function(panel_script, args=(str(run.path),), default_timeout=120)
    size = run.events_path.stat().st_size
    for _ in range(size // MAX_READ_BYTES + 2):  # the last run reads nothing new: a steady poll
        app.run()
        assert not app.exception
    assert app.session_state[f"event-tail-{run.run_id}"].offset == size
    parts: dict[str, int] = {}
    for message in sent:
        if message.WhichOneof("type") == "delta":
            part = message.delta.fragment_id or "page"
            parts[part] = parts.get(part, 0) + message.ByteSize()
    return app, parts


def test_a_poll_sends_the_same_bytes_for_a_log_of_100_and_of_10000_events(tmp_path, monkeypatch):
    short, long = running_run(tmp_path, 100), running_run(tmp_path, 10_000)
    app_short, sent_short = sent_per_part(short, monkeypatch)
    app_long, sent_long = sent_per_part(long, monkeypatch)
    assert len(sent_short) == len(sent_long) == 3  # the page, the polled panel, the memory chart
    for (part, small), large in zip(sent_short.items(), sent_long.values()):
        assert abs(large - small) <= max(64, 0.02 * small), (part, small, large)  # digits of elapsed/done only
    page, panel, chart = sent_long.values()
    assert panel < 4096 and chart < 6144  # a poll a second and a chart every 10 s: far under 10 KiB/s
    # what the panel shows is the log's end, read from the log itself
    events = [json.loads(line) for line in long.events_path.read_text().splitlines()]
    plan = planned_stages(RunConfig())
    bars = [p.proto.text for p in app_long.get("progress")]
    assert bars[0].startswith(f"Stage {FINISHED_STAGES + 1} of {len(plan)}: {plan[FINISHED_STAGES]}")
    assert bars[1].startswith(f"{plan[FINISHED_STAGES]}: {events[-1]['done']:,} / {events[-1]['total']:,}")
    # the chart: a fixed number of points spanning the run, from its first memory sample to its newest
    from oodviz.ui.watch import MEMORY_CHART_POINTS

    for app, run in ((app_short, short), (app_long, long)):
        logged = [json.loads(line) for line in run.events_path.read_text().splitlines()]
        figure = json.loads(app.get("plotly_chart")[0].proto.spec)
        cpu = figure["data"][0]
        x = np.frombuffer(base64.b64decode(cpu["x"]["bdata"]), dtype=cpu["x"]["dtype"])
        assert len(x) == MEMORY_CHART_POINTS
        assert x[0] == 0.0 and x[-1] == pytest.approx(logged[-1]["time"] - logged[0]["time"], abs=1e-3)


def test_the_chart_series_is_evenly_spaced_and_keeps_the_first_and_newest_sample(tmp_path):
    from oodviz.ui.live import EventTail

    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps({"time": float(i), "cpu_rss": i}) + "\n" for i in range(1000)))
    tail = EventTail(log, max_points=120)
    tail.poll()
    kept = tail.memory
    chosen = [m["time"] for m in tail.series(80)]
    reference = [kept[i]["time"] for i in np.rint(np.linspace(0, len(kept) - 1, 80)).astype(int)]
    assert chosen == reference and chosen[0] == 0.0 and chosen[-1] == 999.0
    assert len(set(chosen)) == 80
    assert tail.series(5000) == kept  # fewer samples than points: all of them
