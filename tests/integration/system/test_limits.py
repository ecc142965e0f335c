"""Limits a hostile or busy client meets: replies never exceed the frame limit, busy
refusals are counted once, idle and stalled connections are closed, the connection
limit answers ``busy``, and the listen backlog takes a burst of connects."""

from __future__ import annotations

import errno
import os
import shutil
import socket
from collections.abc import Iterator

import anyio
import pytest

from meshd.daemon.commands.cli import build_parser
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.daemon.system.listener import open_listener, system_backlog
from meshd.protocol import (
    Client,
    Done,
    ErrorCode,
    ErrorMessage,
    FrameTooLarge,
    Generate,
    Health,
    HealthReply,
    SamplingParams,
    ServerBusy,
    Stats,
    StatsReply,
)
from meshd.testing import testmodels
from tests.integration.helpers.daemon import (
    RawConnection,
    assert_no_leaks,
    assert_serves,
    running_daemon,
    short_tempdir,
    wait_idle,
)

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    assert rt.idle_slots == 2
    rt.close()


async def test_a_reply_larger_than_the_frame_limit_is_refused(runtime: ModelRuntime) -> None:
    """A legal tokenize whose token list would not fit one frame gets ``too_large`` (the
    client could not read the reply), and the connection goes on."""
    limit = 16 * 1024
    async with running_daemon(runtime, ServerConfig(max_frame_size=limit)) as (server, path):
        async with Client.connect(path, max_frame_size=limit) as client:
            text = "a1 " * (limit // 4)  # fits a request frame; its reply does not
            with pytest.raises(FrameTooLarge, match=f"above the frame limit of {limit}"):
                await client.tokenize(text)
            assert len(await client.tokenize("a1 " * 100)) > 0  # the same connection
        stats = server.service.stats(Stats(id="s")).counters
        assert stats["errors_too_large"] == 1


async def test_errors_busy_counts_each_busy_frame_once(runtime: ModelRuntime) -> None:
    config = ServerConfig(max_queue=1)
    async with running_daemon(runtime, config) as (server, path):
        async with RawConnection.open(path) as raw:
            ids = [f"g{i}" for i in range(12)]
            for rid in ids:
                await raw.send(Generate(id=rid, prompt="hello", max_tokens=40, sampling=GREEDY))
            finals: dict[str, object] = {}
            with anyio.fail_after(60):
                while len(finals) < len(ids):
                    frame = await raw.recv(60)
                    if isinstance(frame, Done | ErrorMessage):
                        finals[frame.id or ""] = frame
            busy = sum(isinstance(f, ErrorMessage) and f.code is ErrorCode.BUSY
                       for f in finals.values())
            assert busy >= 1  # 2 slots + 1 queue place for 12 requests
            await raw.send(Stats(id="stats"))
            reply = await raw.recv()
            assert isinstance(reply, StatsReply)
            assert reply.counters["errors_busy"] == busy
        await wait_idle(server)
        assert_no_leaks(server)


async def test_an_idle_connection_is_closed_after_the_idle_timeout(runtime: ModelRuntime) -> None:
    config = ServerConfig(idle_timeout_s=1.0)
    async with running_daemon(runtime, config) as (server, path):
        async with RawConnection.open(path) as raw:
            # Requests keep it open: a health check every 0.1 s for 1.5 s (> the timeout).
            for i in range(15):
                await raw.send(Health(id=f"h{i}"))
                assert isinstance(await raw.recv(), HealthReply)
                await anyio.sleep(0.1)
            assert await raw.recv(timeout=30) is None  # then silence: closed, no frame
        await assert_serves(path)
        with anyio.fail_after(10):
            while server.connections:
                await anyio.sleep(0.05)


async def test_a_stalled_partial_frame_gets_an_error_and_a_close(runtime: ModelRuntime) -> None:
    """One byte now and then is not idle, but a frame must end within the frame timeout."""
    config = ServerConfig(frame_timeout_s=0.5, idle_timeout_s=600)
    async with running_daemon(runtime, config) as (_, path):
        async with RawConnection.open(path) as raw:
            with anyio.fail_after(30):
                for byte in b'{"op":"health","id":"slow"':
                    try:
                        await raw.send(bytes([byte]))
                    except (anyio.BrokenResourceError, OSError):
                        break
                    await anyio.sleep(0.1)
                error = await raw.error(timeout=30)
                assert (error.code, error.id) == (ErrorCode.BAD_REQUEST, None)
                assert "not completed within" in error.message
                assert await raw.recv(timeout=30) is None
        await assert_serves(path)


async def test_connections_beyond_the_limit_get_busy(runtime: ModelRuntime) -> None:
    config = ServerConfig(max_connections=2)
    async with running_daemon(runtime, config) as (server, path):
        async with RawConnection.open(path), RawConnection.open(path):
            with pytest.raises(ServerBusy, match="too many connections"):
                async with Client.connect(path):
                    pass
        with anyio.fail_after(10):
            while server.connections:
                await anyio.sleep(0.05)
        await assert_serves(path)
        counters = server.service.stats(Stats(id="s")).counters
        assert counters["connections_refused"] == 1 and counters["errors_busy"] == 1


def _connect_all(path: str, n: int) -> int:
    """Connect ``n`` non-blocking sockets without the server accepting; how many got in."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            socks.append(s)
            try:
                s.connect(path)
            except BlockingIOError:  # EAGAIN: the backlog is full
                return len(socks) - 1
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    return len(socks) - 1
                raise
        return n
    finally:
        for s in socks:
            s.close()


async def test_the_listen_backlog_takes_a_burst_of_connects() -> None:
    with open("/proc/sys/net/core/somaxconn") as f:
        assert system_backlog() == int(f.read())
    burst = min(300, system_backlog() - 1)
    directory = short_tempdir()
    try:
        default_path = os.path.join(directory, "default")
        async with await open_listener(default_path):
            assert await anyio.to_thread.run_sync(_connect_all, default_path, burst) == burst
        small_path = os.path.join(directory, "small")
        async with await open_listener(small_path, backlog=8):
            assert await anyio.to_thread.run_sync(_connect_all, small_path, burst) < 20
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_serve_takes_the_limits_as_options() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--max-connections", "8", "--idle-timeout", "2.5",
                              "--frame-timeout", "0.5", "--backlog", "64"])
    assert (args.max_connections, args.idle_timeout, args.frame_timeout, args.backlog) \
        == (8, 2.5, 0.5, 64)
    defaults = parser.parse_args(["serve"])
    config = ServerConfig()
    assert (defaults.max_connections, defaults.idle_timeout, defaults.frame_timeout,
            defaults.backlog) == (config.max_connections, config.idle_timeout_s,
                                  config.frame_timeout_s, None)
    for bad in (["--idle-timeout", "0"], ["--frame-timeout", "-1"], ["--backlog", "0"],
                ["--max-connections", "0"], ["--idle-timeout", "inf"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])
