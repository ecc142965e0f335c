"""The output constraint an OpenAI request asks for: ``response_format`` (``text``,
``json_object``, ``json_schema``), or llama-server's ``json_schema`` and ``grammar``.

Why apart from the request parser: three fields (one with three shapes) map onto one
native ``constraint``, and at most one of them may be given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshd.protocol import messages as wire

__all__ = ["FormatError", "output_constraint", "response_format"]


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


def output_constraint(body: Mapping[str, Any]) -> tuple[wire.Constraint | None, str]:
    """The output constraint and the field that set it: ``response_format``, or
    llama-server's ``json_schema`` (a schema) or ``grammar`` (GBNF). At most one.
    Raises FormatError, or BadRequest from the native constraint's own checks."""
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
    if len(found) > 1:
        raise _bad(found[1][0], f"only one of response_format, json_schema and grammar may "
                                f"constrain the output (got {found[0][0]} too)")
    return (found[0][1], found[0][0]) if found else (None, "response_format")
