"""Tool calls through the official client: with ``tool_choice`` ``required`` or a named
function every call parses and validates against its function's schema (unseen, nested
schemas, on the default model and on a synthetic qwen35); streaming sends OpenAI's
``delta.tool_calls``; a call cut by ``max_tokens`` stays in the content; a conversation
with earlier calls and tool results is accepted; the native protocol serves the same."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from meshd.daemon.engine.constraint import GrammarState
from meshd.daemon.engine.sampling import GREEDY
from meshd.daemon.engine.sampling import SamplingParams as EngineSampling
from meshd.daemon.frontends.http.completions import request_spec
from meshd.daemon.frontends.http.openai.api import parse_request
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.prompts.tool_calls import (
    FORCED_SYNTAXES,
    ToolSpec,
    answer_calls,
    forced_call_grammar,
    lazy_call_grammar,
    opener_of,
    tool_constraint,
)
from meshd.daemon.prompts.tool_syntax import read_calls
from meshd.daemon.requests.prompting import spec_grammar, spec_prompt
from meshd.daemon.requests.template_tools import call_syntax
from meshd.policy.decision import FinishReason
from meshd.protocol import (
    BadRequest,
    ChatMessage,
    Client,
    Constraint,
    SamplingParams,
    ToolCall,
    ToolFunction,
)
from meshd.testing import testmodels
from tests.integration.helpers import DATA
from tests.integration.helpers.daemon import assert_no_leaks, meshctl, wait_idle
from tests.integration.helpers.http_api import http_daemon, openai_client

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "book_table", "description": "Book a restaurant table",
        "parameters": {"type": "object", "properties": {
            "restaurant": {"type": "string", "maxLength": 30},
            "people": {"type": "integer", "minimum": 1, "maximum": 12},
            "when": {"type": "object", "properties": {
                "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                "required": ["day", "hour"], "additionalProperties": False},
            "notes": {"type": "array", "items": {"type": "string", "maxLength": 20},
                      "maxItems": 2}},
            "required": ["restaurant", "people", "when"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Book a table for four at Luigi's on Friday at 8pm, "
                                   "then tell me the weather in Rome."}]


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=2048, n_seq_max=2, draft_max=6,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


def _valid(calls: list[dict[str, object]] | list[object]) -> None:
    assert calls
    for call in calls:
        fn = call["function"] if isinstance(call, dict) else call.function  # type: ignore
        name = fn["name"] if isinstance(fn, dict) else fn.name
        args = fn["arguments"] if isinstance(fn, dict) else fn.arguments
        jsonschema.validate(json.loads(args), SCHEMAS[name])


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_forced_calls_validate_and_stream(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        for choice in ("required", {"type": "function", "function": {"name": "book_table"}},
                       {"type": "function", "function": {"name": "get_weather"}}):
            for temperature in (0.0, 0.9):
                got = await api.chat.completions.create(
                    model="m", messages=ASK, tools=TOOLS, tool_choice=choice,  # type: ignore
                    max_tokens=300, temperature=temperature, seed=4)
                c = got.choices[0]
                assert c.finish_reason == "tool_calls", c
                _valid(c.message.tool_calls or [])
                if isinstance(choice, dict):
                    assert {t.function.name for t in c.message.tool_calls or []} == \
                        {choice["function"]["name"]}
        stream = await api.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300,
            temperature=0, stream=True)  # type: ignore
        calls: dict[int, dict[str, str]] = {}
        finish = None
        async for ch in stream:
            if not ch.choices:
                continue
            for d in ch.choices[0].delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"name": "", "arguments": ""})
                slot["name"] += (d.function.name or "") if d.function else ""
                slot["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = ch.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        _valid([{"function": c} for c in calls.values()])
        # Cut short in its only call: no tool_calls, and the broken call is not content.
        cut = await api.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=6,
            temperature=0)  # type: ignore
        assert cut.choices[0].finish_reason == "length"
        assert not cut.choices[0].message.tool_calls
        assert cut.choices[0].message.content is None
        # A conversation carrying an earlier call and its result, then auto.
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
        after = await api.chat.completions.create(
            model="m", messages=history, tools=TOOLS, max_tokens=40, temperature=0)  # type: ignore
        msg = after.choices[0].message
        assert msg.content or msg.tool_calls
        if msg.tool_calls:
            _valid(msg.tool_calls)
        r = await http.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name"}}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.name"
        r = await http.post("/v1/chat/completions", json={
            "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function",
                                                             "function": {"name": "nope"}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        await wait_idle(server)
        assert_no_leaks(server)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_parallel_forced_calls_differ_and_a_cut_keeps_the_whole_ones(
        smol: ModelRuntime) -> None:
    """``required`` with parallel calls, a logit bias towards ``<`` (another call) and
    ``get`` (``get_weather``) luring the model into calling ``get_weather`` twice: the
    second call is the other function. Cut by ``max_tokens`` inside that second call, the
    answer keeps the first (``length``, not ``tool_calls``) and the broken call's text
    is not content, streamed or not, over HTTP and the native protocol."""
    ids = [smol.model.tokenizer.tokenize(text, add_special=False) for text in ("<", "get")]
    assert all(len(i) == 1 for i in ids)
    bias = {str(i[0]): 12 for i in ids}
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
            "logit_bias": bias}
    async with http_daemon(smol) as (server, path, http):
        whole = (await http.post("/v1/chat/completions", json={
            **body, "max_tokens": 400})).json()
        c = whole["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        calls = c["message"]["tool_calls"]
        assert [call["function"]["name"] for call in calls] == ["get_weather", "book_table"]
        _valid(calls)
        cut_at = whole["usage"]["completion_tokens"] - 4
        cut = (await http.post("/v1/chat/completions", json={
            **body, "max_tokens": cut_at})).json()["choices"][0]
        assert cut["finish_reason"] == "length", cut
        assert cut["message"]["content"] is None, cut
        assert [call["function"] for call in cut["message"]["tool_calls"]] == \
            [calls[0]["function"]]
        async with http.stream("POST", "/v1/chat/completions", json={
                **body, "max_tokens": cut_at, "stream": True}) as r:
            chunks = [json.loads(line[6:]) async for line in r.aiter_lines()
                      if line.startswith("data: {")]
        deltas = [ch["choices"][0] for ch in chunks if ch.get("choices")]
        assert not "".join(d["delta"].get("content") or "" for d in deltas)
        streamed = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
        assert [t["function"] for t in streamed] == [calls[0]["function"]]
        assert deltas[-1]["finish_reason"] == "length"
        async with Client.connect(path) as native:
            got = await native.generate(
                messages=ASK, tools=FUNCTIONS, tool_choice="required", max_tokens=cut_at,
                sampling=SamplingParams(temperature=0, logit_bias=bias)).collect()
        assert got.done.finish_reason.value == "length"
        assert [(t.name, t.arguments) for t in got.done.tool_calls or ()] == [
            (calls[0]["function"]["name"], calls[0]["function"]["arguments"])]
        await wait_idle(server)
        assert_no_leaks(server)


def _opened_by_force(rt: ModelRuntime) -> list[str]:
    """Three ``auto`` answers to ASK (greedy, then two sampled) whose call is opened by
    force rather than by luring the model: the request is the service's own for a chat
    completion body with ``auto`` (the prompt, with the template's offer where it makes
    one, and the lazy constraint); the call's opener is appended to the prompt and
    consumed by that constraint, as if the model had written it (auto's trigger), and
    the model writes the rest, up to the call's close. Each text is the call, opener
    and close included."""
    spec = request_spec(parse_request(json.dumps(
        {"messages": ASK, "tools": TOOLS, "tool_choice": "auto"}).encode(), chat=True))
    prompt = spec_prompt(rt, spec)
    grammar = spec_grammar(rt, spec, prompt)
    assert grammar is not None
    opener = opener_of(call_syntax(rt) or "hermes")
    opened = tuple(rt.model.tokenizer.tokenize(opener, add_special=False, parse_special=True))
    texts = []
    for sampling in (GREEDY, EngineSampling(temperature=0.9, seed=1),
                     EngineSampling(temperature=0.9, seed=2)):
        gen = rt.generation(prompt.tokens + opened, max_tokens=300, grammar=grammar,
                            sampling=sampling, stop=("</tool_call>",))
        assert gen.grammar is not None
        gen.grammar.settle(opened)
        text = opener + "".join(event.text for event in rt.run(gen))
        assert gen.finish is FinishReason.STOP, text  # every argument bounded: it closes
        texts.append(text + "</tool_call>")
    return texts


def test_with_auto_a_call_the_model_opens_is_held_to_its_schema(smol: ModelRuntime) -> None:
    """``tool_choice: auto`` leaves the model free until it opens a call; from there the
    call is an offered function's, with valid arguments (Hermes' syntax, on a model
    whose template offers no tools)."""
    for text in _opened_by_force(smol):
        assert text.startswith('<tool_call>\n{"name": "'), text
        parsed = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        jsonschema.validate(parsed["arguments"], SCHEMAS[parsed["name"]])


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("template", "syntax", "offer"), [
    ("llama-3.1.jinja", "llama", "Respond in the format"),
    ("mistral-small-3.2.jinja", "mistral_args", "[AVAILABLE_TOOLS]"),
    ("qwen3.5.jinja", "xml", "If you choose to call a function ONLY reply"),
    ("glm-4.6.jinja", "glm", "<arg_key>{arg-key-1}</arg_key>"),
])
async def test_a_forced_call_is_written_in_the_templates_own_syntax(
        template: str, syntax: str, offer: str) -> None:
    """With a template that teaches tools, a forced call is offered by the template and
    held to the syntax it teaches; every call parses and validates (a string argument
    written bare in the tagged syntaxes stays a string), and the text is that syntax's."""
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=2048, n_seq_max=1, calibrate=False, threads=2,
                                    chat_template_file=str(DATA / template)))
    try:
        assert call_syntax(rt) == syntax
        async with http_daemon(rt) as (server, _path, http):
            for choice in ("required", {"type": "function", "function": {"name": "book_table"}}):
                answer = (await http.post("/v1/chat/completions", json={
                    "messages": ASK, "tools": TOOLS, "tool_choice": choice,
                    "max_tokens": 300, "temperature": 0, "verbose": True})).json()
                c = answer["choices"][0]
                assert c["finish_reason"] == "tool_calls", c
                _valid(c["message"]["tool_calls"])
                prompt = answer["__verbose"]["prompt"]
                assert offer in prompt
                text = answer["__verbose"]["content"]
                assert text.startswith({"llama": '{"name": ', "mistral_args": "[TOOL_CALLS]",
                                        "xml": "<tool_call>\n<function=",
                                        "glm": "<tool_call>"}[syntax]), text
            await wait_idle(server)
            assert_no_leaks(server)
    finally:
        rt.close()


