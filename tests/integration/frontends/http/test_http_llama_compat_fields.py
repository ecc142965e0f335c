"""llama-server's request fields and stream extras on the OpenAI endpoints, as its
clients (and llama.cpp's own server tests) see them, on SmolLM2: its fields accepted or
refused by name, ``timings_per_token`` and ``return_progress`` in chat, completion and
Responses streams, the role chunk with null content and no empty content delta (tool
calls too), ``/v1/chat/completions/input_tokens`` counting what a chat request would,
and ``n`` with ``id_slot``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from meshd.daemon.config.http import HttpConfig
from meshd.daemon.frontends.http.openai.api import chunk, parse_request
from meshd.daemon.frontends.http.openai.responses import ResponseEvents
from meshd.daemon.frontends.http.openai.responses_format import parse_responses_request
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.api_errors import ApiError
from tests.integration.helpers.daemon import assert_no_leaks, wait_idle
from tests.integration.helpers.http_api import http_daemon, openai_client

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "system", "content": "Book"},
            {"role": "user", "content": "What is the best book"}]
TIMING_KEYS = {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
               "predicted_n", "predicted_ms", "predicted_per_token_ms",
               "predicted_per_second", "cache_n"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


def _chat(**fields: Any) -> bytes:
    return json.dumps({"messages": MESSAGES, **fields}).encode()


# ------------------------------------------------------------------ without a model


def test_llama_server_fields_pass_or_are_refused_by_name() -> None:
    """Fields that change nothing (or are served) pass with their llama-server types;
    samplers meshd lacks pass only switched off; anything else is still a 400 naming
    it."""
    req = parse_request(_chat(
        id_slot=0, cache_prompt=False, timings_per_token=True, return_progress=True,
        verbose=True, t_max_predict_ms=-1, n_probs=0, samplers=None, n_keep=-1,
        xtc_probability=0, xtc_threshold=0.1, dry_multiplier=0.0, dry_base=1.75,
        top_n_sigma=-1, ignore_eos=False, return_tokens=False, n_cache_reuse=0),
        chat=True)
    assert req.llama.timings_per_token and req.llama.return_progress
    assert not parse_request(_chat(), chat=True).llama.timings_per_token
    parse_request(json.dumps({"prompt": "x", "id_slot": 1, "return_progress": False}
                             ).encode(), chat=False)
    for extra, param, why in (
            ({"t_max_predict_ms": 500}, "t_max_predict_ms", "not supported"),
            ({"samplers": ["top_k", "temperature"]}, "samplers", "not supported"),
            ({"samplers": "kt"}, "samplers", "not supported"),
            ({"n_probs": 5}, "n_probs", "not supported"),
            ({"xtc_probability": 0.5}, "xtc_probability", "not supported"),
            ({"ignore_eos": True}, "ignore_eos", "not supported"),
            ({"id_slot": "0"}, "id_slot", "must be an integer"),
            ({"timings_per_token": "yes"}, "timings_per_token", "true or false"),
            ({"cache_prompt": 1}, "cache_prompt", "true or false"),
            ({"id_slots": 0}, "id_slots", "unrecognized request argument"),
            ({"timing_per_token": True}, "timing_per_token", "unrecognized")):
        with pytest.raises(ApiError) as caught:
            parse_request(_chat(**extra), chat=True)
        assert caught.value.status == 400 and caught.value.param == param, extra
        assert why in caught.value.message, caught.value.message
    # The Responses API passes them on to the chat request, and names them as sent.
    resp = parse_responses_request(json.dumps({
        "input": "hi", "timings_per_token": True, "return_progress": True,
        "id_slot": 0, "cache_prompt": True}).encode())
    assert resp.completion.llama.timings_per_token and resp.completion.llama.return_progress
    for extra, param in (({"id_slot": []}, "id_slot"), ({"samplers": "k"}, "samplers"),
                         ({"id_slots": 0}, "id_slots")):
        with pytest.raises(ApiError) as caught:
            parse_responses_request(json.dumps({"input": "hi", **extra}).encode())
        assert caught.value.param == param, extra


def test_n_predict_sets_the_limit_as_on_llama_server() -> None:
    """llama-server's ``n_predict`` on OpenAI's endpoints: it wins over ``max_tokens``,
    and -1 leaves the limit to ``max_tokens`` (or the server's default)."""
    def limit(**fields: Any) -> int | None:
        body = json.dumps({"prompt": "x", **fields}).encode()
        return parse_request(body, chat=False).spec.max_tokens

    assert limit(n_predict=7) == 7
    assert limit(n_predict=7, max_tokens=3) == 7
    assert limit(n_predict=-1, max_tokens=3) == 3
    assert limit(n_predict=-1) is None
    with pytest.raises(ApiError) as caught:
        limit(n_predict=0)
    assert caught.value.param == "n_predict"


def test_a_message_that_is_not_a_message_is_named() -> None:
    for messages, param in (([{}], "messages[0]"),
                            ([{"role": "system", "content": "test"}, {}], "messages[1]"),
                            ([123], "messages[0]"), ([{"role": 123}], "messages[0].role"),
                            ([{"role": "system", "content": 123}], "messages[0].content"),
                            ("string", "messages"), (None, "messages")):
        with pytest.raises(ApiError) as caught:
            parse_request(json.dumps({"messages": messages}).encode(), chat=True)
        assert caught.value.status == 400 and caught.value.param == param, messages


def test_role_chunk_has_null_content_and_no_delta_is_empty_text() -> None:
    req = parse_request(_chat(stream=True), chat=True)
    role = chunk(req, "m", "fp", role=True)["choices"][0]["delta"]
    assert role == {"role": "assistant", "content": None}
    assert chunk(req, "m", "fp", text="")["choices"][0]["delta"] == {}
    assert chunk(req, "m", "fp", text="Hi")["choices"][0]["delta"] == {"content": "Hi"}
    completion = parse_request(json.dumps({"prompt": "x"}).encode(), chat=False)
    assert chunk(completion, "m", "fp")["choices"][0]["text"] == ""


def test_responses_events_carry_progress_and_timings() -> None:
    """``prompt_progress`` rides on ``response.in_progress`` events, ``timings`` on the
    text deltas and beside the completed response (where llama-server has them)."""
    def record(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps({"id": "resp_1", "created": 7, "model": "m",
                                       "object": "chat.completion.chunk", **body}).encode()

    def delta(d: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": d, "finish_reason": finish}]

    progress = [{"total": 9, "cache": 2, "processed": p, "time_ms": t}
                for p, t in ((2, 0.0), (9, 5.0))]
    timed = {"prompt_per_second": 1.0, "predicted_per_second": 2.0, "predicted_n": 1}
    shaper = ResponseEvents({"store": False})
    out = b"".join(shaper.feed(r) for r in (
        record({"choices": delta({"role": "assistant", "content": None}),
                "prompt_progress": progress[0]}),
        record({"choices": delta({}), "prompt_progress": progress[1]}),
        record({"choices": delta({"content": "Hi"}), "timings": timed}),
        record({"choices": delta({}, "length"), "timings": timed, "meshd": {}}),
        record({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                         "total_tokens": 10}, "timings": timed}),
        b"data: [DONE]"))
    events = [json.loads(block.split(b"\n")[1].removeprefix(b"data: "))
              for block in out.split(b"\n\n")[:-1]]
    assert [e["prompt_progress"] for e in events if "prompt_progress" in e] == progress
    assert {e["type"] for e in events if "prompt_progress" in e} == {"response.in_progress"}
    assert [e["type"] for e in events if "timings" in e] == [
        "response.output_text.delta", "response.incomplete"]
    assert events[-1]["response"]["timings"] == timed


# ------------------------------------------------------------------ on SmolLM2


async def _sse(http: httpx.AsyncClient, url: str, body: dict[str, Any]
               ) -> list[dict[str, Any]]:
    """The data objects of a stream (``[DONE]`` checked and left out)."""
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


async def test_chat_stream_role_chunk_and_timings_per_token(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "timings_per_token": True,
                "logprobs": True, "top_logprobs": 2}
        chunks = await _sse(http, "/chat/completions", body)
        first, *rest = chunks
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
        assert "timings" not in first
        with_choices = [c for c in rest if c["choices"]]
        assert all("role" not in c["choices"][0]["delta"] for c in with_choices)
        # No content delta is empty; every one carries the timings so far.
        texts = [c for c in with_choices if "content" in c["choices"][0]["delta"]]
        assert texts and all(c["choices"][0]["delta"]["content"] for c in texts)
        assert all(set(c["timings"]) >= TIMING_KEYS for c in texts)
        counts = [c["timings"]["predicted_n"] for c in texts]
        assert counts == sorted(counts) and counts[-1] <= 10
        assert all(c["timings"]["prompt_n"] + c["timings"]["cache_n"]
                   == chunks[-1]["usage"]["prompt_tokens"] for c in texts)
        # The usage chunk (the last) carries the final timings.
        usage_chunk = chunks[-1]
        assert usage_chunk["choices"] == [] and "timings" in usage_chunk
        assert usage_chunk["timings"]["predicted_n"] == usage_chunk["usage"][
            "completion_tokens"] <= 10
        # Without timings_per_token only the last chunks carry them.
        plain = await _sse(http, "/v1/chat/completions", {**body, "timings_per_token": None})
        assert [i for i, c in enumerate(plain) if "timings" in c] == [len(plain) - 2,
                                                                       len(plain) - 1]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in plain
                       if c["choices"]) == "".join(
            c["choices"][0]["delta"]["content"] for c in texts)
        # The official client: the first delta is the role with null content, and the
        # text and logprobs tokens agree (llama.cpp's test_logprobs_stream).
        api = openai_client(http)
        stream = await api.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
            top_logprobs=3, stream=True, extra_body={"id_slot": 0, "cache_prompt": True})
        text, tokens, roles = "", "", []
        async for i, ch in _enumerate(stream):
            choice = ch.choices[0]
            if i == 0:
                assert choice.delta.role == "assistant" and choice.delta.content is None
                continue
            roles.append(choice.delta.role)
            text += choice.delta.content or ""
            if choice.finish_reason is None:
                assert choice.logprobs is not None and choice.logprobs.content is not None
                tokens += "".join(t.token for t in choice.logprobs.content)
        assert text and tokens == text and set(roles) == {None}
        await wait_idle(server)
        assert_no_leaks(server)


