"""Helpers for tests that run ``meshd serve`` as a real child process, the way a service
manager does: a notify socket to listen on, a raw NDJSON connection, and a launcher
that hands the daemon an inherited listening socket (systemd socket activation)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from meshd.protocol import PROTOCOL_VERSION

SERVE = [sys.executable, "-m", "meshd.daemon.commands.cli", "serve"]

# Sets LISTEN_PID to its own pid, moves the socket to fd 3 and execs meshd (same pid),
# exactly what systemd does for a socket-activated service.
_ACTIVATION_LAUNCHER = """
import os, sys
fds, names, argv = [int(x) for x in sys.argv[1].split(",")], sys.argv[2], sys.argv[3:]
for i, fd in enumerate(fds):
    os.dup2(fd, 3 + i)
for fd in fds:
    if fd >= 3 + len(fds):
        os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(fds)),
                  LISTEN_FDNAMES=names)
os.execv(argv[0], argv)
"""


def daemon_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS",
                        "LISTEN_PID", "LISTEN_FDNAMES", "JOURNAL_STREAM")}
    env["OMP_WAIT_POLICY"] = "passive"
    env.update(extra)
    return env


class Daemon:
    """A ``meshd serve`` child process; its stderr goes to a file (a pipe nobody reads
    would fill up and block the daemon)."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], *,
                 pass_fds: Sequence[int] = ()) -> None:
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives with the child
        self.proc = subprocess.Popen(list(command), env=dict(env), pass_fds=tuple(pass_fds),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self._log, text=True)
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def stderr(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


def start(args: Sequence[str], env: Mapping[str, str], *,
          inherit: socket.socket | Sequence[socket.socket] | None = None,
          name: str = "meshd") -> Daemon:
    """``meshd serve ARGS``; with ``inherit``, as if socket-activated with those sockets
    (fds 3, 4, ...; ``name`` is ``$LISTEN_FDNAMES``, colon-separated)."""
    command = [*SERVE, *args]
    if inherit is None:
        return Daemon(command, env)
    socks = [inherit] if isinstance(inherit, socket.socket) else list(inherit)
    fds = [s.fileno() for s in socks]
    return Daemon([sys.executable, "-c", _ACTIVATION_LAUNCHER, ",".join(map(str, fds)), name,
                   *command], env, pass_fds=tuple(fds))


def stop(proc: Daemon, sig: int | None = signal.SIGTERM,
         timeout: float = 60) -> tuple[int, str]:
    """Signal (unless ``sig`` is None), wait, and return (exit code, stderr); kills it
    if it does not stop."""
    if sig is not None and proc.poll() is None:
        proc.send_signal(sig)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.proc.kill()
        proc.wait(timeout)
        raise AssertionError(f"the daemon did not stop within {timeout}s:\n"
                             f"{proc.stderr()}") from None
    return code, proc.stderr()


@contextmanager
def reaped(proc: Daemon) -> Iterator[Daemon]:
    """Make sure the child is gone when the test ends, whatever happened."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.proc.kill()
            proc.wait(30)


class NotifySocket:
    """A datagram socket to pass as ``$NOTIFY_SOCKET``; collects what the daemon says."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages: list[tuple[float, dict[str, str]]] = []

    def until(self, key: str, value: str = "1", *, timeout: float,
              proc: Daemon | None = None) -> dict[str, str]:
        """Receive until a message with ``key=value`` arrives; returns it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the daemon exited ({proc.returncode}) while we waited "
                                     f"for {key}={value}:\n{proc.stderr()}")
            self.sock.settimeout(0.5)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.messages.append((time.monotonic(), fields))
            if fields.get(key) == value:
                return fields
        raise AssertionError(f"no {key}={value} within {timeout}s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()


class Wire:
    """A raw protocol connection (JSON objects in and out), blocking with a timeout."""

    def __init__(self, path: str, timeout: float = 60) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.file = self.sock.makefile("rwb")

    def send(self, **frame: Any) -> None:
        self.file.write(json.dumps(frame).encode() + b"\n")
        self.file.flush()

    def recv(self) -> dict[str, Any] | None:
        line = self.file.readline()
        return json.loads(line) if line else None

    def hello(self) -> dict[str, Any]:
        self.send(op="hello", id="h", protocol_version=PROTOCOL_VERSION, client_name="test")
        welcome = self.recv()
        assert welcome is not None and welcome["op"] == "welcome", welcome
        return welcome

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def wait_for_socket(path: str, proc: Daemon, timeout: float = 120) -> None:
    """Until the daemon answers on ``path``. An answer, not a connection: the socket
    listens (and takes connections into its backlog) a moment before the daemon serves
    them and handles its signals, and a SIGTERM in that moment is not a graceful stop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited ({proc.returncode}):\n"
                                 f"{proc.stderr()}")
        if os.path.exists(path):
            try:
                wire = Wire(path, timeout=30)
                try:  # any answer (a welcome, or forbidden for a refused peer) will do
                    wire.send(op="hello", id="h", protocol_version=PROTOCOL_VERSION,
                              client_name="test")
                    wire.recv()
                finally:
                    wire.close()
                return
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"the daemon did not listen on {path} within {timeout}s")


def log_events(stderr: str) -> list[dict[str, Any]]:
    """Every stderr line as a JSON log event (fails on any line that is not one)."""
    events = []
    for line in stderr.splitlines():
        assert line.startswith("{"), f"a log line that is not a JSON event: {line!r}"
        events.append(json.loads(line))
    return events
