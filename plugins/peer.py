"""Whether the process that connected as a plugin is the one its table pins.

Why: a connecting plugin names itself in ``plugin_hello``, and any local process that
can open the daemon's socket can send any name. A table with ``uid``/``gid`` pins the
plugin to a user and/or group, checked on the connection's ``SO_PEERCRED`` (the kernel's
record of the connecting process, which the peer cannot forge). The daemon reads the
credentials (``meshd.daemon.system.peercred``) and hands them here; this module only decides.
"""

from __future__ import annotations

from typing import Protocol

from .config import PluginConfig

__all__ = ["Peer", "pin_mismatch"]


class Peer(Protocol):
    """A connected process's credentials (``meshd.daemon.system.peercred.PeerCredentials``)."""

    @property
    def pid(self) -> int: ...

    @property
    def uid(self) -> int: ...

    @property
    def gid(self) -> int: ...

    @property
    def groups(self) -> frozenset[int]: ...


def pin_mismatch(config: PluginConfig, peer: Peer | None) -> str | None:
    """Why ``peer`` may not be ``config``'s plugin, or None when it may.

    An unpinned table admits anyone who can open the socket; a pinned one needs the
    credentials (none, e.g. on TCP: refused), the uid if pinned, and the gid if pinned
    as the primary or a supplementary group.
    """
    if not config.pinned:
        return None
    if peer is None:
        return "the connection's credentials cannot be read"
    if config.uid is not None and peer.uid != config.uid:
        return f"uid {peer.uid} is not the pinned uid {config.uid}"
    if config.gid is not None and config.gid != peer.gid and config.gid not in peer.groups:
        return f"gid {peer.gid} (and its groups) is not the pinned gid {config.gid}"
    return None
