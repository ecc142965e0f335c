"""Ollama's ``/api/chat`` and ``/api/generate`` requests, as the OpenAI request meshd
already serves.

Why a mapping and not a parser of its own: the Ollama body becomes the OpenAI chat (or
completion) body and goes through :func:`~..openai.api.parse_request`, so validation,
chat rendering, tools, the ``format`` constraint, sampling and ``keep_alive`` are the
OpenAI endpoints' own, and both APIs give the same tokens for the same request. What
Ollama says differently is mapped here: ``options`` (``num_predict``, the samplers with
Ollama's defaults), ``format`` (``"json"`` or a schema), the messages' ``tool_calls``
(arguments as objects) and ``tool_name``, and generate's ``system`` and ``raw``. A field
or option that would change the answer and that meshd cannot honour is a 400 naming it
(``options.mirostat``, ``images``, ``suffix``); those that only steer Ollama's runner
(``num_gpu``, ``num_thread`` ...) change nothing here and pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import attrs

from meshd.daemon.frontends.http.request_fields import keep_alive_seconds
from meshd.daemon.requests.api_errors import ApiError, bad_field
from meshd.protocol import MAX_MESSAGES

__all__ = ["OLLAMA_DEFAULTS", "OllamaRequest", "chat_request", "generate_request",
           "openai_body", "renamed"]

OLLAMA_DEFAULTS: Final[dict[str, float | int]] = {"temperature": 0.8, "top_k": 40,
                                                  "top_p": 0.9}
"""Ollama's sampler defaults (its ``DefaultOptions``), used where ``options`` is silent:
an Ollama client gets the sampling it would get from Ollama."""

_COMMON: Final = frozenset({"model", "stream", "format", "options", "keep_alive", "think",
                            "logprobs", "top_logprobs", "truncate", "shift",
                            "_debug_render_only"})
_CHAT_FIELDS: Final = _COMMON | {"messages", "tools", "tool_choice"}
_GENERATE_FIELDS: Final = _COMMON | {"prompt", "suffix", "system", "template", "context",
                                     "raw", "images"}

_SAMPLERS: Final = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
                    "repeat_last_n", "presence_penalty", "frequency_penalty")
_INTEGER_OPTIONS: Final = frozenset({"top_k", "repeat_last_n", "seed", "num_predict",
                                     "num_ctx", "num_keep", "num_batch", "num_gpu",
                                     "main_gpu", "num_thread", "mirostat",
                                     "draft_num_predict"})
_BOOLEAN_OPTIONS: Final = frozenset({"numa", "low_vram", "f16_kv", "logits_all",
                                     "vocab_only", "use_mmap", "use_mlock",
                                     "embedding_only", "penalize_newline"})
_NO_EFFECT_OPTIONS: Final = frozenset({
    # how Ollama's runner loads and runs the model (meshd's operator sets these)
    "num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread", "draft_num_predict",
    "numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock",
    "embedding_only",
    # ignored by Ollama's own engine today
    "penalize_newline",
    # the tuning of mirostat, which can only be off here
    "mirostat_tau", "mirostat_eta",
})
_OFF_ONLY_OPTIONS: Final[dict[str, float]] = {"mirostat": 0, "tfs_z": 1.0}

_PARAMS: Final = {
    "max_tokens": "options.num_predict", "stop": "options.stop", "seed": "options.seed",
    "response_format": "format", "logprobs": "top_logprobs",
    **{name: f"options.{name}" for name in _SAMPLERS},
}
"""The OpenAI request's fields as the Ollama request names them (in error messages)."""


@attrs.frozen
class OllamaRequest:
    """A checked ``/api/chat`` or ``/api/generate`` request: what to send to the OpenAI
    pipeline once the model (and so its context and chat template) is known."""

    endpoint: str
    """``chat`` or ``generate``: the answer's shape (``message`` or ``response``)."""
    model: str | None
    """The model as the client named it (answers echo it, as Ollama's do)."""
    stream: bool
    fields: dict[str, Any]
    """The OpenAI fields every form of the request shares (sampling, stop, format ...)."""
    keep_alive: float | None
    messages: list[dict[str, Any]] | None = None
    """The chat's turns (OpenAI's shape); None for a generate request."""
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    num_predict: int | None = None
    """Most tokens to generate; None: until the model stops or the context ends."""
    num_ctx: int | None = None
    top_logprobs: int | None = None
    """Alternatives per token with ``logprobs: true`` (None: no log-probabilities)."""

    @property
    def load_only(self) -> bool:
        """No prompt and no messages: Ollama's way to load (or, with ``keep_alive`` 0,
        unload) a model."""
        return not self.messages if self.endpoint == "chat" else not self.prompt


def renamed(exc: ApiError) -> ApiError:
    """An OpenAI pipeline's error with its field named as the Ollama request names it
    (``max_tokens`` is ``options.num_predict``, ``response_format`` is ``format``)."""
    param = exc.param
    if param is None:
        return exc
    head = param.split(".")[0].split("[")[0]
    new = _PARAMS.get(head)
    if new is None or new == head:
        return exc
    name = new + param[len(head):]
    message = name + exc.message[len(param):] if exc.message.startswith(param) \
        else exc.message
    return ApiError(exc.status, message, param=name, code=exc.code, kind=exc.kind,
                    extra=exc.extra)


