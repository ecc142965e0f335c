"""One HTTP/1.1 connection, driven by h11 (a sans-I/O parser): requests in, responses out.

Why this shape: h11 owns every parsing decision (request line, headers, chunked bodies,
keep-alive, pipelining); this class only moves bytes between it and the socket, with
limits (headers, body) and deadlines (idle between requests, whole request), and hands
each complete request to the routes. While a request is served, one watcher task keeps
reading, so a client that disconnects cancels its generation at the next step boundary
(bytes of a pipelined next request are kept for h11); one that only shut its sending
side after its request (a half-close) gets its answer, then the connection closes (see
:mod:`..hangup` for how the two are told apart). A malformed request gets h11's
4xx (400, 431 ...) and the connection closes; a client too slow to send its request
(slowloris) is disconnected after ``request_timeout_s``. Nothing here can stop the
daemon: whatever goes wrong ends this connection only.
"""

from __future__ import annotations

import http
import json
import socket
from collections.abc import Callable, Sequence
from typing import Final

import anyio
import anyio.abc
import anyio.lowlevel
import h11
from structlog.typing import FilteringBoundLogger

from meshd.daemon.frontends.http.access import authorized, cors_headers, preflight_headers
from meshd.daemon.frontends.http.ollama.answers import error_object
from meshd.daemon.frontends.http.ollama.routes import PREFIX as OLLAMA_PREFIX
from meshd.daemon.frontends.http.routes import Routes
from meshd.daemon.frontends.http.stream_sessions import StreamSessions, stream_owner
from meshd.daemon.requests.api_errors import JSON, error_body, json_bytes, unauthorized
from meshd.daemon.requests.service import Service
from meshd.daemon.system.hangup import wait_hangup
from meshd.daemon.system.peercred import peer_credentials
from meshd.protocol import FrameWriter, StreamReceiver

__all__ = ["HttpConnection"]

_SERVER_HEADER: Final = b"meshd"
_MAX_PENDING_BYTES: Final = 1024 * 1024
"""Bytes of a pipelined request kept while the current one is served."""
_DENIED: Final = ("this daemon does not serve your user or groups (ask its administrator to "
                  "add them to the allowed users or groups)")
_LINGER_S: Final = 1.0
_LINGER_BYTES: Final = 4 * 1024 * 1024


