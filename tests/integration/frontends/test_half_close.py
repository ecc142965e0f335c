"""A client that shuts its sending side after its requests (``shutdown(SHUT_WR)``, as
``nc -N`` does) still gets every answer, on the native protocol and over HTTP (Unix
socket and loopback TCP); one that closes the connection entirely still cancels."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anyio
import anyio.abc
import pytest

from meshd.daemon.commands.server import serving
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import (
    PROTOCOL_VERSION,
    Done,
    FinishReason,
    Generate,
    Hello,
    ResponseDecoder,
    SamplingParams,
    StreamReceiver,
    Token,
    Tokenize,
    TokenizeReply,
    Welcome,
    encode,
)
from tests.integration.helpers.daemon import (
    assert_no_leaks,
    assert_serves,
    short_tempdir,
    wait_idle,
)
from tests.integration.helpers.http_api import status_of

pytestmark = pytest.mark.anyio

PROMPT = "The three primary colours are"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=2, draft_max=4, calibrate=False,
                                    threads=1))
    yield rt
    assert rt.idle_slots == 2
    rt.close()


async def _send_then_half_close(stream: anyio.abc.SocketStream, data: bytes) -> bytes:
    """Send ``data``, shut the sending side, read until the daemon closes."""
    got = bytearray()
    async with stream:
        await stream.send(data)
        await stream.send_eof()
        with anyio.fail_after(60):
            while True:
                try:
                    got += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return bytes(got)


def _http_request(body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


async def test_native_requests_are_answered_after_a_half_close(smol: ModelRuntime) -> None:
    path = f"{short_tempdir()}/s"
    frames = b"".join(encode(m) for m in (
        Hello(id="h", protocol_version=PROTOCOL_VERSION, client_name="half-close"),
        Generate(id="g", prompt=PROMPT, max_tokens=8, sampling=SamplingParams(temperature=0)),
        Tokenize(id="t", text="hello world"),
    ))
    async with serving(smol, path) as server:
        got = await _send_then_half_close(await anyio.connect_unix(path), frames)
        decoder = ResponseDecoder()
        decoder.feed(got)
        replies = list(decoder.drain())
        assert isinstance(replies[0], Welcome)
        dones = [r for r in replies if isinstance(r, Done)]
        assert len(dones) == 1, replies  # not cancelled by the end of the stream
        done = dones[0]
        assert (done.id, done.finish_reason) == ("g", FinishReason.LENGTH)
        assert done.usage.completion_tokens == 8
        assert sum(isinstance(r, Token) and r.id == "g" for r in replies) >= 1
        tokenized = next(r for r in replies if isinstance(r, TokenizeReply))
        assert list(tokenized.tokens) == smol.model.tokenizer.tokenize("hello world")
        await wait_idle(server)
        assert_no_leaks(server)


async def test_a_native_client_that_closes_still_cancels(smol: ModelRuntime) -> None:
    path = f"{short_tempdir()}/s"
    async with serving(smol, path) as server:
        cancelled = server.scheduler.statistics().cancelled
        stream = await anyio.connect_unix(path)
        receiver = StreamReceiver(stream)
        await stream.send(encode(Hello(id="h", protocol_version=PROTOCOL_VERSION,
                                       client_name="leaver"))
                          + encode(Generate(id="g", prompt=PROMPT, max_tokens=400)))
        with anyio.fail_after(30):
            while server.scheduler.active == 0:
                await anyio.sleep(0.01)
        await receiver.aclose()
        await wait_idle(server, timeout=30)
        assert server.scheduler.statistics().cancelled == cancelled + 1
        assert_no_leaks(server)
        await assert_serves(path)


async def test_http_answers_after_a_half_close_over_tcp_and_unix(smol: ModelRuntime) -> None:
    path = f"{short_tempdir()}/s"
    async with serving(smol, path, http="tcp:127.0.0.1:0") as server:
        assert server.http_listener is not None
        port = int(server.http_listener.address.rpartition(":")[2])
        plain = _http_request({"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        over_tcp = await _send_then_half_close(await anyio.connect_tcp("127.0.0.1", port),
                                               plain)
        assert status_of(over_tcp) == 200, over_tcp[:200]
        answer = json.loads(over_tcp.partition(b"\r\n\r\n")[2])
        assert answer["usage"]["completion_tokens"] == 6
        assert answer["choices"][0]["finish_reason"] == "length"
        # Two pipelined requests, then the half-close: both are answered, in order.
        second = _http_request({"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        both = await _send_then_half_close(await anyio.connect_tcp("127.0.0.1", port),
                                           plain + second)
        assert both.count(b"HTTP/1.1 200 OK") == 2, both[:300]
        bodies = [json.loads(part.partition(b"\r\n\r\n")[2])
                  for part in both.split(b"HTTP/1.1 ")[1:]]
        assert [b["usage"]["completion_tokens"] for b in bodies] == [6, 3]
        assert bodies[0]["choices"][0]["text"] == answer["choices"][0]["text"]
        streamed = _http_request({"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                  "stream": True})
        for stream in (await anyio.connect_unix(path),
                       await anyio.connect_tcp("127.0.0.1", port)):
            got = await _send_then_half_close(stream, streamed)
            assert status_of(got) == 200
            assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
            events = [json.loads(line.removeprefix(b"data: ")) for line in got.split(b"\n")
                      if line.startswith(b"data: {")]
            assert "".join(e["choices"][0]["text"] for e in events) \
                == answer["choices"][0]["text"]
        await wait_idle(server)
        assert_no_leaks(server)
