"""The distribution: one wheel named meshd holding the five meshd.* packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    """A subpackage missing from pyproject's list imports in a source checkout but is left
    out of the wheel: every folder with an ``__init__.py`` must be listed (except inside
    an example plugin, a distribution of its own with its own ``pyproject.toml``)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            if any((ROOT / folder).joinpath(*parts[:i], "pyproject.toml").exists()
                   for i in range(len(parts) + 1)):
                continue
            assert ".".join((name, *parts)) in listed, f"{init.parent} is not packaged"


def test_import_names_live_under_one_namespace() -> None:
    code = ("import meshd.clients, meshd.daemon, meshd.native, meshd.plugins, meshd.policy, "
            "meshd.protocol")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.slow
def test_wheel_contains_all_packages_and_entry_points(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes its build/ beside the sources, and one left in
    # the working tree would hold stale copies of every module.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".mypy_cache", ".ruff_cache"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         str(source), "-w", str(tmp_path)],
        check=True, capture_output=True, cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("meshd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in ("bench", "clients", "daemon", "native", "plugins", "policy", "protocol",
                "testing"):
        assert f"meshd/{pkg}/__init__.py" in names
        assert f"meshd/{pkg}/py.typed" in names
    assert "meshd/__main__.py" in names  # python -m meshd
    for init in sorted((ROOT / "daemon").rglob("__init__.py")):  # every layer's package
        assert f"meshd/{init.relative_to(ROOT)}" in names
    bare = ("bench/", "daemon/", "protocol/", "testing/")
    assert not any(n.startswith(bare) for n in names), "bare top-level name"
    assert "meshd/protocol/PROTOCOL.md" in names
    assert "meshd/bench/soak/__init__.py" in names
    assert "meshd/bench/workloads/code-edit.json" in names  # bench workloads are data
    assert not any(n.startswith("meshd/daemon/bench") for n in names)
    assert "meshd/testing/testmodels.py" in names  # meshd make-test-model
    assert not any(n.startswith("meshd/native/test") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for name in ("mtp", "ngram", "composite", "draft", "history"):
        assert f"{name} = meshd.plugins." in text
    assert "meshd = meshd.daemon.commands.cli:main" in text
    assert "meshctl = meshd.clients.ctl:main" in text
