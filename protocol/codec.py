"""Sans-I/O codec: NDJSON frames <-> message objects.

Why sans-I/O: framing and validation are the part of the protocol most worth testing
exhaustively (property tests feed arbitrary bytes split at arbitrary points), and free
of sockets the daemon, the clients and tests share the very same code.
:class:`FrameDecoder` splits a byte stream into lines within the frame size limit
(resynchronising after an oversize line); :func:`decode_request` /
:func:`decode_response` turn one frame into a message; :class:`RequestDecoder` /
:class:`ResponseDecoder` combine the two; :func:`encode` writes one compact line. Bad
input of any kind raises only :class:`~meshd.protocol.errors.ProtocolError` subclasses
(naming the field, with the frame's ``id`` where it can be recovered), so a server can
answer every failure with an ``error`` frame.
"""

from __future__ import annotations

import collections
import enum
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, Generic, TypeVar

import attrs
import cattrs
import cattrs.cols
import cattrs.gen
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from . import versions
from .errors import (
    BadRequest,
    ErrorCode,
    FrameTooLarge,
    ProtocolError,
    unknown_fields,
    unknown_op,
)
from .messages import (
    DEFAULT_MAX_FRAME_SIZE,
    MAX_ID_LENGTH,
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    RESPONSE_TYPES,
    FinishReason,
    HealthStatus,
    Message,
    Request,
    Response,
    Token,
)

__all__ = [
    "FrameDecoder",
    "MessageDecoder",
    "RequestDecoder",
    "ResponseDecoder",
    "converter",
    "decode_request",
    "decode_response",
    "encode",
    "unstructure",
]

_SNIFF_LIMIT: Final = 1024
"""How many leading bytes of an unparseable frame are searched for its ``id``."""

_MAX_ERROR_LENGTH: Final = 1000

# A top-level-looking `"id": "..."` member. Inside a JSON string the quotes would be
# escaped (\"id\"), so text that merely mentions "id" does not match.
_ID_PATTERN: Final = re.compile(rb'"id"\s*:\s*"([^"\\\x00-\x1f]{1,%d})"' % MAX_ID_LENGTH)
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


# ------------------------------------------------------------------------- converter
# cattrs' defaults are lenient (int("5") for an int field, "abc" structured as a tuple of
# characters); the wire contract is strict JSON types, so every leaf and container gets a
# hook that checks the JSON type first and raises BadRequest saying what was expected.


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _expected(what: str, value: object) -> BadRequest:
    return BadRequest(f"expected {what}, got {_json_type(value)}")


def _structure_int(value: object, _type: type) -> int:
    if type(value) is not int:
        raise _expected("an integer", value)
    return value


def _structure_float(value: object, _type: type) -> float:
    # Integers are kept as they are (a counter of 3 round-trips as 3, not 3.0).
    if type(value) is not float and type(value) is not int:
        raise _expected("a number", value)
    if not math.isfinite(value):
        raise BadRequest("expected a finite number")
    return value


def _structure_str(value: object, _type: type) -> str:
    if type(value) is not str:
        raise _expected("a string", value)
    # JSON may spell unpaired surrogates (\ud800); they cannot be re-encoded as UTF-8.
    if _SURROGATE.search(value):
        raise BadRequest("string contains an unpaired UTF-16 surrogate")
    return value


def _structure_bool(value: object, _type: type) -> bool:
    if type(value) is not bool:
        raise _expected("a boolean", value)
    return value


def _enum_hook(cls: type[enum.Enum]) -> Callable[[object, type], Any]:
    allowed = ", ".join(repr(m.value) for m in cls)

    def hook(value: object, _type: type) -> Any:
        if type(value) is not str:
            raise _expected(f"one of {allowed}", value)
        try:
            return cls(value)
        except ValueError:
            raise BadRequest(f"expected one of {allowed}, got {value!r}") from None

    return hook


def _is_homogeneous_tuple(t: Any) -> bool:
    args: tuple[Any, ...] = getattr(t, "__args__", ())
    return getattr(t, "__origin__", None) is tuple and len(args) == 2 and args[1] is Ellipsis


def _is_list(t: Any) -> bool:
    return getattr(t, "__origin__", None) is list


def _is_dict(t: Any) -> bool:
    return getattr(t, "__origin__", None) is dict


