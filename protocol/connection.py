"""Sans-I/O protocol connections: the state both ends of a meshd connection keep.

Why this exists: the rules of a connection (``hello`` first, each request id answered,
each ``generate`` ending with exactly one ``done`` or ``error``) are the same for the
daemon and for every client. Kept here once, free of sockets, tasks and clocks (bytes
in, events out, as in h11), they are property-tested on their own and both ends drive
the same code: the daemon's connection handler a :class:`ServerConnection`, the async
client a :class:`ClientConnection`.

Each side feeds what it reads with ``receive_data`` (``b""`` for end of stream) and
takes events with ``next_event`` (``None``: more bytes are needed), and turns what it
wants to say into bytes with ``send``, which refuses (:class:`LocalProtocolError`) what
the protocol forbids at that point, such as a second ``done`` for one ``generate``. What
the *peer* gets wrong arrives as an event, never as an exception.
"""

from __future__ import annotations

import collections
import enum
from typing import Final, TypeAlias

import attrs

from . import versions
from .codec import FrameDecoder, decode_request, decode_response, encode
from .errors import BadRequest, ConnectionClosed, InternalError, ProtocolError, UnsupportedVersion
from .messages import (
    DEFAULT_MAX_FRAME_SIZE,
    PROTOCOL_VERSION,
    Cancel,
    CancelReply,
    DetokenizeReply,
    Done,
    ErrorMessage,
    Generate,
    HealthReply,
    Hello,
    LoadReply,
    ModelsReply,
    Request,
    Response,
    StatsReply,
    Token,
    TokenizeReply,
    UnloadReply,
    Welcome,
    error_from_message,
)

__all__ = [
    "ClientConnection",
    "ClientEvent",
    "ConnectionEnded",
    "Failed",
    "LocalProtocolError",
    "Rejected",
    "Reply",
    "ServerConnection",
    "ServerEvent",
    "State",
    "Stray",
]

_SINGLE_REPLIES: Final = (
    StatsReply, HealthReply, ModelsReply, TokenizeReply, DetokenizeReply, CancelReply,
    LoadReply, UnloadReply,
)
"""Frames that answer a request in one go (the request is over once one is sent)."""


class State(enum.Enum):
    """Where a connection is in its life."""

    HANDSHAKE = "handshake"
    """Nothing but ``hello`` (client) and ``welcome`` or ``error`` (server) yet."""
    OPEN = "open"
    """Handshake done: requests and their answers, in any interleaving."""
    CLOSED = "closed"
    """Over: the handshake failed, the stream ended or a fatal error arrived."""


class LocalProtocolError(RuntimeError):
    """This side tried to send something the protocol forbids here and now (a bug in
    the caller, never the peer's fault): a frame before the handshake, an answer to a
    request that is not in flight, a second final frame for one request."""


# ------------------------------------------------------------------------ events


@attrs.frozen
class Rejected:
    """(Server) A frame that cannot be served: answer it with :meth:`ServerConnection.reject`.

    ``fatal``: the connection must close after the answer (a bad first frame).
    ``frame``: the raw frame when it was complete but not a request (a proposer
    plugin's first frame is one: the daemon may hand the connection over).
    """

    error: ProtocolError
    fatal: bool = False
    frame: bytes | None = None


@attrs.frozen
class ConnectionEnded:
    """The peer closed its side and every frame before that was delivered."""


ServerEvent: TypeAlias = Request | Rejected | ConnectionEnded
"""What :meth:`ServerConnection.next_event` yields: an admitted request, a frame to
reject, or the end."""


@attrs.frozen
class Reply:
    """(Client) A frame for a request this side sent (``item`` is a ProtocolError when
    the server's frame for it was malformed). ``final``: nothing more will come for
    ``request_id`` (``done``, ``error``, or the one reply of a single-reply request)."""

    request_id: str
    item: Response | ProtocolError
    final: bool


@attrs.frozen
class Stray:
    """(Client) A well-formed frame for an id with nothing in flight: not an answer to
    anything this side asked, so it is reported rather than delivered."""

    message: Response