@pytest.mark.parametrize("template", ["qwen3.5.jinja", "glm-4.6.jinja"])
def test_with_auto_a_tagged_call_is_held_to_its_schema(template: str) -> None:
    """In the tagged syntaxes (Qwen 3.5's XML, GLM's) too, ``auto`` leaves the model free
    until it opens a call (the template's own offer); from there each argument is held to
    its schema, so the call reads back valid."""
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=2048, n_seq_max=1, calibrate=False, threads=2,
                                    chat_template_file=str(DATA / template)))
    try:
        for text in _opened_by_force(rt):
            read = read_calls(text, SCHEMAS)
            assert read is not None, text
            assert read[1], text
            for name, arguments in read[1]:
                jsonschema.validate(arguments, SCHEMAS[name])
    finally:
        rt.close()


GOOD_ARGS = {"city": "Rome", "unit": "celsius"}
BAD_ARGS = {"city": "Rome", "unit": "kelvin"}


def _written(syntax: str, name: str, args: dict[str, str]) -> str:
    """A call as ``syntax`` writes it (string arguments only)."""
    if syntax == "hermes":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
    if syntax == "llama":
        return json.dumps({"name": name, "parameters": args})
    if syntax == "mistral_args":
        return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args)}"
    if syntax == "mistral_list":
        return f"[TOOL_CALLS][{json.dumps({'name': name, 'arguments': args})}]"
    if syntax == "xml":
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                    for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


