"""Ollama's API paths (``/api/...``): which method and handler serve each.

Why some are refused rather than missing: ``/api/pull``, ``/api/push``, ``/api/create``,
``/api/copy`` and ``/api/delete`` manage Ollama's model store, and meshd has none: it
serves the GGUF files its operator names (``meshd serve -m NAME=PATH``) and never
reaches the network. A client that calls them gets a 501 saying so, in Ollama's error
shape, rather than a 404 that reads like a wrong address. meshd computes no embeddings
(``/api/embed``), and says that too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

from meshd.daemon.frontends.http.ollama.generation import serve_chat, serve_generate
from meshd.daemon.frontends.http.ollama.models import ps, show, tags
from meshd.daemon.frontends.http.responder import Responder, RouteContext
from meshd.daemon.requests.api_errors import JSON, ApiError, json_bytes
from meshd.daemon.requests.service import server_version

__all__ = ["OLLAMA_API_VERSION", "PREFIX", "route"]

PREFIX: Final = "/api/"
OLLAMA_API_VERSION: Final = "0.12.0"
"""The Ollama release whose API meshd answers (``/api/version``): clients that check the
server's version for a feature (tools, structured outputs) see one that has it."""

Handler = Callable[[Any, bytes, Responder], Awaitable[None]]

_STORE: Final = ("meshd has no model store and never downloads: it serves the GGUF files "
                 "its operator names (meshd serve -m NAME=PATH); see /api/tags")


def _refused(what: str) -> Handler:
    async def refuse(_routes: RouteContext, _body: bytes, _out: Responder) -> None:
        raise ApiError(501, f"{what}: {_STORE}" if what else _STORE, code="not_implemented")
    return refuse


async def _no_embeddings(_routes: RouteContext, _body: bytes, _out: Responder) -> None:
    raise ApiError(501, "meshd serves text generation only: it computes no embeddings",
                   code="not_implemented")


async def _version(routes: RouteContext, _body: bytes, out: Responder) -> None:
    await out.send(200, json_bytes({"version": OLLAMA_API_VERSION,
                                    "meshd": server_version()}), JSON)


_ROUTES: Final[dict[str, tuple[str, Handler]]] = {
    "/api/chat": ("POST", serve_chat),
    "/api/generate": ("POST", serve_generate),
    "/api/tags": ("GET", tags),
    "/api/ps": ("GET", ps),
    "/api/show": ("POST", show),
    "/api/version": ("GET", _version),
    "/api/pull": ("POST", _refused("pulling a model is not supported")),
    "/api/push": ("POST", _refused("pushing a model is not supported")),
    "/api/create": ("POST", _refused("creating a model is not supported")),
    "/api/copy": ("POST", _refused("copying a model is not supported")),
    "/api/delete": ("DELETE", _refused("deleting a model is not supported")),
    "/api/embed": ("POST", _no_embeddings),
    "/api/embeddings": ("POST", _no_embeddings),
}


def _not_found(path: str) -> Handler:
    async def missing(_routes: RouteContext, _body: bytes, _out: Responder) -> None:
        raise ApiError(404, f"no endpoint {path}; meshd serves Ollama's /api/chat, "
                            "/api/generate, /api/tags, /api/ps, /api/show and /api/version",
                       code="not_found")
    return missing


def route(path: str, method: str) -> tuple[str, Handler]:
    """The method and handler of an ``/api/`` path (an unknown one answers a 404 in
    Ollama's shape, whatever the method)."""
    return _ROUTES.get(path) or (method, _not_found(path))
