"""A raw protocol connection for the soak that checks every rule it can observe.

Why not the bundled client: the client hides what the soak must see. It ignores frames
for ids it no longer waits for and treats an ``error`` without id as fatal; the soak
counts both. :class:`ProbeConnection` sends frames as given (garbage included), reads
every frame the daemon sends and records a violation when:

- a frame cannot be decoded (the daemon must only send valid frames within its limit);
- a frame names an id that has no request in flight on this connection;
- a frame arrives for a request after its final frame (``done``/``error``/reply);
- a ``generate`` gets anything but ``token`` frames and then one ``done`` or ``error``;
- another request gets anything but its one reply or one ``error``;
- the daemon closes the connection while requests are unanswered (unless it was told
  it may: idle and frame timeouts).
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import anyio
import anyio.abc
import attrs

from meshd.protocol import (
    PROTOCOL_VERSION,
    DetokenizeReply,
    Done,
    ErrorMessage,
    HealthReply,
    Hello,
    Message,
    ModelsReply,
    ProtocolError,
    Request,
    Response,
    ResponseDecoder,
    StatsReply,
    StreamReceiver,
    Token,
    TokenizeReply,
    Welcome,
    encode,
)

from .report import SoakReport

__all__ = ["ProbeConnection", "Record", "Refused"]

_REPLY_TYPES: Final[dict[str, type[Response]]] = {
    "health": HealthReply,
    "stats": StatsReply,
    "models": ModelsReply,
    "tokenize": TokenizeReply,
    "detokenize": DetokenizeReply,
}
_READ_LIMIT: Final = 64 * 1024 * 1024
"""The probe reads frames up to this size, so an oversize frame is seen, not lost."""


@attrs.define(eq=False)
class Record:
    """One request sent on a probe connection and what came back for it."""

    op: str
    tokens: list[int] = attrs.field(factory=list)
    final: Response | None = None
    first: anyio.Event = attrs.field(factory=anyio.Event)
    finished: anyio.Event = attrs.field(factory=anyio.Event)

    @property
    def error_code(self) -> str | None:
        return self.final.code.value if isinstance(self.final, ErrorMessage) else None


class ProbeConnection:
    """One connection; a reader task checks frames as they arrive."""

    def __init__(self, stream: anyio.abc.ByteStream, report: SoakReport, name: str) -> None:
        self.stream = stream
        self.report = report
        self.name = name
        self.receiver = StreamReceiver(stream)
        self.decoder = ResponseDecoder(_READ_LIMIT)
        self.records: dict[str, Record] = {}
        self.anonymous: collections.deque[ErrorMessage] = collections.deque()
        self.anonymous_seen = anyio.Event()
        self.closed_by_peer = anyio.Event()
        self.may_close = False  # the daemon may close on us (timeouts under test)
        self.max_frame_size = 0
        self._ids = 0
        self._send_lock = anyio.Lock()
        self._leaving = False

    @classmethod
    @asynccontextmanager
    async def open(cls, path: str, report: SoakReport, name: str, *,
                   hello: bool = True) -> AsyncIterator[ProbeConnection]:
        """Connect (and say hello); the reader runs until the block exits."""
        stream = await anyio.connect_unix(path)
        conn = cls(stream, report, name)
        body_error: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                if hello:
                    await conn._handshake()
                tg.start_soon(conn._read_loop)
                try:
                    yield conn
                except Exception as exc:
                    # Re-raised outside the task group: the caller sees its own exception
                    # (a send on a connection the daemon closed), not an ExceptionGroup.
                    body_error = exc
                finally:
                    conn._leaving = True
                    tg.cancel_scope.cancel()
        finally:
            await conn.receiver.aclose()
        if body_error is not None:
            raise body_error

    def new_id(self) -> str:
        self._ids += 1
        return f"{self.name}-{self._ids}"

    def violation(self, text: str) -> None:
        self.report.violations.append(f"{self.name}: {text}")

    # ------------------------------------------------------------------ sending

    async def send_raw(self, data: bytes) -> None:
        async with self._send_lock:
            await self.stream.send(data)

    async def request(self, msg: Request) -> Record:
        """Send ``msg`` and track its answer (its id must be new on this connection)."""
        assert msg.id not in self.records
        record = Record(msg.OP)
        self.records[msg.id] = record
        await self.send_raw(encode(msg))
        return record

    async def expect_anonymous_error(self, timeout: float) -> ErrorMessage | None:
        """The next ``error`` frame without an id (an unattributable bad frame)."""
        with anyio.move_on_after(timeout):
            while not self.anonymous:
                await self.anonymous_seen.wait()
                self.anonymous_seen = anyio.Event()
            return self.anonymous.popleft()
        return None

    # ------------------------------------------------------------------ reading

    async def _frames(self) -> AsyncIterator[Response | ProtocolError]:
        while True:
            for item in self.decoder.drain():
                yield item
            try:
                data = await self.receiver.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.decoder.feed_eof()
                for item in self.decoder.drain():
                    yield item
                return
            self.decoder.feed(data)

    async def _handshake(self) -> None:
        await self.send_raw(encode(Hello(id="hello", protocol_version=PROTOCOL_VERSION,
                                         client_name=f"soak-{self.name}")))
        async for item in self._frames():
            if isinstance(item, Welcome):
                self.max_frame_size = item.max_frame_size
                return
            self._count(item)
            raise Refused(item)
        raise Refused(None)

    def _count(self, item: Response | ProtocolError | None) -> None:
        if isinstance(item, ErrorMessage):
            self.report.errors[item.code.value] += 1

    async def _read_loop(self) -> None:
        async for item in self._frames():
            self._check(item)
        pending = [rid for rid, r in self.records.items() if r.final is None]
        if pending and not self.may_close and not self._leaving:
            self.violation(f"connection closed with {len(pending)} requests unanswered")
        for record in self.records.values():
            record.first.set()
            record.finished.set()
        self.closed_by_peer.set()
        self.anonymous_seen.set()

    def _check(self, item: Response | ProtocolError) -> None:
        if isinstance(item, ProtocolError):
            self.violation(f"invalid frame from the daemon: {item.message[:120]}")
            return
        self._count(item)
        if item.id is None:
            if isinstance(item, ErrorMessage):
                self.anonymous.append(item)
                self.anonymous_seen.set()
            else:
                self.violation(f"{item.OP} frame without id")
            return
        record = self.records.get(item.id)
        if record is None:
            self.violation(f"{item.OP} frame for unknown id {item.id!r}")
            return
        if record.final is not None:
            self.violation(f"{item.OP} frame for {item.id!r} after its final frame")
            return
        if record.op == "generate":
            if isinstance(item, Token):
                record.tokens.extend(item.token_ids)
                record.first.set()
                return
            if not isinstance(item, Done | ErrorMessage):
                self.violation(f"{item.OP} frame in the stream of generate {item.id!r}")
                return
        elif not isinstance(item, ErrorMessage | _REPLY_TYPES.get(record.op, ErrorMessage)):
            self.violation(f"{item.OP} frame answering {record.op} {item.id!r}")
            return
        record.final = item
        record.first.set()
        record.finished.set()


class Refused(Exception):
    """The daemon answered ``hello`` with something other than ``welcome``."""

    def __init__(self, frame: Message | ProtocolError | None) -> None:
        super().__init__(repr(frame))
        self.frame = frame
