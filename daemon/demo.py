"""``meshd demo``: the whole product in one command, for the README and for CI.

Starts ``meshd serve`` as a child process on a private temporary socket, waits until it
answers, sends one request through the socket with meshctl (in this process: the same
code as the ``meshctl`` command), which prints the text and a stats line, then stops
the daemon with SIGTERM and checks that it shut down cleanly and removed its socket.

Why a real child process rather than an in-process server: this is what a user runs,
so it exercises the real ``serve`` command line, signal handling and socket cleanup.

Exit codes: meshctl's when the request fails, 1 when the daemon does not start or
does not stop cleanly, else 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Final

from meshd.native.errors import NativeError
from meshd.protocol import ConnectionClosed, connect_sync

from . import ctl
from . import options as opt
from .checks import check_model_args
from .sampling import SamplingParams

__all__ = ["add_parser", "run"]

DEFAULT_PROMPT: Final = "Rewrite with type hints: def add(a, b): return a + b"
START_TIMEOUT_S: Final = 300.0
"""Loading plus first-time calibration of a large model can take minutes."""
STOP_TIMEOUT_S: Final = 30.0
DEMO_LOG_LEVEL: Final = "warning"
"""The demo shows the generated text; the daemon's info events would bury it."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``demo`` on the ``meshd`` command line."""
    p = opt.subparser(
        sub, "demo",
        help="start the daemon, send one chat request with meshctl, stop the daemon",
        parents=[opt.model_options(), opt.speculation_options(), opt.sampling_options(),
                 opt.generation_options(), opt.daemon_options(log_level=DEMO_LOG_LEVEL)],
    )
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT,
                   help="the user message ('-' reads it from stdin)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as raw text instead of a chat message")


def run(args: argparse.Namespace) -> int:
    # Everything that can be checked is checked before the daemon starts.
    try:
        check_model_args(args.model, args.proposer)
    except NativeError as exc:
        print(f"meshd demo: {exc}", file=sys.stderr)
        return 3
    try:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as exc:
        print(f"meshd demo: {exc}", file=sys.stderr)
        return 2
    directory = tempfile.mkdtemp(prefix="meshd-demo-", dir="/tmp")
    socket_path = os.path.join(directory, "meshd.sock")
    command = [
        sys.executable, "-m", "meshd.daemon.cli", "serve", "--socket", socket_path,
        "--backend", args.backend, "--slots", "1", "--ctx", str(args.ctx),
        "--log-level", args.log_level, "--draft-max", str(args.draft_max),
        "--max-tokens", str(args.max_tokens),
    ]
    if args.model:
        command += ["--model", args.model]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.fixed_k:
        command += ["--fixed-k"]
    if args.proposer.startswith("draft:"):  # the demo's own request may name its draft
        command += ["--draft-model", args.proposer.partition(":")[2]]
    daemon = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    try:
        if not _wait_ready(daemon, socket_path):
            print("meshd demo: the daemon did not start", file=sys.stderr)
            return 1
        request: list[str] = [
            "--socket", socket_path, "generate" if args.raw else "chat",
            "--max-tokens", str(args.max_tokens), "--proposer", args.proposer,
            "--temperature", repr(args.temperature), "--top-k", str(args.top_k),
            "--top-p", repr(args.top_p),
        ]
        if args.seed is not None:
            request += ["--seed", str(args.seed)]
        for stop in args.stop:
            request += ["--stop", stop]
        request += ["--", prompt]  # a prompt may start with '-'
        status = ctl.main(request)
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
        shutil.rmtree(directory, ignore_errors=True)


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

