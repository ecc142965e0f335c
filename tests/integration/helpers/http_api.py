"""Helpers for the HTTP tests: a daemon in the test's event loop with an httpx client (and
the official openai client) on its Unix socket, and raw HTTP over that socket."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
import openai

from meshd.daemon.commands.server import Server
from meshd.daemon.config.http import HttpConfig
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.requests.service import ServerConfig
from meshd.protocol import StreamReceiver

from .daemon import running_daemon


@asynccontextmanager
async def http_daemon(rt: ModelRuntime, http: HttpConfig | None = None
                      ) -> AsyncIterator[tuple[Server, str, httpx.AsyncClient]]:
    config = ServerConfig(http=http or HttpConfig())
    async with running_daemon(rt, config) as (server, path):
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://meshd",
                                     timeout=60) as client:
            yield server, path, client


def openai_client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://meshd/v1", api_key="unused",
                              http_client=http, max_retries=0)


async def raw_exchange(path: str, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection (while reading: the daemon may answer and
    close before it has all of it) and read until the daemon closes the connection (or
    ``timeout``); returns everything received."""
    stream = await anyio.connect_unix(path)
    receiver = StreamReceiver(stream)
    got = bytearray()

    async def send() -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError,
                                 OSError):
            await stream.send(data)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with anyio.move_on_after(timeout):
                while True:
                    try:
                        got += await receiver.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
            tg.cancel_scope.cancel()
    finally:
        await receiver.aclose()
    return bytes(got)


def status_of(response: bytes) -> int:
    """The status code of the first response in ``response`` (0 when there is none)."""
    if not response.startswith(b"HTTP/1."):
        return 0
    return int(response.split(b" ", 2)[1])
