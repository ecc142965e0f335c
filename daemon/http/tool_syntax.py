"""Tool calls as the model families users run write them, read back from an answer.

Why several syntaxes: a model offered tools answers in the syntax it was trained on,
whatever the prompt suggests. Each reader takes only whole, well-formed calls:

- Hermes / Qwen 2.5 / SmolLM: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- Qwen3-Coder / Qwen 3.5: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  </function></tool_call>`` (a value is JSON where it parses, else text);
- Mistral: ``[TOOL_CALLS]NAME[ARGS]{...}`` (Small 3.2, Devstral) or
  ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3);
- Llama 3.1-3.3: the whole answer is ``{"name": ..., "parameters": {...}}`` (after an
  optional ``<|python_tag|>``), several separated by ``;``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from typing import Any, Final

__all__ = ["Call", "read_calls"]

Call = tuple[str, dict[str, Any]]
"""A function's name and its arguments."""

_HERMES: Final = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_XML: Final = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>",
                         re.S)
_XML_PARAM: Final = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
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


def _hermes(text: str) -> tuple[str, list[Call | None]] | None:
    found = list(_HERMES.finditer(text))
    if not found or "<function=" in text:
        return None
    calls = [_named(_object(m.group(1)), "arguments", "parameters") for m in found]
    return _HERMES.sub("", text), calls


def _xml_value(text: str) -> Any:
    value = _object(text)
    return text if value is None and text.strip() not in ("null",) else value


def _xml(text: str) -> tuple[str, list[Call | None]] | None:
    found = list(_XML.finditer(text))
    if not found:
        return None
    calls: list[Call | None] = []
    for m in found:
        args = {key: _xml_value(value) for key, value in _XML_PARAM.findall(m.group(2))}
        rest = _XML_PARAM.sub("", m.group(2)).strip()
        calls.append(None if rest else (m.group(1), args))
    return _XML.sub("", text), calls


def _mistral(text: str) -> tuple[str, list[Call | None]] | None:
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


def _llama(text: str) -> tuple[str, list[Call | None]] | None:
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


_READERS: Final[tuple[Callable[[str], tuple[str, list[Call | None]] | None], ...]] = (
    _xml, _hermes, _mistral, _llama)


def read_calls(text: str, names: Collection[str]) -> tuple[str, list[Call]] | None:
    """The calls ``text`` makes in one of the known syntaxes and the text around them,
    or None when it makes none; also None when a call is malformed or names a function
    not in ``names`` (then the whole answer stays text)."""
    for reader in _READERS:
        read = reader(text)
        if read is None:
            continue
        rest, calls = read
        if not calls or any(c is None or c[0] not in names for c in calls):
            return None
        return rest.strip(), [c for c in calls if c is not None]
    return None
