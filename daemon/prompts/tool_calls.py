"""OpenAI tool calls on chat completions: the request's ``tools`` and ``tool_choice``,
the prompt that offers them, the constraint that holds a forced call to the functions'
schemas, and the answer's ``tool_calls``.

Why one call syntax (Hermes': ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
which Qwen, Hermes and SmolLM-style chat models are trained on) offered in a system turn:
it works with any chat template, including those that know no tools (llama-server's
generic handler does the same with its own format). With ``tool_choice`` ``required`` or
a named function the whole answer is constrained to such calls, each ``arguments``
object to its function's JSON schema, so the call parses and validates; with ``auto``
the model chooses and the answer is read in whichever family's syntax it wrote
(:mod:`.tool_syntax`: a Llama, Mistral or Qwen 3.5 model may answer in its own). An
answer cut short (``max_tokens``) keeps the whole calls before the cut and drops the
call it broke: ``tool_calls`` only ever holds whole, valid calls, and a call's text is
never content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from meshd.daemon.engine.constraint import JSON_DEFAULTS
from meshd.daemon.engine.schema_checks import bounded_numbers, schema_problem
from meshd.daemon.prompts.call_schema import closed_objects, hoist_defs
from meshd.daemon.prompts.tagged_calls import TAGGED_SYNTAXES, tagged_call_rules
from meshd.daemon.prompts.tool_syntax import Call, read_calls
from meshd.protocol import messages as wire

__all__ = [
    "FORCED_SYNTAXES",
    "LAZY_SYNTAXES",
    "ToolError",
    "ToolSpec",
    "answer_calls",
    "forced_call_grammar",
    "join_parts",
    "lazy_call_grammar",
    "offer_tools",
    "opener_of",
    "parameters_problem",
    "parse_tools",
    "past_calls",
    "template_messages",
    "tool_constraint",
]

MAX_TOOLS: Final = 128
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice`` field: (param, message)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@attrs.frozen
class ToolSpec:
    """The request's functions (name -> JSON schema of the arguments) and its choice."""

    functions: tuple[tuple[str, str, dict[str, Any]], ...]  # (name, description, schema)
    choice: str  # "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.functions)

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each function's name and the JSON schema of its arguments."""
        return {name: schema for name, _, schema in self.functions}


def parse_tools(body: Mapping[str, Any]) -> ToolSpec | None:
    """The request's tools, or None (no tools, or ``tool_choice: "none"``)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"must be an array of at most {MAX_TOOLS} functions")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" \
                or not isinstance(fn, Mapping):
            raise ToolError(f"tools[{i}]", "must be {'type': 'function', 'function': {...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}].function.name",
                            "must be 1-64 letters, digits, '_', '.', ':' or '-'")
        schema = fn.get("parameters", {"type": "object"})
        if not isinstance(schema, dict):
            raise ToolError(f"tools[{i}].function.parameters", "must be a JSON schema object")
        problem = parameters_problem(schema)
        if problem is not None:
            raise ToolError(f"tools[{i}].function.parameters", problem)
        description = fn.get("description", "")
        functions.append((name, description if isinstance(description, str) else "", schema))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "must be true or false")
    if choice in (None, "auto"):
        return ToolSpec(tuple(functions), "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolSpec(tuple(functions), "required", parallel=parallel)
    named = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
    if not isinstance(named, str):
        raise ToolError("tool_choice", "must be 'none', 'auto', 'required' or "
                                       "{'type': 'function', 'function': {'name': ...}}")
    if named not in {f[0] for f in functions}:
        raise ToolError("tool_choice", f"names {named[:64]!r}, which is not in tools")
    return ToolSpec(tuple(functions), "named", named, parallel)


def parameters_problem(schema: object) -> str | None:
    """Why a function's ``parameters`` cannot hold a call (nested too deep, or no finite
    value: a cyclic ``$ref``), or None; a call's grammar would otherwise never close."""
    return schema_problem(schema)


