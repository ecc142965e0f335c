"""Why a request cannot be served as asked: the errors both front ends and ``meshd
generate`` map to their answers (``bad_request`` / ``model_error``, exit codes)."""

from __future__ import annotations

__all__ = ["PromptTooLong", "RequestError", "too_long_message"]


class RequestError(ValueError):
    """The request cannot be served as asked (bad proposer name, prompt too long, ...)."""


class PromptTooLong(RequestError):
    """The prompt does not fit the context (the daemon answers ``model_error``; ``meshd
    generate`` exits 3 like meshctl). ``n_prompt``: the prompt's tokens where they were
    counted (a prompt refused by its byte length is not tokenized); ``n_ctx``: the
    context per sequence."""

    def __init__(self, message: str, *, n_prompt: int | None = None, n_ctx: int) -> None:
        super().__init__(message)
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx


def too_long_message(n_prompt: int, n_ctx: int, n_train: int | None) -> str:
    """Why a prompt of ``n_prompt`` tokens cannot run, naming ``--ctx`` and the limit."""
    message = (f"prompt of {n_prompt} tokens does not fit the context of {n_ctx} tokens "
               f"per session (--ctx): at most {n_ctx - 1} prompt tokens")
    if n_train and n_ctx < n_train:
        return f"{message}; a larger --ctx (up to {n_train}, the model's training " \
               "context) makes room"
    if n_train and n_ctx >= n_train:
        return f"{message}; that is the model's training context, the most --ctx allows"
    return message