@pytest.mark.parametrize("syntax", FORCED_SYNTAXES)
def test_the_lazy_constraint_in_each_syntax(smol: ModelRuntime, syntax: str) -> None:
    """``auto``'s constraint in every syntax: free text is free, a whole valid call is
    taken, and once a call is opened an unoffered function or an argument its schema
    refuses is not."""
    spec = ToolSpec(tuple((t["function"]["name"], "", t["function"]["parameters"])
                          for t in TOOLS), "auto")
    grammar = smol.compile_constraint("lark", lazy_call_grammar(
        spec, special_open=None, syntax=syntax))

    def taken(text: str) -> tuple[bool, bool]:
        """Whether the grammar takes all of ``text``, and may end there."""
        state = GrammarState(smol.grammar_vocab.tokenizer(), grammar,
                             n_vocab=smol.model.info.n_vocab, eog=smol.model.info.eog_tokens)
        tokens = smol.model.tokenizer.tokenize(text, add_special=False)
        if state.valid_prefix(tokens) < len(tokens):
            return False, False
        for token in tokens:
            state.advance(token)
        return True, any(state.allows(t) for t in smol.model.info.eog_tokens)

    assert taken("The weather in Rome is mild; I cannot book tables.") == (True, True)
    good = _written(syntax, "get_weather", GOOD_ARGS)
    assert read_calls(good, SCHEMAS) is not None
    assert taken(good) == (True, True), good
    assert taken(_written(syntax, "get_weather", BAD_ARGS))[0] is False
    assert taken(_written(syntax, "delete_all", GOOD_ARGS))[0] is False


