"""Thumbnails on hover in the feature-space map: plotly cannot put an image in a hover label, and
``st.plotly_chart`` reports selections, not hovers, so a small Streamlit v2 component (its JavaScript is
``hover_thumbnail.js`` beside this file, run in the page; no iframe, no network) finds the map's chart by
its ``layout.meta`` and, on plotly's own ``plotly_hover`` event, shows beside the cursor the point's set,
index, true class, prediction and thumbnail, from :func:`oodviz.figures.projection_map.hover_data` sent once.

The sprite's points show their thumbnail at once. For any other point, once the mouse has rested on it, the
panel asks (a window event) a second component that shows nothing, ``hover_thumbnail_answers.js`` in a
fragment of its own (:func:`thumbnail_answers`), for that point and its nearest drawn neighbours without one:
its ``request`` trigger value carries their drawn rows, its callback answers with
:func:`oodviz.figures.projection_map.thumbnail_answer`, only that fragment reruns (the map is not sent again), and the
answer reaches the panel by a window event too. The page keeps every answered thumbnail, so a point is fetched
once.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pandas as pd
import streamlit as st

from oodviz.figures.projection_map import thumbnail_answer

_HERE = Path(__file__).parent
_PANEL = st.components.v2.component(
    "oodviz.hover_thumbnail",
    js=(_HERE / "hover_thumbnail.js").read_text(encoding="utf-8"),
    isolate_styles=False,
)
_ANSWERS = st.components.v2.component(
    "oodviz.hover_thumbnail_answers",
    js=(_HERE / "hover_thumbnail_answers.js").read_text(encoding="utf-8"),
    isolate_styles=False,
)


def hover_panel(data: dict, meta: str, key: str, config: dict | None = None, drawn_keys=None) -> None:
    """Mount the hover panel for the chart whose ``layout.meta`` is ``meta`` (``data``: what
    :func:`oodviz.figures.projection_map.hover_data` returns); it takes no room on the page. With the run's ``config``
    and the drawn table's keys (``drawn_keys``), points outside the sprite get theirs on demand."""
    _PANEL(key=key, data={**data, "meta": meta}, height=0)
    if config is not None and drawn_keys is not None:
        thumbnail_answers(config, drawn_keys, meta, key=f"{key}-answers")


def _answers_key(key: str) -> str:
    return f"{key}:answered"


def _answer(config: dict, drawn_keys: pd.DataFrame, key: str) -> None:
    """The component's ``request`` trigger callback: the asked thumbnails, kept for the fragment's run (added to
    any not sent yet: a request may come while the last answer is still on its way). An invalid request (it
    comes from the browser) is dropped."""
    try:
        answer = thumbnail_answer(config, drawn_keys, st.session_state[key].get("request"))
    except ValueError:
        return
    waiting = st.session_state.get(_answers_key(key)) or {"rows": [], "images": []}
    st.session_state[_answers_key(key)] = {
        "rows": waiting["rows"] + answer["rows"],
        "images": waiting["images"] + answer["images"],
    }


@st.fragment
def thumbnail_answers(config: dict, drawn_keys: pd.DataFrame, meta: str, key: str) -> None:
    """The on-demand thumbnails of the map ``meta``: a component that takes no room, relays the hover panel's
    requests as its ``request`` trigger (answered by :func:`_answer` before this fragment reruns) and hands the
    answer to the panel. In a fragment of its own: a request reruns only this."""
    answered = st.session_state.pop(_answers_key(key), None)
    _ANSWERS(
        key=key,
        data={"meta": meta, "answer": answered},
        height=0,
        on_request_change=partial(_answer, config, drawn_keys, key),
    )
