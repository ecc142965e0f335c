"""Helpers shared by the integration tests of every layer, and the paths they find files by."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
"""The repository's root (tests move between folders; this stays put)."""

DATA = REPO_ROOT / "tests" / "integration" / "data"
"""Recorded sessions and real chat templates the integration tests read."""

UNIT_PLUGINS = REPO_ROOT / "tests" / "unit" / "plugins"
"""Small plugin scripts (a probe, a misbehaving one) the plugin tests run as processes."""

FAKE_LLAMA_SERVER = Path(__file__).resolve().with_name("fake_llama_server.py")
"""The stand-in ``llama-server`` the bench's llama-server arms run as a process."""
