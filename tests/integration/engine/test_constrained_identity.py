"""Constrained generation in the engine: every output matches its schema or grammar, and
speculation (the grammar's forced tokens, prompt lookup, the MTP head) gives exactly the
output plain constrained decoding gives, greedy and seeded, on every kind of model: the
default SmolLM2 (attention KV, trimmed), a synthetic qwen35 with an MTP head (recurrent
state rolled back in place, or restored from a checkpoint and replayed) and a synthetic
mimo2 (attention-only with an MTP head)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from meshd.daemon.engine.constraint import ConstraintError, is_json_document
from meshd.daemon.engine.sampling import SamplingParams
from meshd.daemon.models.runtime import ModelRuntime
from tests.integration.helpers.daemon import KindRuntimes

SCHEMAS: dict[str, dict[str, object]] = {
    "record": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"enum": ["Paris", "Lyon", "Nice"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "service": {"type": "string", "maxLength": 16},
            "limits": {
                "type": "object",
                "properties": {
                    "rpm": {"type": "integer", "minimum": 1, "maximum": 10000},
                    "burst": {"type": "integer", "minimum": 0, "maximum": 99},
                    "mode": {"type": "object",
                             "properties": {"strict": {"type": "boolean"}},
                             "required": ["strict"], "additionalProperties": False},
                },
                "required": ["rpm", "burst", "mode"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["eu", "us", "ap"]},
                     "minItems": 1, "maxItems": 3},
        },
        "required": ["service", "limits", "tags"],
        "additionalProperties": False,
    },
}

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, seed=11)

#: SmolLM2 and the synthetic kinds; ``qwen35-ckpt`` keeps no rollback snapshots, so its
#: rejected drafts are undone by restore-and-replay.
runtime = KindRuntimes(acceptance=0.74, n_ctx_seq=512, n_seq_max=1, draft_max=6,
                       calibrate=False, threads=1)


@pytest.fixture(scope="module", autouse=True)
def _close_runtimes() -> Iterator[None]:
    yield
    runtime.close()


def prompt_of(rt: ModelRuntime, text: str) -> list[int]:
    """A chat prompt where the model has a template (SmolLM2), else plain text."""
    try:
        return rt.tokenize_prompt(rt.render_chat([{"role": "user", "content": text}]),
                                  chat=True)
    except ValueError:
        return rt.tokenize_prompt(text, chat=False)


def generate(rt: ModelRuntime, prompt: list[int], grammar: str, proposer: str,
             sampling: SamplingParams, max_tokens: int = 160) -> tuple[str, object]:
    gen = rt.generation(prompt, max_tokens=max_tokens, proposer=proposer, grammar=grammar,
                        sampling=sampling)
    text = "".join(ev.text for ev in rt.run(gen))
    return text, gen


@pytest.mark.parametrize("kind", ["smol", "qwen35", "qwen35-ckpt", "mimo2"])
@pytest.mark.parametrize("schema", sorted(SCHEMAS))
def test_speculation_keeps_constrained_output_identical(kind: str, schema: str) -> None:
    rt = runtime(kind)
    grammar = rt.compile_constraint("json_schema", SCHEMAS[schema])
    prompt = prompt_of(rt, "Describe the service as JSON: api, 600 rpm, burst 50, strict, "
                           "in eu and us. Alice is 31 and lives in Lyon.")
    proposers = ["ngram", "mtp"] if kind != "smol" else ["ngram", "auto"]
    for sampling in (GREEDY, SEEDED):
        plain, plain_gen = generate(rt, prompt, grammar, "off", sampling)
        assert plain_gen.stats.forced_drafted == 0 and plain_gen.stats.drafted == 0
        if plain_gen.finish.value == "eog":
            jsonschema.validate(json.loads(plain), SCHEMAS[schema])
        forced = 0
        for proposer in proposers:
            text, gen = generate(rt, prompt, grammar, proposer, sampling)
            assert text == plain, (kind, schema, proposer, sampling)
            assert gen.finish == plain_gen.finish
            forced += gen.stats.forced_accepted
        # The grammar's own tokens were drafted and kept (keys, quotes, separators).
        assert forced > 0


def test_every_output_validates_on_the_default_model() -> None:
    rt = runtime("smol")
    tasks = [
        ("record", "Extract the person as JSON: Bob Stone, 47 years old, lives in Nice."),
        ("nested", "Write the config of the billing service as JSON: 120 requests per "
                   "minute, bursts of 10, not strict, deployed in ap."),
    ]
    for schema, task in tasks:
        grammar = rt.compile_constraint("json_schema", SCHEMAS[schema])
        for sampling in (GREEDY, SEEDED, SamplingParams(temperature=1.0, seed=3)):
            text, gen = generate(rt, prompt_of(rt, task), grammar, "auto", sampling,
                                 max_tokens=256)
            assert gen.finish.value == "eog", text
            jsonschema.validate(json.loads(text), SCHEMAS[schema])


def test_values_copied_from_the_prompt_are_drafted_and_change_nothing() -> None:
    """Inside a JSON string, the value's first bytes found in the prompt: the prompt's
    continuation is drafted (the default model writes ``"Ing"`` where the prompt has
    `` Ingrid``, so token lookup finds no match there) and verified like any draft."""
    rt = runtime("smol")
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 40},
                             "email": {"type": "string", "maxLength": 60},
                             "order": {"type": "string", "maxLength": 20}},
              "required": ["name", "email", "order"], "additionalProperties": False}
    grammar = rt.compile_constraint("json_schema", schema)
    prompt = prompt_of(rt, "Extract the name, email and order number as JSON.\n\nFrom: "
                           "Ingrid Solberg <ingrid.solberg@nordkapp-tools.no>\nPlease ship "
                           "order NK-20931 by express.")
    for sampling in (GREEDY, SEEDED):
        plain, plain_gen = generate(rt, prompt, grammar, "off", sampling)
        assert plain_gen.stats.copy_drafted == 0
        text, gen = generate(rt, prompt, grammar, "auto", sampling)
        assert text == plain, sampling
        assert gen.stats.copy_accepted > 0, (text, gen.stats)
        assert gen.stats.drafted >= gen.stats.copy_drafted + gen.stats.forced_drafted
        jsonschema.validate(json.loads(text), schema)


def test_only_a_json_document_s_strings_are_copied_into() -> None:
    """Quotes mean a string only where the whole answer is one JSON document."""
    rt = runtime("smol")
    assert is_json_document(rt.compile_constraint("json_schema", SCHEMAS["record"]))
    assert is_json_document(rt.compile_constraint("json_object", None))
    for kind, value in [("regex", r'"[a-z]+"'), ("lark", 'start: "\\"" /[a-z]+/ "\\""'),
                        ("gbnf", 'root ::= "\\"" [a-z]+ "\\""')]:
        grammar = rt.compile_constraint(kind, value)
        assert not is_json_document(grammar), kind
        prompt = prompt_of(rt, 'Repeat "lantern" with its quotes: "lantern"')
        _, gen = generate(rt, prompt, grammar, "auto", GREEDY, max_tokens=12)
        assert gen.stats.copy_drafted == 0


def test_regex_and_lark_constraints_hold_on_every_output() -> None:
    rt = runtime("smol")
    date = rt.compile_constraint("regex", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")
    csv = rt.compile_constraint("lark", r'''
        start: name "," age "," city "\n"
        name: /[A-Z][a-z]{1,12}/
        age: /[1-9][0-9]?/
        city: "Paris" | "Rome" | "Oslo"
    ''')
    prompt = prompt_of(rt, "When did the first moon landing happen? Then give a CSV line.")
    for seed in range(4):
        sampling = GREEDY if seed == 0 else SamplingParams(temperature=1.0, seed=seed)
        text, _ = generate(rt, prompt, date, "auto", sampling, max_tokens=32)
        assert re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", text), text
        line, _ = generate(rt, prompt, csv, "auto", sampling, max_tokens=32)
        assert re.fullmatch(r"[A-Z][a-z]{1,12},[1-9][0-9]?,(Paris|Rome|Oslo)\n", line), line


def test_forced_tokens_are_not_drafted_without_speculation_and_cut_drafts_never_verify(
) -> None:
    rt = runtime("smol")
    grammar = rt.compile_constraint("json_schema", SCHEMAS["record"])
    prompt = prompt_of(rt, 'Copy this: {"name": "Ann", "age": 5, "city": "Rome"} '
                           '{"name": "Ann", "age": 5, "city": "Rome"}')
    _, off = generate(rt, prompt, grammar, "off", GREEDY)
    assert off.stats.drafted == 0
    _, on = generate(rt, prompt, grammar, "ngram", GREEDY)
    # "Rome" is not in the enum: prompt lookup's copy of it is cut before the verify.
    assert on.stats.forced_accepted > 0
    assert on.stats.drafted >= on.stats.forced_drafted


@pytest.mark.parametrize(("kind", "value", "needle"), [
    ("json_schema", {"type": "object", "properties": {"a": {"type": "nonsense"}}},
     "nonsense"),
    ("lark", "start: undefined_rule", "undefined_rule"),
    ("regex", "[0-9", "regex"),
    ("gbnf", 'root ::= "a" missing-rule', "missing-rule"),
])
def test_a_bad_constraint_is_refused_with_the_engine_message(kind: str, value: object,
                                                            needle: str) -> None:
    rt = runtime("smol")
    with pytest.raises(ConstraintError, match=re.escape(needle)) as info:
        rt.compile_constraint(kind, value)
    assert str(info.value)