async def _enumerate(stream: Any) -> Any:
    i = 0
    async for item in stream:
        yield i, item
        i += 1


async def test_return_progress_reports_the_cached_and_processed_prompt(
        smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        body = {"messages": [{"role": "user", "content": "This is a test" * 10}],
                "max_tokens": 4, "temperature": 0, "stream": True, "return_progress": True,
                "stream_options": {"include_usage": True}}
        served: list[int] = []
        for _ in range(2):  # the second finds the prompt in the prefix cache
            chunks = await _sse(http, "/chat/completions", body)
            reports = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
            assert len(reports) == 2
            before, after = reports
            total = chunks[-1]["usage"]["prompt_tokens"]
            cached = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert before == {"total": total, "cache": cached, "processed": cached,
                              "time_ms": 0.0}
            assert after["processed"] == after["total"] == total
            assert after["cache"] == cached and after["time_ms"] > 0
            served.append(cached)
            # On the role chunk, then on a chunk of its own with an empty delta.
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert chunks[1]["choices"][0]["delta"] == {}
        assert served[1] > served[0] and served[1] > 0
        # A completion's reports ride on chunks of empty text, before any text.
        chunks = await _sse(http, "/v1/completions", {
            "prompt": "The colours are", "max_tokens": 3, "temperature": 0,
            "stream": True, "return_progress": True})
        assert [c["choices"][0]["text"] for c in chunks[:2]] == ["", ""]
        assert [c["prompt_progress"]["processed"] for c in chunks[:2]] == [
            chunks[0]["prompt_progress"]["cache"], chunks[0]["prompt_progress"]["total"]]
        await wait_idle(server)
        assert_no_leaks(server)


async def test_responses_stream_with_llama_telemetry(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        async with http.stream("POST", "/responses", json={
                "input": "This is a test" * 10, "max_output_tokens": 8, "temperature": 0.8,
                "stream": True, "timings_per_token": True, "return_progress": True}) as r:
            assert r.status_code == 200
            events = [json.loads(line.removeprefix("data: ")) async for line in
                      r.aiter_lines() if line.startswith("data: ")]
        progress = [e for e in events if "prompt_progress" in e]
        assert progress and {e["type"] for e in progress} == {"response.in_progress"}
        assert all(e["prompt_progress"]["processed"] >= e["prompt_progress"]["cache"]
                   for e in progress)
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert deltas and all(set(e["timings"]) >= TIMING_KEYS for e in deltas)
        last = events[-1]
        assert last["type"] in ("response.completed", "response.incomplete")
        assert "usage" in last["response"] and "prompt_per_second" in last["timings"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        await wait_idle(server)
        assert_no_leaks(server)


async def test_streamed_tool_calls_send_no_empty_content(smol: ModelRuntime) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
            "additionalProperties": False}}}]
    async with http_daemon(smol) as (server, _path, http):
        chunks = await _sse(http, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 60, "temperature": 0, "stream": True, "timings_per_token": True})
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
        deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
        assert all(d.get("content", "x") for d in deltas)
        calls = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
        assert len(calls) == 1 and "timings" in calls[0]
        assert calls[0]["choices"][0]["delta"]["tool_calls"][0]["function"][
            "name"] == "get_weather"
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        await wait_idle(server)
        assert_no_leaks(server)


