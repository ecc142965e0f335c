"""The house's rules that a reader relies on: modules that do not import each other in
circles, and modules small enough to read in one sitting.

Both read the real source files; the cycle check parses them with ``ast``, so an import
hidden inside a function (the usual way to break a cycle at run time without removing
it) still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The folders that are the product (tests and tooling outside them are not).
PRODUCT = ("meshd", "clients", "daemon", "native", "plugins", "policy", "protocol")
MAX_LINES = 600


def package_imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (a folder such as ``daemon/bench``, not recursing) and
    the modules of the same package it imports anywhere in its body: at the top, in
    functions, under ``TYPE_CHECKING``."""
    folder = ROOT / package
    modules = {path.stem for path in folder.glob("*.py")}
    prefix = "meshd." + package.replace("/", ".") + "."
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name.removeprefix(prefix) for a in node.names
                           if a.name.startswith(prefix)]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:
                    targets = [node.module]
                elif node.level == 1:  # from . import x
                    targets = [a.name for a in node.names]
                elif node.level == 0 and node.module and node.module.startswith(prefix):
                    targets = [node.module.removeprefix(prefix)]
                elif node.level == 0 and node.module == prefix[:-1]:
                    targets = [a.name for a in node.names]
            edges.update(t.split(".")[0] for t in targets)
        graph[path.stem] = {m for m in edges if m in modules and m != path.stem}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", [
    "clients", "daemon", "daemon/bench", "daemon/http", "native", "plugins", "policy",
    "protocol",
])
def test_no_import_cycle_inside_package(package: str) -> None:
    assert cycles(package_imports(package)) == []


def test_no_product_module_over_600_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for folder in PRODUCT
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
