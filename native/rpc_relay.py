"""A fault-isolating relay between llama.cpp's RPC client and one remote worker.

Why: llama.cpp's RPC client aborts the process (``GGML_ABORT``) when a worker's
connection drops mid-way, and a daemon whose worker dies must fail that request and keep
serving. So llama.cpp talks to this relay on loopback, which forwards each ggml-rpc
message unchanged; once the worker's side fails, the relay answers every request itself
with zeros of the expected size, so the forward in progress returns instead of aborting.
That output is never used: :class:`TargetContext` checks the links after every forward
and raises :class:`WorkerLost`. A relay is one incarnation of a worker: after a loss the
model is loaded through a NEW relay, because llama.cpp caches per-endpoint facts.
Wire format (ggml-rpc protocol 7): request ``cmd u8 | size u64 | payload``; the commands
in ``_RESPONSE`` get ``size u64 | payload`` back, the others nothing.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
from typing import Final

import attrs

from .rpc import Endpoint, recv_exact

__all__ = ["LinkStats", "WorkerLink"]

_CHUNK: Final = 1 << 20
_GET_TENSOR: Final = 8
_HELLO: Final = 14
#: Response size by command (ggml-rpc.cpp rpc_msg_*_rsp); -1: the size the request asks
#: for (GET_TENSOR's trailing u64). Commands not listed get no response.
_RESPONSE: Final = {0: 16, 1: 8, 2: 8, 3: 8, 7: 1, _GET_TENSOR: -1, 9: 1, 11: 16, 13: 8,
                    _HELLO: 28, 15: 4}
#: Stand-in answers where zeros would trip an assertion in llama.cpp (alignment, max
#: size, protocol version); everything else is answered with zeros.
_FAKE: Final = {1: struct.pack("<Q", 64), 2: struct.pack("<Q", 1 << 62),
                _HELLO: bytes([7, 0, 0, 0]) + bytes(24)}


class _ClientGone(Exception):
    """llama.cpp closed its side: this relay connection is over."""


@attrs.define
class LinkStats:
    """What went over one link: messages, blocking round trips, bytes each way."""

    requests: int = 0
    round_trips: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class WorkerLink:
    """A loopback endpoint for llama.cpp (``local``) that relays to ``endpoint``."""

    def __init__(self, endpoint: Endpoint, *, connect_timeout: float = 10.0,
                 keepalive_s: int = 10) -> None:
        self.endpoint = endpoint
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self.stats = LinkStats()
        #: Why the worker was lost (None while it is fine).
        self.lost: str | None = None
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=8)
        self.local = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()
        self._closed = False
        self._accepting = threading.Thread(target=self._accept_loop, daemon=True,
                                           name=f"rpc-relay-accept {endpoint}")
        self._accepting.start()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop accepting, drop every connection, join the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks = list(self._sockets)
        for s in (self._listener, *socks):  # shutdown wakes threads blocked on them
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._accepting.join(timeout=5)
        for t in self._threads:
            t.join(timeout=5)

    def _mark_lost(self, reason: str) -> None:
        with self._lock:
            if self.lost is None and not self._closed:
                self.lost = reason

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._sockets.add(s)

    def _untrack(self, s: socket.socket | None) -> None:
        if s is None:
            return
        with self._lock:
            self._sockets.discard(s)
        s.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    client.close()
                    return
                t = threading.Thread(target=self._serve, args=(client,), daemon=True,
                                     name=f"rpc-relay {self.endpoint}")
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    # ------------------------------------------------------------------ relaying

    def _connect(self) -> socket.socket | None:
        if self.lost is not None:
            return None
        try:
            up = socket.create_connection((self.endpoint.host, self.endpoint.port),
                                          timeout=self.connect_timeout)
        except OSError as exc:
            self._mark_lost(f"cannot reach it: {exc.strerror or exc}")
            return None
        up.settimeout(None)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A worker whose machine vanishes sends no reset: keep-alive probes (while idle)
        # and a user timeout (while data is unacknowledged) turn that into an error.
        up.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", self.keepalive_s), ("TCP_KEEPINTVL", 2),
                         ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", self.keepalive_s * 3000)):
            if hasattr(socket, opt):
                up.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
        self._track(up)
        return up

    def _serve(self, client: socket.socket) -> None:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._track(client)
        up = self._connect()
        buf = bytearray(_CHUNK)
        try:
            while True:
                if up is not None and not self._idle_ok(client, up):
                    self._untrack(up)
                    up = None
                header = self._from_client(client, 9)
                cmd, size = struct.unpack("<BQ", header)
                self.stats.requests += 1
                up, tail = self._relay_request(client, up, header, size, buf)
                expect = _RESPONSE.get(cmd)
                if expect is None:
                    continue
                self.stats.round_trips += 1
                if expect < 0:
                    expect = struct.unpack("<Q", tail)[0] if len(tail) == 8 else 0
                up = self._relay_response(client, up, cmd, expect, buf)
        except _ClientGone:
            pass
        finally:
            self._untrack(up)
            self._untrack(client)

    def _idle_ok(self, client: socket.socket, up: socket.socket) -> bool:
        """Between requests the worker must stay silent: readable means it closed (or
        broke the protocol). Wait for the client's next request meanwhile."""
        while True:
            ready, _, _ = select.select([client, up], [], [])
            if up in ready:
                self._mark_lost("the worker closed the connection")
                return False
            if client in ready:
                return True

    def _from_client(self, client: socket.socket, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            try:
                chunk = client.recv(n - len(data))
            except OSError:
                raise _ClientGone() from None
            if not chunk:
                raise _ClientGone()
            data += chunk
        return bytes(data)

    def _to_client(self, client: socket.socket, data: bytes | memoryview) -> None:
        try:
            client.sendall(data)
        except OSError:
            raise _ClientGone() from None

    def _relay_request(self, client: socket.socket, up: socket.socket | None,
                       header: bytes, size: int, buf: bytearray,
                       ) -> tuple[socket.socket | None, bytes]:
        """Forward one request (streamed); returns the live upstream and its last 8
        payload bytes."""
        up = self._send_up(up, header)
        view = memoryview(buf)
        tail = b""
        remaining = size
        while remaining:
            try:
                n = client.recv_into(view, min(remaining, _CHUNK))
            except OSError:
                raise _ClientGone() from None
            if n == 0:
                raise _ClientGone()
            remaining -= n
            tail = (tail + bytes(view[max(0, n - 8):n]))[-8:]
            up = self._send_up(up, view[:n])
        self.stats.bytes_sent += 9 + size
        return up, tail

    def _send_up(self, up: socket.socket | None, data: bytes | memoryview,
                 ) -> socket.socket | None:
        if up is None:
            return None
        try:
            up.sendall(data)
            return up
        except OSError as exc:
            self._mark_lost(f"sending to it failed: {exc.strerror or exc}")
            self._untrack(up)
            return None

    def _relay_response(self, client: socket.socket, up: socket.socket | None, cmd: int,
                        expect: int, buf: bytearray) -> socket.socket | None:
        """Forward the worker's answer; fake it (or its rest) if the worker fails."""
        if up is not None:
            sent = 0
            total: int | None = None
            try:
                raw = recv_exact(up, 8)
                total = struct.unpack("<Q", raw)[0]
                self._to_client(client, raw)
                view = memoryview(buf)
                while sent < total:
                    n = up.recv_into(view, min(total - sent, _CHUNK))
                    if n == 0:
                        raise ConnectionError("the worker closed the connection")
                    self._to_client(client, view[:n])
                    sent += n
                self.stats.bytes_received += 8 + total
                return up
            except (OSError, ConnectionError) as exc:
                self._mark_lost(f"its answer failed: {exc}")
                self._untrack(up)
            if total is not None:  # the size went out: complete the payload with zeros
                self._zeros(client, total - sent)
                return None
        payload = _FAKE.get(cmd, b"")
        self._to_client(client, struct.pack("<Q", expect))
        self._to_client(client, payload[:expect])
        self._zeros(client, expect - min(len(payload), expect))
        return None

    def _zeros(self, client: socket.socket, n: int) -> None:
        zero = bytes(min(n, _CHUNK))
        while n > 0:
            k = min(n, len(zero))
            self._to_client(client, zero[:k])
            n -= k
