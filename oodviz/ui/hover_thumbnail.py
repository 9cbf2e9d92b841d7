"""Thumbnails on hover in the feature-space map: plotly cannot put an image in a hover label, and
``st.plotly_chart`` reports selections, not hovers, so a small Streamlit v2 component (its JavaScript is
``hover_thumbnail.js`` beside this file, run in the page; no iframe, no network) finds the map's chart by
its ``layout.meta`` and, on plotly's own ``plotly_hover`` event, shows beside the cursor the point's set,
index, true class, prediction and thumbnail, from :func:`oodviz.projection_map.hover_data` sent once.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

_PANEL = st.components.v2.component(
    "oodviz.hover_thumbnail",
    js=(Path(__file__).with_name("hover_thumbnail.js")).read_text(encoding="utf-8"),
    isolate_styles=False,
)


def hover_panel(data: dict, meta: str, key: str) -> None:
    """Mount the hover panel for the chart whose ``layout.meta`` is ``meta`` (``data``: what
    :func:`oodviz.projection_map.hover_data` returns); it takes no room on the page."""
    _PANEL(key=key, data={**data, "meta": meta}, height=0)