REF_SCHEMA = {  # as pydantic writes a model's schema: $refs into $defs
    "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]},
              "Place": {"type": "object", "properties": {"lat": {
                  "type": "integer", "minimum": -90, "maximum": 90}},
                        "required": ["lat"], "additionalProperties": False}},
    "type": "object", "required": ["unit", "place"], "additionalProperties": False,
    "properties": {"unit": {"$ref": "#/$defs/Unit"}, "place": {"$ref": "#/$defs/Place"},
                   "label": {"type": "string", "maxLength": 12}}}


@pytest.mark.parametrize("syntax", FORCED_SYNTAXES)
def test_a_forced_call_holds_refs(smol: ModelRuntime, syntax: str) -> None:
    """A schema's ``$ref``s into its ``$defs`` resolve in every syntax (the schema is
    nested in a call's JSON beside other functions', or each argument of a tagged call
    is held on its own): the call reads back valid."""
    spec = ToolSpec((("locate", "", REF_SCHEMA), ("other", "", {"type": "object"})),
                    "named", "locate")
    grammar = smol.compile_constraint("lark", forced_call_grammar(spec, syntax))
    prompt = smol.tokenize_prompt("Call locate:", chat=False)
    gen = smol.generation(prompt, max_tokens=200, grammar=grammar, proposer="off")
    text = "".join(event.text for event in smol.run(gen))
    read = read_calls(text, {"locate": REF_SCHEMA})
    assert read is not None, text
    jsonschema.validate(read[1][0][1], REF_SCHEMA)


OPEN_SCHEMA = {  # as most tools are declared: nothing said of other keys
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}


