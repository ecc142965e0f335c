"""``meshctl chat``'s tool options: the functions the model may call, read from a file,
and how the answer's calls are shown.

Why a file: a function's JSON schema does not fit a flag; the file holds what an OpenAI
client sends as ``tools`` (``[{"type": "function", "function": {...}}, ...]``), or the
bare functions, so one file serves both.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from meshd.protocol import ToolCall, ToolFunction

__all__ = ["ToolRequest", "add_tool_options", "call_lines", "read_tools"]


@attrs.frozen
class ToolRequest:
    """What the request offers: its functions, ``auto``/``none``/``required``, and the
    one function a named choice calls."""

    tools: tuple[ToolFunction, ...] | None = None
    choice: str = "auto"
    name: str | None = None


def add_tool_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tools", metavar="FILE", default=None,
                   help="functions the model may call: a JSON file with OpenAI's `tools` "
                        "array (or the bare functions: name, description, parameters); "
                        "'-' reads stdin")
    p.add_argument("--tool-choice", metavar="CHOICE", default=None,
                   help="auto (the model decides; default), none, required (only calls), "
                        "or a function's name (that call only)")


def _function(item: object, i: int, flag: str) -> ToolFunction:
    fn: Any = item.get("function", item) if isinstance(item, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{flag}: item {i} is not a function (OpenAI's {{'type': "
                         "'function', 'function': {'name', 'parameters'}} or the bare "
                         "function)")
    description = fn.get("description", "")
    return ToolFunction(name=fn["name"],
                        description=description if isinstance(description, str) else "",
                        parameters=fn.get("parameters"))


def read_tools(args: argparse.Namespace) -> ToolRequest:
    """The tools the options ask for; raises ValueError (a usage error: the file cannot
    be read, is not JSON, or holds no functions; a choice that names none of them)."""
    path, choice = args.tools, args.tool_choice
    if path is None:
        if choice is not None:
            raise ValueError("--tool-choice needs --tools FILE")
        return ToolRequest()
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        value = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--tools {path}: {exc}") from None
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError(f"--tools {path}: no functions")
    try:
        tools = tuple(_function(item, i, f"--tools {path}") for i, item in enumerate(items))
    except (TypeError, ValueError) as exc:  # (ToolFunction's own checks too)
        raise ValueError(str(exc)) from None
    if choice in (None, "auto", "none", "required"):
        return ToolRequest(tools, choice or "auto")
    if choice not in {t.name for t in tools}:
        raise ValueError(f"--tool-choice {choice}: not auto, none, required or one of "
                         f"the functions in {path}")
    return ToolRequest(tools, "required", choice)


def call_lines(calls: Sequence[ToolCall]) -> list[str]:
    """The answer's calls as lines a person reads: ``call NAME ARGUMENTS``."""
    return [f"call {call.name} {call.arguments}" for call in calls]
