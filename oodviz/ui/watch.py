"""The job panel: what runs, stage k of N, the whole run's progress and ETA, device and memory; Cancel.

The panel polls every second and reads only what was appended to ``events.jsonl`` since its last poll
(:class:`~oodviz.ui.live.EventTail`, kept in the browser session). What a poll sends does not grow with the
run's length: the heading and Cancel are drawn once, outside the polled fragment (the page is redrawn when the
state changes); the poll sends the progress, the device and memory figures, the last warnings and the
finished-stages count (the table only while its expander is open); the memory chart, redrawn every
:data:`MEMORY_POLL_S` seconds in its own fragment, always has :data:`MEMORY_CHART_POINTS` points once the run
has that many samples (:meth:`~oodviz.ui.live.EventTail.series`).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from oodviz.config.plan import planned_stages, run_headline
from oodviz.config.run import RunConfig
from oodviz.figures.plots import memory_figure
from oodviz.models import format_bytes
from oodviz.results.analysis import memory_timeline
from oodviz.runs.jobs import cancel, refresh
from oodviz.runs.rundir import FINAL_STATES, RunDir
from oodviz.ui.access import show_server_details, shown_message
from oodviz.ui.live import EventTail, hms, run_eta_s, stage_position

POLL_S = 1.0
MEMORY_POLL_S = 10.0
#: memory samples kept per run (twice this at most), from which the chart's fixed number of points is taken
MEMORY_POINTS = 120
MEMORY_CHART_POINTS = 80


def _tail(run: RunDir) -> EventTail:
    """This session's reader of the run's event log (one per run, kept across polls)."""
    key = f"event-tail-{run.run_id}"
    if key not in st.session_state:
        st.session_state[key] = EventTail(run.events_path, max_points=MEMORY_POINTS)
    tail = st.session_state[key]
    tail.poll()
    return tail


def _stage_text(event: dict) -> str:
    parts = [f"{event['stage']}: {event.get('done', 0):,} / {event.get('total', 0):,}"]
    if event.get("reused"):
        parts.append("reused from the feature store")
    if event.get("items_per_s"):
        parts.append(f"{event['items_per_s']:,.0f} items/s")
    if event.get("eta_s") is not None and event.get("done", 0) < event.get("total", 0):
        parts.append(f"stage ETA {hms(event['eta_s'])}")
    return " · ".join(parts)


def _memory_metrics(event: dict, config: RunConfig | None) -> None:
    cols = st.columns(4)
    cols[0].metric("Device", event.get("device") or (config.device if config else "auto"))
    batch = event.get("batch_size") or (config.batch_size if config else None)  # the configured one until reported
    cols[1].metric("Batch size", f"{batch:,}" if batch else "not set")
    cols[2].metric(
        "CPU RSS",
        format_bytes(event["cpu_rss"]) if "cpu_rss" in event else "pending",
        help="The worker process's resident memory, reported with each progress event.",
    )
    if event.get("gpu_allocated") is not None:
        cols[3].metric(
            "GPU allocated",
            format_bytes(event["gpu_allocated"]),
            help=f"reserved {format_bytes(event['gpu_reserved'])}, peak {format_bytes(event['gpu_peak'])} "
            f"of {format_bytes(event['gpu_total'])}"
            + (f", utilisation {event['gpu_util']:.0f}%" if "gpu_util" in event else ""),
        )
        cols[3].caption(f"peak {format_bytes(event['gpu_peak'])} of {format_bytes(event['gpu_total'])}")
    else:
        cols[3].metric("GPU", "none")


def rank_table(ranks: dict[int, dict]) -> pd.DataFrame:
    """One row per process of the run: rank, stage, device, batch size, CPU RSS and GPU memory (latest)."""

    def size(value) -> str:
        return format_bytes(value) if value is not None else ""

    rows = [
        {
            "rank": rank,
            "stage": entry.get("stage") or "",
            "device": entry.get("device") or "",
            "batch size": entry.get("batch_size"),
            "CPU RSS": size(entry.get("cpu_rss")),
            "GPU allocated": size(entry.get("gpu_allocated")),
            "GPU peak": size(entry.get("gpu_peak")),
        }
        for rank, entry in sorted(ranks.items())
    ]
    return pd.DataFrame(rows, columns=["rank", "stage", "device", "batch size", "CPU RSS", "GPU allocated", "GPU peak"])


def _config(run: RunDir) -> RunConfig | None:
    try:
        return RunConfig.load(run.config_path)
    except (ValueError, OSError):
        return None


def job_panel(run: RunDir) -> None:
    """Draw the panel; it re-runs itself every second while the run is unfinished, then reloads the page."""
    status = refresh(run)
    running = status.get("state") not in FINAL_STATES
    config = _config(run)
    plan = planned_stages(config) if config else []
    if config:
        st.markdown(f"**{run_headline(config, paths=show_server_details())}**")
    st.subheader(f"Run {run.run_id}: {status.get('state')}")  # drawn once: a poll resends neither this nor Cancel
    cancelling = run.cancel_requested()
    if cancelling:
        st.info("Cancel requested: the worker stops at its next batch.")
    elif st.button("Cancel run", key=f"cancel-{run.run_id}"):
        cancel(run)
        st.rerun()

    @st.fragment(run_every=POLL_S if running else None)
    def panel():
        now = refresh(run)
        if now.get("state") in FINAL_STATES:
            if running:  # it finished while we watched: redraw the page with the results
                st.rerun()
            return
        if now.get("state") != status.get("state") or run.cancel_requested() != cancelling:
            st.rerun()  # queued -> running, or a cancel from another tab: the heading and Cancel above say so
        tail = _tail(run)
        if now.get("state") == "queued":
            st.info(tail.queued or "Waiting for the worker to start…")
        current = now.get("stage")
        k, fraction = stage_position(plan, tail.ended, current, tail.latest)
        eta = run_eta_s(tail.elapsed_s(), fraction)
        overall = f"Stage {k} of {len(plan)}" + (f": {current}" if current else "")
        overall += f" · {fraction:.0%} of the run · elapsed {hms(tail.elapsed_s())}"
        overall += f" · run ETA {hms(eta)}" if eta is not None else " · run ETA: after the first progress"
        st.progress(fraction, text=overall)
        latest = tail.latest if tail.latest and tail.latest.get("stage") == current else None
        if latest:
            total = max(latest.get("total", 0), 1)
            st.progress(min(latest.get("done", 0) / total, 1.0), text=_stage_text(latest))
        elif current:
            st.progress(0.0, text=f"{current}: starting…")
        _memory_metrics({**tail.last, **(latest or {})}, config)
        if len(tail.ranks) > 1:  # a run on several processes: each one's device, batch size and memory
            st.dataframe(rank_table(tail.ranks), hide_index=True, width="stretch")
        for warning in tail.warnings:
            st.warning(shown_message(warning))
        # the table only while its expander is open: a closed one costs a poll nothing however many stages ended
        stages = st.expander(
            f"Finished stages ({len(tail.ended)} of {len(plan)})", key=f"stages-{run.run_id}", on_change="rerun"
        )
        if stages.open:
            stages.dataframe(
                pd.DataFrame(
                    [
                        {
                            "stage": stage,
                            "seconds": round(e["wall_s"], 2),
                            "peak CPU RSS": format_bytes(e["peak_cpu_rss"]),
                        }
                        for stage, e in tail.ended.items()
                    ],
                    columns=["stage", "seconds", "peak CPU RSS"],
                ),
                hide_index=True,
                width="stretch",
            )

    @st.fragment(run_every=MEMORY_POLL_S if running else None)
    def memory_chart():
        timeline = memory_timeline(_tail(run).series(MEMORY_CHART_POINTS))
        if len(timeline) > 1:
            st.plotly_chart(memory_figure(timeline, stages=plan), width="stretch", key="memory-live")

    panel()
    memory_chart()
