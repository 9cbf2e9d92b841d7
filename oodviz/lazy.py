"""Lazy package facades: a package names its public objects and the submodule of each, and imports a submodule
only when one of its names is first used, so that torch-free layers can import the package (``from oodviz import
detectors``) and reach a name only when they need it.

```python
_SOURCES = {"registry": ("available", "create"), "knn": ("KNN",)}
__getattr__ = lazy_attributes(__name__, _SOURCES, globals())
```
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_attributes(package: str, sources: Mapping[str, tuple[str, ...]], namespace: dict) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: a name of ``sources`` (submodule -> its public names) is imported
    from ``package.<submodule>`` on first use and kept in ``namespace`` (the package's globals); any other name is an
    AttributeError, as for a plain module."""
    module_of = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str):
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module_of[name]}"), name)
        namespace[name] = value
        return value

    return __getattr__
