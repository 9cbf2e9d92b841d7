"""The app's pages and the moves between them: the page registry :data:`PAGES` (each page's script under
``app_pages/``, title and URL path) and the links that carry a run in the URL.

Each page keeps what it shows in its URL's query string: the Run page its run (``/run?run=<id>`` and the view of
:mod:`oodviz.ui.view_url`), the Compare page its two runs (``/compare?a=<id>&b=<id>``), the New run page the run whose
choices it starts from (``/?from=<id>``), the Detectors page the detector explained (``/detectors?detector=<name>``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

SCRIPTS = Path(__file__).resolve().parent / "app_pages"


@dataclass(frozen=True)
class PageSpec:
    """One page: its script in :data:`SCRIPTS`, its title in the navigation, its URL path ("" for the default
    page, served at ``/``) and icon."""

    script: str
    title: str
    url_path: str
    icon: str


#: The pages in the order the navigation shows them; the first is the default (``/``).
PAGES = {
    "new": PageSpec("new_run.py", "New run", "", ":material/add_circle:"),
    "runs": PageSpec("runs.py", "Runs", "runs", ":material/list:"),
    "run": PageSpec("run.py", "Run", "run", ":material/insights:"),
    "compare": PageSpec("compare.py", "Compare", "compare", ":material/compare_arrows:"),
    "detectors": PageSpec("detectors.py", "Detectors", "detectors", ":material/school:"),
}


def page(name: str) -> st.Page:
    """The :class:`streamlit.Page` of ``PAGES[name]`` (made again at each call: Streamlit knows a page by its URL
    path, so two calls give the same page)."""
    spec = PAGES[name]
    return st.Page(
        SCRIPTS / spec.script,
        title=spec.title,
        url_path=spec.url_path or None,
        icon=spec.icon,
        default=not spec.url_path,
    )


def runs_root() -> Path:
    """Where runs live: ``$OODVIZ_RUNS_ROOT``, default ``./runs`` (shared with ``oodviz run``)."""
    return Path(os.environ.get("OODVIZ_RUNS_ROOT", "runs"))


def kept_params() -> dict[str, str]:
    """The query parameters every page keeps when another is opened: the access token of a server serving others
    (:mod:`oodviz.ui.access`), so that a link still opens the app."""
    return {"token": st.query_params["token"]} if "token" in st.query_params else {}


def go(name: str, **params: str | None) -> None:
    """Open page ``name`` with ``params`` as its query string (those not None or empty; and :func:`kept_params`);
    stops this script run."""
    st.switch_page(page(name), query_params={**kept_params(), **{k: v for k, v in params.items() if v}})


def open_run(run_id: str) -> None:
    """Show run ``run_id`` on the Run page, from its own default view (its tab, detector and threshold)."""
    go("run", run=run_id)


def open_new_run(from_run: str | None = None) -> None:
    """The New run page, its fields filled with the choices of run ``from_run`` (None: the defaults)."""
    go("new", **{"from": from_run})  # go leaves out a None


def open_compare(a: str, b: str) -> None:
    """The Compare page with runs ``a`` and ``b``."""
    go("compare", a=a, b=b)


def url_written_key(key: str) -> str:
    """Where the value that widget ``key`` last wrote to the URL is kept (see :func:`url_widget_key`)."""
    return f"{key}-in-url"


def url_widget_key(key: str, asked: str | None, options: list[str], fallback: str) -> str:
    """``key``, the key of a selectbox over ``options`` whose value is in the URL (``asked``): its state set to
    ``asked`` when the URL names another value than the one the page last wrote there (a link, a reload, the browser's
    back button) or the widget has no state yet, else kept; ``fallback`` when neither names one of ``options``. The
    page writes the value chosen to the URL and to :func:`url_written_key` after the widget.

    One key whatever the URL says: a key made of the URL's value changed with each pick (the page writes the pick to
    the URL), making a new widget on the next rerun that showed the URL's value, and that pick was lost."""
    if asked in options and (asked != st.session_state.get(url_written_key(key)) or key not in st.session_state):
        st.session_state[key] = asked
    elif st.session_state.get(key) not in options:
        st.session_state[key] = fallback
    return key
