"""The NDJSON connection (handshake, generate, cancel, errors attributed to their
request) against a daemon on the fake runtime."""

from __future__ import annotations

import pytest

from meshd.protocol import BadRequest, Client
from meshd.testing.fake_runtime import STORY, ToyModel
from tests.unit.daemon.fake_daemon import fake_daemon, fake_model_runtime

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_tokens_stream_in_order_and_end_with_done(monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_daemon(fake_model_runtime(monkeypatch)) as (_, path), \
            Client.connect(path, client_name="t") as client:
        stream = client.generate("Once upon", max_tokens=30, temperature=0.0)
        frames = []
        async with stream:
            async for frame in stream:
                frames.append(frame)
        assert stream.done is not None
    assert "".join(f.text for f in frames) == STORY[len("Once upon"):][:30]
    assert sum(len(f.token_ids) for f in frames) == stream.done.usage.completion_tokens == 30


async def test_a_cancelled_request_ends_early_and_the_connection_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A model that never ends: the request runs until it is cancelled.
    model = ToyModel(rule=lambda tokens: ord("a"))
    async with fake_daemon(fake_model_runtime(monkeypatch, model, n_ctx_seq=4096)) as (
            server, path), Client.connect(path, client_name="t") as client:
        stream = client.generate("go", temperature=0.0)
        async with stream:
            async for _ in stream:
                await stream.cancel()
                break
            async for _ in stream:
                pass
        assert stream.done is not None
        assert stream.done.finish_reason.value == "cancelled"
        assert stream.done.usage.completion_tokens < 4000
        again = await client.generate("go", max_tokens=3, temperature=0.0).collect()
        assert again.text == "aaa"
        assert server.service.n_inflight == 0


async def test_an_error_names_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_daemon(fake_model_runtime(monkeypatch)) as (_, path), \
            Client.connect(path, client_name="t") as client:
        with pytest.raises(BadRequest) as refused:
            await client.generate("Once upon", proposer="no-such",
                                  request_id="r-7").collect()
    assert refused.value.request_id == "r-7"
