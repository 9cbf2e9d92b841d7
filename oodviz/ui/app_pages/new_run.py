"""The New run page: :func:`oodviz.ui.new_run.new_run_page`."""

from oodviz.ui.new_run import new_run_page

new_run_page()
