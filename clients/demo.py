"""The client half of ``meshd demo``: run a daemon, send it one request, stop it.

Starts the daemon's command line (``meshd serve`` on a private socket, built by the
``meshd demo`` command) as a child process, waits until it answers a handshake, sends
one request through the socket with meshctl (in this process: the same code as the
``meshctl`` command), which prints the text and a stats line, then stops the daemon
with SIGTERM and checks that it shut down cleanly and removed its socket.

Why a real child process rather than an in-process server: this is what a user runs,
so it exercises the real ``serve`` command line, signal handling and socket cleanup;
and this side stays a client, talking to the daemon through its socket only.

While it waits, the demo says what the daemon is doing: it stands in for systemd and
hands the child a ``$NOTIFY_SOCKET`` of its own, so the ``STATUS=`` lines the daemon
sends while it loads its model (and while anything else slow runs before it listens)
arrive here and are printed to stderr, and so is why the demo gave up: the daemon
exited (with its status; its own error is printed above), or it was still at its last
status when ``--start-timeout`` ran out.

Exit codes: meshctl's when the request fails, 1 when the daemon does not start or
does not stop cleanly, else 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Final, TextIO

from meshd.protocol import ConnectionClosed, connect_sync

from . import ctl

__all__ = ["START_TIMEOUT_S", "STOP_TIMEOUT_S", "StartWatch", "run_demo"]

START_TIMEOUT_S: Final = 300.0
"""Loading a large model on a busy machine can take minutes (``--start-timeout``)."""
STOP_TIMEOUT_S: Final = 30.0
POLL_S: Final = 0.05
REPEAT_STATUS_S: Final = 10.0
"""How often the same step's progress (``loading X: 40%``) is printed again: each new
step is printed at once, its percentages at most this often."""


def run_demo(daemon_command: Sequence[str], socket_path: str,
             meshctl_args: Sequence[str], *,
             start_timeout: float = START_TIMEOUT_S) -> int:
    """Run ``daemon_command`` (which serves on ``socket_path``), then
    ``meshctl --socket socket_path MESHCTL_ARGS``, then stop the daemon."""
    notify_path = os.path.join(os.path.dirname(socket_path) or ".", "notify.sock")
    with StartWatch(notify_path) as watch:
        env = {k: v for k, v in os.environ.items()
               if k not in ("WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                            "LISTEN_FDNAMES")}  # meant for this process, not the child
        env["NOTIFY_SOCKET"] = notify_path
        daemon = subprocess.Popen(list(daemon_command), stdin=subprocess.DEVNULL, env=env)
        try:
            problem = _wait_ready(daemon, socket_path, watch, start_timeout)
            if problem is not None:
                print(f"meshd demo: the daemon did not start: {problem}", file=sys.stderr)
                return 1
            status = ctl.main(["--socket", socket_path, *meshctl_args])
            stopped = _stop(daemon)
            if status != 0:
                return status
            if not stopped:
                print("meshd demo: the daemon did not shut down cleanly", file=sys.stderr)
                return 1
            if os.path.exists(socket_path):
                print("meshd demo: the daemon left its socket behind", file=sys.stderr)
                return 1
            return 0
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()


class StartWatch:
    """The ``$NOTIFY_SOCKET`` the daemon reports to: keeps its last ``STATUS=`` and,
    until it is ready, prints each new step (and, every :data:`REPEAT_STATUS_S`, its
    progress) to ``out``.

    A thread reads it for the daemon's whole life: a datagram socket's queue is short,
    and a daemon whose notify messages nobody reads blocks in ``sendto``.
    """

    def __init__(self, path: str, out: TextIO | None = None) -> None:
        self.path = path
        self.out = out
        self.status: str | None = None
        """The daemon's last ``STATUS=`` (None: it has said nothing yet)."""
        self.ready = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._printed: tuple[str, float] | None = None
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, name="meshd-demo-notify",
                                        daemon=True)

    def __enter__(self) -> StartWatch:
        self._sock.bind(self.path)
        self._sock.settimeout(POLL_S)
        self._reader.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._reader.join()
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _read(self) -> None:
        while not self._closing.is_set():
            try:
                data = self._sock.recv(4096)
            except (TimeoutError, InterruptedError):
                continue
            except OSError:
                return
            self.heard(data.decode(errors="replace"))

    def heard(self, message: str) -> None:
        """One notify message: ``KEY=VALUE`` lines."""
        for line in message.splitlines():
            key, _, value = line.partition("=")
            if key == "READY" and value == "1":
                self.ready = True
            elif key == "STATUS" and value:
                self._status(value)

    def _status(self, status: str) -> None:
        self.status = status
        if self.ready:
            return  # serving: the demo's request shows the rest
        step = status.partition(":")[0]
        now = time.monotonic()
        last = self._printed
        if last is None or last[0] != step or now - last[1] >= REPEAT_STATUS_S:
            self._printed = (step, now)
            print(f"meshd demo: the daemon is {status}", file=self.out or sys.stderr,
                  flush=True)

    def doing(self) -> str:
        """What the daemon was last heard doing, for the reason the demo gives up."""
        if self.status is None:
            return ("it had not said what it was doing yet (it reports once Python and "
                    "llama.cpp are loaded)")
        return f"it was still {self.status}"


def _wait_ready(daemon: subprocess.Popen[bytes], socket_path: str, watch: StartWatch,
                timeout: float) -> str | None:
    """Poll until the daemon answers a handshake; None then, else why not (it exited,
    or ``timeout`` passed: with what it was doing)."""
    deadline = time.monotonic() + timeout
    while True:
        code = daemon.poll()
        if code is not None:
            return (f"it exited with status {code} before it listened "
                    f"(its error is above; it was {watch.status or 'starting'})")
        if os.path.exists(socket_path):
            try:
                with connect_sync(socket_path, client_name="meshd-demo",
                                  connect_timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                    return None
            except (ConnectionClosed, TimeoutError, OSError):
                pass
        if time.monotonic() >= deadline:
            return (f"no answer within {timeout:g} s: {watch.doing()}; on a busy machine "
                    f"give it longer with --start-timeout S")
        time.sleep(POLL_S)


def _stop(daemon: subprocess.Popen[bytes]) -> bool:
    """SIGTERM, then wait; True if it exited 0 in time."""
    daemon.send_signal(signal.SIGTERM)
    try:
        return daemon.wait(timeout=STOP_TIMEOUT_S) == 0
    except subprocess.TimeoutExpired:
        return False