class HttpConnection:
    """Serves HTTP requests on one accepted stream until the peer or the daemon ends it."""

    def __init__(self, stream: anyio.abc.ByteStream, service: Service, *, conn_id: int,
                 log: FilteringBoundLogger, streams: StreamSessions | None = None) -> None:
        self.stream = stream
        self.service = service
        self.config = service.config.http
        self.conn_id = conn_id
        self.log = log.bind(conn=conn_id, proto="http")
        self._h11 = h11.Connection(
            h11.SERVER, max_incomplete_event_size=self.config.max_header_bytes)
        self._receiver = StreamReceiver(stream)
        self._socket: socket.socket | None = stream.extra(
            anyio.abc.SocketAttribute.raw_socket, None)
        if self._socket is not None and self._socket.family in (socket.AF_INET,
                                                                  socket.AF_INET6):
            # Streamed tokens are small writes; do not let Nagle hold them back.
            self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pending: list[bytes] = []
        self._eof = False
        self._lost = False
        self._refused = False
        #: The current request is a HEAD: its answer is the GET's status and headers,
        #: without the body (RFC 9110 9.3.2; h11 frames it so).
        self._head = False
        self._on_gone: list[Callable[[], None]] = []
        # One write at a time, each bounded (a peer that stops reading cannot hang us).
        self._writer = FrameWriter(stream, timeout=service.config.send_timeout_s, shield=False)
        self._scope: anyio.CancelScope | None = None
        self._routes = Routes(service, self.log, streams)
        #: Over TCP (no peer credentials): the API key applies.
        self._tcp = self._socket is not None and self._socket.family in (socket.AF_INET,
                                                                           socket.AF_INET6)
        #: Whose resumable streams this peer's requests make and see: its uid on the
        #: Unix socket, the API key over TCP (:func:`.stream_sessions.stream_owner`).
        self._owner = stream_owner(
            None if self._socket is None or self._tcp else peer_credentials(self._socket),
            tcp=self._tcp, api_key=self.config.api_key)
        #: The CORS headers of the current request's answer.
        self._cors: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve requests until the peer leaves, a request fails, or :meth:`close`."""
        self.log.debug("connection_opened")
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._peer_allowed():
                    await self._serve()
                elif await self._read_request() is not None:
                    await self._refuse(403, _DENIED, code="forbidden")
        finally:
            self._peer_gone()
            with anyio.CancelScope(shield=True):
                if self._refused:
                    await self._linger()
                await self._receiver.aclose()
            self.log.debug("connection_closed")

    def _peer_allowed(self) -> bool:
        """The allow-list of the daemon's socket applies to HTTP as to the native
        protocol (TCP peers have no credentials; the loopback listener decides)."""
        return self.service.admits_peer(self._socket, self.log)

    def close(self) -> None:
        """Stop serving (from any task of the event loop); a running generation is
        cancelled at its next step."""
        self._peer_gone()
        if self._scope is not None:
            self._scope.cancel()

    async def _serve(self) -> None:
        while True:
            got = await self._read_request()
            if got is None:
                return
            request, body = got
            if await self._answered_at_the_door(request):
                if self._h11.our_state is not h11.DONE or \
                        self._h11.their_state is not h11.DONE:
                    return
                self._h11.start_next_cycle()
                continue
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_peer)
                try:
                    conversation = next((v.decode("utf-8", "replace") for k, v in
                                         request.headers if k.lower() == b"x-conversation-id"),
                                        None)
                    await self._routes.handle(
                        request.method.decode("ascii", "replace"),
                        request.target.decode("ascii", "replace"), body, self,
                        conversation=conversation, owner=self._owner)
                finally:
                    tg.cancel_scope.cancel()
            if self._lost:
                return  # (after a half-close, pipelined requests still get answers)
            if self._h11.our_state is not h11.DONE or self._h11.their_state is not h11.DONE:
                return  # Connection: close, HTTP/1.0, or a response we could not finish
            self._h11.start_next_cycle()
            self._on_gone.clear()

    async def _answered_at_the_door(self, request: h11.Request) -> bool:
        """A CORS preflight, or a TCP request without the API key: answered here."""
        headers = {k.lower(): v for k, v in request.headers}
        allowed = self.config.cors_origins
        origin = headers.get(b"origin")
        self._cors = cors_headers(origin, allowed)
        path = request.target.decode("ascii", "replace").partition("?")[0]
        if request.method == b"OPTIONS" and origin is not None:
            # 200 either way, as llama-server answers: without the Allow headers a
            # browser keeps the page from the answers.
            await self.send(200, b"", "text/plain", preflight_headers(origin, allowed))
            return True
        if self._tcp and not authorized(headers, self.config.api_key, path):
            self.service.counters["errors_forbidden"] += 1
            self.log.info("http_unauthorized", path=path)
            refusal = unauthorized()
            body = error_object(refusal.message) if path.startswith(OLLAMA_PREFIX) \
                else error_body(refusal)
            await self.send(401, json_bytes(body), JSON, [("WWW-Authenticate", "Bearer")])
            return True
        return False

    # ------------------------------------------------------------------ reading

    async def _read_request(self) -> tuple[h11.Request, bytes] | None:
        """The next complete request and its body, or None (closed, refused, too slow)."""
        request: h11.Request | None = None
        self._head = False
        body = bytearray()
        deadline: float | None = None  # set by the request's first byte
        idle_deadline = anyio.current_time() + self.config.idle_timeout_s
        if self._pending or self._h11.trailing_data[0]:
            deadline = anyio.current_time() + self.config.request_timeout_s
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                await self._refuse(exc.error_status_hint, f"malformed request: {exc}")
                return None
            if event is h11.NEED_DATA:
                if self._h11.they_are_waiting_for_100_continue:
                    await self._send_events([h11.InformationalResponse(
                        status_code=100, headers=[])])
                data = await self._receive(deadline if deadline is not None else idle_deadline)
                if data is None:
                    self.log.info("http_timeout", during="request" if deadline else "idle")
                    return None
                if data and deadline is None:
                    deadline = anyio.current_time() + self.config.request_timeout_s
                self._h11.receive_data(data)
            elif isinstance(event, h11.Request):
                request = event
                self._head = event.method == b"HEAD"
                if event.http_version not in (b"1.0", b"1.1"):
                    await self._refuse(505, "only HTTP/1.0 and HTTP/1.1 are served")
                    return None
                length = _content_length(event.headers)
                if length is not None and length > self.config.max_body_bytes:
                    await self._refuse(413, f"body of {length} bytes is over the limit of "
                                            f"{self.config.max_body_bytes}")
                    return None
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > self.config.max_body_bytes:
                    await self._refuse(413, f"body over the limit of "
                                            f"{self.config.max_body_bytes} bytes")
                    return None
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return request, bytes(body)
            else:  # ConnectionClosed (or PAUSED, which only follows a finished request)
                return None

    async def _receive(self, deadline: float) -> bytes | None:
        """Bytes for h11 (b"" at EOF), or None once ``deadline`` passed."""
        if self._pending:
            return self._pending.pop(0)
        if self._eof:
            return b""
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            try:
                return await self._receiver.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._eof = True
                return b""
        return None

    async def _watch_peer(self) -> None:
        """While a request is served: notice a disconnect, keep pipelined bytes. End of
        stream may be a half-close: the client is gone only once it hangs up."""
        size = sum(map(len, self._pending))
        while not self._eof:
            if size >= _MAX_PENDING_BYTES:
                return
            try:
                data = await self._receiver.receive()
            except anyio.EndOfStream:
                self._eof = True
                break
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._eof = True
                self.log.info("http_client_gone")
                self._peer_gone()
                return
            self._pending.append(data)
            size += len(data)
        await wait_hangup(self._socket)
        self.log.info("http_client_gone")
        self._peer_gone()

    async def _linger(self) -> None:
        """After refusing a request the client is still sending: stop writing and read
        (and drop) its rest for a moment, so closing does not reset the connection
        before the client has read the error (TCP discards it then)."""
        sock = self._socket
        if sock is None or self._lost:
            return
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        received = 0
        with anyio.move_on_after(_LINGER_S):
            while received < _LINGER_BYTES:
                try:
                    received += len(await self._receiver.receive())
                except (anyio.EndOfStream, anyio.BrokenResourceError,
                        anyio.ClosedResourceError):
                    return

    def _peer_gone(self) -> None:
        callbacks, self._on_gone = self._on_gone, []
        for callback in callbacks:
            callback()

    # ------------------------------------------------------------------ Responder

    def on_gone(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` if the client disconnects while this request is served."""
        if self._lost:
            callback()
        else:
            self._on_gone.append(callback)

    async def send(self, status: int, body: bytes, content_type: str,
                   headers: Sequence[tuple[str, str]] = ()) -> bool:
        """A whole response (to a HEAD: its headers, Content-Length as the GET's); returns
        whether the client got it."""
        return await self._send_events([
            h11.Response(status_code=status, reason=_reason(status), headers=[
                *self._headers(content_type, headers),
                (b"Content-Length", str(len(body)).encode())]),
            *self._body(body), h11.EndOfMessage(),
        ])

    async def start(self, status: int, content_type: str,
                    headers: Sequence[tuple[str, str]] = ()) -> bool:
        """Begin a streamed response (chunked on HTTP/1.1). To a HEAD the headers are
        the whole answer: False then, as for a client that stopped reading."""
        sent = await self._send_events([h11.Response(
            status_code=status, reason=_reason(status),
            headers=self._headers(content_type, headers)),
            *([h11.EndOfMessage()] if self._head else [])])
        return sent and not self._head

    async def write(self, data: bytes) -> bool:
        if self._head:
            return False
        return await self._send_events([h11.Data(data=data)])

    async def end(self) -> bool:
        if self._head:  # (ended with its headers)
            return True
        return await self._send_events([h11.EndOfMessage()])

    def _headers(self, content_type: str, extra: Sequence[tuple[str, str]]
                 ) -> list[tuple[bytes, bytes]]:
        return [(b"Server", _SERVER_HEADER), (b"Content-Type", content_type.encode()),
                *((k.encode(), v.encode()) for k, v in (*self._cors, *extra))]

    # ------------------------------------------------------------------ writing

    async def _refuse(self, status: int, message: str, code: str | None = None) -> None:
        """Answer a request h11, the limits or the allow-list rejected, then the
        connection closes."""
        code = code or ("too_large" if status in (413, 431) else "bad_request")
        self.log.info("http_refused", status=status, code=code)
        self.log.debug("http_refused_message", message=message)
        self.service.counters[f"errors_{code}"] += 1
        if self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        self._refused = True
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": code}}).encode()
        await self._send_events([
            h11.Response(status_code=status, reason=_reason(status), headers=[
                *self._headers("application/json", [("Connection", "close")]),
                (b"Content-Length", str(len(body)).encode())]),
            *self._body(body), h11.EndOfMessage(),
        ])

    def _body(self, body: bytes) -> list[h11.Event]:
        """The body of an answer: none to a HEAD (h11 refuses one)."""
        return [] if self._head or not body else [h11.Data(data=body)]

    async def _send_events(self, events: Sequence[h11.Event]) -> bool:
        """Serialize with h11 and write; on a dead or stuck peer, give up the connection."""
        if self._lost:
            return False
        try:
            data = b"".join(self._h11.send(e) or b"" for e in events)
        except h11.LocalProtocolError as exc:
            self.log.warning("http_send_refused", error=str(exc))
            self._lost = True
            return False
        failure = await self._writer.write(data)
        if failure is not None:
            self._lost = True
            self.log.info("connection_lost", reason=type(failure).__name__)
            self._peer_gone()
            return False
        return True


def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None
