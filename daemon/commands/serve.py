"""``meshd serve``: load the model, listen on the socket, serve until SIGINT/SIGTERM.

Why the order of things: the model loads (seconds) before the socket exists, so a
client that can connect can also be served; "ready" is logged and systemd told
``READY=1`` only once the socket listens. The cost curve is not waited for: it is
measured (a cached one checked) in the model's idle moments after that, piece by piece,
only while the machine is quiet (:mod:`.calibration`); meanwhile speculation prices its
windows with the cached curve, else a prior under which it never drafts. Under socket
activation the socket is systemd's and exists all along; connections wait in its
backlog until then. The first
SIGINT/SIGTERM shuts down gracefully (running generations get ``--shutdown-grace``
seconds, then end with ``done`` and ``shutdown``; a socket file meshd created is
removed); a second one stops at once. SIGHUP is handled in :mod:`.supervise`.

Every message goes to the log (stderr), once: a person at a terminal reads the console
format, journald gets priority-prefixed lines.

Exit codes: 0 after a clean shutdown, 1 when the socket cannot be used, 2 bad usage,
3 the model failed to load, 130 when a second signal cut the shutdown short.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from typing import Any, Final

import anyio
import anyio.abc

from meshd.clients.argtypes import comma_list, non_negative, positive, positive_seconds
from meshd.clients.terminal import Progress
from meshd.daemon.commands.serve_checks import StartupProblem, check_before_start, default_proposer
from meshd.daemon.commands.server import Server
from meshd.daemon.commands.supervise import (
    Reload,
    Supervisor,
    notifying_events,
    notifying_progress,
    pinging_while_starting,
)
from meshd.daemon.config import options as opt
from meshd.daemon.config import settings as cfg
from meshd.daemon.config.server import DEFAULT_SHUTDOWN_GRACE_S, ServerConfig
from meshd.daemon.engine.request_errors import RequestError
from meshd.daemon.frontends.http.tcp import open_http_listeners
from meshd.daemon.models.compute import ComputeThread
from meshd.daemon.models.model_plans import model_plans, residency
from meshd.daemon.models.model_set import ModelPlan, ModelSet
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.system.activation import ActivationError, InheritedSocket, listen_fds
from meshd.daemon.system.listener import ListenerError, default_socket_path, open_listener
from meshd.daemon.system.logs import (
    DEFAULT_LLAMA_LOG_LEVEL,
    FORMATS,
    configure_logging,
    get_logger,
    set_levels,
)
from meshd.daemon.system.notify import Notifier
from meshd.native.cpus import apply_thread_wait
from meshd.native.errors import NativeError

HTTP_FD_NAME: Final = "http"
"""``FileDescriptorName=`` of an inherited socket to serve HTTP on."""

__all__ = ["HTTP_FD_NAME", "add_parser", "run"]

#: Runtime notes about routine adaptation (logged at info, not warning).
ROUTINE_NOTES = frozenset({"rollback_depth"})


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``serve`` and its options on the ``meshd`` command line."""
    p = opt.subparser(
        sub, "serve", help="run the daemon on a Unix socket until SIGINT/SIGTERM",
        description="Load the model, listen on a Unix socket and serve requests (talk to "
                    "it with meshctl) until SIGINT/SIGTERM.",
        parents=[opt.model_options(several=True), opt.speculation_options(),
                 opt.daemon_options(), opt.placement_options()],
    )
    p.add_argument("-s", "--socket", default=None, metavar="PATH",
                   help="socket path, unix:PATH or fd://N (default: $MESHD_SERVE_SOCKET "
                        "or $MESHD_SOCKET, else the file's [serve] socket, else a "
                        f"socket-activated one, else {default_socket_path()})")
    p.add_argument("--http", default=None, metavar="tcp:127.0.0.1:PORT[,...]",
                   help="also serve HTTP (OpenAI API, /health, /metrics) on a loopback TCP "
                        "port or an inherited socket (fd://N), or on several separated by "
                        "commas (tcp:127.0.0.1:8080,tcp:[::1]:8080); the Unix socket always "
                        "serves HTTP too")
    p.add_argument("--alias", default=None, metavar="NAME[,NAME...]", type=comma_list,
                   help="other names requests may give the model (the first -m model with "
                        "several)")
    p.add_argument("--tags", default=None, metavar="TAG[,TAG...]", type=comma_list,
                   help="labels /v1/models lists with the model")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the TCP listener (not on "
                        "/health; the Unix socket checks its peer instead); prefer "
                        "$MESHD_HTTP_API_KEY or the config file, which other users cannot read")
    p.add_argument("--cors-origins", default=None, metavar="ORIGIN[,ORIGIN...]",
                   type=comma_list,
                   help="web origins whose pages may read the HTTP answers (* for any)")
    p.add_argument("--slots-endpoint", action=argparse.BooleanOptionalAction, default=None,
                   help="serve llama-server's GET /slots: each slot's state, no prompt text "
                        "(default: on)")
    p.add_argument("--verbose-responses", action="store_true", default=None,
                   help="put llama-server's __verbose block (the prompt as the model read "
                        "it) in non-streamed chat and completion answers, as llama-server "
                        "--verbose does; a request's verbose field overrides it")
    p.add_argument("--slots", metavar="N", type=positive, default=opt.DEFAULT_SLOTS,
                   help="generations decoded together (sessions in the shared context)")
    p.add_argument("--prefix-cache-tokens", metavar="N", type=non_negative, default=None,
                   help="tokens of finished requests kept for prompts that share their "
                        "start (default: every slot's context; 0 turns it off). A hit "
                        "decodes the prompt's rest in other batches than a fresh prefill, "
                        "which gives the same text with the default K cache on the CPU "
                        "(with --cache-type-k f16 a greedy near-tie can flip)")
    p.add_argument("--max-queue", metavar="N", type=non_negative, default=opt.DEFAULT_MAX_QUEUE,
                   help="requests waiting for a slot before new ones are answered busy")
    p.add_argument("--stream-interval-ms", metavar="MS", type=non_negative,
                   default=opt.DEFAULT_STREAM_INTERVAL_MS,
                   help="stream tokens in batches at most this far apart (0: each step's "
                        "tokens as soon as they are committed)")
    p.add_argument("--draft-model", action="append", default=[], metavar="PATH",
                   help="a GGUF that requests may name as 'draft:PATH' (repeatable; "
                        "without it the draft proposer is refused)")
    p.add_argument("--max-tokens", metavar="N", type=positive, default=None,
                   help="max_tokens of a request that does not say (default: until the "
                        "model stops or the context ends, as llama-server; set, it caps "
                        "such requests)")
    p.add_argument("--seed", metavar="N", type=non_negative, default=None,
                   help="the seed of sampled requests that send none, so equal requests "
                        "give equal answers (default: a random one per request)")
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
    p.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                   metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long running requests may finish before "
                        "they end with finish reason 'shutdown'")
    p.add_argument("--allow-user", action="append", default=[], metavar="USER",
                   help="serve only these users (name or uid; repeatable) and the groups "
                        "of --allow-group; root and the daemon's own user always may")
    p.add_argument("--allow-group", action="append", default=[], metavar="GROUP",
                   help="serve members of this group (name or gid; repeatable)")
    p.add_argument("--default-model", metavar="NAME", default=None,
                   help="the model of requests that name none, among the -m NAME=PATH and "
                        "[models.NAME] models (default: the first -m, else the first table)")
    p.add_argument("--keep-alive", metavar="DURATION", type=opt.duration_text,
                   default=opt.DEFAULT_KEEP_ALIVE,
                   help="how long a model stays loaded after its last request: seconds, or "
                        "30s, 5m, 1h; 0 unloads it after each request, -1 keeps it")
    p.add_argument("--max-loaded", metavar="N", type=positive, default=None,
                   help="most models loaded at once (default: no limit)")
    p.add_argument("--memory-limit", metavar="SIZE", type=opt.size_text, default=None,
                   help="most bytes of model files loaded at once (default: no limit): "
                        "8G, 512M; K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024, "
                        "KB, MB, GB, TB powers of 1000")
    p.add_argument("--log-format", choices=FORMATS, default="auto",
                   help="auto: journal under journald (priority prefixes), console on a "
                        "terminal, JSON lines otherwise")
    cfg.add_config_flags(p)


