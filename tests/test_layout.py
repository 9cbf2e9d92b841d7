"""The package layout is the data flow: the import contract (pyproject's ``[tool.importlinter]``, run by ``make lint``)
holds, fails on a planted layer breach and a planted circle, and no circle hides anywhere, function-level imports
counted. Function-level imports of oodviz's own modules stay few: each defers torch (or another heavy library) from
a module that must import without it."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
#: the most function-level imports of oodviz modules the package may hold (issue 25: at most 60)
MAX_FUNCTION_LEVEL_IMPORTS = 60


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``oodviz`` package under ``root``, with the repository's contract."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def package_copy(tmp_path) -> Path:
    """The ``oodviz`` sources copied under ``tmp_path`` (Python files only), to plant imports in."""
    shutil.copytree(REPO / "oodviz", tmp_path / "oodviz", ignore=shutil.ignore_patterns("__pycache__", "*.pt", "katex"))
    return tmp_path


def plant(path: Path, statement: str) -> None:
    """Append a function whose body is ``statement`` (an import inside a function counts as much as any)."""
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {statement}\n")


def test_the_import_contract_holds():
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "2 kept, 0 broken" in done.stdout


def test_a_lower_layer_importing_a_higher_one_breaks_the_contract(package_copy):
    plant(package_copy / "oodviz" / "config" / "run.py", "from oodviz.ui import form")
    done = lint_imports(package_copy)
    assert done.returncode == 1
    assert "oodviz.config is not allowed to import oodviz.ui" in done.stdout
    assert "oodviz.config.run -> oodviz.ui.form" in done.stdout


def test_a_circle_inside_a_package_breaks_the_contract(package_copy):
    """``config/run.py`` imports ``config/layers.py``; layers importing run back closes a circle."""
    plant(package_copy / "oodviz" / "config" / "layers.py", "from oodviz.config import run")
    done = lint_imports(package_copy)
    assert done.returncode == 1
    assert "No cycles are allowed in oodviz.config" in done.stdout


def module_imports(package: Path) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """Every import of an ``oodviz`` module by one: ``importer -> {imported}`` (module level and inside functions,
    ``if TYPE_CHECKING:`` blocks excluded), and the function-level ones as ``(importer, imported, line)``."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {name: set() for name in modules}
    inside: list[tuple[str, str, int]] = []

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(module: str, node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            function = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                targets = [f"{child.module}.{alias.name}" for alias in child.names]
            else:
                visit(module, child, function)
                continue
            found = {resolve(t) for t in targets if t.split(".")[0] == "oodviz"} - {None, module}
            edges[module] |= found
            if in_function and found:
                inside.append((module, sorted(found)[0], child.lineno))

    for module, path in modules.items():
        visit(module, ast.parse(path.read_text()), False)
    return edges, inside


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle_anywhere_counting_imports_inside_functions():
    """Stricter than the contract's per-package check: one graph of every module, a package's ``__init__`` included
    (a submodule importing its own package back closes a circle too)."""
    edges, _ = module_imports(REPO / "oodviz")
    assert circles(edges) == []
    # grimp (what lint-imports reads) sees the same modules
    graph = grimp.build_graph("oodviz", exclude_type_checking_imports=True)
    assert set(edges) == set(graph.modules)


def test_the_circle_finder_finds_a_planted_circle(package_copy):
    plant(package_copy / "oodviz" / "detectors" / "persist.py", "from oodviz.detectors import registry")
    edges, _ = module_imports(package_copy / "oodviz")
    (circle,) = circles(edges)
    assert {"oodviz.detectors.persist", "oodviz.detectors.registry"} <= set(circle)


def test_function_level_imports_of_oodviz_modules_are_few():
    _, inside = module_imports(REPO / "oodviz")
    assert len(inside) <= MAX_FUNCTION_LEVEL_IMPORTS, sorted(inside)
