"""OpenAI's ``logprobs``: the request fields, and the answer's shapes (chat's
``logprobs.content`` list, completions' ``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset``), streamed or not.

Why token strings come from the vocabulary pieces: a token may hold part of a UTF-8
character; ``bytes`` carries it whole, and the string shows it with replacement
characters, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshd.daemon.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob

__all__ = ["logprobs_block", "requested_logprobs"]

Piece = Callable[[int], bytes]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def requested_logprobs(body: Mapping[str, Any], *, chat: bool) -> tuple[int | None, str | None]:
    """How many alternatives to report per token (None: no log-probabilities), or the
    field at fault and why: chat's ``logprobs: true`` with ``top_logprobs`` (0-20),
    completions' ``logprobs: N`` (0-20)."""
    value = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if value is None or value is False:
            if top not in (None, 0):
                return None, "top_logprobs: needs logprobs: true"
            return None, None
        if value is not True:
            return None, "logprobs: must be true or false"
        if top is None:
            return 0, None
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            return None, f"top_logprobs: must be an integer from 0 to {MAX_TOP_LOGPROBS}"
        return int(top), None
    if value is None or value is False:
        return None, None
    if not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        return None, f"logprobs: must be an integer from 0 to {MAX_TOP_LOGPROBS}"
    return int(value), None


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def _entry(lp: TokenLogprob, piece: Piece) -> dict[str, Any]:
    raw = piece(lp.token)
    return {"token": _text(raw), "logprob": lp.logprob, "bytes": list(raw),
            "top_logprobs": [{"token": _text(piece(t)), "logprob": v, "bytes": list(piece(t))}
                             for t, v in lp.top]}


def logprobs_block(lps: Sequence[TokenLogprob], piece: Piece, *, chat: bool,
                   offset: int = 0) -> dict[str, Any]:
    """The ``choices[i].logprobs`` object for ``lps``; ``offset``: characters of text
    before them (completions' ``text_offset``)."""
    if chat:
        return {"content": [_entry(lp, piece) for lp in lps]}
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        text = _text(piece(lp.token))
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_text(piece(t)): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets}
