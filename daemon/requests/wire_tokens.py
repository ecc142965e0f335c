"""The native protocol's ``tokenize`` and ``detokenize`` on the default model.

Why bounded here: the vocabulary is read-only and needs no context lock, so the work
runs on a worker thread (a multi-megabyte text must not stall the event loop), and no
reply larger than a frame is ever built: no more ids than a frame could carry (each
takes 2 bytes or more), no text larger than a frame.
"""

from __future__ import annotations

import anyio.to_thread

from meshd.daemon.models.model_set import ModelSet
from meshd.daemon.requests.holding import holding
from meshd.native.records import TooManyTokens
from meshd.protocol import (
    BadRequest,
    Detokenize,
    DetokenizeReply,
    FrameTooLarge,
    Tokenize,
    TokenizeReply,
)

__all__ = ["detokenize", "tokenize"]


async def tokenize(models: ModelSet, request: Tokenize, max_frame_size: int) -> TokenizeReply:
    """The text's token ids; FrameTooLarge past what a reply frame could carry."""
    most = max_frame_size // 2
    try:
        async with holding(models, None, request.id) as rt:
            tok = rt.model.tokenizer
            tokens = await anyio.to_thread.run_sync(lambda: tok.tokenize(
                request.text, add_special=request.add_special, max_tokens=most))
    except TooManyTokens as exc:
        raise FrameTooLarge(
            f"tokenize: the text is {exc.n_tokens} tokens; a reply of more than {most} "
            f"would be above the frame limit of {max_frame_size} bytes",
            request_id=request.id) from None
    return TokenizeReply(id=request.id, tokens=tuple(tokens))


async def detokenize(models: ModelSet, request: Detokenize, max_frame_size: int
                     ) -> DetokenizeReply:
    """The ids' text; BadRequest for an id outside the vocabulary, FrameTooLarge for a
    text larger than a frame."""
    async with holding(models, None, request.id) as rt:
        n_vocab = rt.model.info.n_vocab
        for i, token in enumerate(request.tokens):
            if token >= n_vocab:
                raise BadRequest.invalid_field(
                    f"detokenize.tokens[{i}]",
                    f"must be a token id below the vocabulary size {n_vocab} (got {token})",
                ).with_request_id(request.id)
        tok = rt.model.tokenizer

        def run() -> str:
            # The pieces' sizes first: a reply larger than a frame is never built.
            size = sum(len(tok.piece(t)) for t in request.tokens)
            if size > max_frame_size:
                raise FrameTooLarge(
                    f"detokenize: the text is {size} bytes, above the frame limit of "
                    f"{max_frame_size}", request_id=request.id)
            return tok.detokenize(request.tokens)

        text = await anyio.to_thread.run_sync(run)
    return DetokenizeReply(id=request.id, text=text)