@attrs.frozen
class Failed:
    """(Client) The connection is unusable (``error`` says why): the handshake was
    refused, the server sent an ``error`` without an id or a frame nobody can place, or
    the stream ended. Every request still in flight fails with it."""

    error: ProtocolError


ClientEvent: TypeAlias = Reply | Stray | Failed
"""What :meth:`ClientConnection.next_event` yields."""


class _Side:
    """What both sides share: the state and the bytes received so far."""

    def __init__(self, max_frame_size: int) -> None:
        self.state = State.HANDSHAKE
        self._frames = FrameDecoder(max_frame_size)
        self._eof = False

    def receive_data(self, data: bytes) -> None:
        """Bytes read from the peer; ``b""`` means the peer closed its side."""
        if data:
            self._frames.feed(data)
        elif not self._eof:
            self._eof = True
            self._frames.feed_eof()


# ------------------------------------------------------------------------ server


class ServerConnection(_Side):
    """The server's side of one connection (sans-I/O).

    Requests come out of :meth:`next_event` already admitted: a ``generate`` is in
    flight from then on until this side sends its ``done`` or ``error``; a single-reply
    request until its reply or ``error``. Frames that cannot be admitted (malformed,
    not ``hello`` first, a second ``hello``, a ``generate`` whose id is in flight) come
    out as :class:`Rejected`.

    The ``welcome`` sets the connection's protocol :attr:`version` (the hello's, any the
    server speaks): requests are then read and frames written as that version defines
    them (:mod:`.versions`), so the application deals in today's messages only.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        super().__init__(max_frame_size)
        self.max_frame_size = max_frame_size
        self.version = PROTOCOL_VERSION
        """The client's protocol version once welcomed (the current one until then)."""
        self._hello: Hello | None = None
        self._generating: set[str] = set()
        self._awaiting: collections.Counter[str] = collections.Counter()

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held (a frame has begun but not ended)."""
        return self._frames.buffered

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet answered to the end."""
        return len(self._generating) + self._awaiting.total()

    def generating(self, request_id: str) -> bool:
        """Whether a ``generate`` with this id is in flight."""
        return request_id in self._generating

    def next_event(self) -> ServerEvent | None:
        """The next event, or ``None`` until more bytes arrive."""
        if self.state is State.CLOSED:
            return ConnectionEnded()
        try:
            frame = self._frames.next_frame()
        except ProtocolError as exc:
            return Rejected(exc, fatal=self.state is State.HANDSHAKE)
        if frame is None:
            return ConnectionEnded() if self._eof else None
        try:
            request = decode_request(frame, version=self.version)
        except ProtocolError as exc:
            return Rejected(exc, fatal=self.state is State.HANDSHAKE, frame=frame)
        return self._admit(request)

    def _admit(self, request: Request) -> ServerEvent:
        if self.state is State.HANDSHAKE:
            if self._hello is not None:
                # A request sent before the welcome: the client did not wait.
                return Rejected(BadRequest(
                    f"{request.OP} before the handshake completed", request_id=request.id
                ), fatal=True)
            if not isinstance(request, Hello):
                return Rejected(BadRequest(
                    f"the first frame must be hello (got {request.OP})", request_id=request.id
                ), fatal=True)
            self._hello = request
            return request
        if isinstance(request, Hello):
            return Rejected(BadRequest("hello was already received", request_id=request.id))
        if isinstance(request, Generate):
            if request.id in self._generating:
                return Rejected(BadRequest(
                    f"request id {request.id!r} is already in flight on this connection",
                    request_id=request.id,
                ))
            self._generating.add(request.id)
        elif isinstance(request, Cancel):
            if request.ack is not None:
                self._awaiting[request.ack] += 1
        else:
            self._awaiting[request.id] += 1
        return request

    def send(self, message: Response) -> bytes:
        """The frame for ``message``, which must answer something in flight (or be the
        handshake's answer); raises LocalProtocolError otherwise, and for a frame the
        connection's version does not have."""
        if self.version != PROTOCOL_VERSION and \
                message.OP not in versions.SCHEMAS[self.version].responses:
            raise LocalProtocolError(f"protocol version {self.version} has no {message.OP}")
        self._account(message)
        return self.encode(message)

    def encode(self, message: Response) -> bytes:
        """The frame for ``message`` in the connection's version, without the protocol's
        bookkeeping: for an ``error`` that replaces a reply :meth:`send` already counted
        (one over the frame limit)."""
        return encode(message, version=self.version)

    def reject(self, rejected: Rejected) -> bytes:
        """The ``error`` frame answering a :class:`Rejected` frame (in flight stays as
        it was: a duplicate ``generate`` id is refused, its namesake runs on)."""
        if self.state is State.CLOSED:
            raise LocalProtocolError("the connection is closed")
        if rejected.fatal or self.state is State.HANDSHAKE:
            self.state = State.CLOSED
        return self.encode(ErrorMessage.from_error(rejected.error))

    def refuse(self, error: ProtocolError) -> bytes:
        """The one ``error`` frame for a peer refused before its ``hello`` is read (not
        allowed to connect); the connection is closed after it."""
        if self.state is not State.HANDSHAKE or self._hello is not None:
            raise LocalProtocolError("refuse() comes before anything is read")
        self.state = State.CLOSED
        return encode(ErrorMessage.from_error(error))

    def _account(self, message: Response) -> None:
        rid = message.id
        if self.state is State.CLOSED:
            raise LocalProtocolError(f"{message.OP} on a closed connection")
        if self.state is State.HANDSHAKE:
            if self._hello is None:
                raise LocalProtocolError(f"{message.OP} before a hello to answer")
            if isinstance(message, Welcome) and rid == self._hello.id:
                if message.protocol_version != self._hello.protocol_version or \
                        not versions.speaks(message.protocol_version):
                    raise LocalProtocolError(
                        f"welcome in protocol {message.protocol_version} answers a hello "
                        f"of protocol {self._hello.protocol_version}")
                self.state = State.OPEN
                self.version = message.protocol_version
            elif isinstance(message, ErrorMessage) and rid in (None, self._hello.id):
                self.state = State.CLOSED
            else:
                raise LocalProtocolError(f"{message.OP} does not answer the hello")
            return
        if isinstance(message, Token | Done):
            if rid not in self._generating:
                raise LocalProtocolError(f"{message.OP} for {rid!r}, not a generate in flight")
            if isinstance(message, Done):
                self._generating.discard(rid)
        elif isinstance(message, ErrorMessage):
            if rid is None:
                return  # about the connection, not about one request
            if rid in self._generating:
                self._generating.discard(rid)
            elif rid in self._awaiting:
                self._answered(rid)
            else:
                raise LocalProtocolError(f"error for {rid!r}, which is not in flight "
                                         "(answer a rejected frame with reject())")
        elif isinstance(message, _SINGLE_REPLIES):
            if rid is None or rid not in self._awaiting:
                raise LocalProtocolError(f"{message.OP} for {rid!r}, which awaits no reply")
            self._answered(rid)
        else:
            raise LocalProtocolError(f"{message.OP} after the handshake")

    def _answered(self, request_id: str) -> None:
        self._awaiting[request_id] -= 1
        if self._awaiting[request_id] <= 0:
            del self._awaiting[request_id]


