"""Malformed input gets the right error code, the connection keeps working where the
protocol says it does, and the daemon keeps serving everyone else."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.protocol import (
    Client,
    Done,
    ErrorCode,
    ErrorMessage,
    Generate,
    Health,
    HealthReply,
    Hello,
    ProtocolError,
    Response,
    SamplingParams,
    Token,
    Welcome,
)
from meshd.testing import testmodels
from tests.integration.helpers.daemon import (
    RawConnection,
    assert_no_leaks,
    assert_serves,
    running_daemon,
    wait_idle,
)

pytestmark = pytest.mark.anyio

FRAME_LIMIT = 2048
CTX = 256


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=CTX, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    assert rt.idle_slots == 2
    rt.close()


CONFIG = ServerConfig(max_frame_size=FRAME_LIMIT, max_tokens_limit=200)


async def _health_works(raw: RawConnection, rid: str = "probe") -> None:
    """The same connection still answers."""
    await raw.send(Health(id=rid))
    reply = await raw.recv()
    assert isinstance(reply, HealthReply) and reply.id == rid


# Each case: frame bytes, expected code, expected id, a substring of the message.
CASES = [
    pytest.param(b"not json\n", ErrorCode.BAD_REQUEST, None, "invalid JSON", id="not-json"),
    pytest.param(b'{"op":"health","id":"x1"' + b" " * (FRAME_LIMIT + 10) + b"}\n",
                 ErrorCode.TOO_LARGE, "x1", "maximum size", id="oversize"),
    pytest.param(b'{"op":"launch","id":"x2"}\n', ErrorCode.BAD_REQUEST, "x2", "launch",
                 id="unknown-op"),
    pytest.param(b'{"op":"generate","id":"x3","prompt":5}\n', ErrorCode.BAD_REQUEST, "x3",
                 "generate.prompt", id="wrong-type"),
    pytest.param(b'{"op":"generate","id":"x4","prompt":"hi","max_tokens":"5"}\n',
                 ErrorCode.BAD_REQUEST, "x4", "max_tokens", id="string-for-int"),
    pytest.param(b'{"op":"health","id":"x5","verbose":true}\n', ErrorCode.BAD_REQUEST, "x5",
                 "verbose", id="unknown-field"),
    pytest.param(b'{"op":"generate","id":"x6","prompt":"hi","max_tokens":1000000}\n',
                 ErrorCode.BAD_REQUEST, "x6", "generate.max_tokens", id="huge-max-tokens"),
    pytest.param(b'{"op":"generate","id":"x7","prompt":"' + b"word " * 400 + b'"}\n',
                 ErrorCode.MODEL_ERROR, "x7", "does not fit the context", id="prompt-too-long"),
    pytest.param(b"\x00\xff\xfe\x80garbage\x01\x02\n", ErrorCode.BAD_REQUEST, None, "",
                 id="binary-garbage"),
    pytest.param(b'[1,2,3]\n', ErrorCode.BAD_REQUEST, None, "object", id="not-an-object"),
    pytest.param(b'{"op":"generate","id":"x8","prompt":"hi","speculative":{"proposer":"nope"}}\n',
                 ErrorCode.BAD_REQUEST, "x8", "unknown proposer", id="unknown-proposer"),
    pytest.param(b'{"op":"detokenize","id":"x10","tokens":[1,99999]}\n', ErrorCode.BAD_REQUEST,
                 "x10", "tokens[1]", id="token-out-of-vocab"),
    pytest.param(b'{"op":"hello","id":"x11","protocol_version":1,"client_name":"again"}\n',
                 ErrorCode.BAD_REQUEST, "x11", "hello", id="second-hello"),
    pytest.param(b'{"op":"generate","id":"x12","prompt":"hi","sampling":{"top_p":2}}\n',
                 ErrorCode.BAD_REQUEST, "x12", "top_p", id="bad-value"),
    pytest.param(b'{"op":"welcome","id":"x13"}\n', ErrorCode.BAD_REQUEST, "x13", "",
                 id="server-only-op"),
]


@pytest.mark.parametrize(("frame", "code", "rid", "text"), CASES)
async def test_malformed_frame_answered_and_connection_survives(
    runtime: ModelRuntime, frame: bytes, code: ErrorCode, rid: str | None, text: str
) -> None:
    async with running_daemon(runtime, CONFIG) as (server, path):
        async with RawConnection.open(path) as raw:
            await raw.send(frame)
            error = await raw.error()
            assert (error.code, error.id) == (code, rid), error
            assert text in error.message
            await _health_works(raw)
        await assert_serves(path)
        await wait_idle(server)
        assert_no_leaks(server)
        assert server.service.counters[f"errors_{code.value}"] >= 1


async def test_frame_split_in_pieces_and_oversize_without_newline(runtime: ModelRuntime) -> None:
    async with running_daemon(runtime, CONFIG) as (_, path), RawConnection.open(path) as raw:
        for byte in b'{"op":"health","id":"slow"}\n':
            await raw.send(bytes([byte]))
        reply = await raw.recv()
        assert isinstance(reply, HealthReply) and reply.id == "slow"
        # Oversize is reported as soon as the limit is passed, before any newline.
        await raw.send(b'{"op":"stats","id":"big","x":"' + b"a" * (FRAME_LIMIT * 2))
        error = await raw.error()
        assert (error.code, error.id) == (ErrorCode.TOO_LARGE, "big")
        await raw.send(b"a" * 5000 + b'"}\n')  # the rest of it is skipped
        await _health_works(raw)


async def test_half_frame_then_disconnect(runtime: ModelRuntime) -> None:
    async with running_daemon(runtime, CONFIG) as (server, path):
        for tail in (b'{"op":"generate","id":"g","prompt":"he', b'{"op":"generate","id":"g",'
                     b'"prompt":"hello","max_tokens":50,"sampling":{"temperature":0}}'):
            async with RawConnection.open(path) as raw:
                await raw.send(tail)  # no newline: counts as a frame at EOF
        await assert_serves(path)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_first_frame_must_be_hello(runtime: ModelRuntime) -> None:
    async with running_daemon(runtime, CONFIG) as (_, path):
        async with RawConnection.open(path, hello=False) as raw:
            await raw.send(Health(id="early"))
            error = await raw.error()
            assert (error.code, error.id) == (ErrorCode.BAD_REQUEST, "early")
            assert await raw.recv() is None  # closed
        async with RawConnection.open(path, hello=False) as raw:
            await raw.send(Hello(id="v", protocol_version=99, client_name="future"))
            error = await raw.error()
            assert (error.code, error.id) == (ErrorCode.UNSUPPORTED_VERSION, "v")
            assert await raw.recv() is None
        async with RawConnection.open(path, hello=False) as raw:
            await raw.send(b"garbage\n")
            assert (await raw.error()).code is ErrorCode.BAD_REQUEST
            assert await raw.recv() is None
        await assert_serves(path)


async def test_duplicate_in_flight_id_and_cancel_of_unknown_id(runtime: ModelRuntime) -> None:
    async with running_daemon(runtime, CONFIG) as (server, path):
        async with RawConnection.open(path) as raw:
            gen = Generate(id="dup", prompt="hello", max_tokens=200,
                           sampling=SamplingParams(temperature=0.0))
            await raw.send(b'{"op":"cancel","id":"nobody"}\n')
            await raw.send(gen)
            await raw.send(gen)
            await raw.send(b'{"op":"cancel","id":"dup"}\n')
            frames = await raw.until_final("dup")
            # The duplicate is refused with an error naming the id; the original then
            # ends with done (cancelled, unless it finished first).
            errors = [f for f in frames if isinstance(f, ErrorMessage)]
            assert errors and errors[0].code is ErrorCode.BAD_REQUEST
            assert "already in flight" in errors[0].message
            if isinstance(frames[-1], ErrorMessage):
                frames = await raw.until_final("dup")
            assert isinstance(frames[-1], Done)
            await _health_works(raw)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_max_queue_zero_admits_while_a_slot_is_free(runtime: ModelRuntime) -> None:
    """``--max-queue 0`` means no queue, not no service: a request runs while a slot is
    free, and one that would wait for a slot is answered ``busy``."""
    config = ServerConfig(max_queue=0)
    async with running_daemon(runtime, config) as (server, path):
        async with Client.connect(path) as client:
            alone = await client.generate("hello", max_tokens=5).collect()
            assert alone.done.usage.completion_tokens == 5
        async with RawConnection.open(path) as raw:
            ids = [f"g{i}" for i in range(12)]  # 12 at once on 2 slots
            for rid in ids:
                await raw.send(Generate(id=rid, prompt="hello", max_tokens=40,
                                        sampling=SamplingParams(temperature=0.0)))
            finals: dict[str, Response] = {}
            with anyio.fail_after(60):
                while len(finals) < len(ids):
                    frame = await raw.recv(60)
                    if isinstance(frame, Done | ErrorMessage):
                        finals[frame.id or ""] = frame
        done = [f for f in finals.values() if isinstance(f, Done)]
        busy = [f for f in finals.values() if isinstance(f, ErrorMessage)]
        assert len(done) >= 2 and busy, finals
        assert all(f.code is ErrorCode.BUSY and "all 2 slots are busy" in f.message
                   for f in busy)
        assert server.service.counters["errors_busy"] == len(busy)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_detokenize_and_tokenize_roundtrip(runtime: ModelRuntime) -> None:
    async with running_daemon(runtime, CONFIG) as (_, path), Client.connect(path) as client:
        tokens = await client.tokenize("hello world", add_special=False)
        assert list(tokens) == runtime.model.tokenizer.tokenize("hello world", add_special=False)
        assert await client.detokenize(tokens) == "hello world"
        with_bos = await client.tokenize("hello world")
        assert len(with_bos) >= len(tokens)
        assert (await client.models())[0].n_ctx == CTX


def _is_reply(frame: Response) -> bool:
    return isinstance(frame, ErrorMessage | HealthReply | Token | Done) or frame.OP.endswith(
        "_reply")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6,
)
frames = st.one_of(
    st.binary(max_size=64).map(lambda b: b.replace(b"\n", b" ") + b"\n"),
    st.dictionaries(st.sampled_from(["op", "id", "prompt", "max_tokens", "tokens", "text"]),
                    json_values, max_size=4).map(lambda d: json.dumps(d).encode() + b"\n"),
    st.fixed_dictionaries({"op": st.sampled_from(
        ["generate", "cancel", "stats", "health", "models", "tokenize", "detokenize", "hello"]),
        "id": st.text(min_size=1, max_size=4)}, optional={"prompt": st.text(max_size=6),
        "max_tokens": st.integers(-2, 3), "tokens": st.lists(st.integers(-1, 300), max_size=3),
        "text": st.text(max_size=5)}).map(lambda d: json.dumps(d).encode() + b"\n"),
)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(frames, min_size=1, max_size=6))
async def test_arbitrary_frames_get_errors_or_replies(runtime: ModelRuntime,
                                                      lines: list[bytes]) -> None:
    async with running_daemon(runtime, CONFIG) as (server, path):
        async with RawConnection.open(path) as raw:
            for line in lines:
                await raw.send(line)
            await raw.send(Health(id="\x00end"))
            while True:
                frame = await raw.recv()
                assert frame is not None, "the daemon closed a connection after its hello"
                assert _is_reply(frame) and not isinstance(frame, Welcome), frame
                if isinstance(frame, HealthReply) and frame.id == "\x00end":
                    break
        with anyio.fail_after(10):
            await assert_serves(path)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_silent_connection_is_closed_after_the_hello_timeout(runtime: ModelRuntime) -> None:
    async with running_daemon(runtime, ServerConfig(hello_timeout_s=0.1)) as (_, path):
        async with RawConnection.open(path, hello=False) as raw:
            assert await raw.recv(timeout=5) is None  # closed without a word
        await assert_serves(path)


async def test_per_connection_request_limit(runtime: ModelRuntime) -> None:
    config = ServerConfig(max_requests_per_connection=1)
    async with running_daemon(runtime, config) as (server, path):
        async with RawConnection.open(path) as raw:
            greedy = SamplingParams(temperature=0.0)
            await raw.send(Generate(id="a", prompt="hello", max_tokens=100, sampling=greedy))
            await raw.send(Generate(id="b", prompt="hello", max_tokens=5, sampling=greedy))
            frames = await raw.until_final("b")
            assert isinstance(frames[-1], ErrorMessage) and frames[-1].code is ErrorCode.BUSY
            frames = await raw.until_final("a")
            assert isinstance(frames[-1], Done)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_draft_models_are_limited_to_the_allowed_ones() -> None:
    """``draft:PATH`` would let any client of the socket make the daemon load any file it
    can read; the daemon serves only the drafts it was started with (``--draft-model``)."""
    draft = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=draft, n_ctx_seq=CTX, n_seq_max=1, draft_max=4,
                                    calibrate=False, threads=1, allowed_drafts=(draft,)))
    try:
        async with running_daemon(rt) as (server, path), Client.connect(path) as client:
            other = str(testmodels.test_model_path("mimo2", acceptance=0.9))
            with pytest.raises(ProtocolError, match="not one this daemon serves") as err:
                await client.generate("abc abc", max_tokens=8, temperature=0.0,
                                      proposer=f"draft:{other}").collect()
            assert err.value.code in (ErrorCode.BAD_REQUEST, ErrorCode.MODEL_ERROR)
            ref = await client.generate("abc abc", max_tokens=16, temperature=0.0,
                                        proposer="off").collect()
            got = await client.generate("abc abc", max_tokens=16, temperature=0.0,
                                        proposer=f"draft:{draft}").collect()
            assert list(got.token_ids) == list(ref.token_ids)
            await wait_idle(server)
            assert_no_leaks(server)
    finally:
        rt.close()
