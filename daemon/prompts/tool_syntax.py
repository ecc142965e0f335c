"""Tool calls as the model families users run write them, read back from an answer.

Why several syntaxes: a model offered tools answers in the syntax it was trained on,
whatever the prompt suggests. Each reader takes only whole, well-formed calls:

- Hermes / Qwen 2.5 / SmolLM: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- Qwen3-Coder / Qwen 3.5: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  </function></tool_call>``;
- GLM 4.5-4.7: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>
  </tool_call>``;
- Mistral: ``[TOOL_CALLS]NAME[ARGS]{...}`` (Small 3.2, Devstral) or
  ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3);
- Llama 3.1-3.3: the whole answer is ``{"name": ..., "parameters": {...}}`` (after an
  optional ``<|python_tag|>``), several separated by ``;``.

In the two tagged syntaxes a value is written as text where the parameter's schema says
string, else as JSON (as their templates render earlier calls), so a value is read back
by its schema: ``"42"`` stays a string for a string parameter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["Call", "Functions", "read_calls", "writes_text"]

Call = tuple[str, dict[str, Any]]
"""A function's name and its arguments."""

_HERMES: Final = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_XML: Final = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>",
                         re.S)
_XML_PARAM: Final = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
_GLM: Final = re.compile(
    r"<tool_call>\s*([^\s<]+)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)"
    r"</tool_call>", re.S)
_GLM_ARG: Final = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_MISTRAL_ARGS: Final = re.compile(r"\[TOOL_CALLS\]([A-Za-z0-9_.:-]+)(?:\[CALL_ID\]\w+)?\[ARGS\]")
_PYTHON_TAG: Final = "<|python_tag|>"


def _object(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _named(value: Any, *keys: str) -> Call | None:
    """``{"name": ..., KEY: {...}}`` as a call, for the first of ``keys`` present."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args: Any = next((value[k] for k in keys if k in value), {})
    return (value["name"], args) if isinstance(args, dict) else None


Functions = Mapping[str, Mapping[str, Any]]
"""The offered functions: name -> JSON schema of the arguments."""
Read = tuple[str, list[Call | None]] | None
"""The text around the calls and the calls (None: malformed), or None: no call."""


def _hermes(text: str, _functions: Functions) -> Read:
    found = list(_HERMES.finditer(text))
    if not found or "<function=" in text:
        return None
    calls = [_named(_object(m.group(1)), "arguments", "parameters") for m in found]
    return _HERMES.sub("", text), calls


def writes_text(schema: object) -> bool:
    """Whether a parameter of this schema is written as bare text in the tagged syntaxes
    (its type is string, alone or with null, or it has no type and only string values)."""
    if not isinstance(schema, Mapping):
        return False
    kind = schema.get("type")
    if kind is None:
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        return isinstance(values, list) and bool(values) \
            and all(isinstance(v, str) for v in values)
    return kind == "string" or (isinstance(kind, list) and "string" in kind
                                and set(kind) <= {"string", "null"})


def _tagged_value(text: str, schema: object) -> Any:
    """A tagged syntax's value: text for a string parameter, else JSON where it parses
    (else text: the schema check then refuses it)."""
    if writes_text(schema):
        return text
    value = _object(text)
    return text if value is None and text.strip() != "null" else value


def _arguments(name: str, pairs: list[tuple[str, str]], functions: Functions
               ) -> dict[str, Any]:
    properties = functions.get(name, {}).get("properties")
    schemas = properties if isinstance(properties, Mapping) else {}
    return {key: _tagged_value(value, schemas.get(key)) for key, value in pairs}


def _xml(text: str, functions: Functions) -> Read:
    found = list(_XML.finditer(text))
    if not found:
        return None
    calls: list[Call | None] = []
    for m in found:
        args = _arguments(m.group(1), _XML_PARAM.findall(m.group(2)), functions)
        rest = _XML_PARAM.sub("", m.group(2)).strip()
        calls.append(None if rest else (m.group(1), args))
    return _XML.sub("", text), calls


def _glm(text: str, functions: Functions) -> Read:
    found = list(_GLM.finditer(text))
    if not found:  # (after Hermes': there a call opens with its JSON, never a name)
        return None
    calls: list[Call | None] = [
        (m.group(1), _arguments(m.group(1), _GLM_ARG.findall(m.group(2)), functions))
        for m in found]
    return _GLM.sub("", text), calls


def _mistral(text: str, _functions: Functions) -> Read:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None
    head, body = text[:start], text[start:]
    if body.startswith("[TOOL_CALLS]["):  # v3: one JSON array of calls
        listed = _object(body.removeprefix("[TOOL_CALLS]").strip())
        if not isinstance(listed, list) or not listed:
            return head, [None]
        return head, [_named(c, "arguments", "parameters") for c in listed]
    calls: list[Call | None] = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body.rstrip()):
        m = _MISTRAL_ARGS.match(body, pos)
        if m is None:
            return head, [None]
        try:
            args, end = decoder.raw_decode(body, m.end())
        except json.JSONDecodeError:
            return head, [None]
        calls.append((m.group(1), args) if isinstance(args, dict) else None)
        pos = end
        while pos < len(body) and body[pos].isspace():
            pos += 1
    return head, calls


def _llama(text: str, _functions: Functions) -> Read:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    parts = [_object(part) for part in body.split(";")] if ";" in body else [_object(body)]
    if not all(isinstance(p, dict) and "name" in p for p in parts):
        whole = _object(body)
        if not (isinstance(whole, dict) and "name" in whole):
            return None
        parts = [whole]
    if not all(("parameters" in p or "arguments" in p) and len(p) == 2 for p in parts):
        return None
    return "", [_named(p, "parameters", "arguments") for p in parts]


_READERS: Final[tuple[Callable[[str, Functions], Read], ...]] = (
    _xml, _hermes, _glm, _mistral, _llama)


def read_calls(text: str, functions: Functions) -> tuple[str, list[Call]] | None:
    """The calls ``text`` makes in one of the known syntaxes and the text around them,
    or None when it makes none; also None when a call is malformed or names a function
    not in ``functions`` (then the whole answer stays text)."""
    for reader in _READERS:
        read = reader(text, functions)
        if read is None:
            continue
        rest, calls = read
        if not calls or any(c is None or c[0] not in functions for c in calls):
            return None
        return rest.strip(), [c for c in calls if c is not None]
    return None
