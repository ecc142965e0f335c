"""The fast tier: tests that need neither llama.cpp nor a model (the inner loop:
``pytest tests/unit``). Run alone, the tier fails if anything it ran imported llama_cpp,
so a test that needs the runtime cannot slip in here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    items = getattr(session, "items", [])
    alone = items and all(Path(str(item.path)).is_relative_to(HERE) for item in items)
    if alone and "llama_cpp" in sys.modules:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("tests/unit imported llama_cpp: a test here needs the "
                                "runtime (move it out of tests/unit)", red=True)
