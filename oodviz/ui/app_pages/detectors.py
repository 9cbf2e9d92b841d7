"""The Detectors page: :func:`oodviz.ui.explore.detectors_page`."""

from oodviz.ui.explore import detectors_page

detectors_page()
