"""systemd socket activation: the listening sockets a service manager handed us.

Why: with ``meshd.socket`` systemd owns ``/run/meshd/meshd.sock`` (its mode, group and
lifetime) and starts meshd on the first connection, or at boot with the socket already
accepting, so clients never see "connection refused" while the model loads or during a
restart. The protocol (``sd_listen_fds``): ``$LISTEN_PID`` is our pid, ``$LISTEN_FDS`` the
number of descriptors starting at 3, ``$LISTEN_FDNAMES`` their colon-separated names
(``FileDescriptorName=`` in the unit; ``unknown`` by default).

The variables are read once and removed from the environment, so a child process (a
plugin host, a benchmark) never believes the sockets are meant for it. Every descriptor
is checked before use: it must be a listening stream socket of an address family we
serve (Unix, and IPv4/IPv6 for a TCP listener); anything else is a clear error, not a
confusing failure on the first ``accept``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from typing import Final

import attrs

__all__ = ["SD_LISTEN_FDS_START", "ActivationError", "InheritedSocket", "listen_fds"]

SD_LISTEN_FDS_START: Final = 3
_VARIABLES: Final = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
_FAMILIES: Final = {socket.AF_UNIX: "unix", socket.AF_INET: "inet", socket.AF_INET6: "inet6"}


class ActivationError(Exception):
    """The inherited descriptors are not what socket activation promises."""


@attrs.frozen
class InheritedSocket:
    """One descriptor passed by the service manager."""

    fd: int
    name: str
    family: str
    """``unix``, ``inet`` or ``inet6``."""

    @property
    def bind(self) -> str:
        """The bind address that serves this socket (``fd://N``)."""
        return f"fd://{self.fd}"


def listen_fds(environ: MutableMapping[str, str] | None = None, *,
               unset: bool = True) -> list[InheritedSocket]:
    """The sockets passed to this process ([] when not socket-activated).

    Raises ActivationError when the variables are malformed or a descriptor is not a
    listening stream socket of a family meshd serves. ``unset`` removes the variables
    from ``environ`` (default: ``os.environ``) whatever the outcome.
    """
    env = os.environ if environ is None else environ
    values = {name: env.get(name) for name in _VARIABLES}
    if unset:
        for name in _VARIABLES:
            env.pop(name, None)
    return _parse(values)


def _parse(values: Mapping[str, str | None]) -> list[InheritedSocket]:
    pid, count = values["LISTEN_PID"], values["LISTEN_FDS"]
    if count is None:
        return []
    if pid is None or not pid.isdigit():
        raise ActivationError(f"LISTEN_FDS is set but LISTEN_PID is {pid!r}")
    if int(pid) != os.getpid():
        return []  # meant for another process (we were forked or exec'd by it)
    if not count.isdigit():
        raise ActivationError(f"LISTEN_FDS must be a number of descriptors, not {count!r}")
    n = int(count)
    names = (values["LISTEN_FDNAMES"] or "").split(":") if values["LISTEN_FDNAMES"] else []
    if names and len(names) != n:
        raise ActivationError(f"LISTEN_FDNAMES names {len(names)} descriptors, "
                              f"LISTEN_FDS says {n}")
    found: list[InheritedSocket] = []
    for i in range(n):
        fd = SD_LISTEN_FDS_START + i
        found.append(InheritedSocket(fd, names[i] if names else "unknown", _check(fd)))
        os.set_inheritable(fd, False)
    return found


def _check(fd: int) -> str:
    """The family of ``fd`` if it is a listening stream socket we serve; else raise."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ActivationError(f"inherited fd {fd} is not an open socket: {exc}") from exc
    try:
        if sock.type != socket.SOCK_STREAM:
            raise ActivationError(f"inherited fd {fd} is not a stream socket "
                                  "(meshd.socket must use ListenStream=)")
        if sock.family not in _FAMILIES:
            raise ActivationError(f"inherited fd {fd} has address family {sock.family!r}; "
                                  "meshd serves Unix and TCP sockets")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ActivationError(f"inherited fd {fd} is not listening "
                                  "(Accept=yes is not supported: use Accept=no)")
        return _FAMILIES[sock.family]
    finally:
        sock.detach()  # the descriptor stays open for the listener that serves it
