"""The blocking client, against the fake server running on its own loop thread."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import anyio.from_thread
import pytest

from meshd.protocol import (
    PROTOCOL_VERSION,
    ConnectionClosed,
    FinishReason,
    ServerBusy,
    SyncClient,
    UnsupportedVersion,
    connect_sync,
)

from .fake_server import FakeServer, running_server


@contextmanager
def server_thread(server: FakeServer | None = None) -> Iterator[tuple[FakeServer, str]]:
    """The fake server served from a separate event-loop thread."""
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(running_server(server)) as (srv, path),
    ):
        yield srv, path


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``condition`` (set from the server thread) until true or fail."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("condition not met in time")
        time.sleep(0.005)


@pytest.fixture(params=["asyncio", "trio"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_sync_generate_and_requests(backend: str) -> None:
    with server_thread() as (_, path), connect_sync(path, backend=backend) as c:
        assert c.welcome.model.name == "fake-model"
        with c.generate("hi") as stream:
            assert [t.text for t in stream] == ["hi:0", "hi:1", "hi:2"]
        assert stream.done is not None
        assert stream.done.finish_reason is FinishReason.STOP
        assert stream.text == "hi:0hi:1hi:2"
        assert c.tokenize("a", add_special=False) == (97,)
        assert c.detokenize([98]) == "b"
        assert c.health().active_requests == 0
        assert c.stats().uptime_s == 1.5
        assert c.models()[0].n_ctx == 4096
        assert c.generate("x", max_tokens=1).collect().text == "x:0"


def test_sync_early_close_sends_cancel(backend: str) -> None:
    with server_thread() as (server, path), connect_sync(path, backend=backend) as c:
        with c.generate("slow") as stream:
            for token in stream:
                if token.text == "slow:1":
                    break
        wait_until(lambda: bool(server.cancelled))
        assert server.cancelled == [stream.id]


def test_sync_explicit_cancel(backend: str) -> None:
    with server_thread() as (_, path), connect_sync(path, backend=backend) as c:
        with c.generate("slow", request_id="s1") as stream:
            next(stream)
            c.cancel("s1")
            for _ in stream:
                pass
        assert stream.done is not None
        assert stream.done.finish_reason is FinishReason.CANCELLED


def test_sync_error_and_version(backend: str) -> None:
    with server_thread() as (_, path):
        with SyncClient.connect(path, backend=backend) as c, pytest.raises(ServerBusy):
            list(c.generate("error:busy"))
        with pytest.raises(ConnectionClosed):
            c.health()
    with (
        server_thread(FakeServer(protocol_version=PROTOCOL_VERSION + 1)) as (_, path),
        pytest.raises(UnsupportedVersion),
    ):
        SyncClient.connect(path, backend=backend)