async def test_input_tokens_count_what_the_request_would_prompt(smol: ModelRuntime) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}}}}]
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        for extra in ({}, {"tools": tools}):
            ran = await api.chat.completions.create(model="m", messages=MESSAGES,
                                                    max_tokens=1, **extra)
            assert ran.usage is not None
            for url in ("/chat/completions/input_tokens",
                        "/v1/chat/completions/input_tokens"):
                r = await http.post(url, json={"messages": MESSAGES, **extra})
                assert r.status_code == 200, r.text
                assert r.json() == {"object": "response.input_tokens",
                                    "input_tokens": ran.usage.prompt_tokens}
        r = await http.post("/v1/responses/input_tokens", json={
            "instructions": "Book", "input": "What is the best book"})
        assert r.status_code == 200
        assert r.json()["input_tokens"] == (await http.post(
            "/responses/input_tokens", json={"input": MESSAGES})).json()["input_tokens"]
        for url, body, param in (
                ("/chat/completions/input_tokens",
                 {"messages": [{"role": "system", "content": "test"}, {}]}, "messages[1]"),
                ("/v1/chat/completions/input_tokens",
                 {"messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),
                ("/v1/responses/input_tokens", {"input": [{"role": "robot"}]},
                 "input[0].role"),
                ("/v1/chat/completions/input_tokens",
                 {"messages": [{"role": "user", "content": "x" * 20000}]}, "messages")):
            r = await http.post(url, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, body
        assert (await http.get("/v1/chat/completions/input_tokens")).status_code == 405
        await wait_idle(server)
        assert_no_leaks(server)


async def test_n_choices_with_id_slot(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        for _ in range(2):
            r = await http.post("/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 8, "n": 2, "id_slot": 0})
            assert r.status_code == 200, r.text
            choices = r.json()["choices"]
            assert [c["index"] for c in choices] == [0, 1]
            # sampled (a seed each): a choice may end before its 8 tokens
            assert all(c["message"]["role"] == "assistant"
                       and c["finish_reason"] in ("length", "stop") for c in choices)
            assert 2 <= r.json()["usage"]["completion_tokens"] <= 2 * 8
        await wait_idle(server)
        assert_no_leaks(server)


async def test_verbose_shows_the_prompt_the_model_read(smol: ModelRuntime) -> None:
    """llama-server's ``verbose``: a non-streamed answer carries ``__verbose`` with the
    prompt as the model read it (the chat template's output, what /apply-template
    renders) and the text; ``[http] verbose_responses`` makes it the default, which a
    request's ``verbose: false`` turns off."""
    ask = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    async with http_daemon(smol) as (server, _path, http):
        rendered = (await http.post("/apply-template", json={"messages": MESSAGES})).json()
        for url, body in (("/v1/chat/completions", ask),
                          ("/v1/completions", {"prompt": rendered["prompt"],
                                               "max_tokens": 3, "temperature": 0})):
            plain = (await http.post(url, json=body)).json()
            assert "__verbose" not in plain
            verbose = (await http.post(url, json={**body, "verbose": True})).json()
            block = verbose["__verbose"]
            assert block["prompt"].endswith(rendered["prompt"]), block["prompt"]
            assert "<|im_start|>system\nBook" in block["prompt"]
            choice = verbose["choices"][0]
            assert block["content"] == choice.get("text", (choice.get("message") or {}).get(
                "content"))
            assert block["tokens_evaluated"] == verbose["usage"]["prompt_tokens"]
            assert (await http.post(url, json={**body, "verbose": "yes"})).status_code == 400
        await wait_idle(server)
        assert_no_leaks(server)
    async with http_daemon(smol, HttpConfig(verbose_responses=True)) as (server, _p, http):
        on = (await http.post("/v1/chat/completions", json=ask)).json()
        assert on["__verbose"]["prompt"].endswith(rendered["prompt"])
        off = (await http.post("/v1/chat/completions", json={**ask, "verbose": False})).json()
        assert "__verbose" not in off
        await wait_idle(server)
