"""Resumable streams: a streamed answer kept by conversation, as llama-server keeps it.

Why: a web UI that reloads, or a client whose connection drops, should not lose an answer
still being written. A streamed request sent with an ``X-Conversation-Id`` header is
recorded as it is sent; the generation runs on when the client goes (only ``DELETE
/v1/stream`` stops it), and ``GET /v1/stream?conv_id=ID&from=N`` replays the stream's
bytes from offset N and follows it live. Bounded: :data:`MAX_SESSIONS` sessions of at
most :data:`MAX_BYTES` each (older bytes are dropped; a replay from before them is
refused), a finished one kept :data:`TTL_S`.

Ownership: a stream belongs to the peer that created it (:func:`stream_owner`: its uid on
the Unix socket, the API key over TCP). Streams are kept by owner and id, so another
peer's read, lookup or Stop finds nothing (a 404, as for an id never used: whether it
exists is not told), and the same id used by two owners names two streams. Reusing the
id of one's own stream while it is still live is a conflict (:class:`StreamConflict`, a
409), never a Stop of the first one; a finished one is replaced.
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Final

import anyio

from meshd.daemon.requests.api_errors import ApiError

if TYPE_CHECKING:  # (types only: the sessions' rules are tested without a model)
    from meshd.daemon.frontends.http.responder import Responder
    from meshd.daemon.system.peercred import PeerCredentials

__all__ = ["MAX_BYTES", "MAX_ID_LENGTH", "MAX_SESSIONS", "TTL_S", "OffsetLost",
           "RecordingResponder", "StreamConflict", "StreamSession", "StreamSessions",
           "stream_owner"]

MAX_SESSIONS: Final = 64
MAX_BYTES: Final = 4 * 1024 * 1024
MAX_ID_LENGTH: Final = 256
TTL_S: Final = 300.0


class OffsetLost(Exception):
    """The bytes a replay asks for were dropped (the stream outgrew :data:`MAX_BYTES`)."""


class StreamConflict(ApiError):
    """A stream cannot be recorded: its owner's stream of that id is still live (409),
    or every stream kept is another owner's live one (503)."""


def stream_owner(peer: PeerCredentials | None, *, tcp: bool, api_key: str | None) -> str:
    """Who owns the streams a request creates: ``uid:N`` on the Unix socket (the
    kernel's record of the peer), ``key:HASH`` over TCP with an API key (the key the
    request was admitted with; only a digest is kept), ``tcp`` over TCP without one
    (every loopback peer is the same stranger then)."""
    if not tcp:
        return "unix" if peer is None else f"uid:{peer.uid}"
    if not api_key:
        return "tcp"
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


