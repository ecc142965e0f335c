"""OpenAI's Responses API request, mapped onto a chat completion, and its answer's shapes.

Why through the chat endpoint's parser: a ``POST /v1/responses`` body becomes the chat
body that asks the same thing (``instructions`` a system turn first, ``input`` items the
turns, ``max_output_tokens``, ``text.format`` and the flat ``tools`` in chat's fields),
and :func:`.openai_api.parse_request` validates and bounds it as it does every chat
request, so the answer's tokens are those ``/v1/chat/completions`` gives for the same
conversation. Errors are renamed back to the field the client sent (``input[2]``, never
``messages[3]``). meshd keeps no responses, so what would need one
(``previous_response_id``, ``conversation``, item references) is a 400 saying so.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any, Final

import attrs

from meshd.daemon.frontends.http.openai.api import CompletionRequest, json_object, parse_request
from meshd.daemon.frontends.http.request_fields import LLAMA_SERVER_FIELDS
from meshd.daemon.prompts.tool_calls import MAX_TOOLS
from meshd.daemon.requests.api_errors import ApiError, json_bytes
from meshd.protocol import MAX_MESSAGES

__all__ = ["ResponsesRequest", "call_item", "event", "message_item", "new_id", "outcome",
           "parse_responses_request", "response_object", "response_usage", "text_part",
           "whole_response"]

_PASSED: Final = (
    "model", "temperature", "top_p", "stream", "parallel_tool_calls",
    # meshd's (and llama-server's) sampling extras, validated as on the chat endpoint
    "seed", "top_k", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
    "presence_penalty", "frequency_penalty", "logit_bias", "stop", "speculative",
    "keep_alive",
    # llama-server's own (``timings_per_token``, ``return_progress``, ``id_slot`` ...)
    *sorted(LLAMA_SERVER_FIELDS),
)
"""Fields that mean the same on the chat endpoint: passed to it as they are (and
checked there)."""
_HANDLED: Final = frozenset({"input", "instructions", "max_output_tokens", "text", "tools",
                             "tool_choice", "metadata", "store", "reasoning"})
_NO_EFFECT: Final = frozenset({
    "user", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "stream_options",
    "max_tool_calls",  # (bounds built-in tools' calls; meshd has none)
})
_NOT_STORED: Final = ("meshd stores no responses (every response is as with store: false); "
                      "send the whole conversation in input")
_REFUSED: Final[dict[str, tuple[tuple[object, ...], str]]] = {
    # field: (the values that change nothing besides null, why others are refused)
    "previous_response_id": ((), _NOT_STORED),
    "conversation": ((), _NOT_STORED),
    "prompt": ((), "prompt templates are not stored by meshd; send input"),
    "background": ((False,), "meshd does not run responses in the background"),
    "truncation": (("disabled",), "meshd does not truncate the input (a conversation over "
                                  "the context is a 400)"),
    "include": (([],), "meshd has no extra output to include"),
    "top_logprobs": ((0,), "log-probabilities are served on /v1/chat/completions"),
}
_REASONING_KEYS: Final = frozenset({"effort", "summary", "generate_summary", "context", "mode"})
"""``reasoning``'s fields: ``effort`` is chat's ``reasoning_effort`` (as llama-server
maps it); the others shape reasoning summaries and items, which meshd does not
produce, and change nothing."""
_ITEM_TYPES: Final = ("message", "function_call", "function_call_output")
_ROLES: Final = ("user", "system", "developer", "assistant")
_TEXT_PARTS: Final = ("input_text", "output_text")
_RENAMED: Final = (("response_format.json_schema", "text.format"),
                   ("response_format", "text.format"),
                   ("max_completion_tokens", "max_output_tokens"),
                   ("max_tokens", "max_output_tokens"),
                   ("reasoning_effort", "reasoning.effort"),
                   ("verbosity", "text.verbosity"))
"""Chat's field names and the Responses API's, for the errors chat's parser raises."""
_METADATA_KEYS: Final = 16


def _bad(param: str, detail: str) -> ApiError:
    return ApiError(400, f"{param}: {detail}", param=param)


def new_id(prefix: str) -> str:
    """An id as OpenAI's look (``resp_``, ``msg_``, ``fc_`` and hex)."""
    return f"{prefix}_{uuid.uuid4().hex}"


@attrs.frozen
class ResponsesRequest:
    """A validated Responses request: the chat request that serves it, what the answer
    repeats of the request, and which request field each chat turn came from."""

    completion: CompletionRequest
    echo: dict[str, Any]
    origins: tuple[str, ...]

    def renamed(self, error: ApiError) -> ApiError:
        """``error`` (raised by the chat pipeline) naming the field as this request did."""
        return _renamed(error, self.origins)


def _renamed(error: ApiError, origins: tuple[str, ...]) -> ApiError:
    param = error.param
    if param is None:
        return error
    new = _rename(param, origins)
    if new == param:
        return error
    message = error.message
    if message.startswith(param):
        message = new + message[len(param):]
    return ApiError(error.status, message, param=new, code=error.code, kind=error.kind)


