"""Moving between the app's pages in AppTest as a link, the top bar or a button does (:mod:`oodviz.ui.navigation`).

AppTest follows a page switch the app makes (a button that opens another page) for that run only: its next ``run()``
draws the page it was last told of again. :func:`on_page` tells it, with the URL's query parameters."""

from __future__ import annotations

from pathlib import Path

from oodviz.ui.navigation import PAGES

APP = str(Path(__file__).resolve().parents[1] / "app.py")


def script(name: str) -> str:
    """The script of page ``name`` of :data:`~oodviz.ui.navigation.PAGES`, relative to ``app.py``'s folder."""
    return f"oodviz/ui/app_pages/{PAGES[name].script}"


def on_page(app, name: str, **params: str):
    """Open page ``name`` (``"new"``, ``"runs"``, ``"run"``, ``"compare"``, ``"detectors"``) with ``params`` as its URL's
    query string, as a link to it does; returns ``app`` after the run."""
    if not app._tree.children:  # AppTest knows the pages st.navigation registers after a first run
        app.run()
    app.query_params.clear()
    app.query_params.update(params)
    return app.switch_page(script(name)).run()


def widget(elements, label: str):
    """The one element of ``elements`` (``app.selectbox``, ``app.button``...) labelled ``label``."""
    [found] = [e for e in elements if e.label == label]
    return found
