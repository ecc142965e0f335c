"""The client half of ``meshd demo``: run a daemon, send it one request, stop it.

Starts the daemon's command line (``meshd serve`` on a private socket, built by the
``meshd demo`` command) as a child process, waits until it answers a handshake, sends
one request through the socket with meshctl (in this process: the same code as the
``meshctl`` command), which prints the text and a stats line, then stops the daemon
with SIGTERM and checks that it shut down cleanly and removed its socket.

Why a real child process rather than an in-process server: this is what a user runs,
so it exercises the real ``serve`` command line, signal handling and socket cleanup;
and this side stays a client, talking to the daemon through its socket only.

Exit codes: meshctl's when the request fails, 1 when the daemon does not start or
does not stop cleanly, else 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Final

from meshd.protocol import ConnectionClosed, connect_sync

from . import ctl

__all__ = ["START_TIMEOUT_S", "STOP_TIMEOUT_S", "run_demo"]

START_TIMEOUT_S: Final = 300.0
"""Loading plus first-time calibration of a large model can take minutes."""
STOP_TIMEOUT_S: Final = 30.0


def run_demo(daemon_command: Sequence[str], socket_path: str,
             meshctl_args: Sequence[str]) -> int:
    """Run ``daemon_command`` (which serves on ``socket_path``), then
    ``meshctl --socket socket_path MESHCTL_ARGS``, then stop the daemon."""
    daemon = subprocess.Popen(list(daemon_command), stdin=subprocess.DEVNULL)
    try:
        if not _wait_ready(daemon, socket_path):
            print("meshd demo: the daemon did not start", file=sys.stderr)
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


def _wait_ready(daemon: subprocess.Popen[bytes], socket_path: str) -> bool:
    """Poll until the daemon answers a handshake (or exits, or the timeout passes)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            return False
        if os.path.exists(socket_path):
            try:
                with connect_sync(socket_path, client_name="meshd-demo", connect_timeout=5):
                    return True
            except ConnectionClosed:
                pass
        time.sleep(0.05)
    return False


def _stop(daemon: subprocess.Popen[bytes]) -> bool:
    """SIGTERM, then wait; True if it exited 0 in time."""
    daemon.send_signal(signal.SIGTERM)
    try:
        return daemon.wait(timeout=STOP_TIMEOUT_S) == 0
    except subprocess.TimeoutExpired:
        return False
