"""Limits and timeouts of the HTTP side (part of ``ServerConfig``)."""

from __future__ import annotations

import attrs

__all__ = ["HttpConfig"]


@attrs.frozen
class HttpConfig:
    """What one HTTP connection may send and how long it may take.

    A client that is idle between requests longer than ``idle_timeout_s``, or takes
    longer than ``request_timeout_s`` from a request's first byte to its last (a
    slowloris sending headers a byte at a time), is disconnected.
    """

    max_header_bytes: int = 64 * 1024
    """Request line plus headers; more is answered 431."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Larger bodies are answered 413."""
    request_timeout_s: float = 30.0
    idle_timeout_s: float = 60.0
    api_key: str | None = attrs.field(default=None, repr=False)  # never in a log line
    """The TCP listener's Bearer key (None: none asked; the Unix socket never asks)."""
    cors_origins: tuple[str, ...] = ()
    """Web origins whose pages may read the answers (``*``: any); none by default."""
    slots_endpoint: bool = True
    """Serve llama-server's ``GET /slots`` (each slot's state; no prompt text)."""
    verbose_responses: bool = False
    """Non-streamed chat and completion answers carry llama-server's ``__verbose`` block
    (the prompt as the model read it) unless a request says ``verbose: false``."""
