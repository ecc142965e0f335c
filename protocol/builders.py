"""Request messages built from a client's keyword arguments.

Why apart from the clients: the async and the blocking client take the same keywords
(``max_tokens=``, ``top_p=``, ``messages=[{"role": ..., "content": ...}]``), and a bad
value must fail before anything is sent, with the error naming the field's full path
the way the server would write it (``generate.sampling.top_p: ...``). Pure functions,
no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from .errors import BadRequest
from .messages import ChatMessage, Generate, SamplingParams, SpeculativeOverrides

__all__ = ["build", "generate_request"]

M = TypeVar("M")


def build(cls: Callable[..., M], **fields: Any) -> M:
    """A request message; a bad value raises BadRequest with the field's full path
    (``detokenize.tokens[0]: ...``), as the server would write it."""
    try:
        return cls(**fields)
    except BadRequest as exc:
        raise exc.under(getattr(cls, "OP", "request")) from None


def _sampling(
    base: SamplingParams | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
) -> SamplingParams:
    """Merge individual keyword overrides into a SamplingParams."""
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


def _chat(
    messages: Sequence[ChatMessage | Mapping[str, str]] | None,
) -> tuple[ChatMessage, ...] | None:
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


def generate_request(
    request_id: str,
    prompt: str | None = None,
    *,
    messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    sampling: SamplingParams | None = None,
    stop: Sequence[str] = (),
    proposer: str | None = None,
    draft_max: int | None = None,
) -> Generate:
    """The ``generate`` for a client's keywords (see ``Client.generate``)."""
    # Errors name the field's path as the server's do: generate.sampling.top_p: ...
    try:
        params = _sampling(sampling, temperature, top_k, top_p, seed)
    except BadRequest as exc:
        raise exc.under("generate.sampling") from None
    try:
        speculative = SpeculativeOverrides(proposer=proposer, draft_max=draft_max)
    except BadRequest as exc:
        raise exc.under("generate.speculative") from None
    try:
        return Generate(
            id=request_id,
            prompt=prompt,
            messages=_chat(messages),
            max_tokens=max_tokens,
            sampling=params,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            speculative=speculative,
        )
    except BadRequest as exc:
        raise exc.under("generate") from None
