"""The Run page: :func:`oodviz.ui.run_page.run_page`."""

from oodviz.ui.run_page import run_page

run_page()
