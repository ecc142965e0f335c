"""A blocking NDJSON channel for plugin messages, with absolute deadlines.

Why blocking: on the daemon side a proposer is asked from the engine's worker thread,
which must not wait past the step's deadline; a socket timeout set to what is left of
the deadline is the simplest exact way to do that. The plugin side (the SDK) is a plain
loop. Both ends use this class; it never raises anything but the three errors below.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time

from .plugin import (
    MAX_PLUGIN_FRAME,
    PluginMessage,
    PluginProtocolError,
    decode_plugin,
    encode_plugin,
)

__all__ = ["ChannelClosed", "PluginChannel", "PluginProtocolError", "SendTimeout"]


class ChannelClosed(Exception):
    """The peer closed the connection (or it broke)."""


class SendTimeout(Exception):
    """The peer did not take a frame within the send timeout (it stopped reading)."""


class PluginChannel:
    """One end of a plugin connection. Not thread-safe: callers serialize."""

    def __init__(self, sock: socket.socket, *, max_frame: int = MAX_PLUGIN_FRAME,
                 send_timeout_s: float = 2.0, buffered: bytes = b"") -> None:
        sock.setblocking(True)
        self.sock = sock
        self.max_frame = max_frame
        self.send_timeout_s = send_timeout_s
        self._buf = bytearray(buffered)
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: PluginMessage) -> None:
        """Write one frame whole; raises ChannelClosed or SendTimeout."""
        self.send_bytes(encode_plugin(message))

    def send_bytes(self, data: bytes) -> None:
        if self.closed:
            raise ChannelClosed("channel closed")
        try:
            self.sock.settimeout(self.send_timeout_s)
            self.sock.sendall(data)
        except TimeoutError as exc:
            raise SendTimeout("peer did not read within the send timeout") from exc
        except OSError as exc:
            raise ChannelClosed(str(exc)) from exc

    def recv(self, deadline: float | None) -> PluginMessage | None:
        """The next frame, or None once ``deadline`` (``time.monotonic()``) has passed.

        Raises ChannelClosed at end of stream and PluginProtocolError for a frame that is
        not a plugin message or is longer than ``max_frame`` (then nothing more on this
        channel can be trusted).
        """
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[: nl + 1]
                if not line.strip():
                    continue
                return decode_plugin(line)
            if len(self._buf) > self.max_frame:
                raise PluginProtocolError(f"frame longer than {self.max_frame} bytes")
            if self.closed:
                raise ChannelClosed("channel closed")
            if deadline is None:
                self.sock.settimeout(None)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return None
            except OSError as exc:
                raise ChannelClosed(str(exc)) from exc
            if not data:
                raise ChannelClosed("end of stream")
            self._buf += data

    def peer_closed(self) -> bool:
        """Whether the peer has gone (end of stream or a broken socket), without
        waiting and without consuming anything a reader is owed."""
        if self.closed:
            return True
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return False
            return not self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()
