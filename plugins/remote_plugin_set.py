"""Every out-of-process plugin of one daemon: set up from config, registered, counted.

Why a collection: the daemon has one place to start the spawned plugins, to hand a
connection that opened with ``plugin_hello`` to the plugin of that name, to report every
plugin's counters in ``stats`` and to stop them all on shutdown.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable, Mapping, Sequence

import structlog

from meshd.protocol.plugin import PluginHello, PluginProtocolError, decode_plugin
from meshd.protocol.plugin_channel import ChannelClosed, PluginChannel, SendTimeout

from .base import ModelDescription
from .config import PluginConfig
from .peer import Peer
from .registry import Registry
from .remote_plugin import PluginHost, PluginRefused, refuse
from .resources import TokenizerLike

log = structlog.get_logger("meshd.plugins.remote_plugin_set")


class PluginHosts:
    """The daemon's out-of-process plugins, by name."""

    def __init__(self, configs: Iterable[PluginConfig], *, model: ModelDescription,
                 eog: Sequence[int], tokenizer: TokenizerLike | None) -> None:
        self.hosts: dict[str, PluginHost] = {
            c.name: PluginHost(c, model=model, eog=eog, tokenizer=tokenizer)
            for c in configs if c.out_of_process and c.enabled
        }

    def __bool__(self) -> bool:
        return bool(self.hosts)

    def register_into(self, registry: Registry) -> None:
        """Make every plugin a proposer name (requests may name it before it is up)."""
        for name, host in self.hosts.items():
            registry.register(name, host.factory(), replace=True)

    def start(self, *, wait: bool = True) -> None:
        """Spawn every plugin that has a ``command`` (waiting for their set-up)."""
        for host in self.hosts.values():
            host.start(wait=wait)

    def adopt(self, sock: socket.socket, first_frame: bytes, buffered: bytes = b"", *,
              peer: Peer | None = None) -> str:
        """Take over a connection whose first frame was ``plugin_hello``; blocking.

        ``peer``: the connection's SO_PEERCRED credentials (checked against a table's
        ``uid``/``gid`` pin). Returns the plugin's name; raises PluginRefused (after
        sending the plugin a ``plugin_reject`` with the code) and closes the socket on
        any failure.
        """
        channel = PluginChannel(sock, buffered=buffered)
        name = None
        try:
            hello = decode_plugin(first_frame)
            if not isinstance(hello, PluginHello):
                raise PluginRefused("the first frame must be plugin_hello")
            name = hello.name
            host = self.hosts.get(hello.name)
            if host is None:
                raise PluginRefused(f"no plugin {hello.name!r} is configured to connect",
                                    "not_configured")
            host.adopt(channel, hello, peer)
            log.info("plugin_connected", plugin=hello.name,
                     **({"pid": peer.pid, "uid": peer.uid} if peer is not None else {}))
            return hello.name
        except (PluginRefused, ChannelClosed, SendTimeout, PluginProtocolError) as exc:
            refused = exc if isinstance(exc, PluginRefused) else PluginRefused(str(exc))
            refuse(channel, refused)
            channel.close()
            log.warning("plugin_refused", plugin=name, code=refused.code,
                        error=f"{type(exc).__name__}: {exc}",
                        **({"pid": peer.pid, "uid": peer.uid, "gid": peer.gid}
                           if peer is not None else {}))
            if refused is exc:
                raise
            raise refused from exc

    def connected(self) -> bool:
        """Whether a plugin that connected to the daemon is linked now (it would not
        come back by itself if its model were unloaded)."""
        return any(h.link is not None and h.config.connect for h in self.hosts.values())

    def counters(self) -> Mapping[str, int]:
        out: dict[str, int] = {}
        for name, host in sorted(self.hosts.items()):
            out.update(host.counters.flat(name))
            out[f"plugin.{name}.up"] = int(host.link is not None)
            out[f"plugin.{name}.quarantined"] = int(host.quarantined)
        return out

    def close(self) -> None:
        for host in self.hosts.values():
            host.close()


def is_plugin_hello(frame: bytes) -> bool:
    """Whether a connection's first frame is a plugin's ``plugin_hello``."""
    if b"plugin_hello" not in frame:
        return False
    try:
        obj = json.loads(frame)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and obj.get("op") == "plugin_hello"
