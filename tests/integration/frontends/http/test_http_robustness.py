"""The HTTP surface as clients and monitors meet it, over the daemon's Unix socket: a body
the JSON decoder refuses (deep nesting, a huge integer) is a 400 on every JSON endpoint
(and ``bad_request`` on the native socket), logged at info without a traceback; ``HEAD``
is answered on every route as HTTP says (the GET's status and headers, no body);
``/v1/completions`` batches prompts (OpenAI's ``index`` numbering, usage summed); and a
request that sets no ``max_tokens`` runs until the model stops or the context ends (or
the operator's ``--max-tokens``), on both front ends.

The synthetic llama model never writes its end-of-generation token, so a generation
without a limit runs to the end of its context, quickly."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import openai
import pytest
from structlog.testing import capture_logs

from meshd.daemon.commands.server import Server
from meshd.daemon.frontends.http.openai.api import MAX_BATCH_GENERATIONS, MAX_PROMPTS
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.protocol import Client, ErrorCode
from meshd.testing import testmodels
from tests.integration.helpers.daemon import (
    RawConnection,
    assert_no_leaks,
    running_daemon,
    wait_idle,
)
from tests.integration.helpers.http_api import raw_exchange, status_of

pytestmark = pytest.mark.anyio

N_CTX = 512
PROMPTS = ["the cat sat on", "a big red box", "hello there world"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # httpx (and so the openai client) runs on asyncio here


@pytest.fixture(scope="module")
def synthetic() -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=N_CTX, n_seq_max=2,
                                    draft_max=4, calibrate=False, threads=1))
    yield rt
    rt.close()


@asynccontextmanager
async def daemon(rt: ModelRuntime, config: ServerConfig | None = None
                 ) -> AsyncIterator[tuple[Server, str, httpx.AsyncClient]]:
    async with running_daemon(rt, config) as (server, path):
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://meshd",
                                     timeout=60) as client:
            yield server, path, client


def _openai(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://meshd/v1", api_key="unused", http_client=http,
                              max_retries=0)


# ----------------------------------------------------------------- bodies the decoder refuses

JSON_ENDPOINTS = (
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/completion", "/completions",
    "/chat/completions", "/responses", "/tokenize", "/detokenize", "/apply-template",
    "/v1/chat/completions/input_tokens", "/v1/responses/input_tokens", "/v1/streams/lookup",
)
NESTED = b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"
"""3,000 levels: past Python's decoder (RecursionError)."""
HUGE_INTEGER = b'{"prompt": "hi", "max_tokens": ' + b"1" * 4400 + b"}"
"""An integer past Python's 4,300-digit conversion limit (ValueError)."""
DEEP = b'{"messages": ' + b"[" * 900 + b"]" * 900 + b"}"
"""900 levels: the decoder takes them, the daemon's bound does not."""