def run(args: argparse.Namespace) -> int:
    """Run ``meshd serve`` with parsed ``args``; returns the exit code."""
    flags = cfg.explicit_flags(args)
    try:
        loaded = cfg.load(args.config, flags=flags)
    except cfg.ConfigError as exc:
        configure_logging(flags.get("log_level", opt.DEFAULT_LOG_LEVEL),
                          format=flags.get("log_format", "auto"),
                          llama_level=flags.get("llama_log_level", DEFAULT_LLAMA_LOG_LEVEL))
        get_logger("meshd.serve").error("bad_config", error=str(exc))
        return 2
    c = loaded.config
    apply_thread_wait(c.model.thread_wait)  # may run this command again (see there)
    configure_logging(c.log.level, format=c.log.format, llama_level=c.log.llama_level)
    log = get_logger("meshd.serve")
    if loaded.path:
        log.info("config_loaded", path=loaded.path)
    notifier = Notifier()
    if notifier.last_error:
        log.warning("notify_unusable", error=notifier.last_error)
    try:
        inherited = listen_fds()
    except ActivationError as exc:
        log.error("socket_activation_failed", error=str(exc))
        return 1
    # serve.socket (flag, $MESHD_SERVE_SOCKET or $MESHD_SOCKET, file), else systemd's.
    bind = c.serve.socket or _activated_bind(inherited) or default_socket_path()
    http = c.serve.http or _activated_http(inherited)
    try:
        checked = check_before_start(loaded, bind=bind, http=http)
    except StartupProblem as refused:
        where = {"address": bind} if refused.event == "listen_failed" else {}
        log.error(refused.event, error=refused.message, **where)
        return refused.exit_code
    server_config = checked.server_config
    try:
        plans = model_plans(loaded, checked.proposer)
        models = ModelSet(plans, _loader(log), **residency(c), max_queue=c.serve.max_queue,
                          step_budget_s=server_config.stream_interval_s, events=log.info)
    except cfg.ConfigError as exc:
        log.error("bad_config", error=str(exc))
        return 2
    default = plans[0]
    log.info("loading_model", model=default.config.model_path or "embedded default",
             name=default.name, workers=list(default.config.rpc_workers),
             models=[p.name for p in plans])
    t0 = time.monotonic()
    # Every llama.cpp call for a model, from its load to its close, runs on its one
    # thread, so exactly one OpenMP team exists per model (see meshd.daemon.models.compute).
    # The default model loads now, so a client that can connect can be served at once.
    compute = ComputeThread(f"meshd-{default.name}")
    try:
        with pinging_while_starting(notifier):
            runtime = compute.call(lambda: ModelRuntime(
                default.config, notes=_notes(log),
                progress=notifying_progress(notifier, Progress),
                events=notifying_events(notifier, log.info),
                calibrate_now=False))
    except (NativeError, RequestError, OSError, ValueError) as exc:
        compute.close()
        log.error("model_load_failed", error=str(exc))
        return 3
    # The cost curve is measured (or a cached one checked) in the compute thread's idle
    # moments, after ready: until then speculation prices windows with the cached curve,
    # else the conservative prior (see meshd.daemon.models.calibration).
    compute.set_idle_work(runtime.idle_work())
    models.adopt(models.default, runtime, compute)
    models.describe()  # the others, from their files, for listings before their first load
    try:
        log.info("model_loaded", path=runtime.model.info.path, name=default.name,
                 seconds=round(time.monotonic() - t0, 2),
                 cache_type_k=runtime.context.config.cache_type_k,
                 proposers=runtime.usable_proposers(),
                 unavailable=runtime.unavailable_proposers())
        problem = runtime.proposer_problem(default.config.default_proposer)
        if problem is not None:
            log.error("bad_usage", error=f"proposer: {problem}")
            return 2
        server = Server(models, server_config)
        supervisor = Supervisor(server, notifier,
                                reload=_reloader(loaded, models))
        server.ready_hooks = (supervisor.on_ready,)
        options: dict[str, Any] = {}
        if c.serve.backend == "asyncio" and importlib.util.find_spec("uvloop") is not None:
            options["use_uvloop"] = True
        try:
            anyio.run(_serve_until_signalled, server, supervisor, bind, http,
                      backend=c.serve.backend, backend_options=options)
        except ListenerError as exc:
            log.error("listen_failed", address=bind, error=str(exc))
            return 1
        except KeyboardInterrupt:  # a signal before the handlers were in place
            return 130
        except Exception:  # a bug: logged as one event (with its traceback), not raw
            log.exception("serve_crashed")
            return 1
        finally:
            notifier.stopping("stopped")
            notifier.close()
    finally:
        models.close()
    return 130 if supervisor.forced else 0