def _guarded(
    inner: Callable[[Any, type], Any], json_type: type, what: str
) -> Callable[[object, type], Any]:
    """``inner``, but only for values of exactly ``json_type`` (else a typed error)."""

    def hook(value: object, type_: type) -> Any:
        if type(value) is not json_type:
            raise _expected(what, value)
        return inner(value, type_)

    return hook


def _array_factory(t: Any, conv: cattrs.Converter) -> Callable[[object, type], Any]:
    if _is_homogeneous_tuple(t):
        inner = cattrs.cols.homogenous_tuple_structure_factory(t, conv)
    else:
        inner = cattrs.cols.list_structure_factory(t, conv)
    return _guarded(inner, list, "an array")


def _object_factory(t: Any, conv: cattrs.Converter) -> Callable[[object, type], Any]:
    return _guarded(cattrs.cols.mapping_structure_factory(t, conv), dict, "an object")


def _attrs_factory(t: Any, conv: cattrs.Converter) -> Callable[[object, type], Any]:
    return _guarded(cattrs.gen.make_dict_structure_fn(t, conv), dict, "an object")


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(float, _structure_float)
    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook(bool, _structure_bool)
    for enum_cls in (FinishReason, HealthStatus, ErrorCode):
        conv.register_structure_hook(enum_cls, _enum_hook(enum_cls))
    conv.register_structure_hook_factory(_is_homogeneous_tuple, lambda t: _array_factory(t, conv))
    conv.register_structure_hook_factory(_is_list, lambda t: _array_factory(t, conv))
    conv.register_structure_hook_factory(_is_dict, lambda t: _object_factory(t, conv))
    conv.register_structure_hook_factory(attrs.has, lambda t: _attrs_factory(t, conv))
    # The hot frame stays as small as before for the requests that ask no logprobs.
    conv.register_unstructure_hook(Token, cattrs.gen.make_dict_unstructure_fn(
        Token, conv, logprobs=cattrs.gen.override(omit_if_default=True)))
    return conv


converter: Final = _make_converter()
"""The cattrs converter for every protocol message (strict JSON types, no extra keys)."""


# ------------------------------------------------------------------------ decoding


def _format_exception(exc: BaseException, type_: type | None) -> str:
    """Render one leaf failure from cattrs' error tree (see ``cattrs.transform_error``)."""
    if isinstance(exc, BadRequest) and exc.field and exc.message.startswith(exc.field + ": "):
        # Let _describe append the field to the path: "op.sampling.top_p: must be ...".
        return f"{exc.field}{_FIELD_SEP}{exc.message[len(exc.field) + 2 :]}"
    if isinstance(exc, ProtocolError):
        return exc.message
    if isinstance(exc, ForbiddenExtraKeysError):
        return unknown_fields(exc.extra_fields, (f.name for f in attrs.fields(exc.cl)))
    if isinstance(exc, KeyError):
        return "missing required field"
    return f"invalid value ({type(exc).__name__}: {exc})"


_FIELD_SEP: Final = "\x1f"


def _join_path(path: str, message: str) -> str:
    field, sep, detail = message.partition(_FIELD_SEP)
    if not sep:
        return f"{path}: {message}"
    dot = "" if field.startswith("[") else "."
    return f"{path}{dot}{field}: {detail}"


def _describe(exc: BaseException, op: str) -> str:
    """A one-line description of why structuring a frame of type ``op`` failed."""
    if isinstance(exc, ClassValidationError | IterableValidationError):
        parts = []
        for line in cattrs.transform_error(exc, path=op, format_exception=_format_exception):
            message, _, path = line.rpartition(" @ ")
            parts.append(_join_path(path, message))
        text = "; ".join(parts)
    else:
        text = _join_path(op, _format_exception(exc, None))
    if len(text) > _MAX_ERROR_LENGTH:
        text = text[: _MAX_ERROR_LENGTH - 3] + "..."
    return text


def _sniff_id(prefix: bytes) -> str | None:
    """Best-effort ``id`` of a frame that could not be parsed (oversize, bad JSON)."""
    match = _ID_PATTERN.search(prefix[:_SNIFF_LIMIT])
    if match is None:
        return None
    try:
        return match.group(1).decode("utf-8")
    except UnicodeDecodeError:
        return None


