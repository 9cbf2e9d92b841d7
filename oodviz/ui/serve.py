"""The app's server process: ``python -m oodviz.ui.serve [options]`` is ``streamlit run <the app> [options]``
with the app's modules imported while the server starts.

Streamlit executes the app's script only when the first browser connects, so a server started from
``streamlit run`` imports the pages (pandas, plotly, the sidebar's form, the results tabs) during the first page
load (1.2 s of a 3.2 s cold first load on a quiet 2-core machine), and the results tabs' torch, torchvision and
scikit-learn in background threads after it, while the user clicks the first tabs. Here a thread imports them
beside Streamlit's start-up (:data:`PAGE_MODULES`, then :data:`TAB_MODULES`), prints when it is done, and hides
what it imported from the garbage collector (``gc.freeze``: the ~500k objects of those modules are never garbage,
and a full collection that scans them holds the GIL for 0.25 s). A browser that connects earlier waits only for
what is left. Everything else is Streamlit's own command line, in this process.
"""

from __future__ import annotations

import gc
import importlib
import sys
import threading
import time

from oodviz.ui import APP_SCRIPT

#: What the app's pages import at their first draw: the landing page, a run's results, the live panel, and what
#: those import lazily when they first draw (the page icon's emoji table, scores.parquet's reader, the metrics
#: table's Styler and its jinja2: 0.2-0.3 s of a first run's page otherwise).
PAGE_MODULES = (
    "oodviz.ui.main",
    "oodviz.ui.results",
    "oodviz.ui.watch",
    "streamlit.emojis",
    "pyarrow.parquet",
    "pandas.io.formats.style",
)
#: What the results tabs import later: the galleries' datasets (torch, torchvision; ``torchvision.datasets`` is
#: imported only when a dataset is first opened: 2 s of a core, which the galleries' prefetch thread otherwise
#: spends during a run's first page, holding the GIL), the ROC / PR curves.
TAB_MODULES = ("oodviz.data", "torchvision.datasets", "sklearn.datasets", "sklearn.model_selection", "sklearn.metrics")
READY = "oodviz app: ready"


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


def main(options: list[str] | None = None) -> None:
    """Serve the app: Streamlit's ``run`` command on :data:`APP_SCRIPT` with ``options`` (default: this
    process's arguments), the app's modules imported in a background thread meanwhile."""
    from streamlit.web import cli

    threading.Thread(target=import_app, name="oodviz-import-app", daemon=True).start()
    sys.argv = ["streamlit", "run", str(APP_SCRIPT), *(sys.argv[1:] if options is None else options)]
    cli.main()


if __name__ == "__main__":
    main()
