"""Who is on the other end of a Unix socket, and whether the daemon serves them.

Why check peer credentials when the socket file is already 0660 in a 0750 directory:
file permissions are set once by whoever creates the socket (systemd, an admin's
tmpfiles rule, a shell with another umask) and a mistake there opens the daemon to every
local user. The kernel's record of the connecting process (``SO_PEERCRED``: its pid, uid
and primary gid; ``SO_PEERGROUPS``: its supplementary groups) cannot be forged by the
peer, so an allow-list checked on it holds whatever the file's mode is.

Root and the daemon's own user are always allowed (they can read its memory anyway).
With no allow-list configured, every peer that can open the socket is served.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from collections.abc import Iterable
from typing import Final

import attrs

__all__ = ["PeerCredentials", "PeerPolicy", "peer_credentials", "resolve_gid", "resolve_uid"]

_SO_PEERGROUPS: Final = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
_UCRED: Final = struct.Struct("3i")
_MAX_GROUPS: Final = 256  # Python caps getsockopt buffers at 1024 bytes


@attrs.frozen
class PeerCredentials:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()
    """Supplementary groups (empty when the kernel cannot tell)."""


def peer_credentials(sock: socket.socket) -> PeerCredentials | None:
    """The connected peer's credentials; None for a socket that has none (TCP)."""
    if sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    groups: frozenset[int] = frozenset()
    try:
        buf = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_GROUPS)
        groups = frozenset(struct.unpack(f"{len(buf) // 4}I", buf[: len(buf) // 4 * 4]))
    except OSError:
        pass
    return PeerCredentials(pid=pid, uid=uid, gid=gid, groups=groups)


@attrs.frozen
class PeerPolicy:
    """Which peers the daemon serves. Empty lists: everyone who can open the socket."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    @property
    def restricted(self) -> bool:
        return bool(self.uids or self.gids)

    def allows(self, peer: PeerCredentials | None) -> bool:
        if not self.restricted:
            return True
        if peer is None:  # not a Unix socket: other listeners decide for themselves
            return True
        if peer.uid in (0, os.getuid()) or peer.uid in self.uids:
            return True
        return bool(({peer.gid} | peer.groups) & self.gids)

    @classmethod
    def from_names(cls, users: Iterable[int | str], groups: Iterable[int | str]) -> PeerPolicy:
        """Build from uids/user names and gids/group names (ValueError names the bad one)."""
        return cls(frozenset(resolve_uid(u) for u in users),
                   frozenset(resolve_gid(g) for g in groups))


def resolve_uid(user: int | str) -> int:
    if isinstance(user, int) or user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise ValueError(f"no such user {user!r}") from None


def resolve_gid(group: int | str) -> int:
    if isinstance(group, int) or group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"no such group {group!r}") from None
