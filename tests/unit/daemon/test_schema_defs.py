"""A function's schema nested in a call keeps its ``$defs`` reachable: the call schema
accepts and refuses the same arguments the function's own schema does."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from meshd.daemon.http.schema_defs import hoist_defs

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
