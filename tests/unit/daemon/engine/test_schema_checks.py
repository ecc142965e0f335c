"""What a constraint is refused or bounded for before llguidance compiles it: schemas
and GBNF grammars with no finite answer (and only those: recursion with a way out is
served), nesting past the bound, and numbers bounded without narrowing what a schema
already says."""

from __future__ import annotations

import pytest

from meshd.daemon.engine.schema_checks import (
    MAX_INTEGER,
    MAX_NESTING,
    bounded_numbers,
    gbnf_problem,
    schema_problem,
)

NODE = {"type": "object", "properties": {"kids": {"type": "array",
                                                  "items": {"$ref": "#/$defs/node"}}},
        "required": ["kids"]}


@pytest.mark.parametrize(("schema", "finite"), [
    ({"$ref": "#"}, False),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     False),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, False),
    ({"$defs": {"node": {**NODE, "properties": {"kids": {
        **NODE["properties"]["kids"], "minItems": 1}}}}, "$ref": "#/$defs/node"}, False),
    # a way out: the key is optional, null is allowed, another option, an empty array
    ({"type": "object", "properties": {"x": {"$ref": "#"}}}, True),
    ({"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, True),
    ({"anyOf": [{"$ref": "#"}, {"type": "string"}]}, True),
    ({"$defs": {"node": NODE}, "$ref": "#/$defs/node"}, True),
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/b"},
                                       "b": {"type": "integer"}}, "required": ["a"]}, True),
    ({"$ref": "https://example.com/schema.json"}, True),  # (not ours to resolve)
])
def test_a_schema_without_a_finite_value_is_named(schema: dict[str, object],
                                                  finite: bool) -> None:
    problem = schema_problem(schema)
    assert (problem is None) == finite, problem
    if not finite:
        assert problem is not None and "cyclic $ref" in problem


def test_nesting_is_bounded_without_recursing() -> None:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(5000):  # (deeper than Python's recursion limit)
        schema = {"type": "object", "properties": {"a": schema}}
    assert schema_problem(schema) == f"the schema nests deeper than {MAX_NESTING} levels"
    assert gbnf_problem("root ::= " + "(" * 101 + '"a"' + ")" * 101) is not None
    assert gbnf_problem("root ::= " + "(" * 100 + '"a"' + ")" * 100) is None
    assert gbnf_problem('root ::= "((((" [(] # ((((\n') is None


@pytest.mark.parametrize(("grammar", "stuck"), [
    ("root ::= root", "root"),
    ('root ::= "a" root', "root"),
    ("root ::= a\na ::= b\nb ::= a", "root, a, b"),
    ('root ::= "a" root | "b"', None),
    ("root ::= x*\nx ::= x", None),
    ('root ::= "a" missing', None),  # (the converter names what is missing)
])
def test_a_gbnf_rule_that_never_ends_is_named(grammar: str, stuck: str | None) -> None:
    problem = gbnf_problem(grammar)
    if stuck is None:
        assert problem is None
    else:
        assert problem is not None and f"rule {stuck} never end" in problem


def test_numbers_get_bounds_only_where_the_schema_gives_none() -> None:
    schema = bounded_numbers({"type": "object", "properties": {
        "n": {"type": "integer"}, "f": {"type": ["number", "null"]},
        "low": {"type": "integer", "minimum": 0}, "e": {"type": "integer", "enum": [1]},
        "big": {"type": "integer", "minimum": 10**20}, "s": {"type": "string"}},
        "not": {"type": "integer"}})
    props = schema["properties"]
    assert props["n"] == {"type": "integer", "minimum": -MAX_INTEGER, "maximum": MAX_INTEGER}
    assert props["f"] == {"type": ["number", "null"], "exclusiveMinimum": -1e16,
                          "exclusiveMaximum": 1e16, "multipleOf": 1e-10}
    assert props["low"] == {"type": "integer", "minimum": 0, "maximum": MAX_INTEGER}
    assert props["e"] == {"type": "integer", "enum": [1]}
    assert props["big"] == {"type": "integer", "minimum": 10**20}  # (a bound would empty it)
    assert props["s"] == {"type": "string"}
    assert schema["not"] == {"type": "integer"}  # (a bound there would widen the schema)
