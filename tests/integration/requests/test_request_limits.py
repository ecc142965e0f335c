"""Request fields a hostile client controls are bounded before anything is built from
them, on both front ends: a stop string too long, too many stop strings or chat
messages, a prompt far beyond the context. Each gets a typed error naming the limit
(``bad_request`` on the native socket, 400 in OpenAI's shape over HTTP), the refusal is
logged, and the next request is served."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anyio
import httpx
import pytest
from structlog.testing import capture_logs

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.protocol import (
    MAX_MESSAGES,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    BadRequest,
    Client,
    Done,
    ErrorCode,
    Generate,
    ModelError,
    SamplingParams,
    decode_request,
)
from tests.integration.helpers.daemon import (
    RawConnection,
    assert_no_leaks,
    assert_serves,
    running_daemon,
    wait_idle,
)

pytestmark = pytest.mark.anyio

CTX = 512
HUGE_STOP = "a" * 1_000_000
LONG_STOP = "b" * 20_000
# A daemon without the limits answers model_error for this prompt before it builds a
# stop matcher, so the 1,000,000-character stop cannot take the test machine's memory.
TOO_LONG_PROMPT = "word " * 4000


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # httpx runs on asyncio here


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=CTX, n_seq_max=2, draft_max=4, calibrate=False,
                                    threads=1))
    yield rt
    assert rt.idle_slots == 2
    rt.close()


def _generate(rid: str, **fields: object) -> bytes:
    body = {"op": "generate", "id": rid, "max_tokens": 4, **fields}
    if "messages" not in body:
        body.setdefault("prompt", "The capital of France is")
    return json.dumps(body).encode() + b"\n"


def test_a_million_character_stop_is_refused_while_decoding() -> None:
    """The frame's fields are checked as it is decoded: the refusal costs microseconds
    and names the limit and the length sent."""
    frame = _generate("huge", stop=[HUGE_STOP])
    t0 = time.perf_counter()
    with pytest.raises(BadRequest) as caught:
        decode_request(frame)
    assert time.perf_counter() - t0 < 1.0
    message = caught.value.message
    assert message.startswith("generate.stop[0]: ")
    assert f"at most {MAX_STOP_LENGTH} chars" in message and "1000000 chars" in message
    assert caught.value.request_id == "huge"


# (frame fields, what the error names)
NDJSON_CASES = [
    ({"prompt": TOO_LONG_PROMPT, "stop": [HUGE_STOP]},
     ("generate.stop[0]", f"at most {MAX_STOP_LENGTH} chars", "1000000 chars")),
    ({"stop": [LONG_STOP]}, ("generate.stop[0]", "20000 chars")),
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)},
     ("generate.stop", f"at most {MAX_STOP_STRINGS} stop strings",
      f"{MAX_STOP_STRINGS + 1} items")),
    ({"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)},
     ("generate.messages", f"at most {MAX_MESSAGES} chat messages",
      f"{MAX_MESSAGES + 1} items")),
    ({"messages": [{"role": "r" * 500, "content": "hi"}]},
     ("generate.messages[0].role", "at most 64 chars")),
]


async def test_over_the_limits_on_the_native_socket(smol: ModelRuntime) -> None:
    async with running_daemon(smol) as (server, path):
        with capture_logs() as logs:
            async with RawConnection.open(path) as raw:
                t0 = time.perf_counter()
                for i, (fields, named) in enumerate(NDJSON_CASES):
                    await raw.send(_generate(f"bad{i}", **fields))
                    error = await raw.error(timeout=30)
                    assert (error.code, error.id) == (ErrorCode.BAD_REQUEST, f"bad{i}")
                    for part in named:
                        assert part in error.message, (part, error.message)
                assert time.perf_counter() - t0 < 10
                # The same connection is served at once, with stops at the limits.
                await raw.send(_generate("ok", stop=["s" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS,
                                         max_tokens=6, sampling={"temperature": 0}))
                frames = await raw.until_final("ok")
                assert isinstance(frames[-1], Done)
                assert frames[-1].usage.completion_tokens == 6
        rejected = [e for e in logs if e["event"] == "request_rejected"]
        assert [e["id"] for e in rejected] == [f"bad{i}" for i in range(len(NDJSON_CASES))]
        assert {e["code"] for e in rejected} == {"bad_request"}
        assert server.service.counters["errors_bad_request"] == len(NDJSON_CASES)
        await assert_serves(path)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_a_prompt_far_beyond_the_context_is_refused_before_tokenizing(
        smol: ModelRuntime) -> None:
    """Megabytes of prompt for a 512-token context: refused from its length (a token
    stands for a bounded number of bytes), not after tokenizing a million tokens."""
    async with running_daemon(smol) as (_server, path), Client.connect(path) as client:
        t0 = time.perf_counter()
        with pytest.raises(ModelError,
                           match="3000000 bytes does not fit the context of 512 tokens"):
            await client.generate("x" * 3_000_000, max_tokens=4).collect()
        elapsed = time.perf_counter() - t0
        assert elapsed < 2.0, elapsed  # tokenizing 3 MB alone takes seconds
        # A prompt just beyond the context still gets its exact token count.
        with pytest.raises(ModelError, match=r"prompt of \d+ tokens does not fit"):
            await client.generate("word " * 600, max_tokens=4).collect()
        done = (await client.generate("Hello", max_tokens=3, temperature=0.0).collect()).done
        assert done.usage.completion_tokens == 3


async def test_tokenizer_replies_are_bounded_before_they_are_built(smol: ModelRuntime) -> None:
    """A tokenize or detokenize whose reply could not fit a frame is refused
    ``too_large`` without building it; small ones still work."""
    limit = 64 * 1024
    async with running_daemon(smol, ServerConfig(max_frame_size=limit)) as (server, path):
        async with RawConnection.open(path) as raw:
            await raw.send_json_line(json.dumps({"op": "tokenize", "id": "t",
                                                 "text": "a1 " * 20_000}))
            error = await raw.error(timeout=30)
            assert (error.code, error.id) == (ErrorCode.TOO_LARGE, "t")
            assert f"more than {limit // 2} would be above the frame limit" in error.message
            longest = max(range(smol.model.tokenizer.n_vocab),
                          key=lambda t: len(smol.model.tokenizer.piece(t)))
            n = limit // len(smol.model.tokenizer.piece(longest)) + 10
            await raw.send_json_line(json.dumps({"op": "detokenize", "id": "d",
                                                 "tokens": [longest] * n}))
            error = await raw.error(timeout=30)
            assert (error.code, error.id) == (ErrorCode.TOO_LARGE, "d")
            assert f"above the frame limit of {limit}" in error.message
        async with Client.connect(path, max_frame_size=limit) as client:
            tokens = await client.tokenize("hello world", add_special=False)
            assert await client.detokenize(tokens) == "hello world"
        assert server.service.counters["errors_too_large"] == 2


HTTP_CASES = [
    ("/v1/completions", {"prompt": TOO_LONG_PROMPT, "stop": [HUGE_STOP]}, "stop[0]",
     (f"at most {MAX_STOP_LENGTH} chars", "1000000 chars")),
    ("/v1/completions", {"prompt": "Hi", "stop": LONG_STOP}, "stop[0]", ("20000 chars",)),
    ("/v1/completions", {"prompt": "Hi", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop",
     (f"at most {MAX_STOP_STRINGS}", f"got {MAX_STOP_STRINGS + 1}")),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}, "messages",
     (f"at most {MAX_MESSAGES} messages", f"got {MAX_MESSAGES + 1}")),
]


async def test_over_the_limits_over_http(smol: ModelRuntime) -> None:
    async with running_daemon(smol) as (server, path):
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://meshd",
                                     timeout=60) as http:
            for route, body, param, named in HTTP_CASES:
                with anyio.fail_after(10):
                    r = await http.post(route, json={"max_tokens": 4, **body})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert (error["code"], error["type"], error["param"]) == \
                    ("bad_request", "invalid_request_error", param)
                for part in named:
                    assert part in error["message"], (part, error["message"])
            # The next request, on the same keep-alive connection, is served.
            r = await http.post("/v1/completions", json={
                "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
                "stop": ["s" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert server.service.counters["errors_bad_request"] == len(HTTP_CASES)
        await assert_serves(path)
        await wait_idle(server)
        assert_no_leaks(server)


def test_the_client_library_refuses_what_the_daemon_would() -> None:
    """Built locally, the same rules apply (one definition for both ends)."""
    with pytest.raises(BadRequest, match=f"at most {MAX_STOP_STRINGS} stop strings"):
        Generate(id="g", prompt="x", stop=("s",) * (MAX_STOP_STRINGS + 1),
                 sampling=SamplingParams())
    with pytest.raises(BadRequest, match=f"at most {MAX_STOP_LENGTH} chars"):
        Generate(id="g", prompt="x", stop=("s" * (MAX_STOP_LENGTH + 1),))
