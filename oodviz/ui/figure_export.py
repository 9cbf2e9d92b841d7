"""A plotly chart with "PNG / SVG" downloads below it, drawn by kaleido in the system's Chromium
(:mod:`oodviz.figures.export`), offered only where kaleido 1.x and a Chromium are installed.

The files are drawn on request (a click: a browser session takes seconds) and kept in the session for as
long as the figure stays the same. When the first export fails (the browser does not start), the reason is
shown once and the button is no longer offered in this session.
"""

from __future__ import annotations

import hashlib

import plotly.graph_objects as go
import streamlit as st

from oodviz.figures.export import figure_images, kaleido_problem

BROKEN = "figure-export-broken"


def chart(fig: go.Figure, key: str, name: str | None = None, **plotly_chart):
    """``st.plotly_chart(fig, key=key, **plotly_chart)`` (its selection event is returned), then the export
    button; the files are named ``name`` (default: ``key``)."""
    event = st.plotly_chart(fig, key=key, **plotly_chart)
    export_buttons(fig, key, name or key)
    return event


def export_buttons(fig: go.Figure, key: str, name: str) -> None:
    if kaleido_problem() is not None or BROKEN in st.session_state:
        return
    stored = f"figure-export:{key}"
    clicked = st.button(
        "Export PNG / SVG", key=f"{stored}:button", help="Draws this figure as files (takes a few seconds)"
    )
    if not clicked and stored not in st.session_state:
        return  # nothing drawn for this chart: no need to serialise the figure for its digest (every slider step)
    digest = hashlib.sha256(fig.to_json().encode()).hexdigest()[:16]
    if clicked:
        with st.spinner("Drawing the figure..."):
            try:
                st.session_state[stored] = (digest, figure_images([fig])[0])
            except RuntimeError as error:
                st.session_state[BROKEN] = str(error)
                st.warning(f"Figures cannot be exported here: {error}")
                return
    if st.session_state[stored][0] == digest:
        files = st.session_state[stored][1]
        left, right = st.columns(2)
        left.download_button("Download PNG", files["png"], f"{name}.png", "image/png", key=f"{stored}:png")
        right.download_button("Download SVG", files["svg"], f"{name}.svg", "image/svg+xml", key=f"{stored}:svg")
