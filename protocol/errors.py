"""Error codes and the exception hierarchy that mirrors them.

Why one hierarchy for both directions: the same failure ("this frame is malformed") is
detected by the server's decoder, sent to the client as an ``error`` frame, and raised
again on the client. Giving each wire code one exception class means the server can turn
any :class:`ProtocolError` into a frame (``ErrorMessage.from_error``) and the client can
turn any frame back into the same class (:func:`error_from_code`), so both sides catch
and branch on one set of types.

This module is a leaf: it imports nothing of meshd, so every other module (the
messages' validators included) can raise these errors. The conversions to and from the
``error`` frame live with the frame, in ``messages.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, ClassVar


class ErrorCode(enum.StrEnum):
    """The fixed set of error codes carried by ``error`` frames (see PROTOCOL.md)."""

    BAD_REQUEST = "bad_request"
    """The frame was not valid JSON, not a known message, or had invalid values."""
    UNSUPPORTED_VERSION = "unsupported_version"
    """The ``hello`` asked for a protocol version the server does not speak."""
    TOO_LARGE = "too_large"
    """A frame exceeded the maximum frame size."""
    BUSY = "busy"
    """The server refuses new work right now (queue full, draining); retry later."""
    MODEL_ERROR = "model_error"
    """The model/runtime failed while serving the request."""
    CANCELLED = "cancelled"
    """The request was cancelled before it produced a result."""
    INTERNAL = "internal"
    """A bug or unexpected condition on the answering side."""
    FORBIDDEN = "forbidden"
    """The peer is not allowed to use this daemon (its uid/gid is not on the allow-list)."""
    UNKNOWN_MODEL = "unknown_model"
    """The request names a model the daemon does not serve."""


class ProtocolError(Exception):
    """Base of every error this package raises about the protocol.

    ``code`` is the wire code; ``message`` a human-readable explanation; ``request_id``
    the id of the request the error belongs to, or ``None`` when it could not be told
    (for instance a frame that was not even JSON).
    """

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(code={self.code.value!r}, message={self.message!r}, "
            f"request_id={self.request_id!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments are not restored by BaseException's default reduce.
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))

    def with_request_id(self, request_id: str | None) -> ProtocolError:
        """Return this error attributed to ``request_id`` (self if it already is)."""
        if request_id == self.request_id:
            return self
        clone = _rebuild(type(self), self.message, {**self.__dict__, "request_id": request_id})
        clone.__cause__ = self.__cause__
        return clone


def _rebuild(cls: type[ProtocolError], message: str, state: dict[str, Any]) -> ProtocolError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(state)
    return exc


class BadRequest(ProtocolError, ValueError):
    """Malformed frame or invalid message values (also a ``ValueError``, so constructing
    a message with an out-of-range value locally raises something Python code expects).

    ``field`` names the offending field when one is to blame; the message then starts
    with its path and a colon, written one way everywhere, by the server and by the
    client library (``"generate.sampling.top_p: must be a number in (0, 1] (got 2)"``).
    """

    code = ErrorCode.BAD_REQUEST

    def __init__(
        self, message: str, *, request_id: str | None = None, field: str | None = None
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.field = field

    @classmethod
    def invalid_field(cls, field: str, detail: str) -> BadRequest:
        """The error for one field whose value breaks a rule."""
        return cls(f"{field}: {detail}", field=field)

    def under(self, prefix: str) -> BadRequest:
        """The same error with its field path placed under ``prefix``: a message object
        knows only its own field names (``max_tokens``), its sender knows where it sits
        (``generate``), giving ``generate.max_tokens: ...``."""
        if self.field is None:
            out = BadRequest(f"{prefix}: {self.message}", request_id=self.request_id)
        else:
            detail = self.message.removeprefix(f"{self.field}: ")
            dot = "" if self.field.startswith("[") else "."
            out = BadRequest.invalid_field(f"{prefix}{dot}{self.field}", detail)
            out.request_id = self.request_id
        return out


def unknown_fields(extra: Iterable[str], allowed: Iterable[str]) -> str:
    """How ``bad_request`` names fields an object does not have, written one way by the
    decoder and by an older version's check (``unknown field 'x' (allowed: a, b)``)."""
    names = sorted(extra)
    noun = "field" if len(names) == 1 else "fields"
    return f"unknown {noun} {', '.join(repr(k) for k in names)} (allowed: {', '.join(allowed)})"


def unknown_op(op: str, allowed: Iterable[str], other: Iterable[str], side: str) -> str:
    """How ``bad_request`` names an ``op`` the receiver does not take, written one way by
    the decoder and by an older version's check: ``allowed`` are the ops of this
    direction, ``other`` those of the opposite one (``'welcome' is not a request op``)."""
    reason = f"{op!r} is not a {side} op" if op in set(other) else f"unknown op {op[:40]!r}"
    return f"{reason} (expected one of: {', '.join(sorted(allowed))})"


class UnsupportedVersion(ProtocolError):
    """The peers do not share a protocol version; the server closes the connection."""

    code = ErrorCode.UNSUPPORTED_VERSION


class FrameTooLarge(ProtocolError):
    """A frame exceeded the configured maximum size."""

    code = ErrorCode.TOO_LARGE


class ServerBusy(ProtocolError):
    """The server cannot take the request now; it is safe to retry later."""

    code = ErrorCode.BUSY


class ModelError(ProtocolError):
    """The model or runtime failed while serving the request."""

    code = ErrorCode.MODEL_ERROR


class RequestCancelled(ProtocolError):
    """The request was cancelled before producing a result.

    Not named ``Cancelled`` so it is never confused with ``trio.Cancelled`` or
    ``asyncio.CancelledError``, which mean "this task is being cancelled".
    """

    code = ErrorCode.CANCELLED


class InternalError(ProtocolError):
    """Unexpected failure on the answering side."""

    code = ErrorCode.INTERNAL


class PermissionDenied(ProtocolError, PermissionError):
    """The server refuses this peer (checked from the socket's peer credentials); the
    connection is closed after the ``error`` frame."""

    code = ErrorCode.FORBIDDEN


class UnknownModel(ProtocolError):
    """The request names a model the daemon does not serve (``generate.model``, ``load``,
    ``unload``); ``models`` lists those it does."""

    code = ErrorCode.UNKNOWN_MODEL


class ConnectionClosed(ProtocolError, ConnectionError):
    """The connection ended (EOF, reset, or the client was closed) while a request was
    pending. Client-side only: it never travels as a frame, and its wire code is
    ``internal`` should anyone serialise it."""

    code = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[ProtocolError]] = {
    ErrorCode.BAD_REQUEST: BadRequest,
    ErrorCode.UNSUPPORTED_VERSION: UnsupportedVersion,
    ErrorCode.TOO_LARGE: FrameTooLarge,
    ErrorCode.BUSY: ServerBusy,
    ErrorCode.MODEL_ERROR: ModelError,
    ErrorCode.CANCELLED: RequestCancelled,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.FORBIDDEN: PermissionDenied,
    ErrorCode.UNKNOWN_MODEL: UnknownModel,
}


def exception_class(code: ErrorCode) -> type[ProtocolError]:
    """The exception class that represents ``code``."""
    return _BY_CODE[code]


def error_from_code(
    code: ErrorCode | str, message: str, request_id: str | None = None
) -> ProtocolError:
    """Build the exception for a wire code (unknown codes become :class:`InternalError`)."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except ValueError:
        return InternalError(f"[{code}] {message}", request_id=request_id)
    return cls(message, request_id=request_id)
