"""OpenAI's Responses API (``POST /v1/responses``) on SmolLM2, through the official
client: the answer is the chat endpoint's for the same conversation (text, tokens,
instructions as the system turn, structured outputs, tool calls and their results);
the stream's typed events come in OpenAI's order and join to the same text; a cut is
``incomplete``; bad requests are a 400 naming the field as sent; a disconnect cancels.
The stream's failure path and the error renaming are checked without a model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import jsonschema
import openai
import pytest

from meshd.daemon.frontends.http.openai.responses import ResponseEvents
from meshd.daemon.frontends.http.openai.responses_format import parse_responses_request
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.api_errors import ApiError
from meshd.protocol import StreamReceiver
from tests.integration.helpers.daemon import assert_no_leaks, assert_serves, wait_idle
from tests.integration.helpers.http_api import http_daemon, openai_client

pytestmark = pytest.mark.anyio

ASK = "What is the capital of France? Answer in one sentence."
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "country": {"type": "string", "maxLength": 30}},
    "required": ["city", "country"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
FLAT_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather",
             "parameters": WEATHER, "strict": True}
CHAT_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather", "parameters": WEATHER}}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    assert rt.idle_slots == 2
    rt.close()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def test_answer_equals_chat_and_any_model_name_is_served(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        served = (await api.models.list()).data[0].id
        got = await api.responses.create(model="no-such-model", input=ASK,
                                         max_output_tokens=64, temperature=0)
        ref = await api.chat.completions.create(model="smollm2", messages=user(ASK),
                                                max_tokens=64, temperature=0)
        assert ref.choices[0].finish_reason == "stop" and ref.usage is not None
        assert got.output_text == ref.choices[0].message.content
        assert got.id.startswith("resp_") and got.object == "response"
        assert got.model == ref.model == served
        assert got.status == "completed" and got.incomplete_details is None
        assert got.error is None and got.store is False and got.max_output_tokens == 64
        (item,) = got.output
        assert item.type == "message" and item.role == "assistant"
        assert item.status == "completed" and item.id.startswith("msg_")
        assert [part.type for part in item.content] == ["output_text"]
        assert got.usage is not None
        assert got.usage.input_tokens == ref.usage.prompt_tokens
        assert got.usage.output_tokens == ref.usage.completion_tokens
        assert got.usage.total_tokens == ref.usage.total_tokens
        # llama-server's un-prefixed path, and store/metadata accepted (nothing is stored)
        r = await http.post("/responses", json={
            "input": ASK, "max_output_tokens": 64, "temperature": 0, "store": True,
            "metadata": {"ticket": "42"}, "user": "u1", "reasoning": None})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["output"][0]["content"][0]["text"] == got.output_text
        assert body["store"] is False and body["metadata"] == {"ticket": "42"}
        # A cut answer is incomplete, with the reason.
        cut = await api.responses.create(model="m", input=ASK, max_output_tokens=3,
                                         temperature=0)
        assert cut.status == "incomplete" and cut.incomplete_details is not None
        assert cut.incomplete_details.reason == "max_output_tokens"
        assert cut.output[0].status == "incomplete"
        assert cut.usage is not None and cut.usage.output_tokens == 3
        assert got.output_text.startswith(cut.output_text) and cut.output_text
        await wait_idle(server)
        assert_no_leaks(server)


async def test_instructions_and_input_items_are_the_chat_turns(smol: ModelRuntime) -> None:
    instructions = "You are a pirate. Always answer like a pirate."
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": "Keep answers short."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
        {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Ahoy!", "annotations": []}]},
        {"role": "user", "content": "What is your favourite food?"},
    ]
    turns = [{"role": "developer", "content": "Keep answers short."},
             *user("Hi!"), {"role": "assistant", "content": "Ahoy!"},
             *user("What is your favourite food?")]
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        got = await api.responses.create(model="m", instructions=instructions,
                                         input=items, max_output_tokens=40,
                                         temperature=0)
        ref = await api.chat.completions.create(
            model="m", messages=[{"role": "system", "content": instructions}, *turns],
            max_tokens=40, temperature=0)
        bare = await api.chat.completions.create(model="m", messages=turns,
                                                 max_tokens=1, temperature=0)
        assert got.output_text == ref.choices[0].message.content
        assert got.usage is not None and ref.usage is not None and bare.usage is not None
        assert got.usage.input_tokens == ref.usage.prompt_tokens
        assert got.usage.input_tokens > bare.usage.prompt_tokens  # the instructions count
        assert got.instructions == instructions
        await wait_idle(server)
        assert_no_leaks(server)


async def test_stream_events_in_order_join_to_the_same_text(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        ref = await api.chat.completions.create(model="m", messages=user(ASK),
                                                max_tokens=6, temperature=0)
        events = [e async for e in await api.responses.create(
            model="m", input=ASK, max_output_tokens=6, temperature=0, stream=True)]
        kinds = [e.type for e in events]
        n_deltas = kinds.count("response.output_text.delta")
        assert n_deltas >= 1
        assert kinds == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         *["response.output_text.delta"] * n_deltas,
                         "response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.incomplete"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == ref.choices[0].message.content
        item_ids = {getattr(e, "item_id", None) for e in events} - {None}
        assert len(item_ids) == 1
        last = events[-1].response
        assert last.output_text == text and last.status == "incomplete"
        assert last.incomplete_details.reason == "max_output_tokens"
        assert last.usage.output_tokens == 6 and last.output[0].id in item_ids
        assert events[0].response.status == "in_progress"
        # On the wire: an event: line naming each data's type, and no [DONE].
        whole = await api.responses.create(model="m", input=ASK, max_output_tokens=64,
                                           temperature=0)
        async with http.stream("POST", "/v1/responses", json={
                "input": ASK, "max_output_tokens": 64, "temperature": 0,
                "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            records = [rec async for rec in _records(r.aiter_lines())]
        assert all(kind == data["type"] for kind, data in records)
        assert records[-1][0] == "response.completed"
        assert records[-1][1]["response"]["status"] == "completed"
        streamed = "".join(d["delta"] for k, d in records if k == "response.output_text.delta")
        assert streamed == whole.output_text
        await wait_idle(server)
        assert_no_leaks(server)


async def _records(lines: Any) -> Any:
    """(event name, data) of each server-sent event; fails on a data: line alone."""
    kind = None
    async for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            assert kind is not None, line
            yield kind, json.loads(line.removeprefix("data: "))
            kind = None


async def test_json_schema_format_gives_valid_json(smol: ModelRuntime) -> None:
    ask = "Where is the Eiffel Tower? Answer as JSON."
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        got = await api.responses.create(
            model="m", input=ask, max_output_tokens=80, temperature=0,
            text={"format": {"type": "json_schema", "name": "place", "schema": CITY,
                             "strict": True}})
        assert got.status == "completed"
        jsonschema.validate(json.loads(got.output_text), CITY)
        ref = await api.chat.completions.create(
            model="m", messages=user(ask), max_tokens=80, temperature=0,
            response_format={"type": "json_schema", "json_schema": {
                "name": "place", "schema": CITY, "strict": True}})
        assert got.output_text == ref.choices[0].message.content
        assert got.text is not None and got.text.format is not None
        assert got.text.format.type == "json_schema"
        await wait_idle(server)
        assert_no_leaks(server)


async def test_function_calls_and_their_outputs(smol: ModelRuntime) -> None:
    ask = "What is the weather in Rome?"
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        got = await api.responses.create(
            model="m", input=ask, max_output_tokens=80, temperature=0, tools=[FLAT_TOOL],
            tool_choice={"type": "function", "name": "get_weather"})
        ref = await api.chat.completions.create(
            model="m", messages=user(ask), max_tokens=80, temperature=0, tools=[CHAT_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert got.status == "completed"
        calls = [item for item in got.output if item.type == "function_call"]
        assert len(calls) == 1 and got.output == calls  # no empty message item
        call = calls[0]
        assert call.name == "get_weather" and call.id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        (chat_call,) = ref.choices[0].message.tool_calls or []
        assert call.arguments == chat_call.function.arguments
        # The call and its output in the next request: as chat's tool turns.
        items = [*user(ask), {"type": "function_call", "call_id": call.call_id,
                              "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id,
                  "output": "18 degrees and sunny"}]
        after = await api.responses.create(model="m", input=items, max_output_tokens=40,
                                           temperature=0, tools=[FLAT_TOOL])
        ref_after = await api.chat.completions.create(
            model="m", max_tokens=40, temperature=0, tools=[CHAT_TOOL],
            messages=[*user(ask), {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {
                    "name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id,
                 "content": "18 degrees and sunny"}])
        assert after.usage is not None and ref_after.usage is not None
        assert after.usage.input_tokens == ref_after.usage.prompt_tokens
        assert after.output_text == (ref_after.choices[0].message.content or "")
        await wait_idle(server)
        assert_no_leaks(server)


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"max_token": 5}, "max_token", "unrecognized"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, "conversation", "stores no responses"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "text parts"),
    ({"input": [*user("hi"), {"type": "item_reference", "id": "msg_1"}]}, "input[1].type",
     "item_reference"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "robot"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id", "non-empty"),
    ({"instructions": 5}, "instructions", "string"),
    ({"max_output_tokens": 0}, "max_output_tokens", "positive"),
    ({"temperature": 3}, "temperature", "between"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "xml"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nonsense"}}}},
     "text.format", "nonsense"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "web_search"),
    ({"tools": [CHAT_TOOL]}, "tools[0]", "flat shape"),
    ({"tools": [{**FLAT_TOOL, "name": "bad name"}]}, "tools[0].name", "letters"),
    ({"tools": [FLAT_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "nope"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "reasoning effort"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "16"),
    ({"background": True}, "background", "background"),
    ({"input": "word " * 2000}, "input", "context"),
]


async def test_bad_requests_name_the_field_as_sent(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, path, http):
        for extra, param, needle in BAD:
            r = await http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4,
                                                       **extra})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (extra, error)
            # (a context overflow has llama-server's type, as on chat: its web UI reads it)
            kind = "exceed_context_size_error" if needle == "context" \
                else "invalid_request_error"
            assert needle in error["message"] and error["type"] == kind, (extra, error)
        api = openai_client(http)
        with pytest.raises(openai.BadRequestError, match="stores no responses"):
            await api.responses.create(model="m", input="hi", previous_response_id="resp_1")
        r = await http.get("/v1/responses")
        assert r.status_code == 405
        await assert_serves(path)
        assert_no_leaks(server)


async def test_disconnect_cancels_the_streamed_response(smol: ModelRuntime) -> None:
    data = json.dumps({"input": "Write a long story about a dragon.", "temperature": 0,
                       "max_output_tokens": 400, "stream": True}).encode()
    async with http_daemon(smol) as (server, path, _http):
        cancelled = server.scheduler.statistics().cancelled
        stream = await anyio.connect_unix(path)
        receiver = StreamReceiver(stream)
        await stream.send(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          b"application/json\r\nContent-Length: " + str(len(data)).encode()
                          + b"\r\n\r\n" + data)
        with anyio.fail_after(30):
            assert (await receiver.receive()).startswith(b"HTTP/1.1 200")
        await receiver.aclose()
        await wait_idle(server, timeout=30)
        assert server.scheduler.statistics().cancelled == cancelled + 1
        assert_no_leaks(server)
        await assert_serves(path)


# ------------------------------------------------------------------ without a model


def _chunk(**delta: Any) -> bytes:
    finish = delta.pop("finish", None)
    return b"data: " + json.dumps({
        "id": "resp_1", "created": 7, "model": "m", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode()


def _events(records: list[bytes]) -> list[dict[str, Any]]:
    shaper = ResponseEvents({"store": False})
    out = b"".join(shaper.feed(record) for record in records)
    events = []
    for block in out.split(b"\n\n")[:-1]:
        head, data = block.split(b"\n")
        payload = json.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + payload["type"].encode()
        events.append(payload)
    return events


def test_a_failure_after_the_stream_began_is_an_error_then_failed() -> None:
    events = _events([_chunk(role="assistant", content=""), _chunk(content="Hel"),
                      b'data: {"error": {"message": "boom", "type": "server_error", '
                      b'"param": null, "code": "model_error"}}', b"data: [DONE]"])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "error",
        "response.failed"]
    assert events[-2]["message"] == "boom" and events[-2]["code"] == "model_error"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "boom"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_streamed_tool_calls_are_function_call_items() -> None:
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
             "prompt_tokens_details": {"cached_tokens": 2}}
    events = _events([_chunk(role="assistant", content=""), _chunk(tool_calls=[call]),
                      _chunk(finish="tool_calls"),
                      b"data: " + json.dumps({"id": "resp_1", "created": 7, "model": "m",
                                              "choices": [], "usage": usage}).encode(),
                      b"data: [DONE]"])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[2]["item"]["arguments"] == "" and events[2]["output_index"] == 0
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"] == [events[5]["item"]]
    assert done["output"][0]["call_id"] == "call_1"
    assert done["output"][0]["arguments"] == '{"city": "Rome"}'
    assert done["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2},
                             "output_tokens": 9, "output_tokens_details": {
                                 "reasoning_tokens": 0}, "total_tokens": 14}


def test_chat_errors_are_renamed_to_the_fields_sent() -> None:
    req = parse_responses_request(json.dumps({
        "instructions": "be brief", "input": [*user("hi"), *user("again")]}).encode())
    assert req.origins == ("instructions", "input[0]", "input[1]")
    renamed = req.renamed(ApiError(400, "messages[2].content: too long",
                                   param="messages[2].content"))
    assert renamed.param == "input[1].content"
    assert renamed.message == "input[1].content: too long"
    assert req.renamed(ApiError(400, "x", param="messages[0].content")).param == \
        "instructions"
    assert req.renamed(ApiError(400, "response_format.json_schema.schema: bad",
                                param="response_format.json_schema.schema")).param == \
        "text.format.schema"
    assert req.completion.max_tokens_param == "max_output_tokens"
    assert req.completion.spec.id.startswith("resp_")
    messages = req.completion.spec.messages or ()
    assert [m.role for m in messages] == ["system", "user", "user"]
