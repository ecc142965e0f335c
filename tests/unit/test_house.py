"""The house's rules that a reader relies on: modules that do not import each other in
circles, a scheduler that leaves every step of a generation to the engine, and a product
that does not depend on its tooling. (How long a module is follows from its one concept;
a review, not a line count, asks for a split.)

All read the real source files; the cycle check parses them with ``ast``, so an import
hidden inside a function (the usual way to break a cycle at run time without removing
it) still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The folders that are the product (tests and tooling outside them are not).
PRODUCT = ("meshd", "clients", "daemon", "native", "plugins", "policy", "protocol")
#: The folders that are tooling (benchmarks, soak, synthetic models): they may import the
#: product, not the other way round.
TOOLING = ("bench", "testing")


def package_imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (a folder such as ``daemon/engine``, not recursing) and
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


#: Every package folder of the product and the tooling (daemon/'s layers included).
PACKAGES = sorted(
    str(init.parent.relative_to(ROOT))
    for room in PRODUCT + TOOLING if room != "meshd"
    for init in (ROOT / room).rglob("__init__.py")
)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_package(package: str) -> None:
    assert cycles(package_imports(package)) == []


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
    path = ROOT / "daemon" / "models" / "scheduler.py"
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


#: The one product module that may import the tooling, and only inside a function body
#: (never at module level, in a class body or under ``TYPE_CHECKING``): ``meshd bench*`` and
#: ``meshd soak`` are subcommands of ``meshd``, loaded when their parser is built or run.
LAZY_TOOLING_IMPORTERS = {"daemon/commands/cli.py"}
_TOOLING_PACKAGES = tuple(f"meshd.{room}" for room in TOOLING)


def tooling_imports(source: str, module: str) -> list[tuple[int, bool]]:
    """``(line, inside a function)`` for each import of the tooling (``meshd.bench``,
    ``meshd.testing``: absolute, relative or ``from meshd import bench``) in ``source``,
    the text of the module named ``module`` (for example ``meshd.daemon.commands.cli``)."""
    package = module.split(".")[:-1]
    found: list[tuple[int, bool]] = []

    def names(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = package[:len(package) - node.level + 1] if node.level else []
        stem = ".".join([*base, *([node.module] if node.module else [])])
        return [stem, *(f"{stem}.{a.name}" for a in node.names)]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom) and any(
                    n == room or n.startswith(room + ".")
                    for n in names(child) for room in _TOOLING_PACKAGES):
                found.append((child.lineno, in_function))
            visit(child, in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(source), False)
    return found


def test_tooling_import_finder_sees_every_form() -> None:
    source = (
        "import meshd.bench.run\n"
        "from meshd import bench\n"
        "from ...bench.cli import add_arguments\n"
        "from .benchmarks import x\n"
        "import meshd.benchmarks\n"
        "class C:\n"
        "    from meshd.bench import soak\n"
        "def f():\n"
        "    from meshd.bench.soak import run\n"
        "from meshd.testing import testmodels\n"
        "import meshd.testingx\n"
    )
    assert tooling_imports(source, "meshd.daemon.commands.cli") == [
        (1, False), (2, False), (3, False), (7, False), (9, True), (10, False)]


def test_product_does_not_import_the_tooling() -> None:
    """No product module imports the tooling (benchmarks, soak, synthetic models), anywhere
    in its body; the daemon's CLI alone may, inside the functions that add and run those
    subcommands."""
    bad = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            parts = rel.with_suffix("").parts
            module = ".".join(parts if folder == "meshd" else ("meshd", *parts))
            for line, in_function in tooling_imports(path.read_text(), module):
                if not (in_function and str(rel) in LAZY_TOOLING_IMPORTERS):
                    bad.append(f"{rel}:{line}")
    assert bad == []