def _recover_id(obj: Mapping[str, Any]) -> str | None:
    """The ``id`` of a parsed frame if it is a usable one, else ``None``."""
    rid = obj.get("id")
    if type(rid) is str and 0 < len(rid) <= MAX_ID_LENGTH and _SURROGATE.search(rid) is None:
        return rid
    return None


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse(frame: bytes | bytearray | memoryview | str) -> Any:
    """JSON-decode one frame, turning every failure into BadRequest."""
    if isinstance(frame, str):
        text = frame
    else:
        raw = bytes(frame)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(
                f"frame is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                request_id=_sniff_id(raw),
            ) from None
    try:
        return json.loads(text, parse_float=_parse_float, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        # RecursionError: absurdly nested arrays; ValueError covers JSONDecodeError and
        # integers beyond Python's digit limit.
        reason = str(exc) if isinstance(exc, ValueError) else "nesting too deep"
        raise BadRequest(
            f"invalid JSON: {reason[:200]}",
            request_id=_sniff_id(text[:_SNIFF_LIMIT].encode("utf-8", "replace")),
        ) from None


def _structure(
    obj: Any, table: Mapping[str, type[Any]], other: Mapping[str, type[Any]], side: str
) -> Any:
    if not isinstance(obj, Mapping):
        raise BadRequest(f"frame must be a JSON object, got {_json_type(obj)}")
    rid = _recover_id(obj)
    if "op" not in obj:
        raise BadRequest("frame has no 'op' field", request_id=rid)
    op = obj["op"]
    if type(op) is not str:
        raise BadRequest(f"'op' must be a string, got {_json_type(op)}", request_id=rid)
    cls = table.get(op)
    if cls is None:
        raise BadRequest(unknown_op(op, table, other, side), request_id=rid)
    body = {k: v for k, v in obj.items() if k != "op"}
    try:
        return converter.structure(body, cls)
    except Exception as exc:
        # Broad on purpose: whatever cattrs or a validator raises about peer data must
        # reach the peer as bad_request, never crash the connection.
        raise BadRequest(_describe(exc, op), request_id=rid) from exc


Frame = bytes | bytearray | memoryview | str | Mapping[str, Any]
"""What the decode functions accept: one raw frame (newline optional) or parsed JSON."""


def decode_request(frame: Frame, *, version: int = PROTOCOL_VERSION) -> Request:
    """Parse one frame a client of protocol ``version`` sent (a field that version lacks
    is unknown). Raises BadRequest (carrying the id if known)."""
    obj = frame if isinstance(frame, Mapping) else _parse(frame)
    if version != PROTOCOL_VERSION and isinstance(obj, Mapping):
        try:
            obj = versions.check_request(obj, version)
        except BadRequest as exc:
            raise exc.with_request_id(_recover_id(obj)) from None
    result: Request = _structure(obj, REQUEST_TYPES, RESPONSE_TYPES, "request")
    return result


def decode_response(frame: Frame) -> Response:
    """Parse one frame a server sent. Raises BadRequest (carrying the id if known)."""
    obj = frame if isinstance(frame, Mapping) else _parse(frame)
    result: Response = _structure(obj, RESPONSE_TYPES, REQUEST_TYPES, "response")
    return result


# ------------------------------------------------------------------------ encoding


def unstructure(msg: Message) -> dict[str, Any]:
    """The JSON object for ``msg``, ``op`` first then ``id``."""
    body: dict[str, Any] = converter.unstructure(msg)
    return {"op": msg.OP, **body}


def encode(msg: Message, *, max_frame_size: int | None = None,
           version: int = PROTOCOL_VERSION) -> bytes:
    """One frame: compact UTF-8 JSON plus ``\\n``; a server's frame for a client of an
    older ``version`` shows only what that version defines (:func:`versions.downgrade`).

    Raises FrameTooLarge if the frame (newline excluded) exceeds ``max_frame_size``, and
    BadRequest if the message holds something JSON cannot carry (NaN, lone surrogates)
    or has no form in ``version``.
    """
    try:
        obj = unstructure(msg)
        if version != PROTOCOL_VERSION:
            obj = versions.downgrade(obj, version)
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        data = text.encode("utf-8")
    except (ValueError, TypeError) as exc:  # UnicodeEncodeError is a ValueError
        raise BadRequest(f"cannot encode {msg.OP}: {exc}", request_id=msg.id) from exc
    if max_frame_size is not None and len(data) > max_frame_size:
        raise FrameTooLarge(
            f"{msg.OP} frame is {len(data)} bytes, above the limit of {max_frame_size}",
            request_id=msg.id,
        )
    return data + b"\n"


# ------------------------------------------------------------------ incremental decoding


class FrameDecoder:
    """Split a byte stream into newline-terminated frames (sans-I/O).

    ``feed`` bytes as they arrive, then call ``next_frame`` until it returns ``None``.
    A line longer than ``max_frame_size`` bytes (newline excluded) yields one
    :class:`FrameTooLarge` (raised by ``next_frame`` at the position the line had in the
    stream) and the rest of that line is skipped, so the stream resynchronises at the
    next newline. Memory stays bounded by ``max_frame_size`` plus the complete frames not
    yet taken. Blank lines are ignored. The outcome does not depend on how the bytes were
    split between ``feed`` calls.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size < 1:
            raise ValueError("max_frame_size must be >= 1")
        self.max_frame_size = max_frame_size
        self._partial = bytearray()
        self._discarding = False
        self._ready: collections.deque[bytes | ProtocolError] = collections.deque()

    @property
    def buffered(self) -> int:
        """Bytes of the current incomplete frame held in memory."""
        return len(self._partial)

    def _too_large(self, head: bytes) -> FrameTooLarge:
        # Sniff only what every split of the stream is sure to have seen, so the error
        # (and its id) is the same however the line arrived.
        prefix = head[: min(_SNIFF_LIMIT, self.max_frame_size + 1)]
        return FrameTooLarge(
            f"frame exceeds the maximum size of {self.max_frame_size} bytes",
            request_id=_sniff_id(prefix),
        )

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add received bytes."""
        data = bytes(data)
        start = 0
        limit = self.max_frame_size
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                if not self._discarding:
                    room = limit + 1 - len(self._partial)
                    if len(data) - start > room - 1:
                        # The line is already too long: report it, keep nothing.
                        head = bytes(self._partial) + data[start : start + room]
                        self._ready.append(self._too_large(head))
                        self._partial.clear()
                        self._discarding = True
                    else:
                        self._partial += data[start:]
                return
            if self._discarding:
                self._discarding = False
            elif len(self._partial) + (nl - start) > limit:
                head = bytes(self._partial) + data[start : min(nl, start + limit + 1)]
                self._ready.append(self._too_large(head))
                self._partial.clear()
            else:
                self._partial += data[start:nl]
                self._push_line()
            start = nl + 1

    def _push_line(self) -> None:
        line = bytes(self._partial)
        self._partial.clear()
        if line.strip():
            self._ready.append(line)

    def feed_eof(self) -> None:
        """The stream ended: a final line without newline still counts as a frame."""
        if not self._discarding:
            self._push_line()
        self._discarding = False

    def next_frame(self) -> bytes | None:
        """The next complete frame (without newline), or ``None`` if more bytes are needed.

        Raises FrameTooLarge for an oversize line; call again to continue after it.
        """
        if not self._ready:
            return None
        item = self._ready.popleft()
        if isinstance(item, ProtocolError):
            raise item
        return item

    def __iter__(self) -> Iterator[bytes | ProtocolError]:
        """Drain ready frames, yielding errors as values instead of raising them."""
        while self._ready:
            yield self._ready.popleft()


M = TypeVar("M")


class MessageDecoder(Generic[M]):
    """Bytes in, messages out: a FrameDecoder followed by a decode function.

    ``next_message`` raises a :class:`ProtocolError` for a bad frame and can simply be
    called again to go on with the next one; :meth:`drain` yields errors as values,
    which suits a server that answers each with an ``error`` frame.
    """

    def __init__(
        self, decode: Callable[[bytes], M], max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    ) -> None:
        self._decode = decode
        self.frames = FrameDecoder(max_frame_size)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add received bytes."""
        self.frames.feed(data)

    def feed_eof(self) -> None:
        """The stream ended (flushes a final unterminated frame)."""
        self.frames.feed_eof()

    def next_message(self) -> M | None:
        """The next message, ``None`` if more bytes are needed; raises for a bad frame."""
        frame = self.frames.next_frame()
        if frame is None:
            return None
        return self._decode(frame)

    def drain(self) -> Iterator[M | ProtocolError]:
        """Every message (or error) decodable from the bytes fed so far."""
        for item in self.frames:
            if isinstance(item, ProtocolError):
                yield item
                continue
            try:
                yield self._decode(item)
            except ProtocolError as exc:
                yield exc


class RequestDecoder(MessageDecoder[Request]):
    """Server side: decodes what clients send."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        super().__init__(decode_request, max_frame_size)


class ResponseDecoder(MessageDecoder[Response]):
    """Client side: decodes what the server sends."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        super().__init__(decode_response, max_frame_size)
