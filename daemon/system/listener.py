"""Where the daemon listens: a Unix socket path it owns, or a socket it inherited.

Why one bind syntax (``unix:PATH``, ``fd://N``, as in hypercorn): the same daemon runs
from a shell (it creates its socket), under systemd socket activation (it is handed an
open listening socket), and in tests, and everything after :func:`open_listener` is the
same for all of them.

Owning a socket path means being careful with what is already there: a socket file left
behind by a daemon that crashed is replaced, but only after a connect attempt shows that
nobody listens on it; a live socket (another daemon) or anything that is not a socket
is refused with a clear error rather than deleted. The socket is created 0660 (the
owner and its group may connect) and removed on close if it is still ours.

Connections are accepted by waiting with ``anyio.wait_readable`` and accepting on the
raw socket, which unlike anyio's asyncio listener has no race with cancellation (see
``meshd.protocol.transport`` for the same race on reads).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from typing import Final

import anyio
import anyio.abc
import attrs

from meshd.clients.socket_path import default_socket_path

__all__ = [
    "DEFAULT_SOCKET_MODE",
    "BindSpec",
    "Listener",
    "ListenerError",
    "default_socket_path",
    "open_listener",
    "preflight",
    "system_backlog",
]

DEFAULT_SOCKET_MODE: Final = 0o660
"""Owner and group may connect; nobody else."""

_DIR_MODE: Final = 0o750
_LIVENESS_TIMEOUT_S: Final = 1.0
_SOMAXCONN_PATH: Final = "/proc/sys/net/core/somaxconn"


class ListenerError(Exception):
    """The daemon cannot listen where it was asked to (the message says why)."""


@attrs.frozen
class BindSpec:
    """A parsed bind address: a Unix socket ``path`` or an inherited ``fd``."""

    path: str | None = None
    fd: int | None = None

    def __attrs_post_init__(self) -> None:
        if (self.path is None) == (self.fd is None):
            raise ValueError("a bind spec names exactly one of a path and a file descriptor")

    @classmethod
    def parse(cls, text: str) -> BindSpec:
        """``unix:PATH``, ``fd://N``, or a plain path (taken as ``unix:``)."""
        if text.startswith("fd://"):
            number = text.removeprefix("fd://")
            if not number.isdigit():
                raise ValueError(f"bad bind address {text!r}: expected fd://N")
            return cls(fd=int(number))
        path = text.removeprefix("unix:")
        if not path:
            raise ValueError(f"bad bind address {text!r}: empty socket path")
        return cls(path=path)

    def __str__(self) -> str:
        return f"fd://{self.fd}" if self.fd is not None else f"unix:{self.path}"


class Listener:
    """A listening stream socket; :meth:`accept` yields anyio socket streams."""

    def __init__(self, sock: socket.socket, spec: BindSpec, owned: tuple[int, int] | None) -> None:
        self._sock = sock
        self.spec = spec
        self._owned = owned  # (st_dev, st_ino) of the socket file we created
        self._closed = False

    @property
    def address(self) -> str:
        """The bind address as text (``unix:PATH`` or ``fd://N``)."""
        return str(self.spec)

    @property
    def path(self) -> str | None:
        """The socket file's path, for Unix sockets bound by path."""
        return self.spec.path

    async def accept(self) -> anyio.abc.SocketStream:
        """Wait for and return the next connection.

        Raises ``anyio.ClosedResourceError`` once :meth:`aclose` has been called.
        """
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                try:
                    await anyio.wait_readable(self._sock)
                except (anyio.ClosedResourceError, OSError):
                    raise anyio.ClosedResourceError from None
                continue
            except OSError as exc:
                if self._closed:
                    raise anyio.ClosedResourceError from None
                if exc.errno in (errno.ECONNABORTED, errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                 errno.ENOMEM, errno.EPROTO):
                    # Transient (the peer gave up, or we are out of descriptors): back
                    # off a little instead of spinning, and keep serving.
                    await anyio.sleep(0.01)
                    continue
                raise
            conn.setblocking(False)
            try:
                return await self._wrap(conn)
            except BaseException:
                conn.close()
                raise

    async def _wrap(self, conn: socket.socket) -> anyio.abc.SocketStream:
        """The anyio stream for an accepted connection."""
        if conn.family == socket.AF_UNIX:
            return await anyio.abc.UNIXSocketStream.from_socket(conn)
        return await anyio.abc.SocketStream.from_socket(conn)

    async def aclose(self) -> None:
        """Stop listening and remove the socket file if it is still the one we made.

        Idempotent; wakes a task blocked in :meth:`accept`.
        """
        if self._closed:
            return
        self._closed = True
        if self._sock.fileno() != -1:
            anyio.notify_closing(self._sock)
        self._sock.close()
        if self._owned is not None and self.spec.path is not None:
            _remove_if_ours(self.spec.path, self._owned)
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()


