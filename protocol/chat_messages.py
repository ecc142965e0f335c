"""The chat parts of ``generate`` and ``done``: a turn (``ChatMessage``), a function the
model may call (``ToolFunction``) and a call it made (``ToolCall``). Re-exported by
``messages``."""

from __future__ import annotations

from typing import Any, Final

import attrs
import attrs.validators as V

from . import validators as check

__all__ = ["MAX_TOOLS", "MAX_TOOL_CALLS", "TOOL_CHOICES", "TOOL_NAME_PATTERN", "ChatMessage",
           "ToolCall", "ToolFunction"]

MAX_TOOLS: Final = 128
"""Functions one request may offer."""
MAX_TOOL_CALLS: Final = 128
"""Calls one assistant turn may carry."""
TOOL_NAME_PATTERN: Final = r"[A-Za-z0-9_.:-]{1,64}"
"""A function's name: 1-64 letters, digits, ``_``, ``.``, ``:`` or ``-`` (OpenAI's)."""
TOOL_CHOICES: Final = ("auto", "none", "required")

_tool_name = check.rule("1-64 letters, digits, '_', '.', ':' or '-'", check.STR,
                        V.matches_re(TOOL_NAME_PATTERN))
_json_text = check.rule(f"a string of at most {check.MAX_GRAMMAR_LENGTH} chars", check.STR,
                        V.max_len(check.MAX_GRAMMAR_LENGTH))


@attrs.frozen
class ToolFunction:
    """A function the model may call; ``parameters`` is its arguments' JSON schema."""

    name: str = attrs.field(validator=_tool_name)
    description: str = attrs.field(default="", validator=_json_text)
    parameters: dict[str, Any] | None = attrs.field(default=None, validator=check.rule(
        f"a JSON schema object of at most {check.MAX_GRAMMAR_LENGTH} characters as JSON",
        check.OBJECT, check.json_length(check.MAX_GRAMMAR_LENGTH), optional=True))
    """``None``: any object."""


@attrs.frozen
class ToolCall:
    """A call the model made: the function's name and its arguments as JSON text."""

    id: str = attrs.field(validator=check.request_id)
    name: str = attrs.field(validator=_tool_name)
    arguments: str = attrs.field(default="{}", validator=_json_text)


@attrs.frozen
class ChatMessage:
    """One chat turn; the server renders the list with the model's chat template."""

    role: str = attrs.field(validator=check.role)
    """``system``, ``user``, ``assistant``, ``tool`` or whatever else the template knows."""
    content: str = attrs.field(validator=check.string)
    tool_calls: tuple[ToolCall, ...] | None = attrs.field(default=None, validator=check.rule(
        f"an array of at most {MAX_TOOL_CALLS} ToolCalls", V.instance_of(ToolCall),
        each="a ToolCall", container="array", max_items=MAX_TOOL_CALLS, optional=True))
    """An assistant turn's earlier calls."""
    tool_call_id: str | None = attrs.field(default=None, validator=check.optional_request_id)
    """A ``tool`` turn's answer to this call."""
