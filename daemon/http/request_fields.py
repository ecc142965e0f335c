"""Which top-level fields an OpenAI request may carry, and which meshd must refuse.

Why a table: clients switching from OpenAI or llama-server send fields meshd does not
implement. A field that changes nothing (``user``, ``metadata``, ``store``,
``cache_prompt`` ...) is accepted, as OpenAI accepts it. A field that would change the
answer (``logprobs``, ``tools``, a non-zero ``presence_penalty`` ...) is refused with a
400 naming it unless it holds its no-op default, so an answer is never silently
different from what was asked. A field nobody defines is refused too, as OpenAI
refuses it ("Unrecognized request argument"), so a typo (``max_token``) does not pass
unnoticed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from meshd.clients.argtypes import duration_seconds

__all__ = ["check_fields", "keep_alive_seconds"]

_HANDLED: Final = frozenset({
    "model", "stream", "stream_options", "seed", "top_k", "top_p", "temperature", "stop",
    "speculative", "max_tokens", "max_completion_tokens", "n", "response_format",
    "json_schema", "grammar", "presence_penalty", "frequency_penalty", "repeat_penalty",
    "repeat_last_n", "min_p", "typical_p", "logit_bias", "logprobs", "top_logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "prediction", "keep_alive",
})
_PER_ENDPOINT: Final = {True: frozenset({"messages"}), False: frozenset({"prompt"})}

_NO_EFFECT: Final = frozenset({
    # OpenAI's: bookkeeping and routing, never the text.
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    # llama-server's: meshd always reuses cached prompt prefixes.
    "cache_prompt",
})

_UNSUPPORTED: Final[dict[str, tuple[object, ...]]] = {
    # field: the values that change nothing (besides null)
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "mirostat": (0,),
    "audio": (),
    "modalities": (["text"],),
    "reasoning_effort": (),
}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_default(value: Any, defaults: tuple[object, ...]) -> bool:
    """Null, or one of ``defaults`` (a number equals a number; ``True`` is not 1)."""
    if value is None:
        return True
    return any(value == d and (type(value) is type(d) or (_is_number(value) and _is_number(d)))
               for d in defaults)


def check_fields(body: Mapping[str, Any], *, chat: bool) -> tuple[str, str] | None:
    """The first field to refuse and why (``(field, detail)``), or None when every field
    is served or changes nothing."""
    known = _HANDLED | _PER_ENDPOINT[chat] | _NO_EFFECT
    for key, value in body.items():
        if key in known:
            continue
        defaults = _UNSUPPORTED.get(key)
        if defaults is None:
            other = _PER_ENDPOINT[not chat]
            where = (" on this endpoint (it belongs to "
                     f"{'/v1/completions' if chat else '/v1/chat/completions'})"
                     if key in other else "")
            return key, f"unrecognized request argument{where}"
        if not _is_default(value, defaults):
            return key, "is not supported by meshd"
    return None


def keep_alive_seconds(body: Mapping[str, Any]) -> float | None:
    """Ollama's ``keep_alive``: how long the model stays loaded after this request, in
    seconds or as a duration (``"5m"``); negative keeps it, 0 unloads it after the
    request. Raises ValueError saying what it must be."""
    value = body.get("keep_alive")
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        text = str(value)
    elif isinstance(value, str):
        text = value
    else:
        raise ValueError('must be a number of seconds or a duration like "5m"')
    return duration_seconds(text)
