"""Async client against the fake server on a real Unix socket, on asyncio and trio."""

from __future__ import annotations

import os
import tempfile

import anyio
import pytest

from meshd.protocol import (
    PROTOCOL_VERSION,
    BadRequest,
    Client,
    ConnectionClosed,
    ErrorCode,
    FinishReason,
    FrameTooLarge,
    Generate,
    HealthStatus,
    InternalError,
    ModelError,
    ServerBusy,
    UnsupportedVersion,
    connect_unix,
)

from .fake_server import FakeServer, running_server

pytestmark = pytest.mark.anyio

TIMEOUT = 5


async def test_handshake_exposes_welcome() -> None:
    async with running_server() as (server, path), Client.connect(path, client_name="t") as c:
        assert c.welcome.model.name == "fake-model"
        assert c.welcome.proposers == ("ngram", "mtp")
        assert server.hellos[0].client_name == "t"
        assert server.hellos[0].protocol_version == PROTOCOL_VERSION


async def test_connect_unix_alias() -> None:
    async with running_server() as (_, path), connect_unix(path) as c:
        assert (await c.health()).status is HealthStatus.OK


async def test_streaming_generate() -> None:
    async with running_server() as (_, path), Client.connect(path) as c:
        with anyio.fail_after(TIMEOUT):
            async with c.generate("hi", max_tokens=10, temperature=0.0, stop=["x"]) as stream:
                pieces = [t.text async for t in stream]
        assert pieces == ["hi:0", "hi:1", "hi:2"]
        assert stream.text == "hi:0hi:1hi:2"
        assert stream.token_ids == (0, 1, 2)
        assert stream.done is not None
        assert stream.done.finish_reason is FinishReason.STOP
        assert stream.done.usage.completion_tokens == 3
        assert stream.done.speculation.proposer == "ngram"


async def test_generate_request_fields_reach_server() -> None:
    async with running_server() as (server, path), Client.connect(path) as c:
        stream = c.generate(
            messages=[{"role": "user", "content": "q"}],
            max_tokens=2,
            top_k=5,
            top_p=0.5,
            seed=9,
            proposer="off",
            draft_max=4,
            request_id="mine",
        )
        completion = await stream.collect()
        assert completion.text == "q:0q:1"
        assert completion.done.finish_reason is FinishReason.LENGTH
        (request,) = [r for r in server.received if isinstance(r, Generate)]
        assert request.id == "mine"
        assert request.messages is not None and request.messages[0].content == "q"
        assert (request.sampling.top_k, request.sampling.top_p, request.sampling.seed) == (
            5,
            0.5,
            9,
        )
        assert request.speculative.proposer == "off" and request.speculative.draft_max == 4


async def test_iterating_without_context_manager() -> None:
    async with running_server() as (_, path), Client.connect(path) as c:
        stream = c.generate("a")
        assert [t.text async for t in stream] == ["a:0", "a:1", "a:2"]
        assert stream.done is not None
        # A finished stream stays finished.
        assert [t async for t in stream] == []


async def test_two_concurrent_generates_are_demultiplexed() -> None:
    server = FakeServer(n_tokens=20, token_delay=0.001)
    results: dict[str, list[str]] = {}

    async def run(c: Client, prompt: str) -> None:
        async with c.generate(prompt, request_id=prompt) as stream:
            results[prompt] = [t.text async for t in stream]

    async with running_server(server) as (_, path), Client.connect(path) as c:
        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, c, "a")
                tg.start_soon(run, c, "b")
                # A single-reply request in the middle of both streams.
                assert await c.tokenize("xy") == (120, 121)
    assert results["a"] == [f"a:{i}" for i in range(20)]
    assert results["b"] == [f"b:{i}" for i in range(20)]
    # The frames really were interleaved on the one connection.
    order = "".join(i for i in server.sent_order if i in ("a", "b"))
    assert "ab" in order and "ba" in order


