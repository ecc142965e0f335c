"""The rooms keep their doors: protocol <- plugins <- daemon -> native, policy (pure
computation) below plugins and daemon (and below protocol, which takes its
``FinishReason`` from there), and the clients (protocol <- clients <- daemon) talk to the
daemon through its socket only. Inside ``daemon/``, layers import downward only (see
:data:`DAEMON_LAYERS`), and the two front ends never import each other."""
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
    path = ROOT / "daemon" / "models" / "scheduler.py"
    tree = ast.parse(path.read_text(), str(path))
    assert "session" not in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    native = {name for name in imported_modules(path) if name.startswith("meshd.native")}
    assert native <= {"meshd.native.errors"}


#: ``daemon/``'s layers, top first: a module imports its own layer or one below it.
#: ``config`` and ``system`` are leaves any layer may import (config reads system's
#: peer policy and log levels; system imports no other part of the daemon).
DAEMON_LAYERS = ("commands", "frontends", "requests", "models", "prompts", "engine")
DAEMON_LEAVES = {"config": ("config", "system"), "system": ("system",)}
#: Plain records of the engine's that every layer may name (statistics, log
#: probabilities, the typed request errors).
ENGINE_RECORDS = ("meshd.daemon.engine.generation_stats", "meshd.daemon.engine.logprobs",
                  "meshd.daemon.engine.request_errors")


def daemon_modules() -> dict[str, set[str]]:
    """Each module of ``daemon/`` (dotted below ``meshd.daemon``) and what it imports."""
    folder = ROOT / "daemon"
    return {".".join(path.relative_to(folder).with_suffix("").parts): imported_modules(path)
            for path in sorted(folder.rglob("*.py"))}


def upward_imports(modules: dict[str, set[str]]) -> list[str]:
    """The imports of ``modules`` (as :func:`daemon_modules` gives them) against the
    layers' direction."""
    bad = []
    for module, names in modules.items():
        layer = module.split(".")[0]
        if layer == "__init__":
            continue
        for name in names:
            if not name.startswith("meshd.daemon."):
                continue
            target = name.removeprefix("meshd.daemon.").split(".")[0]
            if layer in DAEMON_LEAVES:
                ok = target in DAEMON_LEAVES[layer]
            else:
                ok = target in DAEMON_LEAVES or (
                    DAEMON_LAYERS.index(target) >= DAEMON_LAYERS.index(layer))
            if not ok:
                bad.append(f"{module} -> {name}")
    return bad


def test_daemon_layers_import_downward_only() -> None:
    assert upward_imports(daemon_modules()) == []


def test_the_layer_check_sees_upward_and_leaf_imports() -> None:
    assert upward_imports({
        "engine.x": {"meshd.daemon.frontends.http.routes", "meshd.daemon.engine.y"},
        "models.m": {"meshd.daemon.prompts.p", "meshd.daemon.config.settings"},
        "config.c": {"meshd.daemon.models.runtime", "meshd.daemon.system.logs"},
        "system.s": {"meshd.daemon.config.options"},
    }) == ["engine.x -> meshd.daemon.frontends.http.routes",
           "config.c -> meshd.daemon.models.runtime",
           "system.s -> meshd.daemon.config.options"]


def test_front_ends_import_neither_each_other_nor_the_engine() -> None:
    """A front end turns bytes into requests and events into bytes: it never imports the
    other front end, nor the engine (but its plain records) or llama.cpp; what it needs
    of them (events, sampling, tokens, slots) comes through ``requests/``."""
    crossing, engine = [], []
    for module, names in daemon_modules().items():
        if not module.startswith("frontends."):
            continue
        side = module.split(".")[1]
        for name in names:
            if name.startswith("meshd.daemon.frontends."):
                other = name.split(".")[3]
                if other != side and other in ("http", "native"):
                    crossing.append(f"{module} -> {name}")
            elif (name.startswith(("meshd.daemon.engine", "meshd.native", "llama_cpp"))
                  and not name.startswith(ENGINE_RECORDS)):
                engine.append(f"{module} -> {name}")
    assert crossing == []
    assert engine == []