def _notes(log: Any) -> Callable[[str, str], None]:
    def note(event: str, message: str) -> None:
        # Routine adaptation is information; everything else asks for attention.
        (log.info if event in ROUTINE_NOTES else log.warning)(event, message=message)

    return note


def _loader(log: Any) -> Callable[[ModelPlan], ModelRuntime]:
    """How a model other than the first loads, on first use (on its compute thread)."""
    def load(plan: ModelPlan) -> ModelRuntime:
        runtime = ModelRuntime(plan.config, notes=_notes(log), events=log.info,
                               calibrate_now=False)
        problem = runtime.proposer_problem(plan.config.default_proposer)
        if problem is not None:
            runtime.close()
            raise ValueError(f"proposer: {problem}")
        compute = ComputeThread.current()
        if compute is not None:  # calibrated in its idle moments, as the first model
            compute.set_idle_work(runtime.idle_work())
        return runtime

    return load


def _reloader(loaded: cfg.Loaded, models: ModelSet) -> Reload:
    """SIGHUP: read the file and environment again (the command line's flags still win),
    apply what can change live (limits; the models: a changed one reloads once idle),
    say which changed keys need a restart."""
    current = [loaded.config]

    def reload() -> tuple[ServerConfig, list[str]]:
        again = cfg.load(loaded.path, flags=loaded.flags)
        new = again.config
        server_config = cfg.server_config(new)  # raises before anything is applied
        try:  # so does a bad [models] table or proposer
            plans = model_plans(again, default_proposer(again))
        except StartupProblem as exc:
            raise ValueError(exc.message) from None
        limits = residency(new)
        needs_restart = cfg.restart_needed(current[0], new)
        if needs_restart:
            get_logger("meshd.serve").warning("restart_needed", keys=needs_restart)
        set_levels(new.log.level, new.log.llama_level)  # every logger, from the next event
        changed = cfg.live_changes(current[0], new)
        models.keep_alive_s = limits["keep_alive_s"]
        models.max_loaded, models.memory_limit = limits["max_loaded"], limits["memory_limit"]
        moved = models.update(plans)
        if any(moved.values()):
            get_logger("meshd.serve").info("models_changed", **moved)
        current[0] = new
        return server_config, changed + [f"models.{n}" for v in moved.values() for n in v]

    return reload