class StreamSession:
    """One conversation's stream: its bytes so far, whether it ended, how to stop it."""

    def __init__(self, conversation: str, owner: str = "") -> None:
        self.conversation = conversation
        self.owner = owner
        self.started_at = time.time()
        self.completed_at: float | None = None
        self.dropped = 0  # bytes dropped from the front
        self._data = bytearray()
        self._changed = anyio.Event()
        self._stops: list[Callable[[], None]] = []

    @property
    def total(self) -> int:
        return self.dropped + len(self._data)

    @property
    def done(self) -> bool:
        return self.completed_at is not None

    def append(self, data: bytes) -> None:
        self._data += data
        over = len(self._data) - MAX_BYTES
        if over > 0:
            del self._data[:over]
            self.dropped += over
        self._wake()

    def finish(self) -> None:
        if self.completed_at is None:
            self.completed_at = time.time()
            self._wake()

    def on_stop(self, callback: Callable[[], None]) -> None:
        self._stops.append(callback)

    def stop(self) -> None:
        """The client's Stop: the generation is cancelled and readers are let go."""
        stops, self._stops = self._stops, []
        for callback in stops:
            callback()
        self.finish()

    def read(self, offset: int) -> bytes:
        """The bytes from ``offset`` on (OffsetLost if some were dropped)."""
        if offset < self.dropped:
            raise OffsetLost(f"offset {offset} is before the {self.dropped} bytes dropped")
        return bytes(self._data[offset - self.dropped:])

    async def changed(self) -> None:
        """Wait until more bytes come or the stream ends."""
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class StreamSessions:
    """The daemon's stream sessions by owner and conversation id (one live stream per
    owner and id; an owner sees only its own)."""

    def __init__(self) -> None:
        self._sessions: collections.OrderedDict[tuple[str, str], StreamSession] = \
            collections.OrderedDict()

    def create(self, owner: str, conversation: str) -> StreamSession:
        """A new session for ``owner``'s ``conversation``, replacing a finished one.
        StreamConflict while that one is live. Past :data:`MAX_SESSIONS` a finished
        session makes room, else ``owner``'s oldest live one (stopped); another owner's
        live stream is never stopped (StreamConflict, 503, when only those are left)."""
        self._collect()
        key = (owner, conversation)
        current = self._sessions.get(key)
        if current is not None and not current.done:
            raise StreamConflict(409, f"X-Conversation-Id: the conversation {conversation!r} "
                                      "already has a live stream; wait for it to end, stop "
                                      "it (DELETE /v1/stream) or use another id",
                                 param="X-Conversation-Id", code="conflict")
        self._sessions.pop(key, None)
        while len(self._sessions) >= MAX_SESSIONS:
            finished = [k for k, s in self._sessions.items() if s.done]
            own = [k for k in self._sessions if k[0] == owner]
            if not finished and not own:
                raise StreamConflict(503, f"{MAX_SESSIONS} streams are live; try again when "
                                          "one has ended", code="busy",
                                     kind="server_error")
            self._stop((finished or own)[0])
        session = self._sessions[key] = StreamSession(conversation, owner)
        return session

    def get(self, owner: str, conversation: str) -> StreamSession | None:
        self._collect()
        return self._sessions.get((owner, conversation))

    def stop(self, owner: str, conversation: str) -> bool:
        """Stop and forget ``owner``'s stream of ``conversation``; False when there was
        none."""
        return self._stop((owner, conversation))

    def lookup(self, owner: str, conversations: Sequence[str]) -> list[StreamSession]:
        """``owner``'s sessions of these ids, and of ``ID::MODEL`` variants of them."""
        self._collect()
        return [s for (o, c), s in self._sessions.items()
                if o == owner
                and any(c == want or c.startswith(f"{want}::") for want in conversations)]

    def _stop(self, key: tuple[str, str]) -> bool:
        session = self._sessions.pop(key, None)
        if session is not None:
            session.stop()
        return session is not None

    def _collect(self) -> None:
        now = time.time()
        for key in [k for k, s in self._sessions.items()
                    if s.completed_at is not None and now - s.completed_at > TTL_S]:
            del self._sessions[key]


class RecordingResponder:
    """A request's responder that records its stream into a session once the stream
    starts; from then on a client that goes does not cancel the generation (the
    session's Stop does), and writes go on into the session. When the stream cannot be
    recorded (:class:`StreamConflict`), ``refuse`` answers the error instead, the
    generation is cancelled and :attr:`refused` says why."""

    def __init__(self, out: Responder, sessions: StreamSessions, conversation: str, *,
                 owner: str = "",
                 refuse: Callable[[StreamConflict], Awaitable[None]] | None = None) -> None:
        self._out = out
        self._sessions = sessions
        self._conversation = conversation
        self._owner = owner
        self._refuse = refuse
        #: The conflict this request's stream was refused with, if it was.
        self.refused: StreamConflict | None = None
        self._session: StreamSession | None = None
        self._live = True
        self._gone: list[Callable[[], None]] = []
        out.on_gone(self._client_gone)

    async def send(self, status: int, body: bytes, content_type: str,
                   headers: Sequence[tuple[str, str]] = ()) -> bool:
        return await self._out.send(status, body, content_type, headers)

    async def start(self, status: int, content_type: str,
                    headers: Sequence[tuple[str, str]] = ()) -> bool:
        if status == 200 and content_type == "text/event-stream":
            try:
                self._session = self._sessions.create(self._owner, self._conversation)
            except StreamConflict as exc:  # (checked here, where it is made: no race)
                self.refused = exc
                self._cancel()
                if self._refuse is not None:
                    await self._refuse(exc)
                self._live = False
                return False
            for callback in self._gone:
                self._session.on_stop(callback)
        self._live = await self._out.start(status, content_type, headers)
        return self._live or self._session is not None

    async def write(self, data: bytes) -> bool:
        if self._session is not None:
            self._session.append(data)
        if self._live:
            self._live = await self._out.write(data)
        return self._live or self._session is not None

    async def end(self) -> bool:
        if self._session is not None:
            self._session.finish()
        return await self._out.end() if self._live else False

    def on_gone(self, callback: Callable[[], None]) -> None:
        self._gone.append(callback)
        if self._session is not None:
            self._session.on_stop(callback)

    def close(self) -> None:
        """The request is over: a stream it left open (a crash) ends for its readers."""
        if self._session is not None:
            self._session.finish()

    def _client_gone(self) -> None:
        self._live = False
        if self._session is None:  # not streaming yet: the request goes with its client
            self._cancel()

    def _cancel(self) -> None:
        gone, self._gone = self._gone, []
        for callback in gone:
            callback()