async def test_break_inside_async_with_sends_cancel() -> None:
    async with running_server() as (server, path), Client.connect(path) as c:
        with anyio.fail_after(TIMEOUT):
            async with c.generate("slow") as stream:
                async for token in stream:
                    if token.text == "slow:2":
                        break
            await server.cancel_event.wait()
        assert server.cancelled == [stream.id]
        assert stream.done is None
        # The connection is still good afterwards.
        assert await c.detokenize([104, 105]) == "hi"


async def test_aclose_sends_cancel() -> None:
    async with running_server() as (server, path), Client.connect(path) as c:
        with anyio.fail_after(TIMEOUT):
            stream = c.generate("slow")
            await stream.__anext__()
            await stream.aclose()
            await server.cancel_event.wait()
        assert server.cancelled == [stream.id]


async def test_cancelled_consumer_still_sends_cancel() -> None:
    async with running_server() as (server, path), Client.connect(path) as c:
        with anyio.CancelScope() as scope:
            async with c.generate("slow") as stream:
                async for _ in stream:
                    scope.cancel()  # delivered at the next checkpoint, mid-iteration
        assert scope.cancelled_caught
        with anyio.fail_after(TIMEOUT):
            await server.cancel_event.wait()
        assert server.cancelled == [stream.id]


async def test_explicit_cancel_ends_with_cancelled_done() -> None:
    async with running_server() as (_, path), Client.connect(path) as c:
        with anyio.fail_after(TIMEOUT):
            async with c.generate("slow") as stream:
                async for token in stream:
                    if token.text == "slow:1":
                        await stream.cancel()
        assert stream.done is not None
        assert stream.done.finish_reason is FinishReason.CANCELLED


async def test_client_cancel_by_id() -> None:
    async with running_server() as (server, path), Client.connect(path) as c:
        with anyio.fail_after(TIMEOUT):
            async with c.generate("slow", request_id="r1") as stream:
                await stream.__anext__()
                await c.cancel("r1")
                async for _ in stream:
                    pass
        assert server.cancelled == ["r1"]
        assert stream.done is not None and stream.done.finish_reason is FinishReason.CANCELLED


async def test_error_frame_becomes_exception() -> None:
    async with running_server() as (_, path), Client.connect(path) as c:
        with pytest.raises(ServerBusy) as info:
            async with c.generate("error:busy", request_id="b1") as stream:
                async for _ in stream:
                    pass
        assert info.value.code is ErrorCode.BUSY
        assert info.value.request_id == "b1"
        assert info.value.message == "canned busy"
        # Other requests are unaffected.
        assert (await c.health()).active_requests == 0


async def test_error_reply_to_single_request() -> None:
    server = FakeServer(stats_error=ErrorCode.MODEL_ERROR)
    async with running_server(server) as (_, path), Client.connect(path) as c:
        with pytest.raises(ModelError, match="stats failed"):
            await c.stats()


async def test_done_with_error_finish_reason() -> None:
    async with running_server() as (_, path), Client.connect(path) as c:
        completion = await c.generate("fail").collect()
        assert completion.done.finish_reason is FinishReason.ERROR
        assert completion.done.error_message == "canned failure"


async def test_single_reply_requests() -> None:
    async with running_server() as (_, path), Client.connect(path) as c:
        stats = await c.stats()
        assert stats.counters == {"requests_total": 3}
        assert stats.proposers["ngram"].acceptance_rate == pytest.approx(0.7)
        health = await c.health()
        assert health.status is HealthStatus.OK
        models = await c.models()
        assert [m.name for m in models] == ["fake-model"]
        assert await c.tokenize("ab", add_special=False) == (97, 98)
        assert await c.detokenize((97, 98)) == "ab"


async def test_version_mismatch_raises() -> None:
    server = FakeServer(protocol_version=PROTOCOL_VERSION + 1)
    async with running_server(server) as (_, path):
        with pytest.raises(UnsupportedVersion, match=f"need protocol {PROTOCOL_VERSION + 1}"):
            async with Client.connect(path):
                pytest.fail("handshake should not succeed")


