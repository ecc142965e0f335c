"""Request messages built from a client's keyword arguments.

Why apart from the client: a bad value must fail before anything is sent, with the
error naming the field's full path the way the server would write it
(``generate.sampling.top_p: ...``, ``detokenize.tokens[0]: ...``); these pure helpers
do that, and keep the client's module about moving frames.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from .errors import BadRequest
from .messages import ChatMessage, SamplingParams

__all__ = ["build", "chat_messages", "sampling_params"]

M = TypeVar("M")


def build(cls: Callable[..., M], **fields: Any) -> M:
    """A request message; a bad value raises BadRequest with the field's full path
    (``detokenize.tokens[0]: ...``), as the server would write it."""
    try:
        return cls(**fields)
    except BadRequest as exc:
        raise exc.under(getattr(cls, "OP", "request")) from None


def sampling_params(
    base: SamplingParams | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
) -> SamplingParams:
    """``base`` (default: SamplingParams()) with the keywords that are not ``None``."""
    params = base or SamplingParams()
    changes: dict[str, Any] = {}
    if temperature is not None:
        changes["temperature"] = temperature
    if top_k is not None:
        changes["top_k"] = top_k
    if top_p is not None:
        changes["top_p"] = top_p
    if seed is not None:
        changes["seed"] = seed
    return attrs.evolve(params, **changes) if changes else params


def chat_messages(
    messages: Sequence[ChatMessage | Mapping[str, str]] | None,
) -> tuple[ChatMessage, ...] | None:
    """Chat turns from ChatMessages or ``{"role": ..., "content": ...}`` dicts; a bad one
    raises BadRequest naming its index (``messages[1].role: ...``)."""
    if messages is None:
        return None
    out = []
    for i, m in enumerate(messages):
        try:
            out.append(m if isinstance(m, ChatMessage)
                       else ChatMessage(role=m["role"], content=m["content"]))
        except BadRequest as exc:
            raise exc.under(f"messages[{i}]") from None
    return tuple(out)
