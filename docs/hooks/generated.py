"""MkDocs hooks: the pages' generated parts, read from the code at build time so that they cannot drift.

- ``<!-- oodviz:detector-table -->`` becomes the table of every detector of :func:`oodviz.detectors.available`
  (parameters from each class's constructor, its default tuning grid, summary and paper), and
  ``<!-- oodviz:detector-cards -->`` one section per detector (formula, what it reads, when it fails), from
  :func:`oodviz.detectors.describe`;
- ``<!-- oodviz:cli-help -->`` becomes the ``--help`` of every ``oodviz`` command, from the CLI's own parser;
- KaTeX (bundled with the package, ``oodviz/katex``) is added to the site, so formulas are typeset offline, and
  the screenshots of ``assets/`` (the README's) without a copy in ``docs/``.

``detector_table()`` and ``cli_help()`` need no MkDocs: the tests read them too (tests/test_docs.py).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # document this checkout's oodviz, whichever one the environment has installed
    sys.path.insert(0, str(REPO))
DETECTOR_TABLE = "<!-- oodviz:detector-table -->"
DETECTOR_CARDS = "<!-- oodviz:detector-cards -->"
CLI_HELP = "<!-- oodviz:cli-help -->"
DETECTOR_API = "<!-- oodviz:detector-api -->"
LAYOUT = "<!-- oodviz:layout -->"
#: The commands whose help the CLI page shows, in the order it shows them.
CLI_COMMANDS = (
    ("run",),
    ("runs",),
    ("app",),
    ("score",),
    ("report",),
    ("project",),
    ("store", "list"),
    ("store", "verify"),
)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _parameters(cls) -> str:
    """``name=default`` for each constructor parameter (the model, a run's own, left out)."""
    signature = inspect.signature(cls.__init__)
    shown = []
    for name in cls.param_names():
        if name == "model":
            continue
        default = signature.parameters[name].default
        shown.append(f"`{name}`" if default is inspect.Parameter.empty else f"`{name}={default!r}`")
    return ", ".join(shown)


def _grid(cls) -> str:
    """``` `key`: v1, v2; `key2`: ... ``` (the form a config's ``grid`` takes), or — for none."""
    return "; ".join(f"`{key}`: {', '.join(map(str, values))}" for key, values in cls.default_grid.items()) or "—"


def _paper_link(url: str) -> str:
    label = url.rsplit("/", 1)[-1] if "arxiv.org" in url else url.split("//", 1)[-1].split("/", 1)[0]
    return f"[{label}]({url})"


def detector_table() -> str:
    """The Markdown table of every detector: one row ``| `name` | parameters | default grid | score | in the
    default list | paper |``, in :func:`oodviz.detectors.available` order."""
    from oodviz.detectors import available, detector_class

    lines = [
        "| name | parameters | default grid (tuning) | score (higher = more OOD) | default list | paper |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in available():
        cls = detector_class(name)
        row = (
            f"[`{name}`](#{name})",
            _parameters(cls),
            _grid(cls),
            _cell(cls.summary),
            "yes" if cls.in_defaults else "no",
            _paper_link(cls.paper),
        )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def detector_cards() -> str:
    """One section per detector: its formula (typeset), what it reads and fits, when it fails, its paper."""
    from oodviz.detectors import available, describe, detector_class

    out = []
    for name in available():
        cls = detector_class(name)
        facts = describe(name)
        needs = [
            label
            for label, flag in (
                ("labels", facts["needs_labels"]),
                ("the head", facts["needs_head"]),
                ("the model", facts["needs_model"]),
            )
            if flag
        ]
        out += [
            f"### `{name}` {{ #{name} }}",
            "",
            f"{facts['summary']}",
            "",
            f"$$\n{facts['formula']}\n$$",
            "",
            f"- **Reads:** {facts['reads']} (batch fields: {', '.join(f'`{i}`' for i in facts['inputs'])}"
            + (f"; needs {', '.join(needs)}" if needs else "")
            + ").",
            f"- **Parameters:** {_parameters(cls) or 'none'}. **Default grid:** {_grid(cls)}.",
            f"- **Fails when:** {facts['fails_when']}",
            f"- **Paper:** {facts['citation']}, <{facts['paper']}>",
            f"- **Class:** [`{cls.__module__}.{cls.__name__}`][{cls.__module__}.{cls.__name__}]",
            "",
        ]
    return "\n".join(out)


def detector_api() -> str:
    """A mkdocstrings block per detector module, in :func:`oodviz.detectors.available` order."""
    from oodviz.detectors import available, detector_class

    # a detector class often has no docstring of its own (the module's gives the formula): shown anyway
    options = "\n    options:\n      show_if_no_docstring: true\n      heading_level: 2"
    return "\n\n".join(f"::: {detector_class(name).__module__}{options}" for name in available())


def _first_line(path: Path) -> str:
    """The first sentence line of a module's docstring (read with ast: nothing is imported)."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    import re

    line = doc.strip().split("\n\n", 1)[0].replace("\n", " ").replace("``", "`")
    return re.sub(r":(?:func|class|mod|meth|attr|data|exc):`~?([\w.]+)`", r"`\1`", line)


def layout() -> str:
    """The package's modules layer by layer, from the ground up, in the order of the import contract in
    pyproject.toml (``[tool.importlinter]``, checked in CI), each with its docstring's first paragraph."""
    import tomllib

    layers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    out = []
    for layer in reversed(layers):
        out += [f"### {' · '.join(f'`{name.strip()}`' for name in layer.split('|'))}", ""]
        for name in (part.strip() for part in layer.split("|")):
            path = REPO / name.replace(".", "/")
            modules = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
            for module in modules:
                relative = module.relative_to(REPO).as_posix()
                out.append(f"- `{relative}`: {_first_line(module)}")
        out.append("")
    return "\n".join(out)


def cli_help() -> str:
    """Each command's ``--help``, as the CLI's own argparse parser prints it."""
    from oodviz import cli

    out = []
    for command in CLI_COMMANDS:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
            cli.main([*command, "--help"])
        text = buffer.getvalue().replace("usage: ", "", 1).rstrip()
        out += [f"### `oodviz {' '.join(command)}`", "", "```text", text, "```", ""]
    return "\n".join(out)


# -- MkDocs hooks ---------------------------------------------------------------------------------------------------
def on_page_markdown(markdown: str, page, config, files) -> str:
    if DETECTOR_TABLE in markdown:
        markdown = markdown.replace(DETECTOR_TABLE, detector_table())
    if DETECTOR_CARDS in markdown:
        markdown = markdown.replace(DETECTOR_CARDS, detector_cards())
    if DETECTOR_API in markdown:
        markdown = markdown.replace(DETECTOR_API, detector_api())
    if LAYOUT in markdown:
        markdown = markdown.replace(LAYOUT, layout())
    if CLI_HELP in markdown:
        markdown = markdown.replace(CLI_HELP, cli_help())
    return markdown


def on_files(files, config):
    """KaTeX from the package (``oodviz/katex``): the site's math is typeset offline, as the report's is."""
    from mkdocs.structure.files import File

    katex = REPO / "oodviz" / "katex"
    for path in sorted(katex.rglob("*")):
        if path.is_file() and path.suffix in (".js", ".css", ".woff2"):
            uri = "katex/" + path.relative_to(katex).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    for path in sorted((REPO / "assets").rglob("*.png")):  # the README's screenshots, not copied into docs/
        files.append(File.generated(config, path.relative_to(REPO).as_posix(), abs_src_path=str(path)))
    return files
