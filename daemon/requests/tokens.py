"""Token ids and their text for the front ends: llama-server's ``/tokenize`` and
``/detokenize``, and its prompts of strings and token ids.

Why here: the tokenizer is the model's (``meshd.native``); a front end hands text or ids
and gets ids, pieces (bytes) or text back, with its refusals as API errors, and never
imports the tokenizer. Blocking work runs on a worker thread, as the native
``tokenize`` op's does (the vocabulary is read-only; a multi-megabyte text must not
stall the event loop), and every answer is bounded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import anyio.to_thread

from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.requests.api_errors import ApiError, bad_field, context_exceeded
from meshd.daemon.requests.service import Service
from meshd.native.records import TooManyTokens
from meshd.protocol import messages as wire

__all__ = ["bias_ids", "detokenize", "mixed_prompt_ids", "tokenize"]


async def tokenize(service: Service, content: str, *, add_special: bool, parse_special: bool,
                   with_pieces: bool) -> list[int] | list[tuple[int, bytes]]:
    """``content``'s token ids on the default model (``with_pieces``: each with its bytes,
    special tokens written out); ApiError 413 past half a frame's worth of ids."""
    most = service.config.max_frame_size // 2

    def run(rt: ModelRuntime) -> list[int] | list[tuple[int, bytes]]:
        tok = rt.model.tokenizer
        ids = tok.tokenize(content, add_special=add_special, parse_special=parse_special,
                           max_tokens=most)
        if not with_pieces:
            return list(ids)
        return [(t, tok.piece(t, special=True)) for t in ids]

    try:
        async with service.holding(None, None) as rt:
            return await anyio.to_thread.run_sync(run, rt)
    except TooManyTokens as exc:
        raise ApiError(413, f"content: the text is {exc.n_tokens} tokens; at most {most} "
                            "are answered", param="content", code="too_large") from None


async def detokenize(service: Service, tokens: list[Any]) -> str:
    """The default model's text of ``tokens``, special tokens written out; ApiError 400
    for an id outside the vocabulary, 413 for a text larger than a frame."""
    limit = service.config.max_frame_size
    async with service.holding(None, None) as rt:
        n_vocab = rt.model.info.n_vocab
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < n_vocab:
                raise ApiError(400, f"tokens[{i}]: must be a token id from 0 to {n_vocab - 1} "
                                    f"(got {t!r})", param=f"tokens[{i}]")
        tok = rt.model.tokenizer

        def run() -> str:
            # The pieces' sizes first: a reply larger than a frame is never built.
            size = sum(len(tok.piece(t, special=True)) for t in tokens)
            if size > limit:
                raise ApiError(413, f"tokens: the text is {size} bytes, above the limit of "
                                    f"{limit}", param="tokens", code="too_large")
            return tok.detokenize(tokens, special=True)

        return await anyio.to_thread.run_sync(run)


def _too_long(rt: ModelRuntime, n_tokens: int) -> ApiError:
    return context_exceeded(rt.prompt_too_long(n_tokens), "prompt")


def mixed_prompt_ids(rt: ModelRuntime, prompt: Sequence[str | int], param: str
                     ) -> tuple[int, ...]:
    """llama-server's tokenization of a prompt of strings and ids (``tokenize_mixed``):
    special tokens parsed, BOS (if the model wants one) before a first string; no more
    tokens than the context holds. Blocking."""
    tok = rt.model.tokenizer
    n_vocab = rt.model.info.n_vocab
    most = rt.context.config.n_ctx_seq - 1
    out: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            try:
                out += tok.tokenize(part, add_special=i == 0, parse_special=True,
                                    max_tokens=max(1, most - len(out)))
            except TooManyTokens as exc:
                raise _too_long(rt, len(out) + exc.n_tokens) from None
        else:
            if part >= n_vocab:
                raise bad_field(f"{param}[{i}]", f"must be a token id below the vocabulary size "
                                            f"{n_vocab} (got {part})")
            out.append(part)
        if len(out) > most:
            raise _too_long(rt, len(out))
    return tuple(out)


def bias_ids(rt: ModelRuntime, logit_bias: Sequence[tuple[int | str, float]], ignore_eos: bool
             ) -> tuple[tuple[int, float], ...]:
    """llama-server's biases by token id (text: each of its tokens; ids outside the
    vocabulary are skipped, as llama-server skips them), then, for ``ignore_eos``, a ban
    of each end-of-generation token. Blocking."""
    tok = rt.model.tokenizer
    n_vocab = rt.model.info.n_vocab
    out: list[tuple[int, float]] = []
    for key, bias in logit_bias:
        if isinstance(key, int):
            if 0 <= key < n_vocab:
                out.append((key, bias))
            continue
        room = wire.MAX_LOGIT_BIAS - len(out)
        try:
            ids: list[int] | None = tok.tokenize(key, add_special=False, parse_special=False,
                                                 max_tokens=max(1, room))
        except TooManyTokens:
            ids = None
        if ids is None or len(ids) > room:
            raise bad_field("logit_bias", f"its text stands for more than {wire.MAX_LOGIT_BIAS} "
                                     "tokens")
        out += [(t, bias) for t in ids]
    if ignore_eos:
        out += [(t, -math.inf) for t in sorted(rt.model.info.eog_tokens)]
    return tuple(out)
