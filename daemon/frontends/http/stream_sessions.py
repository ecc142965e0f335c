"""Resumable streams: a streamed answer kept by conversation, as llama-server keeps it.

Why: a web UI that reloads, or a client whose connection drops, should not lose an answer
still being written. A streamed request sent with an ``X-Conversation-Id`` header is
recorded as it is sent; the generation runs on when the client goes (only ``DELETE
/v1/stream`` stops it), and ``GET /v1/stream?conv_id=ID&from=N`` replays the stream's
bytes from offset N and follows it live. Bounded: :data:`MAX_SESSIONS` sessions of at
most :data:`MAX_BYTES` each (older bytes are dropped; a replay from before them is
refused), a finished one kept :data:`TTL_S`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

import anyio

if TYPE_CHECKING:  # (types only: the sessions' rules are tested without a model)
    from meshd.daemon.frontends.http.responder import Responder

__all__ = ["MAX_BYTES", "MAX_ID_LENGTH", "MAX_SESSIONS", "TTL_S", "OffsetLost",
           "RecordingResponder", "StreamSession", "StreamSessions"]

MAX_SESSIONS: Final = 64
MAX_BYTES: Final = 4 * 1024 * 1024
MAX_ID_LENGTH: Final = 256
TTL_S: Final = 300.0


class OffsetLost(Exception):
    """The bytes a replay asks for were dropped (the stream outgrew :data:`MAX_BYTES`)."""


class StreamSession:
    """One conversation's stream: its bytes so far, whether it ended, how to stop it."""

    def __init__(self, conversation: str) -> None:
        self.conversation = conversation
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
    """The daemon's stream sessions by conversation id (one live stream per id)."""

    def __init__(self) -> None:
        self._sessions: collections.OrderedDict[str, StreamSession] = collections.OrderedDict()

    def create(self, conversation: str) -> StreamSession:
        """A new session for ``conversation``, stopping any earlier one; the oldest
        session makes room past :data:`MAX_SESSIONS` (finished ones first)."""
        self._collect()
        self.stop(conversation)
        while len(self._sessions) >= MAX_SESSIONS:
            finished = [c for c, s in self._sessions.items() if s.done]
            self.stop(finished[0] if finished else next(iter(self._sessions)))
        session = self._sessions[conversation] = StreamSession(conversation)
        return session

    def get(self, conversation: str) -> StreamSession | None:
        self._collect()
        return self._sessions.get(conversation)

    def stop(self, conversation: str) -> bool:
        """Stop and forget ``conversation``'s stream; False when there was none."""
        session = self._sessions.pop(conversation, None)
        if session is not None:
            session.stop()
        return session is not None

    def lookup(self, conversations: Sequence[str]) -> list[StreamSession]:
        """The sessions of these ids, and of ``ID::MODEL`` variants of them."""
        self._collect()
        return [s for c, s in self._sessions.items()
                if any(c == want or c.startswith(f"{want}::") for want in conversations)]

    def _collect(self) -> None:
        now = time.time()
        for conversation in [c for c, s in self._sessions.items()
                             if s.completed_at is not None and now - s.completed_at > TTL_S]:
            del self._sessions[conversation]


class RecordingResponder:
    """A request's responder that records its stream into a session once the stream
    starts; from then on a client that goes does not cancel the generation (the
    session's Stop does), and writes go on into the session."""

    def __init__(self, out: Responder, sessions: StreamSessions, conversation: str) -> None:
        self._out = out
        self._sessions = sessions
        self._conversation = conversation
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
            self._session = self._sessions.create(self._conversation)
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
            gone, self._gone = self._gone, []
            for callback in gone:
                callback()
