"""Ollama's API (``/api/...``) as the official ``ollama`` Python client uses it, on
SmolLM2 over the daemon's socket: listing, showing and the loaded models, chat and
generate (streamed and not) giving the tokens the OpenAI endpoints give, ``format``
schemas, a tool call round trip, and the model store's endpoints refused in Ollama's
error shape."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import jsonschema
import pytest

from meshd.daemon.commands.server import Server, serving
from meshd.daemon.config.http import HttpConfig
from meshd.daemon.models.model_set import ModelPlan, ModelSet, ModelState
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.native.default_model import default_model_path
from meshd.testing import testmodels
from tests.integration.helpers.daemon import (
    assert_no_leaks,
    running_daemon,
    short_tempdir,
    wait_idle,
)

ollama = pytest.importorskip("ollama")

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "Say hello in French."}]
GREEDY = {"temperature": 0, "num_predict": 8}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a given city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


@contextlib.asynccontextmanager
async def ollama_daemon(rt: ModelRuntime
                        ) -> AsyncIterator[tuple[Server, Any, httpx.AsyncClient]]:
    """A daemon, the official client on its socket, and a raw HTTP client."""
    async with running_daemon(rt) as (server, path):
        async with ollama.AsyncClient(host="http://meshd",
                                      transport=httpx.AsyncHTTPTransport(uds=path)) as client, \
                httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path),
                                  base_url="http://meshd", timeout=60) as http:
            yield server, client, http
        await wait_idle(server)
        assert_no_leaks(server)


async def test_list_show_ps_and_version(smol: ModelRuntime) -> None:
    async with ollama_daemon(smol) as (server, client, http):
        name = server.service.model.name
        listed = (await client.list()).models
        assert [m.model for m in listed] == [f"{name}:latest"]
        details = listed[0].details
        assert (details.format, details.family) == ("gguf", "llama")
        assert (details.parameter_size, details.quantization_level) == ("134.52M", "Q4_1")
        assert listed[0].size == smol.model.info.size_bytes
        assert len(listed[0].digest) == 64
        shown = await client.show(f"{name}:latest")
        assert shown.capabilities == ["completion", "tools"]
        assert "<|im_start|>" in (shown.template or "")
        assert shown.modelinfo["llama.context_length"] == 1024
        running = (await client.ps()).models
        assert [(m.model, m.context_length) for m in running] == [(f"{name}:latest", 1024)]
        version = (await http.get("/api/version")).json()
        assert version["version"].count(".") == 2 and "meshd" in version


async def test_chat_streamed_and_not_give_the_openai_tokens(smol: ModelRuntime) -> None:
    async with ollama_daemon(smol) as (_server, client, http):
        got = await client.chat(model="smollm2", messages=MESSAGES, options=GREEDY)
        ref = (await http.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 8, "temperature": 0})).json()
        assert got.message.role == "assistant"
        assert got.message.content == ref["choices"][0]["message"]["content"]
        assert (got.done, got.done_reason, got.model) == (True, "length", "smollm2")
        assert got.eval_count == 8 == ref["usage"]["completion_tokens"]
        assert got.prompt_eval_count == ref["usage"]["prompt_tokens"]
        for field in ("total_duration", "prompt_eval_duration", "eval_duration"):
            assert isinstance(got[field], int) and got[field] > 0, field
        assert got.total_duration >= got.eval_duration
        parts = [part async for part in await client.chat(
            model="smollm2", messages=MESSAGES, options=GREEDY, stream=True)]
        assert all(not p.done for p in parts[:-1]) and parts[-1].done
        assert "".join(p.message.content for p in parts) == got.message.content
        assert (parts[-1].done_reason, parts[-1].eval_count) == ("length", 8)
        # think false is served (a reasoning template's thinking off); logprobs too.
        probed = await client.chat(model="smollm2", messages=MESSAGES, options=GREEDY,
                                   think=False, logprobs=True, top_logprobs=2)
        assert probed.message.content == got.message.content
        assert probed.logprobs is not None and len(probed.logprobs) == 8
        assert all(len(lp.top_logprobs or []) == 2 for lp in probed.logprobs)
        # Ollama streams unless told not to: NDJSON, one object a line.
        r = await http.post("/api/chat", json={"model": "x", "messages": MESSAGES,
                                               "options": GREEDY})
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.text.splitlines()]
        assert lines[-1]["done"] is True and len(lines) >= 2


async def test_generate_templated_raw_and_streamed(smol: ModelRuntime) -> None:
    prompt = "The three primary colours are"
    async with ollama_daemon(smol) as (_server, client, http):
        templated = await client.generate(model="smollm2", prompt=prompt, options=GREEDY)
        chat = await client.chat(model="smollm2", messages=[
            {"role": "user", "content": prompt}], options=GREEDY)
        assert templated.response == chat.message.content
        raw = await client.generate(model="smollm2", prompt=prompt, raw=True, options=GREEDY)
        ref = (await http.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0})).json()
        assert raw.response == ref["choices"][0]["text"]
        assert raw.prompt_eval_count == ref["usage"]["prompt_tokens"]
        parts = [part async for part in await client.generate(
            model="smollm2", prompt=prompt, raw=True, options=GREEDY, stream=True)]
        assert "".join(p.response for p in parts) == raw.response
        # An empty prompt loads the model (keep_alive 0: and unloads it), as Ollama's does.
        loaded = await client.generate(model="smollm2")
        assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
        unloaded = await client.generate(model="smollm2", keep_alive=0)
        assert unloaded.done_reason == "unload"


async def test_format_json_and_schema(smol: ModelRuntime) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    ask = [{"role": "user", "content": "Give a person as JSON."}]
    async with ollama_daemon(smol) as (_server, client, _http):
        got = await client.chat(model="smollm2", messages=ask, format=schema,
                                options={"temperature": 0, "num_predict": 64})
        assert got.done_reason == "stop"
        jsonschema.validate(json.loads(got.message.content), schema)
        free = await client.generate(
            model="smollm2", prompt="Reply with a JSON object with a name and an age.",
            format="json", options={"temperature": 0, "num_predict": 64})
        assert free.done_reason == "stop"
        assert isinstance(json.loads(free.response), dict)


async def test_tool_call_round_trip(smol: ModelRuntime) -> None:
    ask = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    forced = {"temperature": 0, "num_predict": 64, "tool_choice": "required"}
    async with ollama_daemon(smol) as (_server, client, _http):
        got = await client.chat(model="smollm2", messages=ask, tools=[WEATHER], options=forced)
        calls = got.message.tool_calls
        assert calls is not None and len(calls) == 1
        assert calls[0].function.name == "get_weather"
        assert isinstance(calls[0].function.arguments, dict)
        assert isinstance(calls[0].function.arguments["city"], str)
        parts = [part async for part in await client.chat(
            model="smollm2", messages=ask, tools=[WEATHER], options=forced, stream=True)]
        streamed = [c for p in parts for c in p.message.tool_calls or []]
        assert [c.function.arguments for c in streamed] == [calls[0].function.arguments]
        # The call and its result go back as Ollama sends them; the model answers in text.
        answer = await client.chat(model="smollm2", tools=[WEATHER], options=GREEDY, messages=[
            *ask, got.message,
            {"role": "tool", "content": "11 degrees celsius", "tool_name": "get_weather"}])
        assert answer.done and answer.message.content and not answer.message.tool_calls


async def test_refusals_in_ollamas_error_shape(smol: ModelRuntime) -> None:
    async with ollama_daemon(smol) as (_server, client, http):
        with pytest.raises(ollama.ResponseError) as pulled:
            await client.pull("smollm2")
        assert pulled.value.status_code == 501
        assert "never downloads" in pulled.value.error
        for path, method in (("/api/create", "POST"), ("/api/copy", "POST"),
                             ("/api/push", "POST"), ("/api/delete", "DELETE")):
            r = await http.request(method, path, json={"model": "smollm2"})
            assert r.status_code == 501 and set(r.json()) == {"error"}, path
        r = await http.get("/api/nothing")
        assert r.status_code == 404 and set(r.json()) == {"error"}
        cases = [
            ({"options": {"mirostat": 2}}, "options.mirostat"),
            ({"options": {"num_ctx": 4096}}, "options.num_ctx"),
            ({"options": {"temperature": 3}}, "options.temperature"),
            ({"options": {"no_such_option": 1}}, "options.no_such_option"),
            ({"format": "yaml"}, "format"),
            ({"think": True}, "think"),
            ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
             "messages[0].images"),
        ]
        for extra, field in cases:
            body = {"model": "smollm2", "messages": MESSAGES, "stream": False, **extra}
            r = await http.post("/api/chat", json=body)
            assert r.status_code == 400, extra
            assert r.json()["error"].startswith(field), (extra, r.json())
        with pytest.raises(ollama.ResponseError) as refused:
            await client.generate(model="smollm2", prompt="def f(", suffix="return 1")
        assert refused.value.status_code == 400 and "suffix" in refused.value.error
        nested = b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"
        for path in ("/api/chat", "/api/generate", "/api/show"):
            r = await http.post(path, content=nested)
            assert r.status_code == 400 and "nested" in r.json()["error"], path
        head = await http.head("/api/tags")
        assert head.status_code == 200 and head.content == b""


async def test_models_by_ollama_names_loaded_and_unloaded() -> None:
    """With several models: Ollama's names (with or without ``:latest``) choose one, an
    empty prompt loads it and ``keep_alive`` 0 unloads it; another name is a 404."""
    common = dict(n_ctx_seq=512, n_seq_max=2, draft_max=3, calibrate=False, threads=1)
    paths = {"smol": str(default_model_path()),
             "mtp": str(testmodels.test_model_path("qwen35", acceptance=0.9))}
    models = ModelSet([ModelPlan(name, RuntimeConfig(model_path=path, **common),
                                 size_bytes=os.path.getsize(path))
                       for name, path in paths.items()],
                      lambda plan: ModelRuntime(plan.config))
    try:
        async with running_daemon(models) as (_server, path), ollama.AsyncClient(
                host="http://meshd", transport=httpx.AsyncHTTPTransport(uds=path)) as client:
            listed = [m.model for m in (await client.list()).models]
            assert listed == ["smol:latest", "mtp:latest"]
            loaded = await client.generate(model="mtp:latest")
            assert (loaded.done_reason, loaded.model) == ("load", "mtp:latest")
            assert "mtp:latest" in [m.model for m in (await client.ps()).models]
            unloaded = await client.generate(model="mtp", keep_alive=0)
            assert unloaded.done_reason == "unload"
            with anyio.fail_after(10):
                while models.get("mtp").state is not ModelState.UNLOADED:
                    await anyio.sleep(0.05)
            assert "mtp:latest" not in [m.model for m in (await client.ps()).models]
            with pytest.raises(ollama.ResponseError) as unknown:
                await client.chat(model="llama3.2", messages=MESSAGES, stream=False)
            assert unknown.value.status_code == 404
            assert "model 'llama3.2' not found" in unknown.value.error
    finally:
        models.close()


async def test_the_tcp_listener_with_its_api_key(smol: ModelRuntime) -> None:
    """``--http`` serves the same API; without the key the 401 is in Ollama's shape."""
    config = ServerConfig(http=HttpConfig(api_key="k3y"))
    async with serving(smol, f"{short_tempdir()}/s", config, http="tcp:127.0.0.1:0") as server:
        assert server.http_listener is not None
        host = f"http://127.0.0.1:{server.http_listener.address.rpartition(':')[2]}"
        async with ollama.AsyncClient(host=host, headers={"Authorization": "Bearer k3y"}
                                      ) as client:
            got = await client.generate(model="smollm2", prompt="Hi", options=GREEDY)
            assert got.done and got.eval_count == 8
        async with ollama.AsyncClient(host=host) as anonymous:
            with pytest.raises(ollama.ResponseError) as refused:
                await anonymous.list()
        assert refused.value.status_code == 401
        assert isinstance(refused.value.error, str) and "API key" in refused.value.error
