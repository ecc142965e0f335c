"""Helpers for the HTTP tests: raw HTTP over the daemon's Unix socket."""

from __future__ import annotations

import contextlib

import anyio

from meshd.protocol import StreamReceiver


async def raw_exchange(path: str, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection (while reading: the daemon may answer and
    close before it has all of it) and read until the daemon closes the connection (or
    ``timeout``); returns everything received."""
    stream = await anyio.connect_unix(path)
    receiver = StreamReceiver(stream)
    got = bytearray()

    async def send() -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError,
                                 OSError):
            await stream.send(data)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with anyio.move_on_after(timeout):
                while True:
                    try:
                        got += await receiver.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
            tg.cancel_scope.cancel()
    finally:
        await receiver.aclose()
    return bytes(got)


def status_of(response: bytes) -> int:
    """The status code of the first response in ``response`` (0 when there is none)."""
    if not response.startswith(b"HTTP/1."):
        return 0
    return int(response.split(b" ", 2)[1])
