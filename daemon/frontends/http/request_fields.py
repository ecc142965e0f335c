"""Which top-level fields an OpenAI request may carry, and which meshd must refuse.

Why a table: clients switching from OpenAI or llama-server send fields meshd does not
implement. A field that changes nothing (``user``, ``metadata``, ``store``,
``cache_prompt`` ...) is accepted, as OpenAI accepts it. A field that would change the
answer (``logprobs``, ``tools``, a non-zero ``presence_penalty`` ...) is refused with a
400 naming it unless it holds its no-op default, so an answer is never silently
different from what was asked. A field nobody defines is refused too, as OpenAI
refuses it ("Unrecognized request argument"), so a typo (``max_token``) does not pass
unnoticed.

llama-server's own request fields (its ``params_from_json_cmpl`` schema) get the same
treatment: ``timings_per_token``, ``return_progress`` and ``verbose`` are served;
``id_slot``, ``cache_prompt`` and the others that only steer llama-server's slots, its
context shift or its non-OpenAI answer change nothing here and pass (their type
checked, as llama-server checks it); samplers meshd does not have pass only switched
off (``xtc_probability: 0``, ``t_max_predict_ms: -1``), and their tuning fields with
them (they cannot act while the sampler is off).

What clients of other servers send, and its fate here (the table in docs/http-api.md
lists the same):

- served as asked: vLLM's ``repetition_penalty`` (llama.cpp's ``repeat_penalty`` over the
  whole context, as vLLM looks at the prompt and the output), ``min_tokens`` (the
  end-of-generation tokens are held back until that many tokens are out: applied when
  each row is sampled, so speculation's verify agrees with plain decoding) and
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` (the output constraints
  ``response_format`` would give); ``chat_template_kwargs`` (chat: the chat template's
  variables, ``enable_thinking`` for Qwen 3's); ``reasoning_effort`` (chat: ``none``
  turns a reasoning template's thinking off, as llama-server does; another value
  reaches a template that reads ``reasoning_effort`` (gpt-oss), and is a 400 for one
  that does not, or on ``/v1/completions``).
- accepted and ignored, listed in the answer's ``meshd.ignored_fields``: the
  bookkeeping fields (``user``, ``metadata`` ...), ``verbosity`` (a hint meshd's models
  cannot follow), ``prompt_cache_retention`` / ``prompt_cache_options`` (meshd's prefix
  cache keeps what it can), ``reasoning_format`` (llama-server's: meshd leaves a
  model's thinking in ``content``, as its ``/completion`` does), ``web_search_options``
  only empty (meshd searches nothing), and the samplers meshd lacks only switched off.
- refused with a 400 naming it: anything else, and any of the above with a value that
  would change the answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import attrs

from meshd.clients.argtypes import duration_seconds

__all__ = ["LLAMA_SERVER_FIELDS", "MAX_TEMPLATE_KWARGS_BYTES", "LlamaSwitches",
           "check_continuation", "check_fields", "ignored_fields", "keep_alive_seconds",
           "template_kwargs"]

_LLAMA_SERVED: Final = frozenset({
    # per-chunk ``timings`` and ``prompt_progress`` in streams; the ``__verbose`` block
    "timings_per_token", "return_progress", "verbose",
})
_HANDLED: Final = frozenset({
    "model", "stream", "stream_options", "seed", "top_k", "top_p", "temperature", "stop",
    "speculative", "max_tokens", "max_completion_tokens", "n_predict", "n", "response_format",
    "json_schema", "grammar", "presence_penalty", "frequency_penalty", "repeat_penalty",
    "repeat_last_n", "min_p", "typical_p", "logit_bias", "logprobs", "top_logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "prediction", "keep_alive",
    # vLLM's: its repetition penalty, the fewest tokens, its output constraints
    "repetition_penalty", "min_tokens", "guided_json", "guided_regex", "guided_choice",
    # ``none``: thinking off (chat); other values: the template's (see parse_request)
    "reasoning_effort",
}) | _LLAMA_SERVED
_PER_ENDPOINT: Final = {True: frozenset({"messages", "continue_final_message",
                                         "add_generation_prompt", "chat_template_kwargs"}),
                        False: frozenset({"prompt"})}

_LLAMA_NO_EFFECT: Final = frozenset({
    # meshd always reuses cached prompt prefixes.
    "cache_prompt",
    # llama-server's slot choice (meshd's scheduler places requests; its prefix cache
    # serves every slot), its KV-shift reuse, SSE keep-alive comments, and what its
    # context shift keeps (meshd never shifts: a prompt over the context is a 400).
    "id_slot", "n_cache_reuse", "sse_ping_interval", "n_keep", "n_discard",
    # the shape of llama-server's own /completion answer (not OpenAI's)
    "response_fields", "return_tokens",
    # tuning of samplers that can only be off here (their switches: _LLAMA_UNSUPPORTED)
    "xtc_threshold", "dynatemp_exponent", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "mirostat_tau", "mirostat_eta",
})
_NO_EFFECT: Final = frozenset({
    # OpenAI's: bookkeeping and routing, never the text.
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    # OpenAI's hints: how long a cached prefix is kept (meshd's prefix cache keeps what
    # it can), and how wordy the answer is (meshd's models cannot be told).
    "prompt_cache_retention", "prompt_cache_options", "verbosity",
    # llama-server's: where a thinking model's thoughts go; meshd leaves them in the
    # text (its value ``none``), as on its /completion
    "reasoning_format",
}) | _LLAMA_NO_EFFECT

_LLAMA_UNSUPPORTED: Final[dict[str, tuple[object, ...]]] = {
    # llama-server's (server-schema.cpp), off at these values
    "mirostat": (0,),
    "t_max_predict_ms": (-1, 0),
    "n_probs": (0,),  # (log-probabilities: OpenAI's logprobs and top_logprobs)
    "n_indent": (0,),
    "min_keep": (0,),
    "top_n_sigma": (-1,),
    "xtc_probability": (0,),
    "dynatemp_range": (0,),
    "dry_multiplier": (0,),
    "ignore_eos": (False,),
    "post_sampling_probs": (False,),
    "lora": ([],),
    "samplers": (),  # (meshd applies its one order)
}
_UNSUPPORTED: Final[dict[str, tuple[object, ...]]] = {
    # field: the values that change nothing (besides null)
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": ({},),  # (meshd searches nothing)
    **_LLAMA_UNSUPPORTED,
}

LLAMA_SERVER_FIELDS: Final = _LLAMA_SERVED | _LLAMA_NO_EFFECT | frozenset(_LLAMA_UNSUPPORTED)
"""llama-server's request fields meshd knows (served, changing nothing, or refused
unless off): the Responses API passes them on to the chat request as they are."""

_BOOLEAN: Final = frozenset({"timings_per_token", "return_progress", "cache_prompt",
                             "verbose", "return_tokens", "continue_final_message",
                             "add_generation_prompt"})
_INTEGER: Final = frozenset({"id_slot", "n_cache_reuse", "sse_ping_interval", "n_keep",
                             "n_discard"})
_CHOICES: Final[dict[str, tuple[str, ...]]] = {
    "verbosity": ("low", "medium", "high"),
    "prompt_cache_retention": ("in_memory", "in-memory", "24h"),
    "reasoning_format": ("none", "auto", "deepseek", "deepseek-legacy"),
    # OpenAI's ReasoningEffort
    "reasoning_effort": ("none", "minimal", "low", "medium", "high", "xhigh", "max"),
}
MAX_TEMPLATE_KWARGS_BYTES: Final = 16 * 1024
"""The most ``chat_template_kwargs`` may hold, as JSON (they are rendered per request)."""


@attrs.frozen
class LlamaSwitches:
    """llama-server's answer switches on OpenAI's endpoints (types checked by
    :func:`check_fields`)."""

    timings_per_token: bool = False
    """Every streamed chunk with text or calls carries ``timings`` so far."""
    return_progress: bool = False
    """The stream reports the prompt's ``prompt_progress``."""
    verbose: bool | None = None
    """A non-streamed answer carries ``__verbose`` (the prompt as the model read it, the
    text); None: the server's default (``[http] verbose_responses``)."""

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> LlamaSwitches:
        verbose = body.get("verbose")
        return cls(bool(body.get("timings_per_token")), bool(body.get("return_progress")),
                   None if verbose is None else bool(verbose))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _type_error(key: str, value: Any) -> str | None:
    """Why ``value`` is not of the type llama-server reads ``key`` as (None: it is)."""
    if value is None:
        return None
    if key in _BOOLEAN and not isinstance(value, bool):
        return "must be true or false"
    if key in _INTEGER and (not isinstance(value, int) or isinstance(value, bool)):
        return "must be an integer"
    choices = _CHOICES.get(key)
    if choices is not None and value not in choices:
        return f"must be one of {', '.join(choices)} (got {str(value)[:64]!r})"
    return None


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
            wrong = _type_error(key, value)
            if wrong is not None:
                return key, wrong
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


