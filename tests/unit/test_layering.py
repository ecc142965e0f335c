"""The rooms keep their doors: protocol <- plugins <- daemon -> native, policy (pure
computation) below plugins and daemon (and below protocol, which takes its
``FinishReason`` from there), and the clients (protocol <- clients <- daemon) talk to the
daemon through its socket only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "protocol": ("meshd.native", "meshd.plugins", "meshd.daemon", "meshd.clients", "llama_cpp"),
    "clients": ("meshd.native", "meshd.plugins", "meshd.daemon", "meshd.policy", "llama_cpp"),
    "native": ("meshd.daemon", "meshd.plugins", "meshd.protocol", "meshd.clients"),
    "plugins": ("meshd.native", "meshd.daemon", "meshd.clients", "llama_cpp"),
    # Speculation's decisions and economics: a leaf of plain computation, so it can be
    # tested exhaustively; times are handed in, never read.
    "policy": ("meshd.", "llama_cpp", "numpy", "threading", "time", "anyio", "trio",
               "asyncio", "concurrent", "socket", "os", "subprocess"),
}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layering(package: str) -> None:
    bad = [
        f"{path.name}: {name}"
        for path in sorted((ROOT / package).glob("*.py"))
        for name in imported_modules(path)
        if name.startswith(FORBIDDEN[package])
    ]
    assert bad == []


def test_no_bare_top_level_imports() -> None:
    bare = [
        f"{path.relative_to(ROOT)}: {name}"
        for pkg in ("bench", "clients", "daemon", "native", "plugins", "policy", "protocol",
                    "testing", "tests")
        for path in (ROOT / pkg).rglob("*.py")
        for name in imported_modules(path)
        if name.split(".")[0] in {"bench", "clients", "daemon", "native", "plugins", "policy",
                                  "protocol", "testing"}
    ]
    assert bare == []


def test_clients_load_without_the_daemon() -> None:
    """meshctl starts without the model runtime: no daemon modules, numpy or llama.cpp."""
    code = (
        "import sys, meshd.clients.ctl, meshd.clients.demo\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('numpy', 'llama_cpp')\n"
        "         or m.startswith(('meshd.daemon', 'meshd.native', 'meshd.plugins'))]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "[]"


def test_the_scheduler_never_touches_a_runtime_session() -> None:
    """How a step is taken is the engine's (``step_many``): the scheduler admits, delivers
    and counts. It names no session, and of native it imports only the error types."""
    path = ROOT / "daemon" / "scheduler.py"
    tree = ast.parse(path.read_text(), str(path))
    assert "session" not in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    native = {name for name in imported_modules(path) if name.startswith("meshd.native")}
    assert native <= {"meshd.native.errors"}
