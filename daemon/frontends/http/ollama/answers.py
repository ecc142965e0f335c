"""Ollama's answer shapes: a generation's chunks and final object, its error object, and
what ``/api/tags``, ``/api/ps`` and ``/api/show`` say of a model.

Why functions without I/O: the same facts the OpenAI answers carry (text, tool calls,
the engine's statistics, :class:`~meshd.protocol.ModelInfo`) in Ollama's field names
and units (durations in nanoseconds, ``created_at`` in RFC 3339, names with a tag),
testable without a socket.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Sequence
from typing import Any, Final

from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.frontends.http.openai.api import finish_reason
from meshd.protocol import ModelInfo

__all__ = ["NDJSON", "chunk", "details", "done_reason", "error_object", "final", "iso",
           "metrics", "model_entry", "ollama_calls", "ollama_name", "parameter_size"]

NDJSON: Final = "application/x-ndjson"
_FOREVER: Final = "9999-12-31T23:59:59Z"


def iso(timestamp: float | None = None) -> str:
    """A time (now by default) as Ollama writes it: RFC 3339 in UTC, microseconds."""
    if timestamp is None:
        moment = datetime.datetime.now(datetime.UTC)
    else:
        moment = datetime.datetime.fromtimestamp(timestamp, datetime.UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def forever() -> str:
    """``expires_at`` of a model kept loaded until it is unloaded."""
    return _FOREVER


def ollama_name(name: str) -> str:
    """A model's name as Ollama lists it: with a tag (``latest`` when it has none)."""
    return name if ":" in name else f"{name}:latest"


def done_reason(finish: str) -> str:
    """Ollama's ``done_reason``: ``stop`` (an end-of-generation token or a stop string),
    ``length``; meshd's ``cancelled`` and ``shutdown`` keep their names."""
    return finish_reason(finish)


def error_object(message: str) -> dict[str, str]:
    """Ollama's error object (an HTTP error's body, or a stream's last line)."""
    return {"error": message}


def _ns(ms: float) -> int:
    return max(0, round(ms * 1e6))


def metrics(stats: GenerationStats, *, prompt_tokens: int, total_s: float, load_s: float
            ) -> dict[str, int]:
    """The final object's statistics, in nanoseconds: the whole request, holding (or
    loading) the model, the prompt's prefill and the generation after it."""
    prefill_ms = stats.session.prefill_ms
    return {"total_duration": _ns(total_s * 1e3), "load_duration": _ns(load_s * 1e3),
            "prompt_eval_count": prompt_tokens, "prompt_eval_duration": _ns(prefill_ms),
            "eval_count": stats.emitted, "eval_duration": _ns(stats.wall_ms - prefill_ms)}


def ollama_calls(calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` (arguments a JSON string) as Ollama's (an object, and the
    call's index)."""
    return [{"id": call["id"], "function": {
        "index": i, "name": call["function"]["name"],
        "arguments": json.loads(call["function"]["arguments"])}}
        for i, call in enumerate(calls)]


def chunk(endpoint: str, model: str, text: str, *, calls: list[dict[str, Any]] | None = None,
          logprobs: list[dict[str, Any]] | None = None, done: bool = False
          ) -> dict[str, Any]:
    """A chunk (or, with ``done``, the head of the final object): chat's ``message`` or
    generate's ``response``."""
    body: dict[str, Any] = {"model": model, "created_at": iso()}
    if endpoint == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        body["message"] = message
    else:
        body["response"] = text
    body["done"] = done
    if logprobs:
        body["logprobs"] = logprobs
    return body


def final(endpoint: str, model: str, text: str, reason: str, counts: dict[str, int], *,
          calls: list[dict[str, Any]] | None = None,
          logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The last object: ``done`` true, why it ended, and the statistics."""
    body = chunk(endpoint, model, text, calls=calls, logprobs=logprobs, done=True)
    body["done_reason"] = reason
    body.update(counts)
    return body


def parameter_size(n_params: int | None) -> str:
    """``7.6B``, ``134.52M``, as Ollama writes a parameter count."""
    if not n_params:
        return ""
    for unit, scale, places in (("B", 1e9, 1), ("M", 1e6, 2), ("K", 1e3, 0)):
        if n_params >= scale:
            value = n_params / scale
            return f"{value:.0f}{unit}" if value.is_integer() or not places \
                else f"{value:.{places}f}{unit}"
    return str(n_params)


def details(info: ModelInfo, quantization: str) -> dict[str, Any]:
    family = info.architecture or ""
    return {"parent_model": "", "format": "gguf", "family": family,
            "families": [family] if family else None,
            "parameter_size": parameter_size(info.n_params),
            "quantization_level": quantization}


def digest(path: str, size: int, mtime_ns: int) -> str:
    """A stable id of the model's file (of its path, size and time, not its bytes:
    hashing gigabytes for a listing would cost seconds)."""
    return hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()


def model_entry(info: ModelInfo, *, path: str, size: int, mtime_ns: int,
                quantization: str) -> dict[str, Any]:
    """What ``/api/tags`` (and, with more, ``/api/ps``) says of a model."""
    name = ollama_name(info.name)
    return {"name": name, "model": name, "modified_at": iso(mtime_ns / 1e9), "size": size,
            "digest": digest(path, size, mtime_ns), "details": details(info, quantization)}