def past_calls(calls: object, param: str) -> str:
    """An assistant turn's earlier ``tool_calls`` in the call syntax the model is offered
    (so a conversation reads as the model would have written it)."""
    if not isinstance(calls, list):
        raise ToolError(param, "must be an array of tool calls")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ToolError(f"{param}[{i}]", "must be {'function': {'name', 'arguments'}}")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = args
        out.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": parsed})
                   + "\n</tool_call>")
    return ("\n" if out else "") + "\n".join(out)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def join_parts(parts: Sequence[str], *, continued: bool) -> str:
    """Text content parts as one string: joined by a newline, as llama.cpp and vLLM join
    them for templates that take text; a final assistant message the model continues (a
    prefill) by a blank line, as llama.cpp renders a continued message's parts."""
    return ("\n\n" if continued else "\n").join(parts)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A request's messages (already validated) as templates read them: text content
    (parts joined as :func:`~.openai_api.parse_messages` joins them), ``developer`` as
    ``system``, calls with their arguments as objects, a tool turn's ``tool_call_id``."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, list):
            content = join_parts([part["text"] for part in content], continued=(
                msg["role"] == "assistant" and i == len(messages) - 1))
        role = "system" if msg["role"] == "developer" else msg["role"]
        turn: dict[str, Any] = {"role": role, "content": content or ""}
        calls = msg.get("tool_calls") if role == "assistant" else None
        if calls:
            turn["tool_calls"] = [
                {"id": call.get("id") or f"call{i:05d}", "type": "function",
                 "function": {"name": call["function"]["name"],
                              "arguments": _arguments(call["function"].get("arguments", {}))}}
                for i, call in enumerate(calls)]
        for key in ("tool_call_id", "name"):
            if role in ("tool", "function") and isinstance(msg.get(key), str):
                turn[key] = msg[key]
        out.append(turn)
    return out


def offer_tools(messages: Sequence[Mapping[str, Any]], spec: ToolSpec) -> list[dict[str, Any]]:
    """The chat with the tools offered in its system turn (merged into the first system
    message, if any)."""
    listing = "\n".join(json.dumps({"type": "function", "function": {
        "name": name, "description": description, "parameters": schema}})
        for name, description, schema in spec.functions)
    offer = ("You may call one or more functions to assist with the user query. The "
             f"functions are:\n<tools>\n{listing}\n</tools>\nTo call a function, reply "
             "with a JSON object with its name and arguments within <tool_call></tool_call> "
             'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
             "\n</tool_call>")
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{offer}".strip()
    else:
        out.insert(0, {"role": "system", "content": offer})
    return out


def tool_constraint(spec: ToolSpec) -> wire.Constraint | None:
    """For ``required`` or a named function: the answer is calls only, each call's
    arguments held to its function's schema (a Lark grammar with JSON-schema rules), in
    the Hermes syntax the generic offer teaches."""
    if spec.choice == "auto":
        return None
    return wire.Constraint(kind="lark", grammar=forced_call_grammar(spec, "hermes"))


#: The call syntaxes a forced call can be held to (:func:`forced_call_grammar`).
FORCED_SYNTAXES: Final = ("hermes", "llama", "mistral_args", "mistral_list", *TAGGED_SYNTAXES)


def opener_of(syntax: str) -> str:
    """The text a call opens with in ``syntax`` (the vocabulary may have it as one
    special token)."""
    return "[TOOL_CALLS]" if syntax.startswith("mistral") else "<tool_call>"


def forced_call_grammar(spec: ToolSpec, syntax: str, *, opener: str | None = None) -> str:
    """The Lark grammar of an answer that is only calls (``required`` or a named
    function) in ``syntax``, one of :data:`FORCED_SYNTAXES`: Hermes'
    ``<tool_call>{...}</tool_call>``, Llama 3.x's bare ``{"name", "parameters"}`` (several
    joined by ``; ``), Mistral's ``[TOOL_CALLS]NAME[ARGS]{...}`` or its
    ``[TOOL_CALLS][{"name", "arguments"}, ...]``, or a tagged syntax
    (:mod:`.tagged_calls`: Qwen 3.5's XML, GLM's). ``opener``: how the grammar writes
    the syntax's :func:`opener_of` (default: the literal; or the vocabulary's special
    token ``<[ID]>``). Parallel calls: at most one per function (:func:`_distinct`; a
    small model would repeat a call until ``max_tokens`` otherwise)."""
    opener = opener or json.dumps(opener_of(syntax))
    wanted = [f for f in _held(spec.functions)
              if spec.choice == "required" or f[0] == spec.named]
    several = spec.parallel and spec.choice == "required"
    names = [f"call{i}" for i in range(len(wanted))]
    if syntax in TAGGED_SYNTAXES:
        return "\n".join(["%llguidance {}", "start: calls",
                          *_distinct(names, '"\\n"', several=several),
                          *(f"call{i}: {opener} tagged_{i}" for i in range(len(wanted))),
                          *tagged_call_rules(wanted, syntax, "tagged")]) + "\n"
    if syntax == "hermes":
        return "\n".join(["start: calls", *_distinct(names, None, several=several), *(
            f'call{i}: "<tool_call>\\n" body{i} "\\n</tool_call>" "\\n"?\n'
            f"body{i}: %json {json.dumps(_call_schema([f]))}"
            for i, f in enumerate(wanted))]) + "\n"
    if syntax == "llama":
        return "\n".join(["start: calls", *_distinct(names, '"; "', several=several), *(
            f'call{i}: %json {json.dumps(_call_schema([f], "parameters"))}'
            for i, f in enumerate(wanted))]) + "\n"
    if syntax == "mistral_list":
        return "\n".join([f'start: {opener} "[" calls "]"',
                          *_distinct(names, '", "', several=several), *(
            f"call{i}: %json {json.dumps(_call_schema([f]))}"
            for i, f in enumerate(wanted))]) + "\n"
    if syntax != "mistral_args":
        raise ValueError(f"no forced grammar for the {syntax!r} syntax")
    return "\n".join(["start: calls", *_distinct(
        [f"{opener} {name}" for name in names], None, several=several),
        *_mistral_calls(wanted)]) + "\n"