# ------------------------------------------------------------------------ client


class ClientConnection(_Side):
    """The client's side of one connection (sans-I/O).

    ``send`` a ``hello`` first; once its :class:`Reply` (the ``welcome``) has come out
    of :meth:`next_event`, requests may follow. Every frame the server sends comes out
    as a :class:`Reply` to the request it answers (with ``final`` on the last one), a
    :class:`Stray` when it answers nothing in flight, or a :class:`Failed`, after which
    the connection is closed.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        super().__init__(max_frame_size)
        self.welcome: Welcome | None = None
        self.error: ProtocolError | None = None
        """Why the connection closed (set with the :class:`Failed` event or :meth:`fail`)."""
        self._hello: Hello | None = None
        self._generating: set[str] = set()
        self._awaiting: set[str] = set()

    def in_flight(self, request_id: str) -> bool:
        """Whether ``request_id`` still expects frames from the server."""
        return request_id in self._generating or request_id in self._awaiting

    def send(self, request: Request) -> bytes:
        """The frame for ``request``; raises LocalProtocolError for a frame the state
        forbids, ``ValueError`` for an id already in flight, and the connection's error
        once it is closed."""
        if self.state is State.CLOSED:
            error = self.error or ConnectionClosed("connection closed")
            raise error.with_request_id(request.id)
        if self.state is State.HANDSHAKE:
            if not isinstance(request, Hello) or self._hello is not None:
                raise LocalProtocolError(
                    f"{request.OP} before the handshake completed" if self._hello
                    else f"the first frame must be hello (not {request.OP})"
                )
            data = encode(request)
            self._hello = request
            return data
        assert self.welcome is not None
        if isinstance(request, Hello):
            raise LocalProtocolError("hello was already sent")
        key = request.ack if isinstance(request, Cancel) else request.id
        if key is not None and self.in_flight(key):
            raise ValueError(f"request id {key!r} is already in use")
        data = encode(request, max_frame_size=self.welcome.max_frame_size)
        if isinstance(request, Generate):
            self._generating.add(request.id)
        elif key is not None:
            self._awaiting.add(key)
        return data

    def fail(self, error: ProtocolError) -> None:
        """Close the connection from this side (the stream broke, or the user closed)."""
        if self.state is not State.CLOSED:
            self.state = State.CLOSED
            self.error = error
            self._generating.clear()
            self._awaiting.clear()

    def next_event(self) -> ClientEvent | None:
        """The next event, or ``None`` until more bytes arrive."""
        if self.state is State.CLOSED:
            return None
        try:
            frame = self._frames.next_frame()
            message = None if frame is None else decode_response(frame)
        except ProtocolError as exc:
            return self._malformed(exc)
        if message is None:
            if not self._eof:
                return None
            if self.state is State.HANDSHAKE:
                return self._failed(
                    ConnectionClosed("server closed the connection during the handshake"))
            return self._failed(ConnectionClosed("server closed the connection"))
        if self.state is State.HANDSHAKE:
            return self._handshake(message)
        rid = message.id
        if rid is None:
            # Only error frames may lack an id: the server could not tell which request
            # failed, so none of them can be trusted to complete.
            assert isinstance(message, ErrorMessage)
            return self._failed(error_from_message(message))
        if rid in self._generating:
            final = not isinstance(message, Token)
            if final:
                self._generating.discard(rid)
            return Reply(rid, message, final)
        if rid in self._awaiting:
            self._awaiting.discard(rid)
            return Reply(rid, message, True)
        return Stray(message)

    def _malformed(self, exc: ProtocolError) -> ClientEvent:
        """A frame that did not decode fails the request it names, or the connection
        when it names none (whose answer went missing cannot be told)."""
        error = InternalError(f"server sent an invalid frame: {exc.message}",
                              request_id=exc.request_id)
        error.__cause__ = exc
        rid = exc.request_id
        if rid is None:
            return self._failed(error)
        if self.in_flight(rid):
            self._generating.discard(rid)
            self._awaiting.discard(rid)
            return Reply(rid, error, True)
        return Stray(ErrorMessage.from_error(error))

    def _handshake(self, message: Response) -> ClientEvent:
        hello = self._hello
        if hello is None:
            return self._failed(InternalError(f"{message.OP} before hello was sent"))
        if isinstance(message, ErrorMessage):
            return self._failed(error_from_message(message))
        if not isinstance(message, Welcome) or message.id != hello.id:
            return self._failed(
                InternalError(f"expected welcome for {hello.id!r}, got {message.OP}"))
        if message.protocol_version != hello.protocol_version:
            return self._failed(UnsupportedVersion(
                f"server speaks protocol {message.protocol_version}, "
                f"client speaks {hello.protocol_version}",
                request_id=hello.id,
            ))
        self.state = State.OPEN
        self.welcome = message
        return Reply(hello.id, message, True)

    def _failed(self, error: ProtocolError) -> Failed:
        self.fail(error)
        return Failed(error)
