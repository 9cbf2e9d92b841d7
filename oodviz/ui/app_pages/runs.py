"""The Runs page: :func:`oodviz.ui.history.runs_page`."""

from oodviz.ui.history import runs_page

runs_page()
