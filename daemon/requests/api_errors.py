"""OpenAI's error object, and how meshd's errors become it.

Why a module of its own: every HTTP route (OpenAI's, llama-server's, the Responses API,
the stream routes) answers errors in this one shape, with fields named as the request
named them (``max_tokens``, never the native ``generate.max_tokens``). Where llama-server
gives an error a ``type`` of its own that clients test (``exceed_context_size_error`` with
the counts, ``authentication_error``), meshd answers that ``type`` with OpenAI's ``code``
(``context_length_exceeded``, ``invalid_api_key``): OpenAI's clients pick their exception
by the HTTP status, llama.cpp's web UI by the ``type``, so both read it right.
"""

from __future__ import annotations

import json
from typing import Any, Final

from meshd.daemon.engine.request_errors import PromptTooLong
from meshd.protocol import BadRequest, ProtocolError

__all__ = [
    "JSON",
    "ApiError",
    "api_field",
    "bad_field",
    "context_exceeded",
    "error_body",
    "json_bytes",
    "unauthorized",
]

JSON: Final = "application/json"


def json_bytes(payload: Any) -> bytes:
    """A JSON body (UTF-8, non-ASCII text kept as is)."""
    return json.dumps(payload, ensure_ascii=False).encode()


class ApiError(Exception):
    """An error answered with OpenAI's error object and an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str = "bad_request", kind: str = "invalid_request_error",
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.extra = extra or {}
        """Fields beside OpenAI's four (llama-server's ``n_prompt_tokens``, ``n_ctx``)."""

    @classmethod
    def from_protocol(cls, error: ProtocolError, *, before_generation: bool = True,
                      max_tokens_param: str = "max_tokens",
                      constraint_param: str = "response_format") -> ApiError:
        """The HTTP form of a protocol error (before any token: a context overflow is the
        request's fault, so ``model_error`` is a 400 there), its field named as in the
        OpenAI request."""
        code = error.code.value
        status = {"bad_request": 400, "unsupported_version": 400, "too_large": 413,
                  "busy": 503, "cancelled": 499, "internal": 500}.get(code, 500)
        kind = "invalid_request_error"
        if code == "model_error":
            status = 400 if before_generation else 500
        if code == "unknown_model":
            return cls(404, error.message, param="model", code="model_not_found")
        if status >= 500:
            kind = "server_error"
        message, param = error.message, None
        if isinstance(error, BadRequest):
            message, param = api_field(message, error.field, max_tokens_param,
                                       constraint_param)
        return cls(status, message, param=param, code=code, kind=kind)


def api_field(message: str, field: str | None, max_tokens_param: str = "max_tokens",
              constraint_param: str = "response_format") -> tuple[str, str | None]:
    """A native error's message and field with the field named as the OpenAI request
    names it: ``generate.max_tokens: ...`` becomes ``max_tokens: ...`` (or
    ``max_completion_tokens`` when the request used that), ``generate.sampling.top_p``
    becomes ``top_p``. A message that starts with a field path but carries no field
    (``generate.prompt: tokenizes to no tokens``) gets one from that path."""
    if field is None:
        head, sep, _ = message.partition(": ")
        if sep and head.startswith("generate.") and " " not in head:
            field = head
    if field is None:
        return message, None
    name = field.removeprefix("generate.").removeprefix("sampling.")
    if name == "max_tokens":
        name = max_tokens_param
    elif name.split(".")[0] == "constraint":
        name = constraint_param
    return name + message.removeprefix(field), name


def error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": error.message, "type": error.kind, "param": error.param,
                      "code": error.code, **error.extra}}


def bad_field(param: str, detail: str) -> ApiError:
    """A 400 naming the request field ``param`` and what is wrong with it."""
    return ApiError(400, f"{param}: {detail}", param=param)


def context_exceeded(exc: BaseException, param: str) -> ApiError:
    """A prompt over the context (``param``: its field; ``exc``: the PromptTooLong, or
    the ModelError raised from it): OpenAI's code, llama-server's type and counts
    (``n_prompt_tokens`` where the prompt was counted, ``n_ctx`` per sequence), meshd's
    message."""
    extra: dict[str, Any] = {}
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, PromptTooLong):
        cause = cause.__cause__
    if cause is not None:
        if cause.n_prompt is not None:
            extra["n_prompt_tokens"] = cause.n_prompt
        extra["n_ctx"] = cause.n_ctx
    message = exc.message if isinstance(exc, ProtocolError) else str(exc)
    return ApiError(400, message, param=param, code="context_length_exceeded",
                    kind="exceed_context_size_error", extra=extra)


def unauthorized() -> ApiError:
    """The 401 of a TCP request without the configured API key."""
    return ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                    code="invalid_api_key", kind="authentication_error")