def _rename(param: str, origins: tuple[str, ...]) -> str:
    if param == "messages":
        return "input"
    if param.startswith("messages["):
        index, _, rest = param.removeprefix("messages[").partition("]")
        if index.isdigit() and int(index) < len(origins):
            origin = origins[int(index)]
            # a turn's own fields (content, role) are the item's; an instructions turn
            # or a string input has none
            return origin + rest if origin.startswith("input[") else origin
        return "input"
    if param.startswith("tools["):
        return param.replace("].function.", "].", 1)
    for old, new in _RENAMED:
        if param == old or param.startswith((old + ".", old + "[")):
            return new + param[len(old):]
    return param


def _text(value: object, param: str) -> str:
    """An item's content: a string, or text parts (``input_text``, ``output_text``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(param, "must be a string or an array of text parts")
    parts: list[str] = []
    for i, part in enumerate(value):
        if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{i}]", "only text parts ({'type': 'input_text', 'text': "
                                        "...}, or output_text) are supported")
        parts.append(part["text"])
    return "".join(parts)


def _string(item: Mapping[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise _bad(f"{param}.{key}", "must be a non-empty string" if key != "arguments"
                   else "must be a string (the call's arguments as JSON)")
    return value


def _turns(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat turns of ``instructions`` and ``input``, and the field each came from.
    A ``function_call`` item joins the assistant turn before it (chat's ``tool_calls``);
    a ``function_call_output`` is a ``tool`` turn."""
    turns: list[dict[str, Any]] = []
    origins: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "must be a string")
        turns.append({"role": "system", "content": instructions})
        origins.append("instructions")
    value = body.get("input")
    if isinstance(value, str) and value:
        turns.append({"role": "user", "content": value})
        origins.append("input")
        return turns, origins
    if not isinstance(value, list) or not value or len(value) > MAX_MESSAGES:
        raise _bad("input", "must be a non-empty string, or an array of at most "
                            f"{MAX_MESSAGES} input items")
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _bad(param, "must be an input item (an object)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{param}.role", f"must be one of {', '.join(_ROLES)} "
                                            f"(got {str(role)[:64]!r})")
            if "content" not in item:
                raise _bad(f"{param}.content", "a message needs content")
            turns.append({"role": role, "content": _text(item["content"], f"{param}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function", "function": {
                "name": _string(item, "name", param),
                "arguments": _string(item, "arguments", param)}}
            if turns and turns[-1]["role"] == "assistant":
                turns[-1].setdefault("tool_calls", []).append(call)
                continue
            turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            turns.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                          "content": _text(item.get("output"), f"{param}.output")})
        else:
            raise _bad(f"{param}.type", f"must be one of {', '.join(_ITEM_TYPES)} (meshd "
                                        "keeps no items to reference and has no built-in "
                                        f"tools; got {str(kind)[:64]!r})")
        origins.append(param)
    return turns, origins


def _text_format(value: object) -> dict[str, Any] | None:
    """``text: {"format": ...}`` as chat's ``response_format`` (None: plain text)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _bad("text", "must be an object like {'format': {'type': 'text'}}")
    unknown = set(value) - {"format", "verbosity"}
    if unknown:
        raise _bad("text", f"unknown field(s) {sorted(unknown)}")
    fmt = value.get("format")
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, Mapping)
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema", "must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "response", "schema": fmt["schema"],
            "strict": fmt.get("strict")}}
    raise _bad("text.format", "must be an object whose type is 'text', 'json_object' or "
                              f"'json_schema' (got {str(kind)[:64]!r})")


def _tools(value: object) -> list[dict[str, Any]] | None:
    """The flat function tools as chat's ``{"type": "function", "function": {...}}``."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise _bad("tools", f"must be an array of at most {MAX_TOOLS} function tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise _bad(f"tools[{i}]", "must be a function tool {'type': 'function', 'name': "
                                      "..., 'parameters': {...}}; meshd has no built-in "
                                      f"tools (got type {str(kind)[:64]!r})")
        if "function" in tool:
            raise _bad(f"tools[{i}]", "takes the Responses API's flat shape {'type': "
                                      "'function', 'name': ...}, not chat's {'function': ...}")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise _bad(f"tools[{i}].strict", "must be true or false")
        out.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters")
            if tool.get(key) is not None}})
    return out


def _tool_choice(value: object) -> object:
    """``tool_choice`` as chat's (the flat ``{"type": "function", "name": ...}``)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function" \
            and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', "
                              "'name': ...}")


def _metadata(value: object) -> dict[str, str]:
    """OpenAI's bounds: at most 16 pairs, keys of 64 characters, values of 512."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > _METADATA_KEYS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in value.items()):
        raise _bad("metadata", f"must be an object of at most {_METADATA_KEYS} strings "
                               "(keys up to 64 characters, values up to 512)")
    return value


