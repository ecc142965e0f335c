"""Tell an HTTP request from an NDJSON frame by a connection's first bytes.

Why peek and not read: the bytes stay in the socket, so whichever side takes the
connection (the NDJSON ``Connection`` or the HTTP driver) reads it from the start, and
the native protocol's code does not change. An HTTP request starts with a method token
(upper-case letters: ``GET``, ``POST`` ...); an NDJSON frame starts with ``{`` (or
whitespace). Anything else is left to the NDJSON side, which answers it as a bad frame.
"""

from __future__ import annotations

import enum
import socket

import anyio
import anyio.abc

__all__ = ["Kind", "classify", "sniff"]


class Kind(enum.Enum):
    HTTP = "http"
    NDJSON = "ndjson"
    GONE = "gone"
    """The peer closed, or sent nothing before the timeout."""


def classify(first: bytes) -> Kind:
    """What a connection whose first bytes are ``first`` (non-empty) speaks."""
    return Kind.HTTP if first[:1].isalpha() and first[:1].isupper() else Kind.NDJSON


async def sniff(stream: anyio.abc.ByteStream, timeout_s: float) -> Kind:
    """Wait (up to ``timeout_s``) for the first bytes and classify them, consuming none."""
    sock: socket.socket | None = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
    if sock is None:
        return Kind.NDJSON
    with anyio.move_on_after(timeout_s):
        while True:
            try:
                first = sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                try:
                    await anyio.wait_readable(sock)
                except (anyio.ClosedResourceError, OSError):
                    return Kind.GONE
                continue
            except OSError:
                return Kind.GONE
            return classify(first) if first else Kind.GONE
    return Kind.GONE
