"""The optional loopback TCP listener for HTTP (``--http tcp:127.0.0.1:PORT``).

Why loopback only: the daemon has no authentication; on the Unix socket the file mode
decides who may connect, and on TCP only the local machine can. A socket unit may hand
the listener over instead (``fd://N``), as for the Unix socket.
"""

from __future__ import annotations

import ipaddress
import socket

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread

from meshd.clients.argtypes import comma_list
from meshd.daemon.system.listener import (
    BindSpec,
    Listener,
    ListenerError,
    _inherited_socket,
    system_backlog,
)
from meshd.protocol.transport import receive_some, send_all

__all__ = ["HttpAddressError", "TcpListener", "check_http_address", "http_addresses",
           "open_http_listener", "open_http_listeners", "parse_tcp"]


class HttpAddressError(ListenerError):
    """The ``--http`` value itself is wrong (malformed, or not a loopback address): a
    usage error, unlike a port that is taken (a plain ListenerError)."""


def parse_tcp(text: str) -> tuple[str, int]:
    """``tcp:HOST:PORT`` (HOST a loopback address; ``[::1]`` for IPv6) -> (host, port)."""
    host, sep, port_text = text.removeprefix("tcp:").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise HttpAddressError(f"bad HTTP address {text!r}: expected tcp:127.0.0.1:PORT")
    try:
        address = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
    except ValueError:
        raise HttpAddressError(
            f"bad HTTP address {text!r}: HOST must be an IP address or localhost") from None
    _require_loopback(address, host)
    return str(address), int(port_text)


def _require_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address,
                      shown: str) -> None:
    if not address.is_loopback:
        raise HttpAddressError(f"refusing to serve HTTP on {shown}: only loopback addresses "
                               "(127.0.0.0/8, ::1, localhost; the daemon has no "
                               "authentication)")


def _check_inherited(fd: int) -> None:
    """An inherited TCP socket must be bound to loopback too (a socket unit's
    ``ListenStream=8080`` listens on every address). A descriptor that is no socket
    is left to :func:`open_http_listener` to report."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = str(sock.getsockname()[0])
            _require_loopback(ipaddress.ip_address(host.partition("%")[0]),
                              f"fd://{fd} ({host})")
    finally:
        sock.detach()


class SocketByteStream(anyio.abc.SocketStream):
    """An accepted TCP connection as an anyio stream over the plain non-blocking socket.

    anyio's own TCP stream on uvloop exposes a transport's pseudo-socket that cannot
    ``recv``; meshd reads and writes sockets directly (``wait_readable`` /
    ``wait_writable``, free of cancellation races), so it needs the real one.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @property
    def _raw_socket(self) -> socket.socket:
        return self._sock

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint()
        return await receive_some(self._sock, max_bytes)

    async def send(self, item: bytes) -> None:
        await anyio.lowlevel.checkpoint()
        await send_all(self._sock, item)

    async def send_eof(self) -> None:
        self._sock.shutdown(socket.SHUT_WR)

    async def aclose(self) -> None:
        if self._sock.fileno() != -1:
            anyio.notify_closing(self._sock)
            self._sock.close()
        await anyio.lowlevel.checkpoint()


class TcpListener(Listener):
    """A listening TCP socket; its address reads ``tcp:HOST:PORT`` (the bound port)."""

    @property
    def address(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"tcp:[{host}]:{port}" if ":" in host else f"tcp:{host}:{port}"

    async def _wrap(self, conn: socket.socket) -> anyio.abc.SocketStream:
        if conn.family == socket.AF_UNIX:
            return await super()._wrap(conn)
        return SocketByteStream(conn)


def _bind_tcp(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ListenerError(f"cannot listen on tcp:{host}:{port}: {exc.strerror or exc}") \
            from exc
    return sock


def http_addresses(text: str) -> list[str]:
    """The addresses of a ``--http`` value: one, or several separated by commas
    (``tcp:127.0.0.1:8080,tcp:[::1]:8080``, as llama-server's ``--host A,B``)."""
    return list(comma_list(text)) or [text]


async def open_http_listeners(text: str, *, backlog: int | None = None) -> list[Listener]:
    """One listener per address of ``text`` (:func:`http_addresses`); ListenerError
    when one cannot listen (the others opened are closed again)."""
    opened: list[Listener] = []
    try:
        for address in http_addresses(text):
            opened.append(await open_http_listener(address, backlog=backlog))
    except BaseException:
        for listener in opened:
            await listener.aclose()
        raise
    return opened


async def open_http_listener(text: str, *, backlog: int | None = None) -> Listener:
    """Listen for HTTP on ``tcp:HOST:PORT`` or an inherited ``fd://N``; ``backlog``
    defaults to the system maximum, as for the daemon's socket."""
    if text.startswith("fd://"):
        check_http_address(text)
        spec = BindSpec.parse(text)
        assert spec.fd is not None
        return TcpListener(_inherited_socket(spec.fd), spec, None)
    host, port = parse_tcp(text)
    sock = await anyio.to_thread.run_sync(
        _bind_tcp, host, port, system_backlog() if backlog is None else backlog)
    return TcpListener(sock, BindSpec(fd=sock.fileno()), None)


def check_http_address(text: str) -> None:
    """Fail early (before loading a model) on a ``--http`` value (each of its
    addresses) that is malformed or not a loopback address, with HttpAddressError."""
    addresses = http_addresses(text)
    if len(addresses) > 1:
        for address in addresses:
            check_http_address(address)
        return
    if text.startswith("fd://"):
        try:
            spec = BindSpec.parse(text)
        except ValueError as exc:
            raise HttpAddressError(str(exc)) from None
        assert spec.fd is not None
        _check_inherited(spec.fd)
    else:
        parse_tcp(text)
