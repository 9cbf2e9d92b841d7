"""The job panel: a run's stages, progress, device and memory, polled while it runs; Cancel."""

from __future__ import annotations

import streamlit as st

from oodviz.analysis import memory_timeline
from oodviz.models import format_bytes
from oodviz.plots import memory_figure
from oodviz.runs.jobs import cancel, refresh
from oodviz.runs.rundir import FINAL_STATES, RunDir

POLL_S = 1.0


def _progress_text(event: dict) -> str:
    parts = [f"{event['stage']}: {event.get('done', 0):,} / {event.get('total', 0):,}"]
    if event.get("reused"):
        parts.append("reused from the feature store")
    if event.get("items_per_s"):
        parts.append(f"{event['items_per_s']:,.0f} items/s")
    if event.get("eta_s") is not None and event.get("done", 0) < event.get("total", 0):
        parts.append(f"ETA {event['eta_s']:.0f} s")
    return " · ".join(parts)


def _memory_metrics(event: dict) -> None:
    cols = st.columns(4)
    cols[0].metric("Device", event.get("device") or "—")
    cols[1].metric("Batch size", event.get("batch_size") or "—")
    cols[2].metric("CPU RSS", format_bytes(event["cpu_rss"]) if "cpu_rss" in event else "—")
    if "gpu_allocated" in event:
        cols[3].metric(
            "GPU allocated",
            format_bytes(event["gpu_allocated"]),
            help=f"reserved {format_bytes(event['gpu_reserved'])}, peak {format_bytes(event['gpu_peak'])} "
            f"of {format_bytes(event['gpu_total'])}"
            + (f", utilisation {event['gpu_util']:.0f}%" if "gpu_util" in event else ""),
        )
        cols[3].caption(f"peak {format_bytes(event['gpu_peak'])} of {format_bytes(event['gpu_total'])}")
    else:
        cols[3].metric("GPU", "not used")


def job_panel(run: RunDir) -> None:
    """Draw the panel; re-runs itself every second while the run is unfinished, then reloads the page."""
    status = refresh(run)
    running = status.get("state") not in FINAL_STATES

    @st.fragment(run_every=POLL_S if running else None)
    def panel():
        status = refresh(run)
        if status.get("state") in FINAL_STATES:
            if running:  # it finished while we watched: redraw the page with the results
                st.rerun()
            return
        events = run.read_events()
        st.subheader(f"Run {run.run_id}: {status.get('state')}")
        if status.get("state") == "queued":
            waiting = [e for e in events if e.get("stage") == "queued"]
            st.info(waiting[-1]["message"] if waiting else "Waiting for the worker to start…")
        ended = [e for e in events if e.get("event") == "end"]
        progress = [e for e in events if e.get("event") == "progress"]
        current = status.get("stage")
        latest = next((e for e in reversed(progress) if e.get("stage") == current), None)
        st.caption(f"{len(ended)} stage(s) finished" + (f" · now: {current}" if current else ""))
        if latest:
            total = max(latest.get("total", 0), 1)
            st.progress(min(latest.get("done", 0) / total, 1.0), text=_progress_text(latest))
        elif current:
            st.progress(0.0, text=f"{current}: starting…")
        last = events[-1] if events else {}
        _memory_metrics({**last, **(latest or {})})
        timeline = memory_timeline(events)
        if len(timeline) > 1:
            st.plotly_chart(memory_figure(timeline), use_container_width=True, key="memory-live")
        for warning in [e for e in events if e.get("event") == "warning"][-5:]:
            st.warning(warning["message"])
        if run.cancel_requested():
            st.info("Cancel requested: the worker stops at its next batch.")
        elif st.button("Cancel run", key=f"cancel-{run.run_id}"):
            cancel(run)
            st.rerun(scope="fragment")
        with st.expander("Finished stages"):
            st.dataframe(
                [
                    {
                        "stage": e["stage"],
                        "seconds": round(e["wall_s"], 2),
                        "peak CPU RSS": format_bytes(e["peak_cpu_rss"]),
                    }
                    for e in ended
                ],
                hide_index=True,
                use_container_width=True,
            )

    panel()
