"""The house's rules that a reader relies on: modules that do not import each other in
circles, modules small enough to read in one sitting, and a scheduler that leaves every
step of a generation to the engine.

All read the real source files; the cycle check parses them with ``ast``, so an import
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


def session_methods() -> set[str]:
    """The public methods of ``SequenceSession`` (from its source; not its properties)
    plus ``verify_many``; ``open``/``close`` are too generic a name to tell."""
    path = ROOT / "native" / "session.py"
    (cls,) = [node for node in ast.parse(path.read_text(), str(path)).body
              if isinstance(node, ast.ClassDef) and node.name == "SequenceSession"]
    methods = {node.name for node in cls.body
               if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
               and not any(isinstance(d, ast.Name) and d.id == "property"
                           for d in node.decorator_list)}
    return (methods - {"open", "close"}) | {"verify_many"}


def _is_anyio(node: ast.expr) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "anyio"


def test_scheduler_never_calls_a_session() -> None:
    """The scheduler admits, delivers and counts; a step of a generation (forwards,
    verification, repairs) belongs to the engine alone."""
    methods = session_methods()
    assert {"prefill", "verify", "trim", "restore_and_replay"} <= methods
    path = ROOT / "daemon" / "scheduler.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("native.session"):
            found.append(f"line {node.lineno}: imports {node.module}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in methods and not _is_anyio(node.func.value)):
            found.append(f"line {node.lineno}: .{node.func.attr}()")
        elif isinstance(node, ast.Name) and node.id in methods:
            found.append(f"line {node.lineno}: {node.id}")
    assert found == []
