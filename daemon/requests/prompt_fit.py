"""Whether a prompt fits the context, decided before it costs more than its length.

Why: a client may send megabytes of prompt (up to the frame or body limit) to a model
whose context holds a few thousand tokens. Tokenizing all of it costs seconds of CPU
and a list of a million token ids, for an answer its length already gives: one token
stands for at most ``max_piece_bytes`` bytes of text, so a longer text than the context
times that cannot fit. A text that passes is tokenized with the context as the limit:
llama.cpp then reports how many tokens it would be without storing them.
"""

from __future__ import annotations

from meshd.daemon.engine.request_errors import PromptTooLong
from meshd.daemon.models.runtime import ModelRuntime
from meshd.native.tokenizer import TooManyTokens

__all__ = ["PromptTooLong", "prompt_tokens"]


def prompt_tokens(runtime: ModelRuntime, text: str, *, chat: bool) -> list[int]:
    """The prompt's tokens, or PromptTooLong without tokenizing (or storing) more than
    the context holds; blocking (run it on a worker thread)."""
    n_ctx = runtime.context.config.n_ctx_seq
    most = n_ctx - 1  # one position is left for the first generated token
    if len(text) > most:  # (a shorter one is tokenized at once: the limit bounds that too)
        piece = runtime.model.tokenizer.max_piece_bytes
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        if n_bytes > most * piece:
            raise PromptTooLong(
                f"prompt of {n_bytes} bytes does not fit the context of {n_ctx} tokens per "
                f"session (--ctx): a token of this model stands for at most {piece} bytes, "
                f"so a prompt has at most {most * piece} bytes", n_ctx=n_ctx)
    try:
        return runtime.tokenize_prompt(text, chat=chat, limit=most)
    except TooManyTokens as exc:
        raise runtime.prompt_too_long(exc.n_tokens) from None