def ignored_fields(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The fields of a request :func:`check_fields` let through that change nothing here
    (the bookkeeping and hint fields, and unsupported ones at their off values): the
    answer lists them (``meshd.ignored_fields``), so a client can tell what was not
    acted on."""
    return tuple(key for key, value in body.items()
                 if value is not None and (key in _NO_EFFECT or key in _UNSUPPORTED))


def template_kwargs(value: object) -> dict[str, Any] | None:
    """vLLM's and llama-server's ``chat_template_kwargs``: more variables for the chat
    template (``{"enable_thinking": false}``), bounded in size. Raises ValueError saying
    what it must be."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object of template variables")
    if len(json.dumps(value)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"must be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
    thinking = value.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError("enable_thinking must be true or false")  # (as llama-server)
    return dict(value)


def check_continuation(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """vLLM's and llama-server's ``continue_final_message`` / ``add_generation_prompt``
    (types checked): the field to refuse and why, or None. A conversation that ends with
    an assistant message is continued whatever they say (a prefill); they may only ask
    for that, never both it and a new turn, and never a prompt without a turn to
    continue (the native protocol has no such prompt)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None  # (refused where the messages are read)
    last = messages[-1]
    final = last.get("role") if isinstance(last, Mapping) else None
    continuing = bool(body.get("continue_final_message"))
    if continuing and body.get("add_generation_prompt", True) is not False:
        return ("continue_final_message", "cannot be true while add_generation_prompt is "
                "true (set add_generation_prompt to false)")
    if (continuing or body.get("add_generation_prompt") is False) and final != "assistant":
        return (("continue_final_message" if continuing else "add_generation_prompt"),
                "asks to continue the final message, and that is not an assistant message")
    if final == "assistant" and isinstance(last, Mapping) and last.get("tool_calls"):
        return (f"messages[{len(messages) - 1}].tool_calls",
                "an assistant message with tool calls cannot be continued: send the "
                "calls' results as tool messages")
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
