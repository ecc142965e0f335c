"""Who may use the TCP listener, and which web pages may read its answers.

Why only TCP needs a key: the Unix socket knows its peer (SO_PEERCRED and the
allow-lists), a TCP connection from the loopback does not, so any local user or a web
page's script could send it requests. ``api_key`` closes that (OpenAI's ``Authorization:
Bearer KEY``, or Anthropic's ``X-Api-Key: KEY``); ``/health`` stays open for probes.
CORS: a browser shows a local web UI the answers only when ``Access-Control-Allow-Origin``
names its origin (``localhost`` allows any page served from this machine's loopback
names, any port); both are off by default.
"""

from __future__ import annotations

import hmac
import urllib.parse
from collections.abc import Mapping, Sequence

__all__ = ["authorized", "cors_headers", "preflight_headers"]

#: Paths served without the key (liveness probes).
OPEN_PATHS = frozenset({"/health"})
#: The ``cors_origins`` entry that allows every loopback origin, and the names it covers.
LOCALHOST = "localhost"
_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def authorized(headers: Mapping[bytes, bytes], api_key: str | None, path: str) -> bool:
    """Whether the request may be served: no key set, an open path, or the right
    ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY`` (compared in constant time)."""
    if not api_key or path in OPEN_PATHS:
        return True
    key = api_key.encode()
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
        return True
    return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), key)


def _loopback(origin: str) -> bool:
    """Whether ``origin`` is a page served from a loopback name (http or https, any port)."""
    try:
        parsed = urllib.parse.urlsplit(origin)
        host = parsed.hostname
        _ = parsed.port  # a malformed port makes it no origin at all
    except ValueError:
        return False
    return parsed.scheme in ("http", "https") and host in _LOOPBACK_HOSTS


def cors_headers(origin: bytes | None, allowed: Sequence[str]) -> list[tuple[str, str]]:
    """The CORS headers of an answer to ``origin`` (none when it is not allowed)."""
    if origin is None or not allowed:
        return []
    text = origin.decode("latin-1")
    if "*" in allowed:
        return [("Access-Control-Allow-Origin", "*")]
    if text in allowed or (LOCALHOST in allowed and _loopback(text)):
        return [("Access-Control-Allow-Origin", text), ("Vary", "Origin")]
    return []


def preflight_headers(origin: bytes | None, allowed: Sequence[str]) -> list[tuple[str, str]]:
    """The headers a browser's ``OPTIONS`` preflight gets beside :func:`cors_headers`
    (empty: not allowed)."""
    if not cors_headers(origin, allowed):
        return []
    return [("Access-Control-Allow-Methods", "GET, POST, OPTIONS"),
            ("Access-Control-Allow-Headers", "Authorization, Content-Type"),
            ("Access-Control-Max-Age", "600")]
