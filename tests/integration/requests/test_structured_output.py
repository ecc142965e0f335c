"""Structured outputs through the daemon, as clients send them: OpenAI's
``response_format`` (json_object, json_schema; chat and completions, streamed and not),
llama-server's ``json_schema`` and ``grammar`` fields, and the native protocol's
``constraint``. Every answer parses and validates; a schema or grammar that does not
compile is a 400 (or a typed ``bad_request``) quoting the grammar engine, never an
unconstrained generation; the daemon keeps serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import BadRequest, Client, Constraint, ToolFunction
from tests.integration.helpers.daemon import assert_no_leaks, meshctl, wait_idle
from tests.integration.helpers.http_api import http_daemon, openai_client

pytestmark = pytest.mark.anyio

TICKET = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "outage", "account", "other"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 4},
        "summary": {"type": "string", "maxLength": 60},
        "steps": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object",
                            "properties": {"action": {"type": "string", "maxLength": 30},
                                           "done": {"type": "boolean"}},
                            "required": ["action", "done"],
                            "additionalProperties": False}},
    },
    "required": ["category", "priority", "summary", "steps"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Classify this support ticket as JSON: 'The site has "
                                   "been down for an hour and customers cannot pay.'"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=6,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


def schema_format(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def test_openai_client_gets_json_that_validates(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        got = await api.chat.completions.create(
            model="m", messages=ASK, max_tokens=200, temperature=0,
            response_format=schema_format(TICKET))  # type: ignore[arg-type]
        choice = got.choices[0]
        assert choice.finish_reason == "stop"
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), TICKET)
        extra = (got.model_extra or {})["meshd"]["extra"]
        assert extra["forced_accepted"] > 0 and extra["grammar_ms"] > 0
        # Streamed, and sampled: the same schema holds.
        stream = await api.chat.completions.create(
            model="m", messages=ASK, max_tokens=200, temperature=0.9, seed=5, stream=True,
            response_format=schema_format(TICKET))  # type: ignore[arg-type]
        text = "".join([c.choices[0].delta.content or "" async for c in stream
                        if c.choices])
        jsonschema.validate(json.loads(text), TICKET)
        # json_object on plain completions: any JSON object.
        done = await api.completions.create(
            model="m", prompt="A JSON object describing a cat:", max_tokens=120,
            temperature=0, extra_body={"response_format": {"type": "json_object"}})
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(done.choices[0].text), dict)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_llama_server_fields_and_bad_constraints(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        body = {"messages": ASK, "max_tokens": 200, "temperature": 0}
        r = await http.post("/v1/chat/completions", json={**body, "json_schema": TICKET})
        assert r.status_code == 200
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]),
                            TICKET)
        yes_no = 'root ::= ("yes" | "no") "."'
        r = await http.post("/v1/completions", json={
            "prompt": "Is water wet?", "max_tokens": 8, "grammar": yes_no, "temperature": 0})
        assert r.status_code == 200
        text = r.json()["choices"][0]["text"]
        assert text in ("yes.", "no."), text

        bad = [
            ({"response_format": schema_format({"type": "nonsense"})}, "response_format",
             "nonsense"),
            ({"json_schema": {"properties": {"a": {"type": 7}}}}, "json_schema", ""),
            ({"grammar": 'root ::= "a" missing-rule'}, "grammar", "missing-rule"),
            ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
             "json_schema"),
            ({"response_format": {"type": "xml"}}, "response_format", "xml"),
            ({"grammar": 'root ::= "a"', "json_schema": TICKET}, "grammar",
             "only one of"),
        ]
        for extra, param, needle in bad:
            r = await http.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param, error
            assert needle in error["message"], error
        # The daemon still serves, constrained and not.
        small = [{"role": "user", "content": "Return a JSON object with the keys name and "
                                             "age for Ann, who is 30."}]
        r = await http.post("/v1/chat/completions", json={
            **body, "messages": small, "response_format": {"type": "json_object"}})
        assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
        await wait_idle(server)
        assert_no_leaks(server)


CYCLIC = [  # no finite value: every way through the schema comes back to itself
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
]
ENDLESS = ["root ::= root", 'root ::= "a" root', "root ::= a\na ::= b\nb ::= a"]


def _deep(levels: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


async def test_a_constraint_no_answer_can_match_is_refused(smol: ModelRuntime) -> None:
    """A schema or grammar with no finite answer (a cyclic ``$ref``, a rule that never
    ends) is a 400 naming the reason, as a response format, llama-server's fields and a
    tool's parameters alike, and ``bad_request`` on the native protocol: answered, it was
    an empty ``stop`` (or a call that never closed). So is nesting past the stated bound,
    never a 500."""
    async with http_daemon(smol) as (server, path, http):
        body = {"messages": ASK, "max_tokens": 20, "temperature": 0}

        async def refused(extra: dict[str, object], param: str, needle: str) -> None:
            r = await http.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 400, (extra, r.text[:300])
            error = r.json()["error"]
            assert error["param"] == param and needle in error["message"], error

        for schema in CYCLIC:
            await refused({"response_format": schema_format(schema)}, "response_format",
                          "cyclic $ref")
            await refused({"json_schema": schema}, "json_schema", "cyclic $ref")
            await refused({"tools": [{"type": "function", "function": {
                "name": "f", "parameters": schema}}], "tool_choice": "required"},
                "tools[0].function.parameters", "cyclic $ref")
        for grammar in ENDLESS:
            await refused({"grammar": grammar}, "grammar", "allows no finite text")
        deep = _deep(60)  # (121 levels of JSON: within the body's own bound)
        await refused({"response_format": schema_format(deep)}, "response_format",
                      "deeper than 100 levels")
        await refused({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": deep}}]}, "tools[0].function.parameters",
            "deeper than 100 levels")
        await refused({"grammar": "root ::= " + "(" * 1000 + '"a"' + ")" * 1000}, "grammar",
                      "deeper than 100 levels")
        # Recursion with a way out is served: a tree whose children may be none.
        tree = {"$defs": {"node": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8},
            "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
            "required": ["name", "kids"]}}, "$ref": "#/$defs/node"}
        r = await http.post("/v1/chat/completions", json={
            **body, "max_tokens": 120, "response_format": schema_format(tree)})
        assert r.status_code == 200, r.text
        if r.json()["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), tree)
        async with Client.connect(path) as client:
            for constraint, needle in [
                    (Constraint(kind="json_schema", schema=CYCLIC[1]), "cyclic $ref"),
                    (Constraint(kind="gbnf", grammar=ENDLESS[1]), "no finite text"),
                    (Constraint(kind="lark", grammar="start: start"), "allows no answer")]:
                with pytest.raises(BadRequest) as info:
                    await client.generate("x", max_tokens=4, constraint=constraint).collect()
                assert info.value.message.startswith("generate.constraint: "), info.value
                assert needle in info.value.message, info.value
            with pytest.raises(BadRequest) as info:
                await client.generate(messages=ASK, max_tokens=4, tool_choice="required",
                                      tools=[ToolFunction(name="f", parameters=CYCLIC[2])]
                                      ).collect()
            assert info.value.message.startswith("generate.tools[0].parameters: ")
            assert "cyclic $ref" in info.value.message
        await wait_idle(server)
        assert_no_leaks(server)


DIGITS = "0123456789"


async def test_numbers_end_within_llama_cpp_bounds(smol: ModelRuntime) -> None:
    """An integer or number the schema leaves unbounded is bounded as llama.cpp's
    schema-to-grammar bounds it (16 integral digits; an integer within I-JSON's
    ±(2^53 - 1), a number's fraction to 10 digits): a
    logit bias towards digits, which made the small model write digits until
    ``max_tokens``, now meets the bound and the answer ends ``stop`` and parses, as a
    response format and as a forced call's argument."""
    ids = smol.model.tokenizer.tokenize(DIGITS, add_special=False)
    assert len(ids) == len(DIGITS)
    bias = {str(i): 15 for i in ids}
    body = {"messages": [{"role": "user", "content": "How many people live in Rome?"}],
            "max_tokens": 60, "temperature": 0, "logit_bias": bias}
    async with http_daemon(smol) as (server, _path, http):
        for schema in ({"type": "object", "properties": {"population": {"type": "integer"}},
                        "required": ["population"]},
                       {"type": "integer"},
                       {"type": "object", "properties": {"share": {"type": "number"}},
                        "required": ["share"]}):
            r = await http.post("/v1/chat/completions", json={
                **body, "response_format": schema_format(schema)})
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop", (schema, choice)
            text = choice["message"]["content"]
            value = json.loads(text)
            jsonschema.validate(value, schema)
            number = value if isinstance(value, int) else next(iter(value.values()))
            if isinstance(number, int):
                assert abs(number) <= 2**53 - 1, text  # (I-JSON's integers)
            whole, _, fraction = text.strip("{}").split(": ")[-1].lstrip("-").partition(".")
            assert len(whole) <= 16 and len(fraction) <= 10, text
        tool = {"type": "function", "function": {"name": "census", "parameters": {
            "type": "object", "properties": {"count": {"type": "integer"}},
            "required": ["count"]}}}
        r = await http.post("/v1/chat/completions", json={
            **body, "tools": [tool], "tool_choice": "required"})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        count = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["count"]
        assert abs(count) <= 2**53 - 1
        await wait_idle(server)
        assert_no_leaks(server)


async def test_a_response_format_object_takes_its_listed_properties(
        smol: ModelRuntime) -> None:
    """An object schema that lists its properties and says nothing of others takes those
    only, as llama-server reads it (a bias towards ``,`` lured the small model into
    writing invented keys); ``additionalProperties: true`` still allows more."""
    comma = smol.model.tokenizer.tokenize(",", add_special=False)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"]}
    body = {"messages": [{"role": "user", "content": "Name a city as JSON."}],
            "max_tokens": 60, "temperature": 0, "logit_bias": {str(comma[0]): 15}}
    async with http_daemon(smol) as (server, _path, http):
        r = await http.post("/v1/chat/completions", json={
            **body, "response_format": schema_format(schema)})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert set(json.loads(choice["message"]["content"])) == {"name"}
        r = await http.post("/v1/chat/completions", json={**body, "response_format": (
            schema_format({**schema, "additionalProperties": True}))})
        text = r.json()["choices"][0]["message"]["content"]
        assert text.startswith('{"name": "') and text[len('{"name": "'):].count('"') > 1, text
        await wait_idle(server)
        assert_no_leaks(server)


async def test_native_constraint_and_typed_refusal(smol: ModelRuntime) -> None:
    date = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    async with http_daemon(smol) as (server, path, _http):
        async with Client.connect(path) as client:
            for seed in (None, 1, 2):
                done = await client.generate(
                    "The date of the first moon landing was", max_tokens=16,
                    temperature=0.0 if seed is None else 1.0, seed=seed,
                    constraint=Constraint(kind="regex", grammar=date)).collect()
                assert re.fullmatch(date, done.text), done.text
            with pytest.raises(BadRequest) as info:
                await client.generate("x", max_tokens=4, constraint=Constraint(
                    kind="lark", grammar="start: nowhere")).collect()
            assert info.value.message.startswith("generate.constraint: the lark does not")
            assert "nowhere" in info.value.message
            done = await client.generate("Hello", max_tokens=4).collect()
            assert done.done.usage.completion_tokens == 4
        await wait_idle(server)
        assert_no_leaks(server)


async def test_meshctl_json_schema_file(smol: ModelRuntime, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    schema_file = tmp_path / "ticket.json"
    schema_file.write_text(json.dumps(TICKET))
    async with http_daemon(smol) as (server, path, _http):
        code = await meshctl("--socket", path, "chat", ASK[0]["content"], "--max-tokens",
                             "200", "--json-schema", str(schema_file), "--json")
        assert code == 0
        # (the daemon's log shares stdout here; meshctl's reply is the JSON line)
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
        reply = json.loads(line)
        jsonschema.validate(json.loads(reply["text"]), TICKET)
        (tmp_path / "broken.json").write_text("{not json")
        code = await meshctl("--socket", path, "generate", "x", "--json-schema",
                             str(tmp_path / "broken.json"))
        assert code == 2
        assert "not JSON" in capsys.readouterr().err
        code = await meshctl("--socket", path, "generate", "x", "--regex", "[0-9")
        assert code == 2
        assert "generate.constraint: the regex does not compile" in capsys.readouterr().err
        await wait_idle(server)
        assert_no_leaks(server)
