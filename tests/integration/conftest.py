"""Shared fixtures: the real llama.cpp runtime with small real and synthetic models.

Models are loaded once per test session (loading is the slow part); every test opens
its own sessions and must close them, which the slot-leak check below enforces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import pytest

from tests.integration.helpers.quiet_machine import MARKER, is_xdist_worker, machine_share
from tests.integration.helpers.worker_cpus import every_cpu, pin_worker

if TYPE_CHECKING:  # imported by the fixtures: tests/unit runs without llama.cpp
    from meshd.native.context import TargetContext
    from meshd.native.model import Model


@pytest.fixture(scope="session")
def smollm2() -> Iterator[Model]:
    """The embedded default model: SmolLM2-135M-Instruct, Q4_1 (quantized)."""
    from meshd.native.default_model import default_model_path
    from meshd.native.model import Model

    model = Model.load(default_model_path())
    yield model
    model.close()


@pytest.fixture(scope="session")
def smol_ctx(smollm2: Model) -> Iterator[TargetContext]:
    """A 4-slot shared context on SmolLM2 (2048 tokens per session)."""
    from meshd.native.context import ContextConfig, TargetContext

    ctx = TargetContext(smollm2, ContextConfig(n_ctx_seq=2048, n_seq_max=4, draft_max=8))
    yield ctx
    ctx.close()


@pytest.fixture(autouse=True)
def _no_leaked_slots(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test must hand back every session slot it took on shared contexts."""
    yield
    if "smol_ctx" in request.fixturenames:
        ctx: TargetContext = request.getfixturevalue("smol_ctx")
        assert ctx.free_slots == ctx.config.n_seq_max, "a test leaked a session slot"


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist each worker keeps to its own CPUs (see helpers/worker_cpus.py); this
    runs before any test module loads llama.cpp."""
    pin_worker()


def _quiet(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker(MARKER) is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist the ``quiet_machine`` tests go first, together: one worker runs them
    back to back under one exclusive hold (:func:`pytest_runtest_protocol`), so the
    other workers wait for the machine once, not once per quiet test (each wait also
    lets the other worker's current test, up to half a minute, finish first)."""
    if is_xdist_worker():
        items[:] = [i for i in items if _quiet(i)] + [i for i in items if not _quiet(i)]


#: The exclusive hold a run of consecutive ``quiet_machine`` tests shares.
_quiet_hold: contextlib.ExitStack | None = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, object, object]:
    """Under xdist a ``quiet_machine`` test runs alone, on every CPU (see
    helpers/quiet_machine.py), holding the machine on to the next test where that one
    is quiet too; pytest calls this for every test of the run, tests/unit's too."""
    global _quiet_hold
    if not _quiet(item):
        with machine_share(exclusive=False):
            return (yield)
    if _quiet_hold is None:
        hold = contextlib.ExitStack()
        hold.enter_context(machine_share(exclusive=True))
        hold.enter_context(every_cpu())
        _quiet_hold = hold
    try:
        return (yield)
    finally:
        if not _quiet(nextitem):
            _quiet_hold.close()
            _quiet_hold = None