#: Up to this many functions, parallel calls may come in any order; beyond it (a rule
#: per subset of the functions would be too many), in the order the request lists them.
_ANY_ORDER: Final = 6


def _distinct(calls: Sequence[str], separator: str | None, *, several: bool) -> list[str]:
    """Lark rules defining ``calls``: one of ``calls`` (Lark items), or with ``several``
    one to all of them, each at most once, joined by ``separator`` (a Lark literal). A
    rule per subset of the calls still open (any order) for at most :data:`_ANY_ORDER`
    of them, else the calls in the order given."""
    if not several or len(calls) == 1:
        return [f"calls: {' | '.join(calls)}"]
    then = f"{separator} " if separator else ""
    every = (1 << len(calls)) - 1
    if len(calls) > _ANY_ORDER:  # calls_i: a non-empty run of calls[i:], in order
        last = len(calls) - 1
        return ["calls: calls_0", *(
            f"calls_{i}: {call} ({then}calls_{i + 1})? | calls_{i + 1}" if i < last
            else f"calls_{i}: {call}" for i, call in enumerate(calls))]

    def rule(left: int) -> str:
        return "calls" if left == every else f"calls_{left:x}"

    lines = []
    for left in range(1, every + 1):
        options = []
        for i, call in enumerate(calls):
            if left & (1 << i):
                rest = left & ~(1 << i)
                options.append(f"{call} ({then}{rule(rest)})?" if rest else call)
        lines.append(f"{rule(left)}: {' | '.join(options)}")
    return lines


