"""The distribution: one wheel named meshd holding the five meshd.* packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_names_live_under_one_namespace() -> None:
    code = "import meshd.clients, meshd.daemon, meshd.native, meshd.plugins, meshd.protocol"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.slow
def test_wheel_contains_all_packages_and_entry_points(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         str(ROOT), "-w", str(tmp_path)],
        check=True, capture_output=True, cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("meshd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in ("clients", "daemon", "native", "plugins", "protocol"):
        assert f"meshd/{pkg}/__init__.py" in names
        assert f"meshd/{pkg}/py.typed" in names
    assert "meshd/__main__.py" in names  # python -m meshd
    assert not any(n.startswith(("daemon/", "protocol/")) for n in names), "bare top-level name"
    assert "meshd/protocol/PROTOCOL.md" in names
    assert "meshd/daemon/workloads/code-edit.json" in names  # bench workloads are data
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for name in ("mtp", "ngram", "composite", "draft"):
        assert f"{name} = meshd.plugins." in text
    assert "meshd = meshd.daemon.cli:main" in text
    assert "meshctl = meshd.clients.ctl:main" in text
