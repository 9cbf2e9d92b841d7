"""The app's server process: ``python -m oodviz.ui.serve [options]`` is ``streamlit run <the app> [options]``
with the app's modules imported while the server starts.

Streamlit executes the app's script only when the first browser connects, so a server started from
``streamlit run`` imports the pages (pandas, plotly, the New run form, the results tabs) during the first page
load (1.2 s of a 3.2 s cold first load on a quiet 2-core machine), and the results tabs' torch, torchvision and
scikit-learn in background threads after it, while the user clicks the first tabs. Here a thread imports them
beside Streamlit's start-up (:data:`PAGE_MODULES`, then :data:`TAB_MODULES`), prints when it is done, and hides
what it imported from the garbage collector (``gc.freeze``: the ~500k objects of those modules are never garbage,
and a full collection that scans them holds the GIL for 0.25 s). A browser that connects earlier waits only for
what is left. Everything else is Streamlit's own command line, in this process.

The app's websocket opens only from the app's own origin (:func:`own_origin_websockets`).
"""

from __future__ import annotations

import gc
import importlib
import sys
import threading
import time

from oodviz.ui import APP_SCRIPT, streamlit_has_option

#: What the app's pages import at their first draw: the New run page, a run's results, the live panel, and what
#: those import lazily when they first draw (the page icon's emoji table, scores.parquet's reader, the metrics
#: table's Styler and its jinja2: 0.2-0.3 s of a first run's page otherwise).
PAGE_MODULES = (
    "oodviz.ui.main",
    "oodviz.ui.new_run",
    "oodviz.ui.run_page",
    "oodviz.ui.history",
    "oodviz.ui.compare",
    "streamlit.emojis",
    "pyarrow.parquet",
    "pandas.io.formats.style",
)
#: What the results tabs import later: the galleries' datasets (torch, torchvision; ``torchvision.datasets`` is
#: imported only when a dataset is first opened: 2 s of a core, which the galleries' prefetch thread otherwise
#: spends during a run's first page, holding the GIL), the ROC / PR curves.
TAB_MODULES = ("oodviz.data", "torchvision.datasets", "sklearn.datasets", "sklearn.model_selection", "sklearn.metrics")
READY = "oodviz app: ready"
#: The modules of Streamlit's websocket handlers (its Starlette server, the Tornado one of older versions): each lets
#: in the page's own origin (the ``Origin`` header's host:port is the ``Host`` header) and asks the
#: ``is_url_from_allowed_origins`` it imported about any other.
WEBSOCKET_HANDLERS = (
    "streamlit.web.server.starlette.starlette_websocket",
    "streamlit.web.server.browser_websocket_handler",
)


def import_app() -> None:
    """Import :data:`PAGE_MODULES` and :data:`TAB_MODULES` once Streamlit's runtime exists (their ``st.cache_data``
    functions are then declared on its cache storage, as when a script run imports them), freeze them out of
    the garbage collector's sight and print :data:`READY`."""
    from streamlit import runtime

    while not runtime.exists():
        time.sleep(0.02)
    started = time.perf_counter()
    for name in PAGE_MODULES + TAB_MODULES:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    print(
        f"{READY} (the pages, torch, torchvision and scikit-learn imported in {time.perf_counter() - started:.1f} s)",
        flush=True,
    )


def listed_origin(origin: str) -> bool:
    """Whether a websocket from ``origin``, not the app's own, may open: only when it is listed whole
    (``scheme://host:port``) in ``server.corsAllowedOrigins`` (e.g. a reverse proxy's public origin).

    Streamlit's own check compares host names only: it lets in a page from any port of localhost, 127.0.0.1,
    0.0.0.0 and the machine's addresses, so another local web server's page could drive the app."""
    from streamlit import config

    listed = config.get_option("server.corsAllowedOrigins") if streamlit_has_option("server.corsAllowedOrigins") else []
    return origin.strip() in {entry.strip() for entry in listed}


def own_origin_websockets() -> list[str]:
    """Make Streamlit's websocket handlers ask :func:`listed_origin` about a foreign origin; returns the modules
    changed (none: this Streamlit's handler is not where it was looked for, and :func:`main` warns)."""
    changed = []
    for name in WEBSOCKET_HANDLERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if hasattr(module, "is_url_from_allowed_origins"):
            module.is_url_from_allowed_origins = listed_origin
            changed.append(name)
    return changed


def main(options: list[str] | None = None) -> None:
    """Serve the app: Streamlit's ``run`` command on :data:`APP_SCRIPT` with ``options`` (default: this
    process's arguments), the app's modules imported in a background thread meanwhile."""
    from streamlit.web import cli

    if not own_origin_websockets():
        print(
            "oodviz app: WARNING this Streamlit's websocket handler was not found: a web page served from another "
            "port of this machine could open the app's websocket",
            file=sys.stderr,
            flush=True,
        )
    threading.Thread(target=import_app, name="oodviz-import-app", daemon=True).start()
    sys.argv = ["streamlit", "run", str(APP_SCRIPT), *(sys.argv[1:] if options is None else options)]
    cli.main()


if __name__ == "__main__":
    main()
