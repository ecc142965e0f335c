"""Reading an anyio byte stream without anyio's asyncio Unix-socket cancellation race.

Why this exists: on the asyncio backend, anyio's Unix socket stream waits for data with
``loop.add_reader(sock, future.set_result, None)``. If the reading task is cancelled in
the same event-loop iteration in which data arrives (which is exactly what happens when
a client stops a connection while the server is still streaming tokens, or a server
stops a connection handler while the client is still sending), the queued callback runs
``set_result`` on the already-cancelled future and asyncio reports
"Exception in callback Future.set_result(None) ... InvalidStateError". Nothing breaks,
but the error is logged (and the anyio pytest plugin fails the test).
``anyio.wait_readable`` tolerates that race, so :class:`StreamReceiver` waits with it and
reads the non-blocking socket itself, which is what the stream would do anyway;
:func:`write_all` is its twin for writing. :class:`FrameWriter` adds what both ends need
on top: one writer at a time (frames of different requests interleave but never mix
bytes) and a bound on each write (a peer that stops reading cannot hang the writer).
The client, the daemon's connection handlers and its HTTP TCP stream all read and
write sockets through this module (:func:`receive_some`, :func:`send_all`).
"""

from __future__ import annotations

import socket
from typing import Final

import anyio
import anyio.abc
import anyio.lowlevel

__all__ = [
    "READ_SIZE",
    "TRANSPORT_ERRORS",
    "FrameWriter",
    "StreamReceiver",
    "receive_some",
    "send_all",
    "write_all",
]

READ_SIZE: Final = 65536
"""Most bytes taken from the socket per read."""

TRANSPORT_ERRORS: Final = (
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    OSError,
)
"""What reading or writing a stream raises when the connection is gone (reset, closed
by us or the peer); ``TimeoutError`` is an ``OSError``."""


class StreamReceiver:
    """``receive()``/``aclose()`` for an anyio byte stream, race-free on Unix sockets.

    Streams that are not backed by a socket (memory streams, TLS wrappers) fall back to
    their own ``receive``. Only one task may receive at a time, as with any stream.
    """

    def __init__(self, stream: anyio.abc.ByteStream, read_size: int = READ_SIZE) -> None:
        self.stream = stream
        self._read_size = read_size
        self._socket: socket.socket | None = stream.extra(
            anyio.abc.SocketAttribute.raw_socket, None
        )

    async def receive(self) -> bytes:
        """Bytes that have arrived (at least one).

        Raises ``anyio.EndOfStream`` when the peer closed its side,
        ``anyio.BrokenResourceError`` on a socket error or once the socket was closed,
        ``anyio.ClosedResourceError`` if :meth:`aclose` ran while waiting.
        """
        sock = self._socket
        if sock is None:
            return await self.stream.receive(self._read_size)
        await anyio.lowlevel.checkpoint()
        return await receive_some(sock, self._read_size)

    async def aclose(self) -> None:
        """Close the stream, first waking a task blocked in :meth:`receive`.

        Shielded, so it completes even when called from a cancelled scope.
        """
        if self._socket is not None and self._socket.fileno() != -1:
            anyio.notify_closing(self._socket)
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


async def write_all(
    stream: anyio.abc.ByteStream, sock: socket.socket | None, data: bytes
) -> None:
    """``stream.send``, but on a socket it writes the non-blocking socket directly and
    waits with ``anyio.wait_writable``: anyio's asyncio stream waits with a future that,
    cancelled in the same loop iteration the socket turns writable, logs an
    InvalidStateError (the write-side twin of :class:`StreamReceiver`)."""
    if sock is None:
        await stream.send(data)
        return
    await anyio.lowlevel.checkpoint_if_cancelled()
    await send_all(sock, data)


async def receive_some(sock: socket.socket, max_bytes: int) -> bytes:
    """Bytes from a non-blocking socket (at least one), waiting with
    ``anyio.wait_readable``. Raises ``anyio.EndOfStream`` when the peer closed its side,
    ``anyio.BrokenResourceError`` on a socket error (EBADF once the socket was closed)."""
    while True:
        try:
            data = sock.recv(max_bytes)
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        except OSError as exc:
            raise anyio.BrokenResourceError(str(exc)) from exc
        if not data:
            raise anyio.EndOfStream
        return data


async def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """Write all of ``data`` to a non-blocking socket, waiting with
    ``anyio.wait_writable``; a socket error raises ``anyio.BrokenResourceError``."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await anyio.wait_writable(sock)
            continue
        except OSError as exc:
            raise anyio.BrokenResourceError(str(exc)) from exc
        view = view[sent:]


class FrameWriter:
    """Writes whole frames to a stream: one write at a time, each within ``timeout``
    seconds, and nothing more once one has failed.

    ``shield`` protects a write from the writing task's cancellation, so a cancelled
    task never leaves half a frame behind (the client, whose connection outlives the
    task); the daemon's handlers write unshielded, since their cancellation ends the
    connection anyway and must not wait for a stuck peer.
    """

    def __init__(self, stream: anyio.abc.ByteStream, *, timeout: float, shield: bool) -> None:
        self.stream = stream
        self._socket: socket.socket | None = stream.extra(
            anyio.abc.SocketAttribute.raw_socket, None
        )
        self._timeout = timeout
        self._shield = shield
        self._lock = anyio.Lock()
        self.failure: BaseException | None = None
        """Why the connection broke (``TimeoutError`` if the peer stopped reading), or
        ``None`` while it works."""

    async def write(self, data: bytes) -> BaseException | None:
        """Write ``data``; ``None`` once written, else the error that broke the
        connection (returned at once for every later write)."""
        if self.failure is not None:
            return self.failure
        async with self._lock:
            if self.failure is not None:
                return self.failure
            with anyio.CancelScope(shield=self._shield) as scope:
                scope.deadline = anyio.current_time() + self._timeout
                try:
                    await write_all(self.stream, self._socket, data)
                except TRANSPORT_ERRORS as exc:
                    self.failure = exc
            if scope.cancelled_caught and self.failure is None:
                self.failure = TimeoutError(f"write not completed within {self._timeout:g} s")
        return self.failure