@pytest.mark.parametrize("syntax", FORCED_SYNTAXES)
def test_a_forced_call_takes_only_the_declared_parameters(smol: ModelRuntime,
                                                          syntax: str) -> None:
    """A schema that lists its properties and says nothing of other keys gets those only
    (as llama.cpp reads it): the small model would write invented keys until
    ``max_tokens``, and the call never closed."""
    spec = ToolSpec((("forecast", "", OPEN_SCHEMA),), "required")
    grammar = smol.compile_constraint("lark", forced_call_grammar(spec, syntax))
    gen = smol.generation(smol.tokenize_prompt("Get the forecast for Rome:", chat=False),
                          max_tokens=200, grammar=grammar, proposer="off")
    text = "".join(event.text for event in smol.run(gen))
    read = read_calls(text, {"forecast": OPEN_SCHEMA})
    assert read is not None, text
    for _name, arguments in read[1]:
        assert set(arguments) <= {"city", "days"}, arguments
        jsonschema.validate(arguments, OPEN_SCHEMA)


@pytest.mark.parametrize("syntax", ["xml", "glm"])
def test_a_tagged_call_writes_required_keys_its_properties_omit(smol: ModelRuntime,
                                                                 syntax: str) -> None:
    schema = {"type": "object", "required": ["text"]}
    spec = ToolSpec((("note", "", schema),), "required")
    grammar = smol.compile_constraint("lark", forced_call_grammar(spec, syntax))
    gen = smol.generation(smol.tokenize_prompt("Take a note:", chat=False), max_tokens=100,
                          grammar=grammar, proposer="off")
    read = read_calls("".join(event.text for event in smol.run(gen)), {"note": schema})
    assert read is not None
    jsonschema.validate(read[1][0][1], schema)


