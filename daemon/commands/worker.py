"""``meshd worker``: offer this machine's CPU (or GPUs) to a meshd elsewhere.

Runs llama.cpp's RPC server (``ggml_backend_rpc_start_server``, the engine behind
llama.cpp's own ``rpc-server``), which a ``meshd serve --rpc HOST:PORT`` on another
machine places some of its model's layers on. The worker holds no model of its own: the
daemon uploads the layers when it loads, and the worker serves one daemon at a time.

Why loopback by default: the RPC protocol has no authentication and no encryption;
anyone who can connect can run computations on this machine and read or write its
buffers. Binding another address needs ``--allow-remote`` and prints a warning, as
llama.cpp's rpc-server does.

Exit codes: 0 after SIGINT/SIGTERM, 1 when it cannot listen, 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from meshd.clients.argtypes import positive
from meshd.native.rpc import (
    DEFAULT_PORT,
    Endpoint,
    is_loopback,
    parse_endpoint,
    serve_forever,
)

__all__ = ["add_parser", "free_port", "run"]

WARNING = """\
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
WARNING: meshd worker listens on {host}, not on loopback.
         The RPC protocol has NO authentication and NO encryption: anyone who
         can reach this port can run computations here and read this
         machine's buffers. Never expose it to an open network; allow only
         the daemon's machine (firewall, private network or SSH tunnel).
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshd.daemon.config import options as opt

    p = opt.subparser(
        sub, "worker", help="offer this machine's CPU/GPU to a meshd elsewhere (llama.cpp RPC)",
        description="Run llama.cpp's RPC server: a meshd serve --rpc HOST:PORT elsewhere "
                    "places some of its model's layers here. The protocol has no "
                    "authentication: it listens on loopback unless --allow-remote.")
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help=f"IPv4 address and port (default 127.0.0.1:{DEFAULT_PORT})")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --listen address (the protocol has no "
                        "authentication: see the warning it prints)")
    p.add_argument("-t", "--threads", type=positive, default=None, metavar="N",
                   help="CPU threads for the computations (default: half the cores)")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="cache large tensors here, so a daemon reloading the same model "
                        "sends hashes instead of the weights")


def check_listen(text: str, *, allow_remote: bool) -> Endpoint:
    """The endpoint to bind; raises ValueError for a bad address or a non-loopback one
    without ``allow_remote``."""
    import ipaddress

    ep = parse_endpoint(text, default_port=DEFAULT_PORT)
    try:
        ipaddress.IPv4Address(ep.host)
    except ValueError:
        raise ValueError(f"--listen {text!r}: the host must be an IPv4 address "
                         "(llama.cpp's RPC server binds IPv4 only)") from None
    if not is_loopback(ep.host) and not allow_remote:
        raise ValueError(
            f"--listen {ep}: not a loopback address; the RPC protocol has no "
            "authentication, so listening there needs --allow-remote")
    return ep


def run(args: argparse.Namespace) -> int:
    try:
        ep = check_listen(args.listen, allow_remote=args.allow_remote)
    except ValueError as exc:
        print(f"meshd worker: {exc}", file=sys.stderr)
        return 2
    if not is_loopback(ep.host):
        print(WARNING.format(host=ep.host), file=sys.stderr, flush=True)
    cache = None
    if args.cache:
        cache_path = Path(args.cache).expanduser()
        try:
            cache_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"meshd worker: cannot use --cache {cache_path}: {exc}", file=sys.stderr)
            return 2
        cache = str(cache_path)
    threads = args.threads or max(1, _cores() // 2)
    failed = threading.Event()

    def serve() -> None:
        try:
            serve_forever(ep, threads=threads, cache_dir=cache)
        finally:
            failed.set()  # the server only returns when it cannot listen

    # The server loop runs inside llama.cpp and never returns to Python, so it gets a
    # thread of its own (it lives as long as the process) and the main thread waits for
    # a signal; ending the process is the only way to stop llama.cpp's server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    threading.Thread(target=serve, name="rpc-server", daemon=True).start()
    try:
        while not failed.wait(0.5):
            pass
    except (KeyboardInterrupt, SystemExit):
        return 0
    print(f"meshd worker: cannot listen on {ep} (address in use, or not this machine's)",
          file=sys.stderr)
    return 1


def _cores() -> int:

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
