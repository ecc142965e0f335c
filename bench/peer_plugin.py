"""A pytest plugin for running llama.cpp's server test suite offline: the suite's model
downloads are turned off (both arms are given one local model file by the launcher), and
a download the suite still attempts fails its test instead of reaching the network."""

from __future__ import annotations

import sys
import types
from typing import Any, NoReturn


def _no_download(url: str, *args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError(f"the peer suite runs offline; not downloading {url}")


def _offline_wget() -> types.ModuleType:
    module = types.ModuleType("wget")
    module.download = _no_download  # type: ignore[attr-defined]
    return module


sys.modules.setdefault("wget", _offline_wget())


def pytest_sessionstart(session: Any) -> None:
    """Skip ``ServerPreset.load_all`` (it starts every preset once to download it)."""
    utils = sys.modules.get("utils")
    if utils is not None:
        utils.ServerPreset.load_all = staticmethod(lambda: None)
