"""Keyword parameters checked against the signature of the function that takes them, before it runs.

:func:`param_problems` is how a run config's dataset and detector parameters are checked before any
work: unknown names, values of the wrong type, numbers that are not finite, negative counts. A
parameter's type is its annotation (``k: int = 50``, ``path: str | None = None``,
``size: int | tuple[int, int]``), else nothing is assumed; an integer parameter whose default is
positive takes positive values, one whose default is 0 takes values >= 0 (counts, sizes, seeds).
``bool`` is not an integer here, an ``int`` is accepted where a ``float`` is asked for, and a JSON
list where a ``tuple`` is.
"""

from __future__ import annotations

import inspect
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass

_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "a table",
    list: "a list",
    type(None): "null",
}


def shown(value) -> str:
    """``value`` as a config file spells it (``true``, ``null``, ``"text"``, ``Infinity``), else its repr."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def non_finite(value, where: str) -> list[str]:
    """One problem per number inside ``value`` (nested lists and tables too) that is NaN or infinite."""
    found, pending = [], [(where, value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            found.append(f"{path} must be a finite number, got {shown(item)}")
        elif isinstance(item, Mapping):
            pending.extend((f"{path}.{key}", v) for key, v in reversed(list(item.items())))
        elif isinstance(item, (list, tuple)):
            pending.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return found


def matches(value, annotation) -> bool:
    """Whether ``value`` fits ``annotation`` (a type, a union, ``tuple[...]``, ``list[...]``); unknown
    annotations (a class of the library, ``typing.Any``) accept anything."""
    if annotation is None or annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, option) for option in typing.get_args(annotation))
    if origin in (tuple, list):
        args = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
        return not args or all(matches(v, args[0]) for v in value)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation in (dict, list):
        return isinstance(value, annotation)
    return True


def describe(annotation) -> str:
    """``int | None`` -> ``"an integer or null"``; ``tuple[int, int]`` -> ``"a list of 2 integers"``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(option) for option in typing.get_args(annotation))
    if origin in (tuple, list):
        args = typing.get_args(annotation)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} {describe(args[0]).removeprefix('an ').removeprefix('a ')}s"
        return "a list"
    return _NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _signature(function: Callable) -> inspect.Signature:
    try:
        return inspect.signature(function, eval_str=True)
    except (NameError, TypeError, SyntaxError):  # an annotation naming what is not importable here
        return inspect.signature(function)


def param_problems(
    function: Callable, params: Mapping, where: str, skip: tuple[str, ...] = (), signs: bool = True
) -> list[str]:
    """Every problem with calling ``function(**params)`` that its signature shows; ``where`` prefixes
    each message, ``skip`` names parameters the caller supplies itself (``root``, ``self``), ``signs=False``
    leaves the signs of integers to ``function`` (a constructor that checks its values itself)."""
    if not isinstance(params, Mapping):
        return [f"{where}: params must be a table of name = value, got {shown(params)}"]
    accepted = {
        name: p
        for name, p in _signature(function).parameters.items()
        if name not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    unknown = [str(name) for name in params if name not in accepted]
    found = []
    if unknown:
        valid = ", ".join(accepted) or "none"
        found.append(f"{where} has no parameter(s) {', '.join(sorted(unknown))}; its parameters: {valid}")
    for name, value in params.items():
        if name not in accepted:
            continue
        parameter = accepted[name]
        annotation, default = parameter.annotation, parameter.default
        if non_finite(value, name):
            found.extend(f"{where}: {problem}" for problem in non_finite(value, name))
        elif annotation is not parameter.empty and not matches(value, annotation):
            found.append(f"{where}: {name} must be {describe(annotation)}, got {shown(value)}")
        elif signs and matches(value, int) and matches(default, int) and value < min(default, 1):
            minimum = min(default, 1)
            found.append(f"{where}: {name} must be {'positive' if minimum else '>= 0'}, got {value}")
    return found


@dataclass(frozen=True)
class ParamField:
    """How the form edits one detector parameter: ``kind`` is ``"int"``, ``"float"`` (``optional``: blank =
    the detector's automatic choice, None), ``"bool"`` or ``"choice"`` (one of ``choices``)."""

    name: str
    kind: str
    default: object
    optional: bool = False
    choices: tuple = ()


def editable_fields(cls) -> list[ParamField]:
    """The parameters of class ``cls`` (a detector: its ``param_names()`` and ``param_choices``) a browser user may
    edit, from its constructor's signature: numbers (also ``int | None``), booleans and the strings of
    ``param_choices``. Paths (``bank_dir``), module names, lists and the model are left to config files. The app's
    form reads them from :mod:`oodviz.config.catalog` (no torch import)."""
    try:
        parameters = inspect.signature(cls.__init__, eval_str=True).parameters
    except (NameError, TypeError):
        parameters = inspect.signature(cls.__init__).parameters
    fields = []
    for name in cls.param_names():
        parameter = parameters[name]
        annotation, default = parameter.annotation, parameter.default
        options = (
            set(typing.get_args(annotation))
            if typing.get_origin(annotation) in (typing.Union, types.UnionType)
            else set()
        )
        if name in cls.param_choices:
            fields.append(ParamField(name, "choice", default, choices=tuple(cls.param_choices[name])))
        elif annotation is bool or isinstance(default, bool):
            fields.append(ParamField(name, "bool", bool(default)))
        elif annotation in (int, float) or (annotation is parameter.empty and type(default) in (int, float)):
            number = annotation if annotation in (int, float) else type(default)
            fields.append(ParamField(name, number.__name__, default))
        elif options in ({int, type(None)}, {float, type(None)}):
            kind = "int" if int in options else "float"
            fields.append(ParamField(name, kind, default, optional=True))
    return fields
