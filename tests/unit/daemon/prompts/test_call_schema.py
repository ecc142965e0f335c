"""A function's schema nested in a call keeps its ``$defs`` reachable: the call schema
accepts and refuses the same arguments the function's own schema does."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from meshd.daemon.prompts.call_schema import closed_objects, hoist_defs

SCHEMA = {"$defs": {"Unit": {"enum": ["c", "f"]},
                    "Place": {"type": "object", "required": ["unit"],
                              "properties": {"unit": {"$ref": "#/$defs/Unit"}}}},
          "definitions": {"Tag": {"type": "string", "maxLength": 3}},
          "type": "object", "required": ["at"],
          "properties": {"at": {"$ref": "#/$defs/Place"},
                         "tags": {"type": "array", "items": {"$ref": "#/definitions/Tag"}}}}
OTHER = {"$defs": {"Unit": {"type": "integer"}}, "type": "object",
         "properties": {"n": {"$ref": "#/$defs/Unit"}}}


def _call(*schemas: dict[str, Any]) -> dict[str, Any]:
    """Each schema as one alternative's ``arguments``, the definitions at the root."""
    alternatives, defs = [], {}
    for i, schema in enumerate(schemas):
        body, found = hoist_defs(schema, f"f{i}_")
        defs.update(found)
        alternatives.append({"type": "object", "required": ["name", "arguments"],
                             "properties": {"name": {"const": str(i)}, "arguments": body}})
    return {"anyOf": alternatives, "$defs": defs}


@pytest.mark.parametrize("arguments", [
    {"at": {"unit": "c"}}, {"at": {"unit": "k"}}, {"at": {}}, {"at": {"unit": "f"},
                                                               "tags": ["ab", "abcd"]},
    {"at": {"unit": "f"}, "tags": ["ab"]}, {},
])
def test_the_nested_schema_judges_as_the_function_s_own(arguments: dict[str, Any]) -> None:
    call = _call(SCHEMA, OTHER)  # OTHER's Unit (an integer) must not shadow SCHEMA's
    own = jsonschema.Draft202012Validator(SCHEMA).is_valid(arguments)
    nested = jsonschema.Draft202012Validator(call).is_valid({"name": "0",
                                                             "arguments": arguments})
    assert own == nested


def test_a_schema_without_definitions_is_left_as_it_is() -> None:
    plain = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert hoist_defs(plain, "f0_") == (plain, {})


OPEN = {"type": "object", "required": ["city"],
        "properties": {"city": {"type": "string"},
                       "stops": {"type": "array", "items": {
                           "type": "object", "properties": {"name": {"type": "string"}}}},
                       "when": {"anyOf": [{"type": "null"}, {"properties": {
                           "day": {"type": "integer"}}}]}},
        "$defs": {"Unit": {"type": "object", "properties": {"u": {"type": "string"}}}}}


def test_an_object_that_lists_its_properties_takes_only_those() -> None:
    closed = closed_objects(OPEN)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["stops"]["items"]["additionalProperties"] is False
    assert closed["properties"]["when"]["anyOf"][1]["additionalProperties"] is False
    assert closed["$defs"]["Unit"]["additionalProperties"] is False
    assert OPEN.get("additionalProperties") is None  # (the declaration is not changed)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
    {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
    {"type": "object", "properties": {"a": {}}, "allOf": [{"required": ["a"]}]},
    {"type": "object"},
    {"if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["x"]}},
    {"not": {"properties": {"kind": {"const": "a"}}}},
    {"oneOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
    {"oneOf": [{"$ref": "#/$defs/A"}, {"required": ["b"]}],
     "$defs": {"A": {"properties": {"a": {}}}}},
])
def test_what_the_schema_says_of_other_keys_stands(schema: dict[str, Any]) -> None:
    assert closed_objects(schema) == schema


@pytest.mark.parametrize("value", [
    {"city": "Rome"}, {"city": "Rome", "x": 1}, {"city": "Rome", "stops": [{"name": "a"}]},
    {"city": "Rome", "stops": [{"name": "a", "b": 2}]}, {"city": "Rome", "when": {"day": 1}},
    {"city": "Rome", "when": {"day": 1, "hour": 2}}, {"city": 3}, {},
])
def test_what_the_closed_schema_takes_the_declared_one_takes(value: dict[str, Any]) -> None:
    if jsonschema.Draft202012Validator(closed_objects(OPEN)).is_valid(value):
        assert jsonschema.Draft202012Validator(OPEN).is_valid(value)
