"""The Streamlit app. ``APP_SCRIPT`` is its entry script, shipped inside the package so that an installed
wheel can serve it: ``oodviz app``, ``make app`` and the repository's ``app.py`` all run this one file."""

from pathlib import Path

APP_SCRIPT = Path(__file__).resolve().parent / "app.py"


def streamlit_has_option(name: str) -> bool:
    """Whether the installed Streamlit knows config option ``name`` (e.g. ``server.allowedHosts``, recent)."""
    from streamlit import config

    try:
        config.get_option(name)
    except RuntimeError:  # Streamlit's "Config key ... not defined"
        return False
    return True
