"""The Compare page: :func:`oodviz.ui.compare.compare_page`."""

from oodviz.ui.compare import compare_page

compare_page()
