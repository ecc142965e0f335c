"""Where the daemon listens: stale sockets replaced, live ones and other files refused,
permissions 0660, the socket removed on shutdown, inherited sockets (fd://N) served."""

from __future__ import annotations

import os
import shutil
import socket
import stat
from collections.abc import Iterator

import anyio
import pytest

from meshd.daemon.commands.server import Server
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.system.listener import (
    BindSpec,
    ListenerError,
    default_socket_path,
    open_listener,
    preflight,
)
from meshd.protocol import Client
from meshd.testing import testmodels
from tests.integration.helpers.daemon import short_tempdir

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sock_dir() -> Iterator[str]:
    directory = short_tempdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=1,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


def test_bind_spec_parsing() -> None:
    assert BindSpec.parse("unix:/run/x.sock") == BindSpec(path="/run/x.sock")
    assert BindSpec.parse("/run/x.sock") == BindSpec(path="/run/x.sock")
    assert BindSpec.parse("fd://3") == BindSpec(fd=3)
    assert str(BindSpec(fd=3)) == "fd://3" and str(BindSpec(path="/a")) == "unix:/a"
    for bad in ("fd://x", "unix:", "fd://"):
        with pytest.raises(ValueError):
            BindSpec.parse(bad)


def test_default_socket_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path() == "/run/user/1000/meshd/meshd.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    expected = ("/run/meshd/meshd.sock" if os.getuid() == 0
                else f"/tmp/meshd-{os.getuid()}/meshd.sock")
    assert default_socket_path() == expected
    # Under systemd, RuntimeDirectory= wins (its first entry when it names several).
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/meshd:/run/other")
    assert default_socket_path() == "/run/meshd/meshd.sock"


async def test_socket_mode_and_removal_on_close(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "sub", "s")  # the directory is created too
    listener = await open_listener(path)
    async with listener:
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert listener.address == f"unix:{path}"
    assert not os.path.exists(path)


async def test_stale_socket_is_replaced(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "s")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays behind, nobody listens: a crashed daemon
    assert os.path.exists(path)
    async with await open_listener(path) as listener:
        stream = await anyio.connect_unix(path)
        accepted = await listener.accept()
        await stream.aclose()
        await accepted.aclose()


async def test_live_socket_and_other_files_are_refused(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "s")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen()
    try:
        with pytest.raises(ListenerError, match="already listening"):
            await open_listener(path)
        assert os.path.exists(path)  # untouched
    finally:
        live.close()
    regular = os.path.join(sock_dir, "file")
    with open(regular, "w") as f:
        f.write("precious")
    with pytest.raises(ListenerError, match="not a socket"):
        await open_listener(regular)
    with open(regular) as f:
        assert f.read() == "precious"
    with pytest.raises(ListenerError, match=r"not a directory|cannot create"):
        await open_listener(os.path.join(regular, "s"))


async def test_inherited_listening_socket(sock_dir: str, runtime: ModelRuntime) -> None:
    path = os.path.join(sock_dir, "activated")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen()
    fd = sock.detach()  # as systemd would hand it over
    server = Server(runtime)
    async with anyio.create_task_group() as tg:
        address = await tg.start(server.serve, f"fd://{fd}")
        assert address == f"fd://{fd}"
        async with Client.connect(path) as client:
            assert (await client.health()).status.value == "ok"
        server.shutdown()
    assert os.path.exists(path)  # not ours to remove
    with pytest.raises(OSError):
        os.fstat(fd)  # but the socket itself was closed


async def test_fd_that_is_not_a_listening_socket(sock_dir: str) -> None:
    with open(os.path.join(sock_dir, "f"), "w") as f, pytest.raises(ListenerError):
        await open_listener(f"fd://{f.fileno()}")
    a, b = socket.socketpair()
    try:
        with pytest.raises(ListenerError, match="not a listening socket"):
            await open_listener(f"fd://{a.fileno()}")
    finally:
        a.close()
        b.close()


async def test_daemon_refuses_a_socket_in_use(sock_dir: str, runtime: ModelRuntime) -> None:
    path = os.path.join(sock_dir, "s")
    first = Server(runtime)
    async with anyio.create_task_group() as tg:
        await tg.start(first.serve, path)
        second = Server(runtime)
        with pytest.raises(ListenerError, match="already listening"):
            await second.serve(path)
        async with Client.connect(path) as client:  # the first one is unharmed
            assert (await client.health()).status.value == "ok"
        first.shutdown()
    assert not os.path.exists(path)


def test_preflight_checks_without_touching(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "s")
    preflight(path)  # nothing there: fine
    preflight("fd://3")  # nothing to check for inherited sockets
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen()
    try:
        with pytest.raises(ListenerError, match="already listening"):
            preflight(path)
    finally:
        live.close()
    preflight(path)  # stale now: open_listener would replace it
    assert os.path.exists(path)
    with pytest.raises(ListenerError, match="bad bind address"):
        preflight("fd://x")