def _mistral_calls(functions: Sequence[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Lark rules defining ``call``: Mistral's ``NAME[ARGS]{...}`` after its opener."""
    lines = [f"call: {' | '.join(f'call{i}' for i in range(len(functions)))}"]
    for i, (name, _, schema) in enumerate(functions):
        body = {**schema, "x-guidance": dict(JSON_DEFAULTS)}
        lines += [f"call{i}: {json.dumps(name + '[ARGS]')} args{i}",
                  f"args{i}: %json {json.dumps(body)}"]
    return lines


#: The syntaxes an ``auto`` answer's calls are held in (:func:`lazy_call_grammar`).
LAZY_SYNTAXES: Final = FORCED_SYNTAXES


def lazy_call_grammar(spec: ToolSpec, *, special_open: str | None,
                      syntax: str = "hermes") -> str:
    """For ``auto``: free text until the model opens a call (writes the syntax's
    :func:`opener_of`, or emits that special token where the vocabulary has one:
    ``special_open``, its Lark reference ``<[ID]>``); from there the call, in ``syntax``
    (one of :data:`LAZY_SYNTAXES`), is held to an offered function's schema and closed.
    llguidance's lazy lexeme ends the text at the opening, so the constraint starts
    where a call does, as llama-server's lazy grammars start at their trigger. Mistral's
    calls end the answer (its readers take nothing after them); Llama 3.x's have no
    opener: an answer that starts with ``{`` is calls, any other is free text (a lexeme
    that could also start a call would swallow it: llguidance's lexer is greedy)."""
    functions = _held(spec.functions)
    many = "*" if spec.parallel else "?"
    if syntax == "llama":
        return "\n".join([
            "%llguidance {}", "start: FREE | body (\"; \" body)" + many,
            r"FREE: /([^{](.|\n)*)?/",
            f'body: %json {json.dumps(_call_schema(functions, "parameters"))}']) + "\n"
    opens = "open_text | open_special" if special_open else "open_text"
    literal = json.dumps(opener_of(syntax))
    later = special_open or literal
    if syntax in TAGGED_SYNTAXES:
        rules = [f"start: call{many} TEXT", f"call: ({opens}) tagged",
                 *tagged_call_rules(functions, syntax, "tagged")]
    elif syntax == "hermes":
        rules = [f"start: call{many} TEXT", f'call: ({opens}) "\\n" body "\\n</tool_call>"',
                 f"body: %json {json.dumps(_call_schema(functions))}"]
    elif syntax == "mistral_args":
        rules = [f"start: TEXT | ({opens}) call ({later} call){many}",
                 *_mistral_calls(functions)]
    elif syntax == "mistral_list":
        rules = [f'start: TEXT | ({opens}) "[" body (", " body){many} "]"',
                 f"body: %json {json.dumps(_call_schema(functions))}"]
    else:
        raise ValueError(f"no lazy grammar for the {syntax!r} syntax")
    return "\n".join(["%llguidance {}", *rules, r"TEXT: /(.|\n)*/",
                      f"open_text[lazy]: TEXT {literal}",
                      *([f"open_special: TEXT {special_open}"] if special_open else [])]) + "\n"


def _held(functions: Sequence[tuple[str, str, dict[str, Any]]]
          ) -> list[tuple[str, str, dict[str, Any]]]:
    """The functions with their schemas as a call's grammar holds them (objects closed:
    :func:`~.call_schema.closed_objects`; numbers bounded:
    :func:`~meshd.daemon.engine.schema_checks.bounded_numbers`)."""
    return [(name, description, bounded_numbers(closed_objects(schema)))
            for name, description, schema in functions]


def _call_schema(functions: Sequence[tuple[str, str, dict[str, Any]]],
                 arguments: str = "arguments") -> dict[str, Any]:
    """One call's JSON: the name of one of ``functions`` and its ``arguments`` (as the
    syntax names that key), each function's ``$defs`` moved to the root
    (:func:`~.call_schema.hoist_defs`)."""
    alternatives, defs = [], {}
    for i, (name, _, schema) in enumerate(functions):
        body, found = hoist_defs(schema, f"f{i}_")
        defs.update(found)
        alternatives.append({"type": "object", "properties": {
            "name": {"const": name}, arguments: body},
            "required": ["name", arguments], "additionalProperties": False})
    call: dict[str, Any] = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return {**call, **({"$defs": defs} if defs else {}), "x-guidance": dict(JSON_DEFAULTS)}


def answer_calls(text: str, spec: ToolSpec, *, finished: bool
                 ) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's content and ``tool_calls``: whole calls to offered functions, in the
    syntax offered or the one the model's family writes (:mod:`.tool_syntax`), at most
    one unless parallel calls are allowed; anything else stays content. An answer that
    did not finish on its own (``max_tokens``) keeps the whole calls before the one the
    cut broke, and the broken call's text is dropped, never content
    (:func:`_whole_calls`)."""
    if finished:
        read = read_calls(text, spec.schemas)
        if read is None or (len(read[1]) > 1 and not spec.parallel):
            return text, []
        content, calls = read
    else:
        content, calls = _whole_calls(text, spec)
    return (content or None), [
        {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}
        for name, arguments in calls]


#: Where a call may begin in an answer: an opener in any family's syntax, or Llama 3.x's
#: bare ``{"name": "`` (at the start or after ``;``), its name perhaps cut short.
_CALL_START: Final = re.compile(
    r'<tool_call>|\[TOOL_CALLS\]|<\|python_tag\|>|(?:^|;)\s*\{"name": "([A-Za-z0-9_.:-]*)')
#: Between two calls of Mistral v3's list, ``[TOOL_CALLS][{...}, {...}]``.
_LIST_ITEM: Final = re.compile(r"\}\s*,\s*\{")


def _whole_calls(text: str, spec: ToolSpec) -> tuple[str, list[Call]]:
    """A cut answer's whole calls and the text around them: the longest part of the
    answer before a call began (or Mistral's list closed after a whole item) that reads
    as calls with no call begun in its rest; else no calls, and the text before the
    first call began."""
    starts = [m.start() for m in _CALL_START.finditer(text)
              if m.group(1) is None or any(n.startswith(m.group(1)) for n in spec.names)]
    if not starts:
        return text, []
    heads = [text]
    if "[TOOL_CALLS][" in text:
        heads += [text[:m.start() + 1] + "]" for m in reversed(list(_LIST_ITEM.finditer(text)))]
    heads += [text[:start] for start in reversed(starts)]
    for head in heads:
        read = read_calls(head, spec.schemas)
        if read is None or (len(read[1]) > 1 and not spec.parallel):
            continue
        rest, calls = read
        if calls and not any(m.group(1) is None for m in _CALL_START.finditer(rest)):
            return rest, calls
    return text[:starts[0]].strip(), []
