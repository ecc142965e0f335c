"""What a route sees of the connection and of the routing table.

Why a module of its own: ``routes`` dispatches to ``completions``, and ``completions``
answers through these two interfaces; keeping them here lets the two modules import in
one direction only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from structlog.typing import FilteringBoundLogger

from meshd.daemon.requests.service import Service

__all__ = ["Responder", "RouteContext"]


class Responder(Protocol):
    """How a route answers (the HTTP connection implements it)."""

    async def send(self, status: int, body: bytes, content_type: str,
                   headers: Sequence[tuple[str, str]] = ()) -> bool: ...

    async def start(self, status: int, content_type: str,
                    headers: Sequence[tuple[str, str]] = ()) -> bool: ...

    async def write(self, data: bytes) -> bool: ...

    async def end(self) -> bool: ...

    def on_gone(self, callback: Callable[[], None]) -> None: ...


class RouteContext(Protocol):
    """What an endpoint needs of the routing table (``Routes`` implements it)."""

    @property
    def service(self) -> Service: ...

    @property
    def log(self) -> FilteringBoundLogger: ...

    @property
    def owner(self) -> str:
        """Who asked (``uid:N`` on the socket, the API key's hash over TCP; empty:
        unknown): whose streams it sees and whose earlier answers it drafts from."""
        ...
