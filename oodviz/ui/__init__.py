"""The Streamlit app. ``APP_SCRIPT`` is its entry script, shipped inside the package so that an installed
wheel can serve it: ``oodviz app``, ``make app`` and the repository's ``app.py`` all run this one file."""

from pathlib import Path

APP_SCRIPT = Path(__file__).resolve().parent / "app.py"

#: Streamlit options every server of the app gets (``oodviz app``, the browser tests, ``bench/app_bench.py``):
#: no usage statistics, no first-run e-mail prompt, and no full garbage collection after each script run. That
#: collection scans every object of the server process, 0.06 s with Streamlit, pandas and plotly and 0.25 s once
#: the galleries' prefetch has imported torch and torchvision, holding the GIL while the answer to a click waits
#: to be sent; Python's own generational collections still run. The toolbar is the viewer's: no "Deploy" button
#: (to Streamlit's cloud; this app runs where its data is) and no developer menu entries.
SERVER_FLAGS = [
    "--browser.gatherUsageStats",
    "false",
    "--server.showEmailPrompt",
    "false",
    "--runner.postScriptGC",
    "false",
    "--client.toolbarMode",
    "viewer",
]


def streamlit_has_option(name: str) -> bool:
    """Whether the installed Streamlit knows config option ``name`` (e.g. ``server.allowedHosts``, recent)."""
    from streamlit import config

    try:
        config.get_option(name)
    except RuntimeError:  # Streamlit's "Config key ... not defined"
        return False
    return True
