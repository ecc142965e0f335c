"""A request's cancellation is latched once: whoever cancels (the client, a disconnect,
another connection, the shutdown) sets the request's one latch, and the service, the
scheduler and the engine all read it, so a cancel is kept whenever it comes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.events import Finished, TokenEvent
from meshd.daemon.requests.inflight import InFlightGeneration
from meshd.daemon.requests.spec import RequestSpec
from meshd.policy.decision import FinishReason
from tests.integration.helpers.daemon import assert_no_leaks, wait_idle
from tests.integration.helpers.http_api import http_daemon

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, calibrate=False, threads=1))
    yield rt
    rt.close()


def _spec(request_id: str) -> RequestSpec:
    return RequestSpec(id=request_id, prompt="The three primary colours are", max_tokens=200)


async def test_a_cancel_before_the_scheduler_is_kept(smol: ModelRuntime) -> None:
    """Cancelled while it was being prepared, a request never runs: ``start`` does not
    submit it, and one submitted anyway ends ``cancelled`` without a token, its slot
    never taken (the scheduler reads the same latch)."""
    async with http_daemon(smol) as (server, _path, _http):
        service = server.service
        entry = InFlightGeneration("early")
        service.register(entry)
        try:
            entry.cancel()
            await service.start(_spec("early"), entry)
            assert entry.handle is None
            gen = await service.prepare(_spec("early"), entry)
            handle = service.submit(gen, entry)
            assert handle.cancelled
            async with handle.events:
                events = [event async for event in handle.events]
        finally:
            service.unregister(entry)
        assert not any(isinstance(e, TokenEvent) for e in events)
        assert isinstance(events[-1], Finished)
        assert events[-1].finish is FinishReason.CANCELLED
        assert events[-1].stats.emitted == 0
        await wait_idle(server)
        assert_no_leaks(server)


async def test_a_cancel_while_decoding_stops_at_the_next_step(smol: ModelRuntime) -> None:
    """Cancelled through its registration while it decodes, a request ends
    ``cancelled`` after the tokens of the step it was in (the engine reads the latch)."""
    async with http_daemon(smol) as (server, _path, _http):
        service = server.service
        entry = InFlightGeneration("late")
        service.register(entry)
        try:
            await service.start(_spec("late"), entry)
            handle = entry.handle
            assert handle is not None
            seen = 0
            async with handle.events:
                async for event in handle.events:
                    if isinstance(event, TokenEvent):
                        seen += len(event.tokens)
                        assert service.cancel_anywhere("late")
                    else:
                        final = event
        finally:
            service.unregister(entry)
        assert isinstance(final, Finished)
        assert final.finish is FinishReason.CANCELLED
        assert 0 < final.stats.emitted < 200
        await wait_idle(server)
        assert_no_leaks(server)
