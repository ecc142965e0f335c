"""Who may use the TCP listener, and which web pages may read its answers.

Why only TCP needs a key: the Unix socket knows its peer (SO_PEERCRED and the
allow-lists), a TCP connection from the loopback does not, so any local user or a web
page's script could send it requests. ``api_key`` closes that (OpenAI's ``Authorization:
Bearer KEY``); ``/health`` stays open for probes. CORS: a browser shows a local web UI
the answers only when ``Access-Control-Allow-Origin`` names its origin; both are off by
default.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

__all__ = ["authorized", "cors_headers", "preflight_headers"]

#: Paths served without the key (liveness probes).
OPEN_PATHS = frozenset({"/health"})


def authorized(headers: Mapping[bytes, bytes], api_key: str | None, path: str) -> bool:
    """Whether the request may be served: no key set, an open path, or the right
    ``Authorization: Bearer KEY`` (compared in constant time)."""
    if not api_key or path in OPEN_PATHS:
        return True
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              api_key.encode())


def cors_headers(origin: bytes | None, allowed: Sequence[str]) -> list[tuple[str, str]]:
    """The CORS headers of an answer to ``origin`` (none when it is not allowed)."""
    if origin is None or not allowed:
        return []
    text = origin.decode("latin-1")
    if "*" in allowed:
        return [("Access-Control-Allow-Origin", "*")]
    if text in allowed:
        return [("Access-Control-Allow-Origin", text), ("Vary", "Origin")]
    return []


def preflight_headers(origin: bytes | None, allowed: Sequence[str]) -> list[tuple[str, str]]:
    """The answer to a browser's ``OPTIONS`` preflight (empty: not allowed)."""
    base = cors_headers(origin, allowed)
    if not base:
        return []
    return [*base, ("Access-Control-Allow-Methods", "GET, POST, OPTIONS"),
            ("Access-Control-Allow-Headers", "Authorization, Content-Type"),
            ("Access-Control-Max-Age", "600")]
