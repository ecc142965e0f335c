"""The output constraint an OpenAI request asks for: ``response_format`` (``text``,
``json_object``, ``json_schema``), llama-server's ``json_schema`` and ``grammar``, or
vLLM's ``guided_json``, ``guided_regex`` and ``guided_choice``.

Why apart from the request parser: six fields (one with three shapes) map onto one
native ``constraint``, and at most one of them may be given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from meshd.protocol import BadRequest
from meshd.protocol import messages as wire

__all__ = ["MAX_GUIDED_CHOICES", "FormatError", "output_constraint", "response_format"]


class FormatError(ValueError):
    """A bad constraint field: (param, message)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def _bad(param: str, message: str) -> FormatError:
    return FormatError(param, message)


def response_format(value: object) -> wire.Constraint | None:
    """OpenAI's ``response_format``: ``text``, ``json_object`` (llama-server's extension:
    with a ``schema``) or ``json_schema`` (``{"json_schema": {"name", "schema",
    "strict"}}``; every output is held to the schema, ``strict`` or not)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    assert isinstance(value, Mapping)
    if kind == "json_object":
        schema = value.get("schema")
        if schema is None:
            return wire.Constraint(kind="json_object")
        if not isinstance(schema, dict):
            raise _bad("response_format.schema", "must be a JSON schema object")
        return wire.Constraint(kind="json_schema", schema=schema)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise _bad("response_format.json_schema",
                       "must be an object like {'name': ..., 'schema': {...}}")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema", "must be a JSON schema object")
        return wire.Constraint(kind="json_schema", schema=schema)
    raise _bad("response_format", "must be an object whose type is 'text', 'json_object' "
                                  f"or 'json_schema' (got {str(kind)[:64]!r})")


#: The most choices vLLM's ``guided_choice`` may list (each is one branch of a grammar).
MAX_GUIDED_CHOICES: Final = 1024


def _guided(body: Mapping[str, Any]) -> list[tuple[str, wire.Constraint]]:
    """vLLM's ``guided_json`` (a schema, or one as JSON text), ``guided_regex`` and
    ``guided_choice`` (the answer is one of the strings): the constraints
    ``response_format`` and a grammar would give."""
    try:
        return _guided_constraints(body)
    except BadRequest as exc:  # (the native constraint's bounds), named by its field
        field = next(k for k in ("guided_json", "guided_regex", "guided_choice")
                     if body.get(k) is not None)
        raise _bad(field, exc.message.partition(": ")[2] or exc.message) from None


def _guided_constraints(body: Mapping[str, Any]) -> list[tuple[str, wire.Constraint]]:
    found: list[tuple[str, wire.Constraint]] = []
    schema = body.get("guided_json")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            raise _bad("guided_json", "must be a JSON schema (an object, or one as JSON "
                                      "text)") from None
    if schema is not None:
        if not isinstance(schema, dict):
            raise _bad("guided_json", "must be a JSON schema (an object, or one as JSON text)")
        found.append(("guided_json", wire.Constraint(kind="json_schema", schema=schema)))
    regex = body.get("guided_regex")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise _bad("guided_regex", "must be a regular expression (a non-empty string)")
        found.append(("guided_regex", wire.Constraint(kind="regex", grammar=regex)))
    choices = body.get("guided_choice")
    if choices is not None:
        if (not isinstance(choices, list) or not 1 <= len(choices) <= MAX_GUIDED_CHOICES
                or not all(isinstance(c, str) and c for c in choices)):
            raise _bad("guided_choice", f"must be an array of 1 to {MAX_GUIDED_CHOICES} "
                                        "non-empty strings")
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        found.append(("guided_choice", wire.Constraint(kind="lark", grammar=lark)))
    return found


def output_constraint(body: Mapping[str, Any]) -> tuple[wire.Constraint | None, str]:
    """The output constraint and the field that set it: ``response_format``,
    llama-server's ``json_schema`` (a schema) or ``grammar`` (GBNF), or vLLM's
    ``guided_json``, ``guided_regex`` or ``guided_choice``. At most one. Raises
    FormatError, or BadRequest from the native constraint's own checks."""
    found: list[tuple[str, wire.Constraint]] = []
    fmt = response_format(body.get("response_format"))
    if fmt is not None:
        found.append(("response_format", fmt))
    schema = body.get("json_schema")
    if schema is not None and schema != {}:
        if not isinstance(schema, dict):
            raise _bad("json_schema", "must be a JSON schema object")
        found.append(("json_schema", wire.Constraint(kind="json_schema", schema=schema)))
    grammar = body.get("grammar")
    if grammar is not None and grammar != "":
        if not isinstance(grammar, str):
            raise _bad("grammar", "must be a GBNF grammar (a string)")
        found.append(("grammar", wire.Constraint(kind="gbnf", grammar=grammar)))
    found += _guided(body)
    if len(found) > 1:
        raise _bad(found[1][0], f"only one of response_format, json_schema, grammar and "
                                f"vLLM's guided_json, guided_regex and guided_choice may "
                                f"constrain the output (got {found[0][0]} too)")
    return (found[0][1], found[0][0]) if found else (None, "response_format")
