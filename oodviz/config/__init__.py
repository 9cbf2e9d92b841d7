"""What a run asks for: the config dataclasses, their checks, the tuning grids, the defaults and the app's catalog.

Torch-free at import (the app's pages read configs before anything else): what needs torch (loading a model to
check a layer name, a detector's parameters) is reached through the lazy :mod:`oodviz.models` and
:mod:`oodviz.detectors` packages at call time.

- :mod:`oodviz.config.run`: :class:`RunConfig`, :class:`DatasetChoice`, :class:`DetectorChoice`, presets.
- :mod:`oodviz.config.validation`: reading config files, :class:`ConfigError`, size checks.
- :mod:`oodviz.config.tuning`: the grids a run tunes and their problems.
- :mod:`oodviz.config.layers`: the result columns a config's detectors and layers give.
- :mod:`oodviz.config.splits`: the splits a run extracts and where their stores live.
- :mod:`oodviz.config.plan`: the stages a run will go through, its headline, the config as shown.
- :mod:`oodviz.config.defaults`, :mod:`oodviz.config.catalog`: what the form offers.
"""
