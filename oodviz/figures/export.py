"""Figures as PNG and SVG files, drawn by kaleido 1.x in the system's Chromium (``pip install 'oodviz[export]'``).

kaleido 1.x renders a plotly figure in a headless Chrome/Chromium it drives through the DevTools protocol
(choreographer); it downloads no browser here: the browser is ``OODVIZ_CHROMIUM`` when set, else the first
of ``chromium``, ``chromium-browser``, ``google-chrome`` on ``PATH`` (Debian's package installs
``/usr/bin/chromium``). The page kaleido draws in loads plotly.js from the installed plotly package and no
MathJax (oodviz's figures have no LaTeX), so an export needs no network.

:func:`export_problem` says why exports cannot work here (``None`` when they can, found by exporting a
one-bar figure once per process), so that the app and the report offer the downloads only then.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import plotly.graph_objects as go

FORMATS = ("png", "svg")
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT_S = 90


def browser_path() -> str | None:
    """The Chromium kaleido drives: ``OODVIZ_CHROMIUM`` when set, else the first of :data:`BROWSERS` on PATH."""
    return os.environ.get("OODVIZ_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)


def kaleido_problem() -> str | None:
    """Why kaleido cannot be used (not installed, or older than 1.0), else ``None``; runs no browser."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("kaleido")
    except PackageNotFoundError:
        return "kaleido is not installed (pip install 'oodviz[export]')"
    if int(installed.split(".")[0]) < 1:
        return f"kaleido {installed} is too old: oodviz needs kaleido 1.x (pip install 'oodviz[export]')"
    if browser_path() is None:
        return "no Chromium found (apt-get install chromium, or set OODVIZ_CHROMIUM to a Chrome/Chromium binary)"
    return None


async def _render(figures: list[go.Figure], formats, width, height, scale) -> list[dict[str, bytes]]:
    from kaleido import Kaleido

    async with Kaleido(n=1, timeout=TIMEOUT_S, path=browser_path(), mathjax=False) as kaleido:
        rendered = []
        for fig in figures:
            size = {"width": width or fig.layout.width or 900, "height": height or fig.layout.height or 500}
            rendered.append(
                {fmt: await kaleido.calc_fig(fig, opts={"format": fmt, "scale": scale, **size}) for fmt in formats}
            )
        return rendered


def figure_images(
    figures: list[go.Figure], formats=FORMATS, width: int | None = None, height: int | None = None, scale: float = 1
) -> list[dict[str, bytes]]:
    """Each figure of ``figures`` as ``{format: bytes}`` for each of ``formats`` (``"png"``, ``"svg"``), drawn
    ``width x height`` CSS pixels (default: the figure's own size, else 900 x 500) times ``scale`` (PNG), all
    in one browser session. RuntimeError saying why when kaleido or the browser cannot draw them."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ValueError(f"formats must be among {', '.join(FORMATS)}, got {', '.join(unknown)}")
    problem = kaleido_problem()
    if problem:
        raise RuntimeError(problem)
    with ThreadPoolExecutor(1) as pool:  # a loop of its own, whether or not the caller's thread runs one
        try:
            return pool.submit(asyncio.run, _render(list(figures), tuple(formats), width, height, scale)).result()
        except Exception as error:
            raise RuntimeError(f"kaleido could not draw the figure with {browser_path()}: {error}") from error


@functools.cache
def export_problem() -> str | None:
    """Why figures cannot be exported here, else ``None``: :func:`kaleido_problem`, then a one-bar figure
    really exported (once per process: the browser may be there and still fail to start)."""
    problem = kaleido_problem()
    if problem:
        return problem
    try:
        figure_images([go.Figure(go.Bar(x=[0], y=[1]))], ("png",), width=64, height=64)
    except RuntimeError as error:
        return str(error)
    return None
