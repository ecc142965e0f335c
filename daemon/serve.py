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
import signal
import sys
import time
from typing import Any

import anyio
import anyio.abc

from meshd.native.context import DEFAULT_DRAFT_MAX
from meshd.native.errors import NativeError
from meshd.plugins.config import PluginConfigError, load_plugin_config

from .argtypes import non_negative, positive
from .listener import ListenerError, default_socket_path, open_listener, preflight
from .logs import LEVELS, configure_logging, get_logger
from .runtime import ModelRuntime, RequestError, RuntimeConfig
from .server import Server
from .service import DEFAULT_MAX_TOKENS, ServerConfig

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``serve`` and its options on the ``meshd`` command line."""
    p = sub.add_parser("serve", help="run the daemon on a Unix socket until SIGINT/SIGTERM")
    p.add_argument("--socket", default=None, metavar="PATH",
                   help="socket path, unix:PATH or fd://N "
                        f"(default: {default_socket_path()})")
    p.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M)")
    p.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio",
                   help="event loop (asyncio uses uvloop when installed)")
    p.add_argument("--slots", type=positive, default=4,
                   help="generations decoded together (sessions in the shared context)")
    p.add_argument("--ctx", type=positive, default=4096, help="context length per session")
    p.add_argument("--draft-max", type=non_negative, default=DEFAULT_DRAFT_MAX,
                   help=f"longest draft per step (k; default {DEFAULT_DRAFT_MAX}); 0 disables "
                        "speculation")
    p.add_argument("--max-queue", type=non_negative, default=64,
                   help="requests waiting for a slot before new ones are answered busy")
    p.add_argument("--stream-interval-ms", type=positive, default=100,
                   help="stream tokens in batches at most this far apart (fewer wake-ups "
                        "of the client, which on a small machine steal the decode's cores)")
    p.add_argument("--threads", type=positive, default=None)
    p.add_argument("--proposer", default="auto",
                   help="default proposer: off | auto | mtp | ngram | composite | a plugin")
    p.add_argument("--draft-model", action="append", default=[], metavar="PATH",
                   help="a GGUF that requests may name as 'draft:PATH' (repeatable; "
                        "without it the draft proposer is refused)")
    p.add_argument("--plugins-config", metavar="FILE",
                   help="TOML file whose [speculation.plugins.NAME] tables enable and "
                        "configure proposer plugins (in-process and out-of-process)")
    p.add_argument("--max-tokens", type=positive, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens of a request that does not say")
    p.add_argument("--max-tokens-limit", type=positive, default=None,
                   help="largest max_tokens accepted (default: the context length)")
    p.add_argument("--fixed-k", action="store_true",
                   help="always draft --draft-max tokens (no cost model, no calibration)")
    p.add_argument("--log-level", choices=LEVELS, default="info")
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto",
                   help="auto: console on a terminal, JSON lines otherwise")


def run(args: argparse.Namespace) -> int:
    """Run ``meshd serve`` with parsed ``args``; returns the exit code."""
    json_logs = {"auto": None, "json": True, "console": False}[args.log_format]
    configure_logging(args.log_level, json=json_logs)
    log = get_logger("meshd.serve")
    bind = args.socket or default_socket_path()
    try:
        plugins = load_plugin_config(args.plugins_config) if args.plugins_config else {}
    except PluginConfigError as exc:
        log.error("config_invalid", error=str(exc))
        print(f"meshd serve: {exc}", file=sys.stderr)
        return 2
    config = RuntimeConfig(
        model_path=args.model, n_ctx_seq=args.ctx, n_seq_max=args.slots,
        draft_max=args.draft_max, threads=args.threads, calibrate=not args.fixed_k,
        default_proposer=args.proposer, allowed_drafts=tuple(args.draft_model),
        plugins=plugins,
    )
    try:
        preflight(bind)
    except ListenerError as exc:
        log.error("listen_failed", address=bind, error=str(exc))
        print(f"meshd serve: {exc}", file=sys.stderr)
        return 1
    log.info("loading_model", model=args.model or "embedded default")
    t0 = time.monotonic()
    try:
        runtime = ModelRuntime(config)
    except (NativeError, RequestError, OSError) as exc:
        log.error("model_load_failed", error=str(exc))
        print(f"meshd serve: {exc}", file=sys.stderr)
        return 3
    with runtime:
        log.info("model_loaded", path=runtime.model.info.path,
                 seconds=round(time.monotonic() - t0, 2))
        if args.proposer not in ("off", "auto") and \
                runtime.resolve_proposer(args.proposer) not in runtime.registry:
            print(f"meshd serve: unknown proposer {args.proposer!r}; available: off, auto, "
                  f"{', '.join(runtime.registry.names())}", file=sys.stderr)
            return 2
        server = Server(runtime, ServerConfig(
            max_tokens_default=args.max_tokens, max_tokens_limit=args.max_tokens_limit,
            max_queue=args.max_queue, stream_interval_s=args.stream_interval_ms / 1000,
        ))
        options: dict[str, Any] = {}
        if args.backend == "asyncio" and importlib.util.find_spec("uvloop") is not None:
            options["use_uvloop"] = True
        try:
            anyio.run(_serve_until_signalled, server, bind, backend=args.backend,
                      backend_options=options)
        except ListenerError as exc:
            log.error("listen_failed", address=bind, error=str(exc))
            print(f"meshd serve: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # a signal before the handlers were in place
            return 130
    return 0


async def _serve_until_signalled(server: Server, bind: str) -> None:
    listener = await open_listener(bind)  # raises ListenerError plainly, before any task
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, signals, server, tg.cancel_scope)
            await server.serve(listener)
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
