"""A griffe extension: the docstrings' Sphinx roles (``:func:`name```, ``:class:``, ``:mod:``, ``:meth:``,
``:attr:``, ``:data:``, ``:exc:``) become cross-references of the API reference, optional ones: a name the
reference does not render (a private helper, a module left out) is shown as code, without a broken link.

A leading ``~`` shows the last part only, as in Sphinx. A name without a dot is looked up next to the object
whose docstring names it (its class, then its module).
"""

from __future__ import annotations

import html
import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj):`(~?)([\w.]+)(?:\(\))?`")


def _target(obj: griffe.Object, name: str) -> str:
    if name.startswith("oodviz"):
        return name
    first = name.split(".", 1)[0]
    scope = obj if obj.is_class or obj.is_module else obj.parent
    while scope is not None:
        try:
            if first in scope.members:
                return f"{scope.path}.{name}"
        except Exception:  # an alias that cannot be resolved
            pass
        scope = scope.parent
    return name


def _replace(obj: griffe.Object, text: str) -> str:
    def link(match: re.Match) -> str:
        tilde, name = match.groups()
        shown = name.rsplit(".", 1)[-1] if tilde else name
        target = _target(obj, name)
        return f'<autoref identifier="{html.escape(target)}" optional><code>{html.escape(shown)}</code></autoref>'

    return ROLE.sub(link, text)


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = _replace(obj, obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:  # the top package is not among the objects
        self.on_object(obj=pkg)