def _activated_bind(inherited: list[InheritedSocket]) -> str | None:
    """The socket-activated Unix socket to serve: the one named ``meshd`` (the unit's
    ``FileDescriptorName=``), else the first Unix one."""
    unix = [s for s in inherited if s.family == "unix" and s.name != HTTP_FD_NAME]
    named = [s for s in unix if s.name == "meshd"]
    chosen = named or unix
    return chosen[0].bind if chosen else None


def _activated_http(inherited: list[InheritedSocket]) -> str | None:
    """A socket-activated TCP socket for HTTP: the one named ``http`` (a second socket
    unit with ``FileDescriptorName=http``), else the first TCP one."""
    tcp = [s for s in inherited if s.family in ("inet", "inet6")]
    named = [s for s in tcp if s.name == HTTP_FD_NAME]
    chosen = named or tcp
    return chosen[0].bind if chosen else None


async def _serve_until_signalled(server: Server, supervisor: Supervisor, bind: str,
                                 http: str | None) -> None:
    # Raises ListenerError plainly, before any task.
    listener = await open_listener(bind, backlog=server.config.backlog)
    try:
        http_listeners = await open_http_listeners(http, backlog=server.config.backlog) \
            if http is not None else None
    except BaseException:
        await listener.aclose()
        raise
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run, tg.cancel_scope)
        await server.serve(listener, http=http_listeners)
        tg.cancel_scope.cancel()
