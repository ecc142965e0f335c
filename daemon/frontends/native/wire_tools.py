"""Tool calls on the native protocol, served as the HTTP API's chat completions serve them.

Why one path: a ``generate`` with ``tools`` becomes the request chat completions would
make of the same conversation (:mod:`.http.tool_calls`: the generic offer and the forced
call's grammar; :mod:`.http.template_tools`: the template's own offer and the lazy
constraint for ``auto``), and its answer is read the same way, so both front ends give
one model the same prompt, constraint and calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from meshd.daemon.prompts.tool_calls import (
    ToolSpec,
    answer_calls,
    offer_tools,
    parameters_problem,
    past_calls,
    template_messages,
    tool_constraint,
)
from meshd.protocol import BadRequest, ChatMessage, Generate, ToolCall
from meshd.protocol import messages as wire

__all__ = ["WireTools", "calls_of", "offered"]


@attrs.frozen
class WireTools:
    """A request's tools as the daemon serves them."""

    spec: ToolSpec
    #: The conversation as templates read it (for the template's own offer).
    conversation: tuple[dict[str, Any], ...]


def offered(request: Generate) -> tuple[Generate, WireTools | None]:
    """``request`` with its tools offered in its messages (and, for a forced call, the
    constraint that holds it), and the tools to read the answer with; earlier calls in
    the history are written in the offered syntax. Raises BadRequest for a forced call
    with a ``constraint`` of its own, and for ``parameters`` no call can satisfy."""
    given = request.messages
    if given is None:
        return request, None
    turns = [_turn(m) for m in given]
    if request.tools is None or request.tool_choice == "none":
        if any(m.tool_calls for m in given):
            request = attrs.evolve(request, messages=tuple(
                ChatMessage(role=t["role"], content=t["content"]) for t in turns))
        return request, None
    for i, function in enumerate(request.tools):
        problem = parameters_problem(function.parameters)
        if problem is not None:
            raise BadRequest.invalid_field(f"generate.tools[{i}].parameters", problem)
    spec = ToolSpec(
        tuple((f.name, f.description, f.parameters if f.parameters is not None
               else {"type": "object"}) for f in request.tools),
        "named" if request.tool_name else request.tool_choice, request.tool_name,
        request.parallel_tool_calls)
    constraint = request.constraint
    if spec.choice != "auto":
        if constraint is not None:
            raise BadRequest.invalid_field(
                "tool_choice", "a forced tool call and constraint cannot both constrain "
                "the answer")
        constraint = tool_constraint(spec)
    messages = tuple(ChatMessage(role=m["role"], content=m["content"])
                     for m in offer_tools(turns, spec))
    conversation = tuple(template_messages([_openai_turn(m) for m in given]))
    return (attrs.evolve(request, messages=messages, constraint=constraint),
            WireTools(spec, conversation))


def calls_of(tools: WireTools, text: str, finish: str) -> tuple[ToolCall, ...]:
    """The whole calls ``text`` made (cut by ``max_tokens``: those before the cut)."""
    _content, calls = answer_calls(text, tools.spec, finished=finish in ("eog", "stop"))
    return tuple(ToolCall(id=c["id"], name=c["function"]["name"],
                          arguments=c["function"]["arguments"]) for c in calls)


def _turn(message: wire.ChatMessage) -> dict[str, str]:
    """A turn in the generic offer's terms: earlier calls written after the text."""
    content = message.content
    if message.tool_calls:
        content += past_calls(_openai_calls(message.tool_calls), "messages")
    return {"role": message.role, "content": content}


def _openai_turn(message: wire.ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = _openai_calls(message.tool_calls)
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _openai_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
