"""The app's server process: ``python -m oodviz.ui.serve [options]`` is ``streamlit run <the app> [options]``
with the app's own modules imported while the server starts.

Streamlit executes the app's script only when the first browser connects, so a server started from
``streamlit run`` imports the pages (pandas, plotly, the sidebar's form, the results tabs) during the first page
load: 1.2 s of a 3.2 s cold first load on a quiet 2-core machine. Here a thread imports them (:data:`PAGE_MODULES`)
beside Streamlit's start-up; a browser that connects before it has finished waits only for what is left (Python's
import lock). Everything else is Streamlit's own command line, in this process.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time

from oodviz.ui import APP_SCRIPT

#: What the app's pages import at their first draw (the landing page, a run's results, the live panel).
PAGE_MODULES = ("oodviz.ui.main", "oodviz.ui.results", "oodviz.ui.watch")


def import_pages() -> None:
    """Import :data:`PAGE_MODULES` once Streamlit's runtime exists (their ``st.cache_data`` functions are then
    declared on its cache storage, as when a script run imports them)."""
    from streamlit import runtime

    while not runtime.exists():
        time.sleep(0.02)
    for name in PAGE_MODULES:
        importlib.import_module(name)


def main(options: list[str] | None = None) -> None:
    """Serve the app: Streamlit's ``run`` command on :data:`APP_SCRIPT` with ``options`` (default: this
    process's arguments), the pages imported in a background thread meanwhile."""
    from streamlit.web import cli

    threading.Thread(target=import_pages, name="oodviz-import-pages", daemon=True).start()
    sys.argv = ["streamlit", "run", str(APP_SCRIPT), *(sys.argv[1:] if options is None else options)]
    cli.main()


if __name__ == "__main__":
    main()
