"""Per-daemon limits and timeouts, as one frozen object (the model side is
``RuntimeConfig``): what SIGHUP can replace while the daemon serves."""

from __future__ import annotations

from typing import Final

import attrs

from meshd.daemon.config.http import HttpConfig
from meshd.daemon.config.options import DEFAULT_MAX_QUEUE, DEFAULT_STREAM_INTERVAL_MS
from meshd.daemon.system.peercred import PeerPolicy
from meshd.protocol import DEFAULT_MAX_FRAME_SIZE

__all__ = ["DEFAULT_SHUTDOWN_GRACE_S", "ServerConfig"]

DEFAULT_SHUTDOWN_GRACE_S: Final = 30.0
"""Seconds running generations may go on after SIGTERM (systemd's stop timeout is 90)."""


@attrs.frozen
class ServerConfig:
    """Per-daemon limits and timeouts (the model side is ``RuntimeConfig``)."""

    max_tokens_default: int | None = None
    """``max_tokens`` of a request that sets none (the operator's cap on open-ended
    requests); ``None``: until the model stops or the context ends, as llama-server."""
    max_tokens_limit: int | None = None
    """Largest ``max_tokens`` accepted; ``None`` means the per-session context length."""
    seed: int | None = None
    """The seed of sampled requests that send none (None: a random one per request)."""
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    max_queue: int = DEFAULT_MAX_QUEUE
    """Generations waiting for a slot before new ones are answered ``busy``."""
    stream_interval_s: float = DEFAULT_STREAM_INTERVAL_MS / 1000
    """Tokens are streamed in batches at most this far apart (after the first token)."""
    max_requests_per_connection: int = 256
    """Concurrent requests one connection may have in flight before ``busy``."""
    hello_timeout_s: float = 10.0
    """A connection that does not say ``hello`` within this is closed."""
    idle_timeout_s: float = 300.0
    """After the handshake, a connection with no request in flight that sends no frame
    for this long is closed (each connection holds a file descriptor)."""
    frame_timeout_s: float = 30.0
    """A frame that has begun must be complete (newline) within this; else the client
    gets a ``bad_request`` error and the connection is closed."""
    max_connections: int = 1024
    """Open connections at once; one more is answered ``busy`` and closed."""
    backlog: int | None = None
    """Listen backlog; ``None`` takes the system's maximum (``net.core.somaxconn``)."""
    send_timeout_s: float = 60.0
    """A client that takes longer than this to accept one write is disconnected."""
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    """On shutdown, how long running generations may go on to finish normally; those
    still running then end with ``done`` and ``finish_reason: shutdown``."""
    drain_timeout_s: float = 10.0
    """On shutdown, how long cancelled generations get to end with ``done``."""
    worker_probe_s: float = 1.0
    """While a remote worker is lost, how often it is probed to reload the model."""
    peers: PeerPolicy = attrs.field(factory=PeerPolicy)
    """Which peers (by uid/gid from the socket's credentials) are served."""
    http: HttpConfig = attrs.field(factory=HttpConfig)
    """Limits and timeouts of HTTP connections (Unix socket and ``--http``)."""
