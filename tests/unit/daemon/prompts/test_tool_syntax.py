"""Tool calls read back in each family's own syntax: whole, well-formed calls to offered
functions only; anything else leaves the answer as text."""

from __future__ import annotations

import json

import pytest

from meshd.daemon.prompts.tool_calls import answer_calls, parse_tools
from meshd.daemon.prompts.tool_syntax import read_calls

NAMES = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}, "add": {"type": "object"}}
WEATHER = ("get_weather", {"city": "Paris", "days": 2})


@pytest.mark.parametrize("text", [
    # Hermes / Qwen 2.5
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 2}}\n</tool_call>',
    # Qwen3-Coder / Qwen 3.5: text values stay text, others are JSON
    "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    # GLM 4.5-4.7
    "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
    "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
    # Mistral Small 3.2 / Devstral, with and without a call id
    'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
    'Let me check.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "days": 2}',
    # Mistral v3
    'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 2}}]',
])
def test_one_call_in_each_syntax(text: str) -> None:
    assert read_calls(text, NAMES) == ("Let me check.", [WEATHER])


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
])
def test_llama_3_answers_with_the_call_alone(text: str) -> None:
    assert read_calls(text, NAMES) == ("", [WEATHER])


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
])
def test_tagged_values_are_read_by_their_schema(text: str) -> None:
    """A string parameter's value stays text though it reads as JSON (the templates write
    strings bare); an integer's is JSON."""
    assert read_calls(text, NAMES) == ("", [("get_weather", {"city": "42", "days": 2})])


def test_several_calls() -> None:
    both = [WEATHER, ("add", {"a": 1, "b": 2})]
    assert read_calls('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
                      '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', NAMES) == ("", both)
    assert read_calls('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                      '{"name": "add", "parameters": {"a": 1, "b": 2}}', NAMES) == ("", both)
    assert read_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
                      '"days": 2}}</tool_call>\n<tool_call>{"name": "add", "arguments": '
                      '{"a": 1, "b": 2}}</tool_call>', NAMES) == ("", both)


@pytest.mark.parametrize("text", [
    "The weather in Paris is mild.",
    '{"name": "Bob", "parameters": {"age": 3}}',  # a JSON answer, no offered function
    '{"name": "get_weather", "city": "Paris"}',  # not a call's shape
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # cut short
    '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # not offered
    "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Par",  # cut by max_tokens
    "[TOOL_CALLS]get_weather and then some text",
    "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>",
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",  # cut short
    "<tool_call>delete_all\n</tool_call>",  # not offered
])
def test_anything_else_stays_text(text: str) -> None:
    assert read_calls(text, NAMES) is None


def test_the_answer_holds_calls_in_any_syntax_as_openai_shapes_them() -> None:
    spec = parse_tools({"tools": [{"type": "function", "function": {
        "name": name, "parameters": {"type": "object"}}} for name in sorted(NAMES)],
        "parallel_tool_calls": False})
    assert spec is not None
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
    content, calls = answer_calls(text, spec, finished=True)
    assert content == "Sure."
    (call,) = calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather",
                                "arguments": json.dumps({"city": "Paris", "days": 2})}
    # cut by max_tokens after the call: the whole call holds; inside it: the text before
    assert answer_calls(text, spec, finished=False)[1][0]["function"] == call["function"]
    assert answer_calls(text[:-6], spec, finished=False) == ("Sure.", [])
    # two calls where one is allowed: text, no calls
    two = text + '[TOOL_CALLS]add[ARGS]{"a": 1}'
    assert answer_calls(two, spec, finished=True) == (two, [])


WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}


@pytest.mark.parametrize("text", [
    # Hermes / Qwen 2.5
    f"Let me check.\n<tool_call>\n{json.dumps(WEATHER_CALL)}\n</tool_call>\n"
    '<tool_call>\n{"name": "add", "argu',
    # Qwen3-Coder / Qwen 3.5
    "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=add>\n<param",
    # GLM
    "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
    "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    "<tool_call>ad",
    # Mistral Small 3.2 and v3
    'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]ad',
    f"Let me check.[TOOL_CALLS][{json.dumps(WEATHER_CALL)}, " '{"name": "add", "arg',
    # Llama 3.x (no text before its calls)
    '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "ad',
])
def test_a_cut_answer_keeps_its_whole_calls_and_drops_the_broken_one(text: str) -> None:
    spec = parse_tools({"tools": [{"type": "function", "function": {
        "name": name, "parameters": {"type": "object"}}} for name in sorted(NAMES)]})
    assert spec is not None
    content, calls = answer_calls(text, spec, finished=False)
    assert content == (None if text.startswith("{") else "Let me check.")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [WEATHER]
    # cut in the first call: no calls, and none of the call's text
    first = text.index("get_weather")
    assert answer_calls(text[:first + 4], spec, finished=False) == (
        None if text.startswith("{") else "Let me check.", [])