WEATHER_AND_TIME = (
    ("get_weather", "", TOOLS[0]["function"]["parameters"]),
    ("get_time", "", {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"], "additionalProperties": False}))


def _joined(syntax: str, calls: list[tuple[str, dict[str, str]]]) -> str:
    """Several calls as ``syntax`` writes them one after another."""
    if syntax == "llama":
        return "; ".join(_written(syntax, name, args) for name, args in calls)
    if syntax == "mistral_list":
        return "[TOOL_CALLS][" + ", ".join(json.dumps({"name": name, "arguments": args})
                                           for name, args in calls) + "]"
    return ("" if syntax == "mistral_args" else "\n").join(
        _written(syntax, name, args) for name, args in calls)


def _taken(rt: ModelRuntime, grammar: str, text: str) -> tuple[bool, bool]:
    """Whether ``grammar`` takes all of ``text``, and may end there."""
    state = GrammarState(rt.grammar_vocab.tokenizer(), grammar,
                         n_vocab=rt.model.info.n_vocab, eog=rt.model.info.eog_tokens)
    tokens = rt.model.tokenizer.tokenize(text, add_special=False)
    if state.valid_prefix(tokens) < len(tokens):
        return False, False
    for token in tokens:
        state.advance(token)
    return True, any(state.allows(t) for t in rt.model.info.eog_tokens)


@pytest.mark.parametrize("syntax", FORCED_SYNTAXES)
def test_a_forced_answer_calls_each_function_at_most_once(smol: ModelRuntime,
                                                          syntax: str) -> None:
    """``required`` with parallel calls: each offered function at most once, in any
    order (a small model would call one function again and again); without
    ``parallel_tool_calls``, one call."""
    weather, time = ("get_weather", GOOD_ARGS), ("get_time", {"city": "Rome"})
    for parallel in (True, False):
        spec = ToolSpec(WEATHER_AND_TIME, "required", parallel=parallel)
        grammar = smol.compile_constraint("lark", forced_call_grammar(spec, syntax))
        assert _taken(smol, grammar, _joined(syntax, [time])) == (True, True)
        both = _taken(smol, grammar, _joined(syntax, [time, weather]))
        assert both == (True, True) if parallel else both[0] is False, (parallel, both)
        assert _taken(smol, grammar, _joined(syntax, [weather, weather]))[0] is False
        assert _taken(smol, grammar, _joined(syntax, [time, time]))[0] is False


def test_many_forced_parallel_calls_come_in_the_listed_order(smol: ModelRuntime) -> None:
    """Past six functions (a rule per subset would be too many) parallel calls follow the
    order the request lists them, still each at most once."""
    names = [f"f{i}" for i in range(8)]
    spec = ToolSpec(tuple((name, "", {"type": "object"}) for name in names), "required")
    grammar = smol.compile_constraint("lark", forced_call_grammar(spec, "hermes"))
    calls = [(name, {}) for name in names]
    assert _taken(smol, grammar, _joined("hermes", calls)) == (True, True)
    assert _taken(smol, grammar, _joined("hermes", calls[2:5])) == (True, True)
    assert _taken(smol, grammar, _joined("hermes", [calls[3], calls[1]]))[0] is False
    assert _taken(smol, grammar, _joined("hermes", [calls[3], calls[3]]))[0] is False


FUNCTIONS = [ToolFunction(name=t["function"]["name"], description=t["function"]["description"],
                          parameters=t["function"]["parameters"]) for t in TOOLS]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_native_protocol_serves_tools_as_http_does(smol: ModelRuntime) -> None:
    """A ``generate`` with ``tools`` (protocol 4) gets the prompt, constraint and calls the
    same conversation gets over HTTP; ``done`` carries the calls."""
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


def test_forced_calls_hold_on_a_synthetic_qwen35() -> None:
    rt = ModelRuntime(RuntimeConfig(
        model_path=str(testmodels.test_model_path("qwen35", acceptance=0.9)), n_ctx_seq=1024,
        calibrate=False, threads=1))
    try:
        spec = ToolSpec(tuple((t["function"]["name"], "", t["function"]["parameters"])
                              for t in TOOLS), "required", parallel=False)
        constraint = tool_constraint(spec)
        assert constraint is not None
        grammar = rt.compile_constraint(constraint.kind, constraint.value)
        prompt = rt.tokenize_prompt("Call a tool. ", chat=False)
        for proposer in ("off", "mtp"):
            gen = rt.generation(prompt, max_tokens=400, proposer=proposer, grammar=grammar)
            text = "".join(e.text for e in rt.run(gen))
            content, calls = answer_calls(text, spec, finished=gen.finish.value == "eog")
            assert gen.finish.value == "eog", text
            _valid(calls)
            assert content is None
    finally:
        rt.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_meshctl_chat_offers_tools_from_a_file(
        smol: ModelRuntime, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``meshctl chat --tools FILE --tool-choice NAME`` calls that function (the file holds
    OpenAI's ``tools`` array) and prints the call; a bad file or choice is a usage error
    before anything is sent."""
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(TOOLS))
    async with http_daemon(smol) as (server, path, _http):
        code = await meshctl("--socket", path, "chat", ASK[0]["content"], "--tools",
                             str(tools_file), "--tool-choice", "get_weather",
                             "--max-tokens", "200", "--temperature", "0")
        assert code == 0
        calls = [line.split(" ", 2) for line in capsys.readouterr().out.splitlines()
                 if line.startswith("call ")]
        assert calls and {name for _, name, _ in calls} == {"get_weather"}
        for _, name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        code = await meshctl("--socket", path, "chat", "x", "--tools", str(tools_file),
                             "--tool-choice", "nope")
        assert code == 2 and "--tool-choice nope" in capsys.readouterr().err
        (tmp_path / "bad.json").write_text('[{"parameters": {}}]')
        code = await meshctl("--socket", path, "chat", "x", "--tools",
                             str(tmp_path / "bad.json"))
        assert code == 2 and "item 0 is not a function" in capsys.readouterr().err
        await wait_idle(server)
        assert_no_leaks(server)