def _refused(body: Mapping[str, Any]) -> ApiError | None:
    """The first field meshd cannot serve, or None."""
    known = _HANDLED | _NO_EFFECT | set(_PASSED)
    for key, value in body.items():
        if key in known:
            continue
        rule = _REFUSED.get(key)
        if rule is None:
            return _bad(key, "unrecognized request argument")
        defaults, why = rule
        if value is not None and not any(type(value) is type(d) and value == d
                                         for d in defaults):
            return _bad(key, why)
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, Mapping):
        return _bad("reasoning", "must be an object like {'effort': 'none'}")
    unknown = set(reasoning or {}) - _REASONING_KEYS
    if unknown:
        return _bad("reasoning", f"unknown field(s) {sorted(unknown)}")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        return _bad("store", "must be true or false (meshd stores nothing either way)")
    return None


def parse_responses_request(raw: bytes) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body; raises ApiError (400) naming the first bad field
    as the request named it."""
    body = json_object(raw)
    refused = _refused(body)
    if refused is not None:
        raise refused
    turns, origins = _turns(body)
    chat: dict[str, Any] = {key: body[key] for key in _PASSED if key in body}
    chat["messages"] = turns
    text_options = body.get("text")
    extra = {"max_completion_tokens": body.get("max_output_tokens"),
             "response_format": _text_format(text_options),
             "verbosity": (text_options or {}).get("verbosity"),
             "reasoning_effort": (body.get("reasoning") or {}).get("effort"),
             "tools": _tools(body.get("tools")),
             "tool_choice": _tool_choice(body.get("tool_choice"))}
    chat.update({key: value for key, value in extra.items() if value is not None})
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    metadata = _metadata(body.get("metadata"))
    try:
        req = parse_request(json_bytes(chat), chat=True)
    except ApiError as exc:
        raise _renamed(exc, tuple(origins)) from None
    req = attrs.evolve(
        req, spec=attrs.evolve(req.spec, id=new_id("resp")),
        max_tokens_param="max_output_tokens",
        constraint_param=("text.format" if req.constraint_param == "response_format"
                          else req.constraint_param))
    text = body.get("text") or {}
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": _or(body.get("temperature"), 1.0),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": _or(body.get("tool_choice"), "auto"),
        "tools": body.get("tools") or [],
        "top_p": _or(body.get("top_p"), 1.0),
        "truncation": "disabled", "user": body.get("user"), "metadata": metadata,
    }
    return ResponsesRequest(completion=req, echo=echo, origins=tuple(origins))


def _or(value: object, default: object) -> object:
    return default if value is None else value


# ---------------------------------------------------------------------- the answer


def outcome(finish: str) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """A chat finish reason as the response's ``status``, ``incomplete_details`` and
    ``error``: ``length`` is ``max_output_tokens``; a cancellation (by another client's
    ``cancel`` or the daemon's shutdown) is incomplete, its reason meshd's name."""
    if finish in ("stop", "tool_calls"):
        return "completed", None, None
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish == "error":
        return "failed", None, {"code": "server_error", "message": "the generation failed"}
    return "incomplete", {"reason": finish}, None


def response_usage(chat_usage: Mapping[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses API's names."""
    prompt, emitted = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": emitted, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + emitted}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, status: str, content: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def call_item(call: Mapping[str, Any], status: str = "completed", *,
              item_id: str | None = None, arguments: str | None = None) -> dict[str, Any]:
    """A chat tool call as a ``function_call`` output item."""
    fn = call["function"]
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"],
            "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments,
            "status": status}


def response_object(rid: str, created: int, model: str, status: str, echo: Mapping[str, Any],
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None, *,
                    incomplete: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None,
                    extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The response object (``echo``: what it repeats of the request; ``extras``: meshd's
    ``timings`` and ``meshd`` blocks, as chat answers carry them)."""
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "model": model, "output": output, **echo, "usage": usage, **(extras or {})}


def whole_response(chat: Mapping[str, Any], echo: Mapping[str, Any]) -> dict[str, Any]:
    """A (non-streamed) chat completion as the response object."""
    choice = chat["choices"][0]
    message = choice["message"]
    status, incomplete, error = outcome(choice["finish_reason"])
    calls = message.get("tool_calls") or []
    output = []
    if message.get("content") or not calls:
        output.append(message_item(new_id("msg"),
                                   "completed" if status == "completed" else "incomplete",
                                   [text_part(message.get("content") or "")]))
    output += [call_item(call) for call in calls]
    return response_object(chat["id"], chat["created"], chat["model"], status, echo, output,
                           response_usage(chat["usage"]), incomplete=incomplete, error=error,
                           extras={k: chat[k] for k in ("timings", "meshd") if k in chat})


def event(kind: str, sequence_number: int, **fields: Any) -> bytes:
    """One typed server-sent event, as OpenAI sends it (``event:`` then ``data:``)."""
    payload = {"type": kind, **fields, "sequence_number": sequence_number}
    return f"event: {kind}\ndata: ".encode() + json.dumps(
        payload, ensure_ascii=False).encode() + b"\n\n"
