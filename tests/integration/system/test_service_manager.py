"""``meshd serve`` as a service manager runs it, as a real child process: the notify
sequence (STATUS while loading, READY=1, WATCHDOG=1 at the interval, STOPPING=1), socket
activation with an inherited listening socket, SIGTERM during a long generation, and
peer credentials checked against the allow-list."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.protocol import PROTOCOL_VERSION
from meshd.testing import testmodels
from tests.integration.helpers.daemon import short_tempdir
from tests.integration.helpers.processes import (
    NotifySocket,
    Wire,
    daemon_env,
    log_events,
    reaped,
    start,
    stop,
    wait_for_socket,
)

WATCHDOG_USEC = 300_000  # pings every 0.15 s


@pytest.fixture
def workdir() -> Iterator[str]:
    directory = short_tempdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _synthetic() -> str:
    return str(testmodels.test_model_path("llama"))


def _serve_args(socket_path: str | None, *extra: str, model: str | None = None) -> list[str]:
    args = ["--threads", "1", "--slots", "1", "--ctx", "512", "--draft-max", "4"]
    if socket_path is not None:
        args += ["--socket", socket_path]
    if model is not None:
        args += ["--model", model]
    return [*args, *extra]


@pytest.mark.quiet_machine
def test_notify_sequence_watchdog_and_cache_directory(workdir: str) -> None:
    notify = NotifySocket(os.path.join(workdir, "notify"))
    sock_path = os.path.join(workdir, "s")
    cache = os.path.join(workdir, "cache")
    env = daemon_env(NOTIFY_SOCKET=notify.path, WATCHDOG_USEC=str(WATCHDOG_USEC),
                     CACHE_DIRECTORY=cache)
    try:
        with reaped(start(_serve_args(sock_path, model=_synthetic()), env)) as proc:
            ready = notify.until("READY", timeout=120, proc=proc)
            assert ready["STATUS"].startswith("serving")
            assert os.path.exists(sock_path), "READY=1 came before the socket listened"
            before = [fields for _, fields in notify.messages[:-1]]
            statuses = [f["STATUS"] for f in before if "STATUS" in f]
            assert any(s.startswith("loading") for s in statuses), statuses
            # Ready without waiting for the calibration (it runs in idle moments).
            assert not any(s.startswith("measuring") for s in statuses), statuses
            n_before = len(notify.messages)
            for _ in range(4):
                notify.until("WATCHDOG", timeout=30, proc=proc)
            pings = [t for t, f in notify.messages[n_before:] if f.get("WATCHDOG") == "1"]
            gaps = [b - a for a, b in itertools.pairwise(pings)]
            # Not more often than half the interval asks for (no timing upper bound: the
            # machine may be busy; a missing ping would have failed `until` above).
            assert min(gaps) >= WATCHDOG_USEC / 2e6 * 0.5, gaps
            # The calibrated curve goes to systemd's CacheDirectory=, nowhere else (once
            # measured: on a machine kept busy by other processes it waits for quiet).
            deadline = time.monotonic() + 60
            while not list(Path(cache, "costs").glob("*.json")) and \
                    "calibration_waiting" not in proc.stderr() and time.monotonic() < deadline:
                time.sleep(0.1)
            if "calibration_waiting" not in proc.stderr():
                assert [p.name for p in Path(cache, "costs").iterdir()
                        if p.suffix == ".json"], proc.stderr()
            proc.send_signal(signal.SIGTERM)
            stopping = notify.until("STOPPING", timeout=30, proc=None)
            assert "STATUS" in stopping
            code, err = stop(proc, sig=None)
        assert code == 0, err
        assert not os.path.exists(sock_path)
        # Nothing else after STOPPING=1 but the final status.
        assert not any(f.get("READY") for _, f in notify.messages[-2:])
    finally:
        notify.close()


def test_socket_activation_serves_the_inherited_socket(workdir: str) -> None:
    path = os.path.join(workdir, "activated.sock")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen(16)
    # A client may connect before the daemon even runs: the socket already accepts.
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.connect(path)
    try:
        with reaped(start(_serve_args(None, model=_synthetic()), daemon_env(),
                          inherit=listening)) as proc:
            listening.close()  # the daemon holds its own copy now
            early.sendall(b'{"op":"hello","id":"e","protocol_version":%d,"client_name":"x"}\n'
                          % PROTOCOL_VERSION)
            reply = early.makefile("rb").readline()
            assert b'"welcome"' in reply, reply
            wire = Wire(path)
            wire.hello()
            wire.send(op="generate", id="g", prompt="abc", max_tokens=5)
            frames = []
            while (frame := wire.recv()) is not None:
                frames.append(frame)
                if frame["op"] in ("done", "error"):
                    break
            wire.close()
            assert frames[-1]["op"] == "done" and frames[-1]["finish_reason"] == "length"
            code, err = stop(proc)
        assert code == 0, err
        events = log_events(err)
        ready = next(e for e in events if e["event"] == "ready")
        assert ready["address"] == "fd://3"
        # systemd owns the socket file: the daemon must leave it alone.
        assert os.path.exists(path)
    finally:
        early.close()
        listening.close()


def test_socket_activation_with_an_http_socket(workdir: str) -> None:
    """Two sockets, as from meshd.socket plus a TCP socket unit named http: the Unix one
    serves the protocol, the TCP one HTTP."""
    path = os.path.join(workdir, "activated.sock")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(path)
    unix.listen(16)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(16)
    port = tcp.getsockname()[1]
    try:
        with reaped(start(_serve_args(None, model=_synthetic()), daemon_env(),
                          inherit=[unix, tcp], name="meshd:http")) as proc:
            unix.close()
            tcp.close()
            wait_for_socket(path, proc)
            with socket.create_connection(("127.0.0.1", port), timeout=30) as http:
                http.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                reply = b""
                while chunk := http.recv(65536):
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
            code, err = stop(proc)
        assert code == 0, err
    finally:
        unix.close()
        tcp.close()


def test_socket_activation_refuses_a_socket_of_the_wrong_type(workdir: str) -> None:
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(os.path.join(workdir, "d"))
    try:
        with reaped(start(_serve_args(None, model=_synthetic()), daemon_env(),
                          inherit=dgram)) as proc:
            code, err = stop(proc, sig=None)
        assert code == 1
        failure = next(e for e in log_events(err) if e["event"] == "socket_activation_failed")
        assert "not a stream socket" in failure["error"]
    finally:
        dgram.close()


@pytest.mark.slow
def test_sigterm_during_a_long_generation(workdir: str) -> None:
    """The running request gets the grace period, then ``done`` with ``shutdown``; the
    daemon exits 0, removes its socket, and every stderr line is one JSON event
    (llama.cpp's own lines included, at debug level)."""
    sock_path = os.path.join(workdir, "s")
    args = _serve_args(sock_path, "--shutdown-grace", "0.5", "--log-level", "debug",
                       "--llama-log-level", "debug", "--stream-interval-ms", "20",
                       "--fixed-k")
    args[args.index("--ctx") + 1] = "2048"
    with reaped(start(args, daemon_env())) as proc:  # SmolLM2, ~40 tok/s on one thread
        wait_for_socket(sock_path, proc)
        wire = Wire(sock_path)
        wire.hello()
        wire.send(op="generate", id="long", prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
                  max_tokens=2000)
        first = wire.recv()
        assert first is not None and first["op"] == "token", first
        proc.send_signal(signal.SIGTERM)
        frames = [first]
        while (frame := wire.recv()) is not None:
            frames.append(frame)
            if frame["op"] in ("done", "error"):
                break
        wire.close()
        code, err = stop(proc, sig=None)
    done = frames[-1]
    assert done["op"] == "done" and done["finish_reason"] == "shutdown", done
    assert 0 < done["usage"]["completion_tokens"] < 2000
    assert code == 0, err
    assert not os.path.exists(sock_path)
    events = log_events(err)
    assert any(e.get("logger_name") == "meshd.llama" for e in events)
    finished = next(e for e in events if e["event"] == "request_finished")
    assert finished["finish_reason"] == "shutdown"
    # One event per line: nothing is reported twice.
    lines = err.splitlines()
    assert len(lines) == len(set(lines))


def test_a_denied_peer_gets_forbidden_and_is_counted(workdir: str) -> None:
    """Even with the socket wide open (a mistake the allow-list must survive), a user
    who is not allowed gets a ``forbidden`` error frame; an allowed group is served."""
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another user")
    os.chmod(workdir, 0o755)
    sock_path = os.path.join(workdir, "s")
    args = _serve_args(sock_path, "--allow-group", "12345", model=_synthetic())
    with reaped(start(args, daemon_env())) as proc:
        wait_for_socket(sock_path, proc)
        os.chmod(sock_path, 0o666)
        denied = _connect_as(sock_path, uid=65534, gid=65534)
        allowed = _connect_as(sock_path, uid=65534, gid=65534, groups=[12345])
        wire = Wire(sock_path)  # root: always allowed
        wire.hello()
        wire.send(op="stats", id="st")
        stats = wire.recv()
        wire.close()
        code, err = stop(proc)
    assert '"code": "forbidden"' in denied and '"id": null' in denied, denied
    assert '"op": "welcome"' in allowed, allowed
    assert stats is not None and stats["counters"]["connections_denied"] == 1, stats
    assert code == 0, err
    denial = next(e for e in log_events(err) if e["event"] == "peer_denied")
    assert denial["uid"] == 65534


def _connect_as(path: str, *, uid: int, gid: int, groups: list[int] | None = None) -> str:
    """Connect as another user (a plain interpreter, no meshd imports) and return the
    first frame the daemon sends after our hello."""
    code = (
        "import socket,sys,json\n"
        "s=socket.socket(socket.AF_UNIX); s.settimeout(30); s.connect(sys.argv[1])\n"
        "try:\n"
        "    s.sendall(b'{\"op\":\"hello\",\"id\":\"h\",\"protocol_version\":"
        f"{PROTOCOL_VERSION},\"client_name\":\"other\"}}\\n')\n"
        "except OSError:\n"  # a refused peer may be cut off before it says hello
        "    pass\n"
        "line=s.makefile('rb').readline()\n"
        "print(json.dumps(json.loads(line)))\n"
    )
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 another user could run")
    done = subprocess.run(
        [python, "-I", "-c", code, path],
        user=uid, group=gid, extra_groups=groups or [], capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_sighup_reloads_live_settings(workdir: str) -> None:
    """SIGHUP re-reads the file: a live key (serve.max_tokens) changes at once, a key that
    needs a restart is reported, a bad file is refused and the old settings stay."""
    notify = NotifySocket(os.path.join(workdir, "notify"))
    conf = Path(workdir, "meshd.toml")
    conf.write_text(f'[model]\npath = "{_synthetic()}"\nctx = 512\n[serve]\nmax_tokens = 3\n')
    sock_path = os.path.join(workdir, "s")
    args = ["--config", str(conf), "--socket", sock_path, "--threads", "1", "--slots", "1",
            "--fixed-k"]
    try:
        with reaped(start(args, daemon_env(NOTIFY_SOCKET=notify.path))) as proc:
            notify.until("READY", timeout=120, proc=proc)
            assert _default_length(sock_path) == 3
            conf.write_text(f'[model]\npath = "{_synthetic()}"\nctx = 256\n'
                            '[serve]\nmax_tokens = 5\nbacklog = 64\n')
            proc.send_signal(signal.SIGHUP)
            reloading = notify.until("RELOADING", timeout=30, proc=proc)
            assert int(reloading["MONOTONIC_USEC"]) > 0
            notify.until("READY", timeout=30, proc=proc)
            assert _default_length(sock_path) == 5
            conf.write_text("[serve]\nmax_tokens = 0\n")
            proc.send_signal(signal.SIGHUP)
            notify.until("RELOADING", timeout=30, proc=proc)
            notify.until("READY", timeout=30, proc=proc)
            assert _default_length(sock_path) == 5  # the bad file changed nothing
            code, err = stop(proc)
        assert code == 0, err
        events = log_events(err)
        reloaded = next(e for e in events if e["event"] == "reloaded")
        # The model's own keys reload it (once idle); a listen backlog needs a restart.
        assert reloaded["changed"] == ["model.ctx", "serve.max_tokens",
                                       f"models.{Path(_synthetic()).stem}"]
        restart = next(e for e in events if e["event"] == "restart_needed")
        assert restart["keys"] == ["serve.backlog"]
        failed = next(e for e in events if e["event"] == "reload_failed")
        assert str(conf) in failed["error"] and "serve.max_tokens" in failed["error"]
    finally:
        notify.close()


def _default_length(sock_path: str) -> int:
    """Tokens generated for a request that does not say max_tokens."""
    wire = Wire(sock_path)
    try:
        wire.hello()
        wire.send(op="generate", id="d", prompt="abc", max_tokens=None)
        while (frame := wire.recv()) is not None:
            if frame["op"] in ("done", "error"):
                assert frame["op"] == "done", frame
                return int(frame["usage"]["completion_tokens"])
        raise AssertionError("connection closed before done")
    finally:
        wire.close()


@pytest.mark.slow
def test_a_second_sigint_forces_the_exit(workdir: str) -> None:
    """With a long grace period, the first SIGINT waits for the running request; the
    second one stops at once (exit 130) and still removes the socket."""
    sock_path = os.path.join(workdir, "s")
    args = _serve_args(sock_path, "--shutdown-grace", "600", "--stream-interval-ms", "20",
                       "--fixed-k")
    with reaped(start(args, daemon_env())) as proc:
        wait_for_socket(sock_path, proc)
        wire = Wire(sock_path)
        wire.hello()
        wire.send(op="generate", id="long", prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
                  max_tokens=400)
        assert (wire.recv() or {}).get("op") == "token"
        proc.send_signal(signal.SIGINT)
        assert (wire.recv() or {}).get("op") == "token"  # still generating: grace period
        proc.send_signal(signal.SIGINT)
        code, err = stop(proc, sig=None, timeout=30)
        wire.close()
    assert code == 130, err
    assert not os.path.exists(sock_path)
    actions = [e.get("action") for e in log_events(err) if e["event"] == "signal_received"]
    assert actions == ["graceful shutdown", "stopping now"]
