"""Lark grammars for calls in the tagged syntaxes: Qwen3-Coder / Qwen 3.5's
``<function=NAME><parameter=KEY>`` and GLM's ``NAME<arg_key>KEY</arg_key><arg_value>``.

Why a grammar per parameter: these syntaxes write each argument in a tag of its own,
a string bare and anything else as JSON (as the templates render earlier calls), so the
constraint follows the schema key by key: the keys a function has (the required ones
always, in the schema's order), a string as text up to its closing tag (an ``enum`` or
``const`` as one of its values, a ``pattern`` or length as a regular expression; a lazy
lexeme with the closing tag, so the text ends where that tag first appears), any other
value as JSON held to its schema. The answer then reads back
(:mod:`.tool_syntax`) as arguments that validate.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from meshd.daemon.engine.constraint import JSON_DEFAULTS
from meshd.daemon.prompts.tool_syntax import writes_text

__all__ = ["TAGGED_SYNTAXES", "tagged_call_rules"]

#: The tagged syntaxes: the template family's name for each.
TAGGED_SYNTAXES: Final = ("xml", "glm")

_TEXT: Final = r"TAGGED_TEXT: /(.|\n)*/"


def _literal(text: str) -> str:
    return json.dumps(text)


def _text_value(rule: str, schema: Mapping[str, Any], close: str) -> list[str]:
    """The rule for a string parameter's bare text, then ``close``."""
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        choices = " | ".join(_literal(str(v)) for v in values if isinstance(v, str))
        return [f"{rule}: ({choices or _literal('')}) {_literal(close)}"]
    pattern = schema.get("pattern")
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(pattern, str) or isinstance(low, int) or isinstance(high, int):
        parts = []
        if isinstance(pattern, str):
            body = pattern.removeprefix("^").removesuffix("$")
            parts.append("/" + body.replace("/", "\\/") + "/")
        if isinstance(low, int) or isinstance(high, int):
            low_n = low if isinstance(low, int) else 0
            parts.append(f"/(.|\\n){{{low_n},{high if isinstance(high, int) else ''}}}/")
        lexeme = rule.upper() + "_TEXT"
        return [f"{lexeme}: {' & '.join(parts)}", f"{rule}[lazy]: {lexeme} {_literal(close)}"]
    return [f"{rule}[lazy]: TAGGED_TEXT {_literal(close)}"]


def _value(rule: str, schema: object, close: str) -> list[str]:
    """The rules for one argument's value, then ``close``."""
    if isinstance(schema, Mapping) and writes_text(schema):
        return _text_value(rule, schema, close)
    body = {**schema, "x-guidance": dict(JSON_DEFAULTS)} if isinstance(schema, Mapping) \
        else {"x-guidance": dict(JSON_DEFAULTS)}
    return [f"{rule}: {rule}_json {_literal(close)}", f"{rule}_json: %json {json.dumps(body)}"]


def _arguments(prefix: str, schema: Mapping[str, Any], syntax: str
               ) -> tuple[str, list[str]]:
    """A function's arguments in order (optional ones may be left out): the sequence to
    write in its call, and the rules it names."""
    properties = dict(schema.get("properties") or {})
    required = [key for key in schema.get("required") or () if isinstance(key, str)]
    for key in required:  # (a required key the properties do not describe: any value)
        properties.setdefault(key, {})
    shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    sequence, lines = [], []
    for j, (key, sub) in enumerate(properties.items()):
        if shared and isinstance(sub, Mapping):  # its $refs point to the root's
            sub = {**sub, **shared}
        rule = f"{prefix}_{j}"
        if syntax == "xml":
            opening, close = f"<parameter={key}>\n", "\n</parameter>\n"
        else:
            opening, close = f"<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n"
        lines += [f"{rule}: {_literal(opening)} {rule}_v", *_value(f"{rule}_v", sub, close)]
        sequence.append(rule if key in required else f"{rule}?")
    return " ".join(sequence), lines


def tagged_call_rules(functions: Sequence[tuple[str, str, dict[str, Any]]], syntax: str,
                      rule: str) -> list[str]:
    """Lark rules defining ``rule``: one call, after its ``<tool_call>`` opener, to one
    of ``functions`` in ``syntax`` (one of :data:`TAGGED_SYNTAXES`), closed by
    ``</tool_call>``."""
    if syntax not in TAGGED_SYNTAXES:
        raise ValueError(f"{syntax!r} is not a tagged call syntax")
    alternatives, lines = [], [_TEXT]
    for i, (name, _, schema) in enumerate(functions):
        args, arg_lines = _arguments(f"{rule}_{i}a", schema, syntax)
        if syntax == "xml":
            head, tail = f"\n<function={name}>\n", "</function>\n</tool_call>"
        else:
            head, tail = f"{name}\n", "</tool_call>"
        lines += [f"{rule}_{i}: {_literal(head)} {args} {_literal(tail)}", *arg_lines]
        alternatives.append(f"{rule}_{i}")
    return [f"{rule}: {' | '.join(alternatives)}", *lines]
