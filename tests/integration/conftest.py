"""Shared fixtures: the real llama.cpp runtime with small real and synthetic models.

Models are loaded once per test session (loading is the slow part); every test opens
its own sessions and must close them, which the slot-leak check below enforces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import pytest

from tests.integration.helpers.quiet_machine import MARKER, machine_share
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, object, object]:
    """Under xdist a ``quiet_machine`` test runs alone, on every CPU (see
    helpers/quiet_machine.py); pytest calls this for every test of the run, tests/unit's
    too."""
    quiet = item.get_closest_marker(MARKER) is not None
    with machine_share(exclusive=quiet), every_cpu() if quiet else contextlib.nullcontext():
        return (yield)
