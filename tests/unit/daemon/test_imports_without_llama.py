"""The engine, the requests layer and the front ends import without llama.cpp (so their
tests run against the fake runtime in this tier): every module of those layers, and the
fake itself, imported in a fresh interpreter where ``import llama_cpp`` fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LAYERS = ("engine", "requests", "frontends")


def modules() -> list[str]:
    names = []
    for layer in LAYERS:
        for path in sorted((ROOT / "daemon" / layer).rglob("*.py")):
            parts = path.relative_to(ROOT / "daemon").with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join(("meshd.daemon", *parts)))
    return [*names, "meshd.testing.fake_runtime"]


def test_the_layers_above_the_runtime_import_without_llama_cpp() -> None:
    names = modules()
    assert len(names) > 40  # the walk found the layers
    code = (
        "import importlib, sys\n"
        "sys.modules['llama_cpp'] = None  # any import of it raises ImportError\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        failed.append(f'{name}: {exc}')\n"
        "print('\\n'.join(failed))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == ""
