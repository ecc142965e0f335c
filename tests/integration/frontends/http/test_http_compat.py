"""The HTTP API as clients of OpenAI and llama-server expect it, on SmolLM2:
``/v1/models/{id}``, llama-server's un-prefixed aliases and extras (``/tokenize``,
``/detokenize``, ``/apply-template``, ``/props``), ``system_fingerprint`` and
``cached_tokens``, prompt arrays, and OpenAI's error codes and field names."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.protocol import Client
from tests.integration.helpers.daemon import assert_no_leaks, running_daemon, wait_idle
from tests.integration.helpers.http_api import http_daemon, openai_client

pytestmark = pytest.mark.anyio

PROMPT = "The three primary colours are"
MESSAGES = [{"role": "user", "content": "Say hello in French."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


async def test_model_by_id_and_unprefixed_aliases(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        name = server.service.model.name
        model = await openai_client(http).models.retrieve(name)
        assert (model.id, model.object) == (name, "model")
        r = await http.get("/v1/models/no-such-model")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model"
        assert (await http.get("/models")).json()["data"][0]["id"] == name
        assert (await http.get(f"/models/{name}")).json()["id"] == name
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        v1 = (await http.post("/v1/completions", json=body)).json()
        bare = (await http.post("/completions", json=body)).json()
        # /completions is llama-server's own endpoint (its answer's shape), not an alias.
        assert bare["content"] == v1["choices"][0]["text"]
        chat = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        v1 = (await http.post("/v1/chat/completions", json=chat)).json()
        bare = (await http.post("/chat/completions", json=chat)).json()
        assert bare["choices"][0]["message"] == v1["choices"][0]["message"]
        await wait_idle(server)
        assert_no_leaks(server)


async def test_llama_server_tokenize_detokenize(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (_server, path, http):
        content = "What is the capital of France ?"
        r = await http.post("/tokenize", json={"content": content})
        assert r.status_code == 200
        tokens = r.json()["tokens"]
        async with Client.connect(path) as native:
            assert tuple(tokens) == await native.tokenize(content, add_special=False)
        r = await http.post("/detokenize", json={"tokens": tokens})
        assert r.status_code == 200 and r.json()["content"] == content
        # Special tokens in the text are parsed (llama-server's default).
        r = await http.post("/tokenize", json={"content": "<|im_start|>"})
        assert len(r.json()["tokens"]) == 1
        text = "unicode 媽 and emoji 🤗"
        r = await http.post("/tokenize", json={"content": text, "with_pieces": True})
        pieces = r.json()["tokens"]
        assert all(isinstance(p["id"], int) and p["piece"] for p in pieces)
        joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str)
                          else bytes(p["piece"]) for p in pieces)
        assert joined.decode() == text
        for url, body, param in (("/tokenize", {"content": 5}, "content"),
                                 ("/tokenize", {"content": "x", "add_special": 1},
                                  "add_special"),
                                 ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
                                 ("/detokenize", {"tokens": "1"}, "tokens")):
            r = await http.post(url, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        r = await http.get("/tokenize")
        assert r.status_code == 405


async def test_extras_replies_are_bounded_like_native_ones(smol: ModelRuntime) -> None:
    """No more token ids than a native reply frame carries, no longer text."""
    config = ServerConfig(max_frame_size=4096)
    async with running_daemon(smol, config) as (_server, path):
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://meshd") as http:
            r = await http.post("/tokenize", json={"content": "a " * 3000})
            assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
            ids = (await http.post("/tokenize", json={"content": "a " * 1000})).json()
            r = await http.post("/detokenize", json={"tokens": ids["tokens"] * 3})
            assert r.status_code == 413 and "above the limit of 4096" in r.text


async def test_llama_server_apply_template_and_props(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        messages = [{"role": "system", "content": "You are a test."},
                    {"role": "user", "content": "Hi there"}]
        r = await http.post("/apply-template", json={"messages": messages})
        assert r.status_code == 200
        assert r.json()["prompt"] == smol.render_chat(messages)
        r = await http.post("/apply-template", json={"messages": [
            {"role": "wizard", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
        props = (await http.get("/props")).json()
        assert props["default_generation_settings"]["n_ctx"] == 1024
        assert props["default_generation_settings"]["params"]["seed"] == -1  # random
        assert props["total_slots"] == 2
        assert props["model_path"].endswith(".gguf")
        assert props["chat_template"] == smol.model.chat_template
        assert props["build_info"].startswith("meshd ")
        assert server.service.model.has_chat_template


async def test_fingerprint_and_cached_tokens(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        first = await api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4,
                                                  temperature=0)
        again = await api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4,
                                                  temperature=0)
        fp = first.system_fingerprint
        assert fp is not None and fp.startswith("fp_") and again.system_fingerprint == fp
        assert first.usage is not None and again.usage is not None
        assert again.usage.prompt_tokens_details is not None
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached == (again.model_extra or {})["timings"]["cache_n"]
        assert cached is not None and cached > 0  # the same prompt: its prefix is reused
        done = await api.completions.create(model="m", prompt=PROMPT, max_tokens=3,
                                            temperature=0)
        assert done.system_fingerprint == fp
        stream = await api.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks and all(c.system_fingerprint == fp for c in chunks)
        last = chunks[-1].usage
        assert last is not None and last.prompt_tokens_details is not None
        assert last.prompt_tokens_details.cached_tokens == cached
        await wait_idle(server)
        assert_no_leaks(server)


async def test_prompt_arrays_on_completions(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        ref = await api.completions.create(model="m", prompt=PROMPT, max_tokens=8,
                                           temperature=0)
        one = await api.completions.create(model="m", prompt=[PROMPT], max_tokens=8,
                                           temperature=0)
        ids = (await http.post("/tokenize", json={"content": PROMPT})).json()["tokens"]
        by_ids = await api.completions.create(model="m", prompt=ids, max_tokens=8,
                                              temperature=0)
        assert one.choices[0].text == by_ids.choices[0].text == ref.choices[0].text
        assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
        both = await api.completions.create(model="m", prompt=[PROMPT, ids], max_tokens=8,
                                            temperature=0)
        assert [c.text for c in both.choices] == [ref.choices[0].text] * 2
        assert [c.index for c in both.choices] == [0, 1]
        r = await http.post("/v1/completions", json={"prompt": [1, 10**9], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = await http.post("/v1/completions", json={"prompt": [1] * 2000, "max_tokens": 2})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded"
        assert (err["n_prompt_tokens"], err["n_ctx"]) == (2000, smol.context.config.n_ctx_seq)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_openai_error_codes_and_field_names(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        r = await http.post("/v1/completions", json={"prompt": "x " * 3000, "max_tokens": 4})
        err = r.json()["error"]
        assert r.status_code == 400
        assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
        assert "does not fit the context" in err["message"]
        # llama-server's type and counts beside OpenAI's code (its web UI reads them)
        n_ctx = smol.context.config.n_ctx_seq
        assert err["type"] == "exceed_context_size_error"
        assert err["n_ctx"] == n_ctx and err["n_prompt_tokens"] > n_ctx, err
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x " * 3000}], "stream": True})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded"
        assert err["param"] == "messages" and err["n_prompt_tokens"] > n_ctx, err
        # a prompt refused by its length in bytes was never counted: no token count
        r = await http.post("/v1/completions", json={"prompt": "x" * 400_000})
        err = r.json()["error"]
        assert (err["type"], err["n_ctx"]) == ("exceed_context_size_error", n_ctx)
        assert "n_prompt_tokens" not in err and "bytes" in err["message"]
        for key in ("max_tokens", "max_completion_tokens"):
            r = await http.post("/v1/chat/completions", json={
                "messages": MESSAGES, key: 100_000})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == key, err
            assert err["message"].startswith(f"{key}: ") and "generate." not in err["message"]
        r = await http.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "response_format": {"type": "text"}})
        assert r.status_code == 200
        for extra, param in (({"response_format": {"type": "json"}}, "response_format"),
                             ({"frobnicate": True}, "frobnicate"),
                             ({"presence_penalty": 7}, "presence_penalty")):
            r = await http.post("/v1/completions", json={"prompt": PROMPT, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "narrator", "content": "x"}], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
        r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                     "user": "u", "store": False,
                                                     "metadata": {"k": "v"}})
        assert r.status_code == 200, r.text
        assert json.loads(r.text)["choices"][0]["finish_reason"] == "length"
        assert server.service.counters["errors_model_error"] >= 2
        await wait_idle(server)
        assert_no_leaks(server)