async def test_client_rejects_other_welcome_version() -> None:
    async with running_server(FakeServer(welcome_version=7)) as (_, path):
        with pytest.raises(UnsupportedVersion, match="server speaks protocol 7"):
            async with Client.connect(path):
                pytest.fail("handshake should not succeed")


async def test_connect_to_missing_socket() -> None:
    directory = tempfile.mkdtemp(dir="/tmp", prefix="mp")
    try:
        with pytest.raises(ConnectionClosed, match="cannot connect"):
            async with Client.connect(os.path.join(directory, "nope")):
                pass
    finally:
        os.rmdir(directory)


async def test_invalid_values_rejected_before_sending() -> None:
    async with running_server() as (server, path), Client.connect(path) as c:
        with pytest.raises(BadRequest, match="max_tokens"):
            c.generate("x", max_tokens=0)
        with pytest.raises(BadRequest, match="top_p"):
            c.generate("x", top_p=0.0)
        with pytest.raises(BadRequest, match="exactly one"):
            c.generate()
        assert not [r for r in server.received if isinstance(r, Generate)]


async def test_oversize_request_refused_locally() -> None:
    server = FakeServer(max_frame_size=256)
    async with running_server(server) as (_, path), Client.connect(path) as c:
        stream = c.generate("x" * 1000)
        with pytest.raises(FrameTooLarge):
            async with stream:
                pass
        assert stream.done is None
        assert [t async for t in stream] == []
        assert await c.tokenize("ok") == (111, 107)


async def test_server_hangup_fails_pending_requests() -> None:
    async with running_server() as (_, path), Client.connect(path) as c:
        with anyio.fail_after(TIMEOUT):
            stream = c.generate("hangup")
            assert (await stream.__anext__()).text == "hangup:0"
            with pytest.raises(ConnectionClosed):
                await stream.__anext__()
            with pytest.raises(ConnectionClosed):
                await c.health()


async def test_error_frame_without_id_is_fatal() -> None:
    frame = b'{"op":"error","id":null,"code":"internal","message":"lost track"}\n'
    server = FakeServer(after_welcome=frame)
    async with running_server(server) as (_, path), Client.connect(path) as c:
        with anyio.fail_after(TIMEOUT), pytest.raises(InternalError, match="lost track"):
            await c.generate("slow").collect()
        with pytest.raises(InternalError, match="lost track"):
            await c.health()


async def test_malformed_frame_with_id_fails_only_that_request() -> None:
    async with running_server() as (_, path), Client.connect(path) as c:
        with anyio.fail_after(TIMEOUT):
            with pytest.raises(InternalError, match="invalid frame") as info:
                await c.generate("garble", request_id="g").collect()
            assert info.value.request_id == "g"
            assert (await c.health()).status is HealthStatus.OK


async def test_body_exception_is_not_wrapped() -> None:
    async with running_server() as (_, path):
        with pytest.raises(KeyError):
            async with Client.connect(path):
                raise KeyError("mine")


async def test_requests_after_exit_fail() -> None:
    async with running_server() as (_, path):
        async with Client.connect(path) as c:
            pass
        with pytest.raises(ConnectionClosed):
            await c.health()


async def test_duplicate_request_id_rejected() -> None:
    async with (
        running_server() as (_, path),
        Client.connect(path) as c,
        c.generate("slow", request_id="dup"),
    ):
        with pytest.raises(ValueError, match="already in use"):
            await c.generate("x", request_id="dup").start()


async def test_aclose_while_streaming_wakes_everyone() -> None:
    async with running_server() as (_, path), Client.connect(path) as c:
        with anyio.fail_after(TIMEOUT):
            stream = c.generate("slow")
            await stream.__anext__()
            await c.aclose()
            with pytest.raises(ConnectionClosed, match="client closed"):
                async for _ in stream:
                    pass
            with pytest.raises(ConnectionClosed):
                await c.stats()
