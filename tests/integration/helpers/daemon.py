"""Helpers for the socket-level daemon tests: a daemon in the test's event loop, raw
connections for malformed input, and in-process reference generations."""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc

from meshd.clients import ctl
from meshd.daemon.commands.server import Server, serving
from meshd.daemon.engine.sampling import GREEDY, SamplingParams
from meshd.daemon.models.model_set import ModelSet
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.protocol import (
    PROTOCOL_VERSION,
    Client,
    Done,
    ErrorMessage,
    Hello,
    Message,
    ProtocolError,
    Response,
    ResponseDecoder,
    StreamReceiver,
    Welcome,
    encode,
)
from meshd.testing import testmodels


def short_tempdir() -> str:
    """Unix socket paths are limited to ~108 bytes: keep them under /tmp."""
    return tempfile.mkdtemp(dir="/tmp", prefix="mdt")


@asynccontextmanager
async def running_daemon(
    runtime: ModelRuntime | ModelSet, config: ServerConfig | None = None
) -> AsyncIterator[tuple[Server, str]]:
    """A daemon on a fresh socket in the current event loop; yields (server, path)."""
    directory = short_tempdir()
    path = os.path.join(directory, "s")
    try:
        async with serving(runtime, path, config) as server:
            yield server, path
        assert not os.path.exists(path), "the socket file outlived the daemon"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def wait_idle(server: Server, timeout: float = 10.0) -> None:
    """Wait until the daemon has nothing in flight (cancellations are asynchronous)."""
    with anyio.fail_after(timeout):
        while (server.scheduler.active or server.scheduler.queued
               or server.service.n_inflight):
            await anyio.sleep(0.01)


def assert_no_leaks(server: Server) -> None:
    rt = server.runtime
    assert server.scheduler.active == 0 and server.scheduler.queued == 0
    assert server.service.n_inflight == 0
    assert rt.idle_slots == rt.context.config.n_seq_max, "a session slot leaked"


async def assert_serves(path: str, prompt: str = "still alive") -> None:
    """Another client is served normally (the daemon survived whatever came before)."""
    async with Client.connect(path, client_name="bystander") as client:
        assert (await client.health()).status.value == "ok"
        completion = await client.generate(prompt, max_tokens=4, temperature=0.0).collect()
        assert completion.done.finish_reason.value == "length"
        assert len(completion.token_ids) == 4


def reference(runtime: ModelRuntime, prompt: Sequence[int], *, max_tokens: int,
              proposer: str | None = "off", sampling: SamplingParams = GREEDY,
              stop: Sequence[str] = ()) -> tuple[list[int], str, str]:
    """In-process generation (no daemon): (tokens, text, finish reason).

    Call only while no daemon runs a step on the same runtime (one context, one thread).
    """
    gen = runtime.generation(list(prompt), max_tokens=max_tokens, sampling=sampling,
                             stop=stop, proposer=proposer)
    for _ in runtime.run(gen):
        pass
    assert gen.finish is not None
    return list(gen.committed), gen.text, gen.finish.value


class RawConnection:
    """Frames in and out without the client library's checks (for malformed input)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.receiver = StreamReceiver(stream)
        self.decoder = ResponseDecoder(64 * 1024 * 1024)
        self.ready: collections.deque[Response | ProtocolError] = collections.deque()
        self.eof = False

    @classmethod
    @asynccontextmanager
    async def open(cls, path: str, *, hello: bool = True) -> AsyncIterator[RawConnection]:
        stream = await anyio.connect_unix(path)
        conn = cls(stream)
        try:
            if hello:
                await conn.send(Hello(id="h0", protocol_version=PROTOCOL_VERSION,
                                      client_name="raw-test"))
                welcome = await conn.recv()
                assert isinstance(welcome, Welcome), welcome
            yield conn
        finally:
            await conn.receiver.aclose()

    async def send(self, data: bytes | Message) -> None:
        await self.stream.send(data if isinstance(data, bytes) else encode(data))

    async def send_json_line(self, line: str) -> None:
        await self.stream.send(line.encode() + b"\n")

    async def recv(self, timeout: float = 10.0) -> Response | None:
        """The next frame (decode errors raise), or None once the daemon closed."""
        with anyio.fail_after(timeout):
            while not self.ready:
                if self.eof:
                    return None
                try:
                    data = await self.receiver.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    self.decoder.feed_eof()
                    self.eof = True
                else:
                    self.decoder.feed(data)
                self.ready.extend(self.decoder.drain())
            item = self.ready.popleft()
        if isinstance(item, ProtocolError):
            raise AssertionError(f"the daemon sent an invalid frame: {item!r}")
        return item

    async def error(self, timeout: float = 10.0) -> ErrorMessage:
        frame = await self.recv(timeout)
        assert isinstance(frame, ErrorMessage), frame
        return frame

    async def until_final(self, request_id: str, timeout: float = 30.0) -> list[Any]:
        """Frames up to and including ``request_id``'s done/error (others are kept too)."""
        frames: list[Any] = []
        with anyio.fail_after(timeout):
            while True:
                frame = await self.recv(timeout)
                assert frame is not None, "connection closed before the final frame"
                frames.append(frame)
                if frame.id == request_id and isinstance(frame, Done | ErrorMessage):
                    return frames


async def meshctl(*argv: str) -> int:
    """Run meshctl with ``argv`` in this process, off the event loop; its exit status."""
    return await anyio.to_thread.run_sync(ctl.main, list(argv))


class KindRuntimes:
    """Runtimes by model kind for one test module, each made on first use: ``smol`` is
    the default SmolLM2, the others synthetic (``qwen35``, ``mimo2``, ``llama``) at
    ``acceptance``; a ``-ckpt`` suffix turns in-place rollback off (restore-and-replay)."""

    def __init__(self, *, acceptance: float, **config: Any) -> None:
        self.acceptance = acceptance
        self.config = config
        self._made: dict[str, ModelRuntime] = {}

    def __call__(self, kind: str) -> ModelRuntime:
        if kind not in self._made:
            base = kind.removesuffix("-ckpt")
            path = None if base == "smol" else str(testmodels.test_model_path(
                base, acceptance=self.acceptance))
            self._made[kind] = ModelRuntime(RuntimeConfig(
                model_path=path, in_place_rollback=not kind.endswith("-ckpt"), **self.config))
        return self._made[kind]

    def close(self) -> None:
        for rt in self._made.values():
            rt.close()
        self._made.clear()
