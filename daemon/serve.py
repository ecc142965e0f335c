"""``meshd serve``: load the model, listen on the socket, serve until SIGINT/SIGTERM.

Why the order of things: the model loads (seconds) before the socket exists, so a
client that can connect can also be served; "ready" is logged (and the ready hooks run,
systemd notify later) only once the socket listens. The first SIGINT/SIGTERM shuts down
gracefully (running generations end with ``done`` cancelled, the socket file goes); a
second one stops at once.

Exit codes: 0 after a clean shutdown, 1 when the socket cannot be used, 2 bad usage,
3 the model failed to load.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
from typing import Any

import anyio
import anyio.abc

from meshd.native.errors import NativeError

from . import options as opt
from .argtypes import non_negative, positive, positive_seconds
from .checks import check_model_args
from .http.tcp import check_http_address, open_http_listener
from .listener import ListenerError, default_socket_path, open_listener, preflight
from .logs import configure_logging, get_logger
from .runtime import ModelRuntime, RequestError, RuntimeConfig
from .server import Server
from .service import ServerConfig
from .terminal import Progress

__all__ = ["add_parser", "run", "socket_address"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``serve`` and its options on the ``meshd`` command line."""
    p = opt.subparser(
        sub, "serve", help="run the daemon on a Unix socket until SIGINT/SIGTERM",
        description="Load the model, listen on a Unix socket and serve requests (talk to "
                    "it with meshctl) until SIGINT/SIGTERM.",
        parents=[opt.model_options(), opt.speculation_options(), opt.daemon_options()],
    )
    p.add_argument("-s", "--socket", default=None, metavar="PATH",
                   help="socket path, unix:PATH or fd://N (default: $MESHD_SOCKET, else "
                        f"{default_socket_path()})")
    p.add_argument("--http", default=None, metavar="tcp:127.0.0.1:PORT",
                   help="also serve HTTP (OpenAI API, /health, /metrics) on a loopback TCP "
                        "port or an inherited socket (fd://N); the Unix socket always "
                        "serves HTTP too")
    p.add_argument("--slots", metavar="N", type=positive, default=4,
                   help="generations decoded together (sessions in the shared context)")
    p.add_argument("--max-queue", metavar="N", type=non_negative, default=64,
                   help="requests waiting for a slot before new ones are answered busy")
    p.add_argument("--stream-interval-ms", metavar="MS", type=positive, default=100,
                   help="stream tokens in batches at most this far apart (fewer wake-ups "
                        "of the client, which on a small machine steal the decode's cores)")
    p.add_argument("--draft-model", action="append", default=[], metavar="PATH",
                   help="a GGUF that requests may name as 'draft:PATH' (repeatable; "
                        "without it the draft proposer is refused)")
    p.add_argument("--max-tokens", metavar="N", type=positive, default=opt.DEFAULT_MAX_TOKENS,
                   help="max_tokens of a request that does not say")
    p.add_argument("--max-tokens-limit", metavar="N", type=positive, default=None,
                   help="largest max_tokens accepted (default: the context length)")
    defaults = ServerConfig()
    p.add_argument("--max-connections", type=positive, default=defaults.max_connections,
                   metavar="N",
                   help="open connections at once; one more is answered busy and closed")
    p.add_argument("--idle-timeout", type=positive_seconds, default=defaults.idle_timeout_s,
                   metavar="SECONDS",
                   help="close a connection with nothing in flight that sends nothing for "
                        "this long")
    p.add_argument("--frame-timeout", type=positive_seconds, default=defaults.frame_timeout_s,
                   metavar="SECONDS",
                   help="a frame that has begun must end within this, else the connection "
                        "gets an error and is closed")
    p.add_argument("--backlog", type=positive, default=None, metavar="N",
                   help="listen backlog (default: the system maximum, "
                        "/proc/sys/net/core/somaxconn)")
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto",
                   help="auto: console on a terminal, JSON lines otherwise")


