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
reads the non-blocking socket itself, which is what the stream would do anyway. Both
the client and the daemon's connection handlers can use it.
"""

from __future__ import annotations

import socket
from typing import Final

import anyio
import anyio.abc
import anyio.lowlevel

__all__ = ["READ_SIZE", "StreamReceiver", "write_all"]

READ_SIZE: Final = 65536
"""Most bytes taken from the socket per read."""


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
        while True:
            try:
                data = sock.recv(self._read_size)
            except BlockingIOError:
                await anyio.wait_readable(sock)
                continue
            except OSError as exc:  # includes EBADF once the socket has been closed
                raise anyio.BrokenResourceError(str(exc)) from exc
            if not data:
                raise anyio.EndOfStream
            return data

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
