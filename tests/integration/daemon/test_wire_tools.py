"""Tool calls on the native protocol: a ``generate`` with ``tools`` is served as the HTTP
API serves the same conversation (same prompt, constraint and calls), and ``done``
carries the calls."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from meshd.daemon.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import BadRequest, ChatMessage, Client, Constraint, ToolCall, ToolFunction

from .daemon_helpers import assert_no_leaks, wait_idle
from .test_http import http_daemon
from .test_tool_calls import ASK, SCHEMAS, TOOLS

pytestmark = pytest.mark.anyio
FUNCTIONS = [ToolFunction(name=t["function"]["name"], description=t["function"]["description"],
                          parameters=t["function"]["parameters"]) for t in TOOLS]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=2048, n_seq_max=2, draft_max=6,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


async def test_forced_calls_come_in_done_as_over_http(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, path, http):
        async with Client.connect(path) as native:
            for choice, name in (("required", None), ("required", "get_weather")):
                got = await native.generate(messages=ASK, tools=FUNCTIONS, tool_choice=choice,
                                            tool_name=name, max_tokens=200,
                                            temperature=0).collect()
                calls = got.done.tool_calls
                assert calls, got.text
                for call in calls:
                    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
                if name is not None:
                    assert {c.name for c in calls} == {name}
                over_http = (await http.post("/v1/chat/completions", json={
                    "messages": ASK, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
                    "tool_choice": choice if name is None else {
                        "type": "function", "function": {"name": name}}})).json()
                assert [(c.name, c.arguments) for c in calls] == [
                    (c["function"]["name"], c["function"]["arguments"])
                    for c in over_http["choices"][0]["message"]["tool_calls"]]
            # Earlier calls and their results in the history; auto answers text or calls.
            history = [ChatMessage(role="user", content=ASK[0]["content"]),
                       ChatMessage(role="assistant", content="", tool_calls=(ToolCall(
                           id="call_1", name="get_weather",
                           arguments='{"city": "Rome", "unit": "celsius"}'),)),
                       ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1")]
            after = await native.generate(messages=history, tools=FUNCTIONS, max_tokens=30,
                                          temperature=0).collect()
            assert after.done.tool_calls is not None
            for call in after.done.tool_calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            plain = await native.generate(messages=ASK, max_tokens=4, temperature=0).collect()
            assert plain.done.tool_calls is None
            with pytest.raises(BadRequest, match="tool_name"):
                await native.generate(messages=ASK, tools=FUNCTIONS, tool_choice="required",
                                      tool_name="nope").collect()
            with pytest.raises(BadRequest, match="tools"):
                await native.generate("Hi", tools=FUNCTIONS).collect()
            with pytest.raises(BadRequest, match="tool_choice"):
                await native.generate(messages=ASK, tools=FUNCTIONS, tool_choice="required",
                                      constraint=Constraint(kind="json_object")).collect()
        await wait_idle(server)
        assert_no_leaks(server)