def socket_address(explicit: str | None) -> str:
    """Where ``serve`` listens: ``--socket``, else ``$MESHD_SOCKET``, else the default
    (the same order meshctl looks in, so both find each other)."""
    return explicit or os.environ.get("MESHD_SOCKET") or default_socket_path()


def run(args: argparse.Namespace) -> int:
    """Run ``meshd serve`` with parsed ``args``; returns the exit code."""
    json_logs = {"auto": None, "json": True, "console": False}[args.log_format]
    configure_logging(args.log_level, json=json_logs)
    log = get_logger("meshd.serve")
    bind = socket_address(args.socket)
    proposer = args.proposer
    if proposer.startswith("draft:") and proposer.partition(":")[2] not in args.draft_model:
        message = (f"--proposer {proposer} names a draft model that is not among the "
                   "--draft-model files; add --draft-model "
                   f"{proposer.partition(':')[2]}")
        log.error("bad_usage", error=message)
        print(f"meshd serve: {message}", file=sys.stderr)
        return 2
    try:
        check_model_args(args.model, proposer, args.draft_model)
    except NativeError as exc:
        log.error("model_load_failed", error=str(exc))
        print(f"meshd serve: {exc}", file=sys.stderr)
        return 3
    config = RuntimeConfig(
        model_path=args.model, n_ctx_seq=args.ctx, n_seq_max=args.slots,
        draft_max=args.draft_max, threads=args.threads, calibrate=not args.fixed_k,
        default_proposer=proposer, allowed_drafts=tuple(args.draft_model),
    )
    try:
        preflight(bind)
        if args.http is not None:
            check_http_address(args.http)
    except ListenerError as exc:
        log.error("listen_failed", address=bind, error=str(exc))
        print(f"meshd serve: {exc}", file=sys.stderr)
        return 1
    log.info("loading_model", model=args.model or "embedded default")
    t0 = time.monotonic()

    def note(event: str, message: str) -> None:
        log.warning(event, message=message)

    try:
        runtime = ModelRuntime(config, notes=note, progress=Progress)
    except (NativeError, RequestError, OSError) as exc:
        log.error("model_load_failed", error=str(exc))
        print(f"meshd serve: {exc}", file=sys.stderr)
        return 3
    with runtime:
        log.info("model_loaded", path=runtime.model.info.path,
                 seconds=round(time.monotonic() - t0, 2))
        server = Server(runtime, ServerConfig(
            max_tokens_default=args.max_tokens, max_tokens_limit=args.max_tokens_limit,
            max_queue=args.max_queue, stream_interval_s=args.stream_interval_ms / 1000,
            max_connections=args.max_connections, idle_timeout_s=args.idle_timeout,
            frame_timeout_s=args.frame_timeout, backlog=args.backlog,
        ))
        options: dict[str, Any] = {}
        if args.backend == "asyncio" and importlib.util.find_spec("uvloop") is not None:
            options["use_uvloop"] = True
        try:
            anyio.run(_serve_until_signalled, server, bind, args.http,
                      backend=args.backend, backend_options=options)
        except ListenerError as exc:
            log.error("listen_failed", address=bind, error=str(exc))
            print(f"meshd serve: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # a signal before the handlers were in place
            return 130
    return 0


async def _serve_until_signalled(server: Server, bind: str, http: str | None) -> None:
    # Raises ListenerError plainly, before any task.
    listener = await open_listener(bind, backlog=server.config.backlog)
    try:
        http_listener = await open_http_listener(http, backlog=server.config.backlog) \
            if http is not None else None
    except BaseException:
        await listener.aclose()
        raise
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, signals, server, tg.cancel_scope)
            await server.serve(listener, http=http_listener)
            tg.cancel_scope.cancel()


async def _watch_signals(signals: Any, server: Server, scope: anyio.CancelScope) -> None:
    log = get_logger("meshd.serve")
    stopping = False
    async for signum in signals:
        name = signal.Signals(signum).name
        if not stopping:
            stopping = True
            log.info("signal_received", signal=name, action="graceful shutdown")
            server.shutdown()
        else:
            log.warning("signal_received", signal=name, action="stopping now")
            scope.cancel()