async def test_bodies_the_decoder_refuses_are_a_400_on_every_json_endpoint(
        synthetic: ModelRuntime) -> None:
    async with daemon(synthetic) as (server, _path, http):
        with capture_logs() as logs:
            for endpoint in JSON_ENDPOINTS:
                for body, words in ((NESTED, "nested"), (HUGE_INTEGER, "digits"),
                                    (DEEP, "nested")):
                    r = await http.post(endpoint, content=body,
                                        headers={"Content-Type": "application/json"})
                    assert r.status_code == 400, (endpoint, r.status_code, r.text[:200])
                    error = r.json()["error"]
                    assert error["type"] == "invalid_request_error", (endpoint, error)
                    assert words in error["message"], (endpoint, error["message"])
        assert not [e for e in logs if e["log_level"] in ("error", "critical")
                    or e.get("exc_info")]
        rejected = [e for e in logs if e["event"] == "request_rejected"]
        assert len(rejected) == 3 * len(JSON_ENDPOINTS)
        assert {e["log_level"] for e in rejected} == {"info"}
        assert server.service.counters["errors_internal"] == 0
        # The daemon still serves, on the same connection.
        r = await http.post("/v1/completions", json={"prompt": "the", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        await wait_idle(server)
        assert_no_leaks(server)


async def test_the_native_socket_answers_the_same_bodies_bad_request(
        synthetic: ModelRuntime) -> None:
    frames = (b'{"op": "generate", "id": "n1", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
              b'{"op": "generate", "id": "n2", "prompt": "hi", "max_tokens": '
              + b"1" * 4400 + b"}")
    async with running_daemon(synthetic) as (server, path):
        with capture_logs() as logs:
            async with RawConnection.open(path) as raw:
                for frame in frames:
                    await raw.send(frame + b"\n")
                    error = await raw.error()
                    assert error.code is ErrorCode.BAD_REQUEST, error
                    assert "invalid JSON" in error.message
        assert not [e for e in logs if e["log_level"] in ("error", "critical")
                    or e.get("exc_info")]
        async with Client.connect(path) as client:
            done = await client.generate("the", max_tokens=3, temperature=0.0).collect()
            assert len(done.token_ids) == 3
        await wait_idle(server)
        assert_no_leaks(server)


# ----------------------------------------------------------------------------------- HEAD

GET_ROUTES = ("/health", "/metrics", "/v1/models", "/models", "/props", "/slots")


async def test_head_is_answered_as_the_get_without_its_body(synthetic: ModelRuntime) -> None:
    async with daemon(synthetic) as (server, path, http):
        name = server.service.model.name
        for route in (*GET_ROUTES, f"/v1/models/{name}"):
            got = await http.get(route)
            head = await http.head(route)
            assert head.status_code == got.status_code == 200, route
            assert head.content == b"", route
            assert head.headers["content-type"] == got.headers["content-type"], route
            assert int(head.headers["content-length"]) > 0, route
            if route not in ("/health", "/metrics"):  # (their numbers move between calls)
                assert head.headers["content-length"] == got.headers["content-length"], route
        # Errors too: the status and headers, no body.
        for route, status in (("/no-such-route", 404), ("/v1/completions", 405),
                              ("/v1/models/no-such-model", 404),
                              ("/v1/stream?conv_id=none", 404)):
            head = await http.head(route)
            assert (head.status_code, head.content) == (status, b""), route
            assert int(head.headers["content-length"]) > 0, route
        assert (await http.head("/v1/completions")).headers["allow"] == "POST"
        assert "HEAD" in (await http.post("/health")).headers["allow"]
        # The connection goes on: a HEAD, then a GET pipelined behind it.
        raw = await raw_exchange(path, b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n"
                                       b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                       b"Connection: close\r\n\r\n")
        assert status_of(raw) == 200
        first, _, rest = raw.partition(b"\r\n\r\n")
        assert b"content-length: " in first.lower()
        assert rest.startswith(b"HTTP/1.1 200 "), rest[:80]  # (no body between them)
        assert json.loads(rest.partition(b"\r\n\r\n")[2])["object"] == "list"
        await wait_idle(server)
        assert_no_leaks(server)


async def test_curl_head_probes_health(synthetic: ModelRuntime) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed (.ci/run installs it)")
    async with daemon(synthetic) as (_server, path, _http):
        done = await anyio.run_process([curl, "-sI", "--unix-socket", path,
                                        "http://localhost/health"], check=False)
        assert done.returncode == 0, done.stderr
        head = done.stdout.decode().lower()
        assert head.startswith("http/1.1 200") and "content-length:" in head


# ------------------------------------------------------------------------ batched prompts


async def _single(api: openai.AsyncOpenAI, prompt: str | list[int], **fields: Any) -> str:
    got = await api.completions.create(model="m", prompt=prompt, temperature=0, **fields)
    return got.choices[0].text


async def test_completions_batch_prompts_as_openai_numbers_them(
        synthetic: ModelRuntime) -> None:
    async with daemon(synthetic) as (server, _path, http):
        api = _openai(http)
        alone = [await _single(api, p, max_tokens=8) for p in PROMPTS]
        got = await api.completions.create(model="m", prompt=PROMPTS, max_tokens=8,
                                           temperature=0)
        assert [c.index for c in got.choices] == [0, 1, 2]
        assert [c.text for c in got.choices] == alone
        assert {c.finish_reason for c in got.choices} == {"length"}
        ids = [(await http.post("/tokenize", json={"content": p})).json()["tokens"]
               for p in PROMPTS]
        assert got.usage is not None
        assert got.usage.prompt_tokens == sum(len(i) for i in ids)
        assert got.usage.completion_tokens == 3 * 8
        # Token lists, and n per prompt: prompt i's choice j is index i * n + j.
        by_ids = await api.completions.create(model="m", prompt=ids[:2], max_tokens=8,
                                              temperature=0, n=2)
        assert [c.index for c in by_ids.choices] == [0, 1, 2, 3]
        assert [c.text for c in by_ids.choices] == [alone[0], alone[0], alone[1], alone[1]]
        assert by_ids.usage is not None
        assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])
        assert by_ids.usage.completion_tokens == 4 * 8
        # Streamed: each chunk names its choice.
        texts: dict[int, str] = {}
        finishes: dict[int, str | None] = {}
        stream = await api.completions.create(model="m", prompt=PROMPTS, max_tokens=8,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                if choice.finish_reason is not None:
                    finishes[choice.index] = choice.finish_reason
            usage = chunk.usage or usage
        assert [texts[i] for i in range(3)] == alone
        assert finishes == {0: "length", 1: "length", 2: "length"}
        assert usage is not None and usage.completion_tokens == 3 * 8
        assert usage.prompt_tokens == got.usage.prompt_tokens
        await wait_idle(server)
        assert_no_leaks(server)


async def test_completions_batch_bounds(synthetic: ModelRuntime) -> None:
    async with daemon(synthetic) as (server, _path, http):
        for body, words in (
                ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, f"at most {MAX_PROMPTS} prompts"),
                ({"prompt": ["a"] * MAX_PROMPTS, "n": MAX_BATCH_GENERATIONS // MAX_PROMPTS + 1},
                 f"at most {MAX_BATCH_GENERATIONS} completions"),
                ({"prompt": ["a", ""]}, "prompt[1]"),
                ({"prompt": [[1, 2], [-1]]}, "prompt[1]"),
                ({"prompt": ["a", 3]}, "prompt[1]")):
            r = await http.post("/v1/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == "prompt" or error["param"] == "n", error
            assert words in error["message"], error["message"]
        # A prompt of a batch over the context: the whole request is refused, nothing runs.
        r = await http.post("/v1/completions", json={"prompt": ["a", "b c " * N_CTX],
                                                     "max_tokens": 2})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        await wait_idle(server)
        assert_no_leaks(server)


# ------------------------------------------------------------------- the default max_tokens


async def test_no_max_tokens_runs_to_the_end_of_the_context(synthetic: ModelRuntime) -> None:
    async with daemon(synthetic) as (server, path, http):
        r = (await http.post("/v1/completions", json={"prompt": "the", "temperature": 0})).json()
        used = r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
        assert r["choices"][0]["finish_reason"] == "length"
        assert N_CTX - 1 <= used <= N_CTX + 1, r["usage"]  # (the last token needs no room)
        assert r["usage"]["completion_tokens"] > 256  # (the old default)
        async with Client.connect(path) as client:
            done = await client.generate("the", temperature=0.0).collect()
        assert done.done.finish_reason.value == "length"
        assert len(done.token_ids) == r["usage"]["completion_tokens"]
        llama = (await http.post("/completion", json={"prompt": "the"})).json()
        assert llama["tokens_predicted"] > 256 and llama["stop_type"] == "limit"
        assert llama["generation_settings"]["n_predict"] == -1
        props = (await http.get("/props")).json()
        assert props["default_generation_settings"]["params"]["n_predict"] == -1
        await wait_idle(server)
        assert_no_leaks(server)


async def test_the_operators_max_tokens_caps_requests_that_set_none(
        synthetic: ModelRuntime) -> None:
    async with daemon(synthetic, ServerConfig(max_tokens_default=40)) as (server, path, http):
        r = (await http.post("/v1/completions", json={"prompt": "the"})).json()
        assert r["usage"]["completion_tokens"] == 40
        asked = (await http.post("/v1/completions", json={"prompt": "the",
                                                          "max_tokens": 60})).json()
        assert asked["usage"]["completion_tokens"] == 60
        async with Client.connect(path) as client:
            done = await client.generate("the", temperature=0.0).collect()
        assert len(done.token_ids) == 40
        props = (await http.get("/props")).json()
        assert props["default_generation_settings"]["params"]["n_predict"] == 40
        await wait_idle(server)
        assert_no_leaks(server)


async def test_batched_prompts_decode_together(synthetic: ModelRuntime) -> None:
    """A batch's prompts share the scheduler's forwards: far fewer forwards than the
    same prompts one after the other."""
    body = {"prompt": PROMPTS[:2], "max_tokens": 200, "temperature": 0,
            "speculative": {"enabled": False}}
    async with daemon(synthetic) as (server, _path, http):
        before = synthetic.context.forward_id
        for prompt in PROMPTS[:2]:
            r = await http.post("/v1/completions", json={**body, "prompt": prompt})
            assert r.json()["usage"]["completion_tokens"] == 200
        alone = synthetic.context.forward_id - before
        before = synthetic.context.forward_id
        r = await http.post("/v1/completions", json=body)
        assert r.json()["usage"]["completion_tokens"] == 400
        together = synthetic.context.forward_id - before
        assert together < 0.75 * alone, (together, alone)
        await wait_idle(server)
        assert_no_leaks(server)
