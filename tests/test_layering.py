"""The rooms keep their doors: protocol <- plugins <- daemon -> native, and policy (pure
computation) below plugins and daemon."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "protocol": ("meshd.native", "meshd.plugins", "meshd.daemon", "llama_cpp"),
    "native": ("meshd.daemon", "meshd.plugins", "meshd.protocol"),
    "plugins": ("meshd.native", "meshd.daemon", "llama_cpp"),
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
        for pkg in ("daemon", "native", "plugins", "policy", "protocol", "tests")
        for path in (ROOT / pkg).rglob("*.py")
        for name in imported_modules(path)
        if name.split(".")[0] in {"daemon", "native", "plugins", "policy", "protocol"}
    ]
    assert bare == []