def system_backlog() -> int:
    """The largest listen backlog the kernel grants (``net.core.somaxconn``).

    Why the maximum by default: connections that arrive while the accept loop is busy wait
    in the backlog; a burst larger than it (a thousand clients connecting at once) makes
    the rest fail with EAGAIN and retry. The kernel caps any larger request at this value.
    """
    try:
        with open(_SOMAXCONN_PATH, encoding="ascii") as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        return socket.SOMAXCONN
    return value if value > 0 else socket.SOMAXCONN


async def open_listener(
    spec: BindSpec | str, *, mode: int = DEFAULT_SOCKET_MODE, backlog: int | None = None
) -> Listener:
    """Listen on ``spec``. Raises ListenerError when that is not possible or not safe.

    ``backlog`` defaults to :func:`system_backlog`. An inherited socket (``fd://N``) keeps
    the backlog its creator gave it (systemd's ``Backlog=``).
    """
    if backlog is None:
        backlog = system_backlog()
    if backlog < 1:
        raise ListenerError(f"the listen backlog must be at least 1 (got {backlog})")
    if isinstance(spec, str):
        try:
            spec = BindSpec.parse(spec)
        except ValueError as exc:
            raise ListenerError(str(exc)) from exc
    if spec.fd is not None:
        return Listener(_inherited_socket(spec.fd), spec, None)
    assert spec.path is not None
    sock, owned = await anyio.to_thread.run_sync(_bind_unix, spec.path, mode, backlog)
    return Listener(sock, spec, owned)


def preflight(spec: BindSpec | str, *, other_user: bool = False,
              listening_ok: bool = False) -> None:
    """Fail early (before loading a model for minutes) if ``spec`` cannot be used:
    the same checks :func:`open_listener` makes, without binding or removing anything.

    For ``meshd config check``: ``other_user``, the daemon runs as another user (root
    checks for the ``meshd`` user), so that user's directories are not a problem;
    ``listening_ok``, a daemon already listening there is the one being checked."""
    if isinstance(spec, str):
        try:
            spec = BindSpec.parse(spec)
        except ValueError as exc:
            raise ListenerError(str(exc)) from exc
    if spec.path is None:
        return
    directory = os.path.dirname(os.path.abspath(spec.path))
    if os.path.exists(directory):
        if not os.path.isdir(directory):
            raise ListenerError(f"{directory} is not a directory")
        if not other_user:
            _ensure_directory(directory)
    elif not other_user:
        _check_creatable(directory)
    try:
        st = os.lstat(spec.path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenerError(f"{spec.path} exists and is not a socket; refusing to replace it")
    if not listening_ok and _is_live(spec.path):
        raise ListenerError(f"another process is already listening on {spec.path}")


def _inherited_socket(fd: int) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ListenerError(f"fd://{fd} is not an open socket: {exc}") from exc
    if sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise ListenerError(f"fd://{fd} is not a stream socket")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise ListenerError(f"fd://{fd} is not a listening socket")
    sock.setblocking(False)
    return sock


def _bind_unix(path: str, mode: int, backlog: int) -> tuple[socket.socket, tuple[int, int]]:
    """Create, bind (replacing a stale socket), chmod and listen; blocking."""
    directory = os.path.dirname(os.path.abspath(path))
    _ensure_directory(directory)
    _clear_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.bind(path)
        except OSError as exc:
            raise ListenerError(f"cannot bind {path}: {exc.strerror or exc}") from exc
        # Nobody can connect before listen(), so the file's initial umask-derived mode
        # is never usable by anyone we did not mean to let in.
        os.chmod(path, mode)
        st = os.lstat(path)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock, (st.st_dev, st.st_ino)


def _check_creatable(directory: str) -> None:
    """The socket directory does not exist: its nearest existing ancestor must let us
    create it (else the bind would fail after the model has loaded)."""
    ancestor = os.path.dirname(directory)
    while ancestor != os.path.dirname(ancestor) and not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ListenerError(f"cannot create socket directory {directory}: {ancestor} is "
                            "not a writable directory")


def _ensure_directory(directory: str) -> None:
    try:
        os.makedirs(directory, mode=_DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise ListenerError(f"cannot create socket directory {directory}: {exc}") from exc
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ListenerError(f"{directory} is not a directory")
    # A shared directory (/tmp) is fine if it is sticky; otherwise it must be ours, or
    # someone else could swap our socket for theirs.
    if st.st_uid not in (os.getuid(), 0) and not st.st_mode & stat.S_ISVTX:
        raise ListenerError(f"socket directory {directory} belongs to another user")


def _clear_stale(path: str) -> None:
    """Remove a leftover socket nobody listens on; refuse anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenerError(f"{path} exists and is not a socket; refusing to replace it")
    if _is_live(path):
        raise ListenerError(f"another process is already listening on {path}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ListenerError(f"cannot remove stale socket {path}: {exc}") from exc


def _is_live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_LIVENESS_TIMEOUT_S)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        # Permission denied, a full backlog, a timeout: something is there and we
        # cannot tell what, so we must not delete it.
        return True
    finally:
        probe.close()
    return True


def _remove_if_ours(path: str, owned: tuple[int, int]) -> None:
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == owned:
            os.unlink(path)
    except OSError:
        pass