def _integral(key: str, value: object) -> int:
    """An integer option; a whole float passes (Ollama's JSON numbers are floats)."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
        raise bad_field(f"options.{key}", f"must be an integer (got {value!r})")
    return int(value)


def _options(value: object, fields: dict[str, Any], *, chat: bool
             ) -> tuple[int | None, int | None]:
    """``options`` into ``fields`` (OpenAI's names, Ollama's defaults where it is
    silent); returns ``num_predict`` (None: no limit) and ``num_ctx``."""
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise bad_field("options", "must be an object of model options")
    fields.update(OLLAMA_DEFAULTS)
    num_predict = num_ctx = None
    for key, option in value.items():
        if option is None:
            continue
        if key in _INTEGER_OPTIONS:
            option = _integral(key, option)
        elif key in _BOOLEAN_OPTIONS and not isinstance(option, bool):
            raise bad_field(f"options.{key}", "must be true or false")
        if key in _SAMPLERS:
            fields[key] = option
        elif key == "seed":
            fields["seed"] = option if option >= 0 else None  # (-1: a random seed)
        elif key == "stop":
            fields["stop"] = option
        elif key == "num_predict":
            num_predict = option if option > 0 else None  # (-1, -2, 0: no limit)
        elif key == "num_ctx":
            if option < 1:
                raise bad_field("options.num_ctx", "must be a positive integer")
            num_ctx = option
        elif key == "tool_choice" and chat:
            fields["tool_choice"] = option  # meshd's: the clients' only way to send it
        elif key in _OFF_ONLY_OPTIONS:
            if option != _OFF_ONLY_OPTIONS[key]:
                raise bad_field(f"options.{key}", "is not supported by meshd (only "
                                f"{_OFF_ONLY_OPTIONS[key]:g}, off, is)")
        elif key not in _NO_EFFECT_OPTIONS:
            raise bad_field(f"options.{key}", "unrecognized option")
    return num_predict, num_ctx


def _format(value: object) -> dict[str, Any] | None:
    """``format``: ``"json"`` (any JSON object) or a JSON schema."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise bad_field("format", 'must be "json" or a JSON schema object')


def _think(value: object) -> bool:
    """``think``: whether a reasoning model thinks before it answers. meshd leaves the
    thinking in the answer's text (it has no ``thinking`` field to move it to), so only
    "no thinking" (false) is served; left out, the server's ``--reasoning`` decides."""
    if value is not None and value is not False:
        raise bad_field("think", "meshd does not separate a model's thinking from its "
                                 "answer: send false (no thinking) or leave it out (the "
                                 "server's --reasoning setting decides)")
    return value is False


