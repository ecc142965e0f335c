"""meshctl finds the daemon by one search order: ``--socket``, ``$MESHD_SOCKET``, the
user's default, the systemd service's ``/run/meshd/meshd.sock`` (a temporary directory
stands in for ``/run`` here)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
from structlog.testing import capture_logs

from meshd.clients import ctl, socket_path
from meshd.clients.socket_path import find_socket, socket_candidates
from meshd.daemon.commands.server import serving
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.testing import testmodels
from tests.integration.helpers.daemon import meshctl, short_tempdir


@pytest.fixture
def places(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """(the user's default socket, the system socket), both in fresh directories that
    exist, neither socket there yet; the environment names neither."""
    user_dir, system_dir = short_tempdir(), short_tempdir()
    system = os.path.join(system_dir, "meshd.sock")
    monkeypatch.setattr(socket_path, "SYSTEM_SOCKET_PATH", system)
    monkeypatch.setenv("XDG_RUNTIME_DIR", user_dir)
    for name in ("MESHD_SOCKET", "RUNTIME_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    os.mkdir(os.path.join(user_dir, "meshd"))
    yield os.path.join(user_dir, "meshd", "meshd.sock"), system
    for path in (os.path.join(user_dir, "meshd", "meshd.sock"), system):
        if os.path.exists(path):
            os.unlink(path)
    os.rmdir(os.path.join(user_dir, "meshd"))
    os.rmdir(user_dir)
    os.rmdir(system_dir)


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def test_search_order(places: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    user, system = places
    assert socket_candidates() == [user, system]
    assert find_socket() == user  # nothing exists: the user's default, for the message
    _touch(system)
    assert find_socket() == system  # only the system service runs
    _touch(user)
    assert find_socket() == user  # the user's own daemon comes first
    monkeypatch.setenv("MESHD_SOCKET", "/elsewhere/env.sock")  # used even if missing
    assert find_socket() == "/elsewhere/env.sock"
    assert find_socket("unix:/given.sock") == "/given.sock"  # --socket beats them all


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=1,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_meshctl_finds_the_system_daemon(places: tuple[str, str], runtime: ModelRuntime,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A daemon on the systemd service's path answers a bare ``meshctl health``; with
    none anywhere, the error names every place meshctl looked."""
    user, system = places
    assert await meshctl("health") == ctl.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert f"no daemon at {user}" in err and system in err
    with capture_logs():
        async with serving(runtime, system):
            assert await meshctl("health") == ctl.EXIT_OK
    assert capsys.readouterr().out.startswith("ok uptime=")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_meshctl_socket_prints_the_path_for_http_clients(
        places: tuple[str, str], runtime: ModelRuntime,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``meshctl socket`` prints where meshctl looks (the docs' ``curl --unix-socket
    "$(meshctl socket)"``, as root and as a user), exit 5 while no daemon listens."""
    user, system = places
    assert await meshctl("socket") == ctl.EXIT_UNAVAILABLE
    printed = capsys.readouterr()
    assert printed.out == f"{user}\n" and f"no daemon at {user}" in printed.err
    with capture_logs():
        async with serving(runtime, system):
            assert await meshctl("socket") == ctl.EXIT_OK
            path = capsys.readouterr().out.strip()
            assert path == system
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path),
                                         base_url="http://meshd") as http:
                assert (await http.get("/health")).status_code == 200