def _common(body: Mapping[str, Any], known: frozenset[str], *, chat: bool
            ) -> tuple[dict[str, Any], int | None, int | None, int | None, bool, float | None]:
    """What both endpoints share: the OpenAI fields, ``num_predict``, ``num_ctx``,
    ``top_logprobs``, ``stream`` and ``keep_alive``."""
    for key in body:
        if key not in known:
            raise bad_field(key, "unrecognized field")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_field("model", "must be a string")
    stream = body.get("stream")
    if stream is None:
        stream = True  # (Ollama streams unless told not to)
    if not isinstance(stream, bool):
        raise bad_field("stream", "must be true or false")
    for key in ("truncate", "shift", "_debug_render_only"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise bad_field(key, "must be true or false")
    if body.get("_debug_render_only"):
        raise bad_field("_debug_render_only", "is not supported by meshd")
    try:
        keep_alive = keep_alive_seconds(body)
    except ValueError as exc:
        raise bad_field("keep_alive", str(exc)) from None
    fields: dict[str, Any] = {}
    if _think(body.get("think")):  # (a chat template's variable: dropped for a raw prompt)
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(model, str) and model:
        fields["model"] = model
    if keep_alive is not None:
        fields["keep_alive"] = keep_alive
    fmt = _format(body.get("format"))
    if fmt is not None:
        fields["response_format"] = fmt
    num_predict, num_ctx = _options(body.get("options"), fields, chat=chat)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_field("logprobs", "must be true or false")
    top = body.get("top_logprobs")
    top_logprobs = None
    if logprobs:
        top_logprobs = 0 if top is None else top
    elif top not in (None, 0):
        raise bad_field("top_logprobs", "needs logprobs: true")
    return fields, num_predict, num_ctx, top_logprobs, stream, keep_alive


def _tool_calls(calls: object, param: str) -> list[dict[str, Any]]:
    """An assistant turn's Ollama ``tool_calls`` (arguments an object) in OpenAI's shape."""
    if not isinstance(calls, list):
        raise bad_field(param, "must be an array of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            raise bad_field(f"{param}[{j}]", "must be {'function': {'name', 'arguments'}}")
        entry: dict[str, Any] = {"type": "function", "function": {
            "name": fn.get("name"), "arguments": fn.get("arguments", {})}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _messages(value: object) -> list[dict[str, Any]]:
    """The chat's turns in OpenAI's shape: ``tool_name`` is a tool turn's ``name``, a
    call's arguments stay an object; ``thinking`` of earlier turns is left out (as
    templates leave it out); images are refused (meshd serves text models)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_field("messages", "must be an array of messages")
    if len(value) > MAX_MESSAGES:
        raise bad_field("messages", f"must be an array of at most {MAX_MESSAGES} messages "
                                    f"(got {len(value)})")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping):
            raise bad_field(f"messages[{i}]", "must be an object with role and content")
        if msg.get("images"):
            raise bad_field(f"messages[{i}].images", "meshd serves text models: images are "
                                                     "not supported")
        role = msg.get("role")
        turn: dict[str, Any] = {"role": role.lower() if isinstance(role, str) else role,
                                "content": msg.get("content") or ""}
        if msg.get("tool_calls"):
            turn["tool_calls"] = _tool_calls(msg["tool_calls"], f"messages[{i}].tool_calls")
        if isinstance(msg.get("tool_name"), str):
            turn["name"] = msg["tool_name"]
        if isinstance(msg.get("tool_call_id"), str):
            turn["tool_call_id"] = msg["tool_call_id"]
        out.append(turn)
    return out


def chat_request(body: Mapping[str, Any]) -> OllamaRequest:
    """Check an ``/api/chat`` body; raises ApiError (400) naming the first bad field."""
    fields, num_predict, num_ctx, top, stream, keep_alive = _common(body, _CHAT_FIELDS,
                                                                    chat=True)
    tools = body.get("tools")
    if tools:
        fields["tools"] = tools
    if body.get("tool_choice") is not None:
        fields["tool_choice"] = body["tool_choice"]
    return OllamaRequest(endpoint="chat", model=fields.get("model"), stream=stream,
                         fields=fields, keep_alive=keep_alive,
                         messages=_messages(body.get("messages")), num_predict=num_predict,
                         num_ctx=num_ctx, top_logprobs=top)


def generate_request(body: Mapping[str, Any]) -> OllamaRequest:
    """Check an ``/api/generate`` body; raises ApiError (400) naming the first bad field."""
    fields, num_predict, num_ctx, top, stream, keep_alive = _common(body, _GENERATE_FIELDS,
                                                                    chat=False)
    for key, why in (("images", "meshd serves text models: images are not supported"),
                     ("suffix", "meshd does not fill in the middle; send the text before "
                                "it as the prompt"),
                     ("template", "meshd renders the model's own chat template; send "
                                  "raw: true with a prompt rendered your way"),
                     ("context", "meshd keeps no conversations as token arrays; send the "
                                 "conversation to /api/chat")):
        if body.get(key):
            raise bad_field(key, why)
    prompt, system, raw = body.get("prompt"), body.get("system"), body.get("raw", False)
    for key, value in (("prompt", prompt), ("system", system)):
        if value is not None and not isinstance(value, str):
            raise bad_field(key, "must be a string")
    if raw is not None and not isinstance(raw, bool):
        raise bad_field("raw", "must be true or false")
    if raw and system:
        raise bad_field("system", "raw mode takes the prompt as it is: put the system text "
                                  "in it")
    return OllamaRequest(endpoint="generate", model=fields.get("model"), stream=stream,
                         fields=fields, keep_alive=keep_alive, prompt=prompt or None,
                         system=system or None, raw=bool(raw), num_predict=num_predict,
                         num_ctx=num_ctx, top_logprobs=top)


def openai_body(req: OllamaRequest, *, model: str, max_tokens: int | None,
                chat_template: bool) -> tuple[dict[str, Any], bool]:
    """The OpenAI body to serve ``req`` with on ``model`` (whose chat template there is
    or not), and whether it is a chat request. A generate request is a chat of the
    system text and the prompt, rendered by the model's template, as Ollama renders it;
    raw (or for a model without a template) it is a completion of the prompt as it is.
    ``max_tokens`` None: the server's default (until the model stops or the context
    ends, unless its operator caps it)."""
    body = {**req.fields, "model": model}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if req.endpoint == "chat":
        if not chat_template:
            raise ApiError(400, "this model has no chat template; use /api/generate with "
                                "raw: true", param="messages")
        messages: list[dict[str, Any]] | None = req.messages
    elif req.raw or not chat_template:
        if req.system:
            raise bad_field("system", "this model has no chat template: put the system "
                                      "text in the prompt")
        messages = None
    else:
        messages = [*([{"role": "system", "content": req.system}] if req.system else []),
                    {"role": "user", "content": req.prompt}]
    if messages is None:
        body.pop("chat_template_kwargs", None)
        body["prompt"] = req.prompt
        if req.top_logprobs is not None:
            body["logprobs"] = req.top_logprobs
    else:
        body["messages"] = messages
        if req.top_logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, req.top_logprobs
    return body, messages is not None
