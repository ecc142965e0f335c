"""The daemon: a listener, the scheduler's engine loop, and one task per connection.

Why this shape (structured concurrency, as in trio): :meth:`Server.serve` owns every
task it starts; it reports readiness through ``task_status.started()`` once the socket
listens, and nothing outlives it. Shutting down is a sequence, not a cancellation
storm: stop accepting and remove the socket, refuse new work, let running generations
finish for a grace period, cancel the rest so each client gets ``done`` with
``finish_reason: shutdown``, wait (bounded) for those to be delivered, then close the
connections and stop the engine loop. Cancelling
``serve`` from outside (a test's task group, a second Ctrl-C) skips the politeness but
still closes every generation's session and removes the socket.

The same code runs on asyncio (uvloop when installed) and trio through anyio.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial

import anyio
import anyio.abc

from meshd.daemon.config.server import ServerConfig
from meshd.daemon.frontends.http.connection import HttpConnection
from meshd.daemon.frontends.http.stream_sessions import StreamSessions
from meshd.daemon.frontends.http.tcp import open_http_listeners
from meshd.daemon.frontends.native.connection import Connection
from meshd.daemon.frontends.sniff import Kind, sniff
from meshd.daemon.models.compute import ComputeThread
from meshd.daemon.models.mapping import model_info
from meshd.daemon.models.model_set import ModelSet
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.models.scheduler import Scheduler
from meshd.daemon.requests.service import Service
from meshd.daemon.system.listener import BindSpec, Listener, open_listener
from meshd.daemon.system.logs import get_logger
from meshd.protocol import ServerBusy, encode, error_message

__all__ = ["Server", "serving"]

ReadyHook = Callable[[str], None]
"""Called with the bind address once the daemon accepts connections (systemd notify)."""


class Server:
    """Serves a ModelSet (or one ModelRuntime) over the protocol; run it with
    :meth:`serve`."""

    def __init__(self, models: ModelSet | ModelRuntime, config: ServerConfig | None = None, *,
                 ready_hooks: tuple[ReadyHook, ...] = (),
                 compute: ComputeThread | None = None) -> None:
        """``models``: the set of models served, or one runtime its caller loaded and
        closes (named after its file; ``compute``: the thread it was loaded on, which
        then makes every llama.cpp call, else a thread of its own)."""
        self.config = config = config if config is not None else ServerConfig()
        if isinstance(models, ModelRuntime):
            models = ModelSet.single(models, model_info(models).name, compute=compute,
                                     max_queue=config.max_queue,
                                     step_budget_s=config.stream_interval_s)
        self.models = models
        self.service = Service(models, config)
        self.ready_hooks = ready_hooks
        self.log = get_logger("meshd.server")
        self.listener: Listener | None = None
        #: The HTTP-only listeners (``--http``), if any.
        self.http_listeners: list[Listener] = []
        self._connections: set[Connection | HttpConnection] = set()
        self._ids = itertools.count(1)
        #: The HTTP front end's resumable streams, shared by its connections.
        self.streams = StreamSessions()
        self._open = 0  # connections accepted and not yet closed (the limit counts them)
        self._stop = anyio.Event()
        self._grace_s: float | None = None

    def shutdown(self, *, grace_s: float | None = None) -> None:
        """Begin a graceful shutdown (call from the event loop; idempotent): stop
        accepting, let running generations finish for up to ``grace_s`` (default: the
        config's ``shutdown_grace_s``), then end the rest with ``shutdown``."""
        if not self._stop.is_set() and grace_s is not None:
            self._grace_s = grace_s
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def runtime(self) -> ModelRuntime:
        """The default model's runtime (while loaded)."""
        return self.service.runtime

    @property
    def scheduler(self) -> Scheduler:
        """The default model's scheduler (while loaded)."""
        return self.service.scheduler

    def reconfigure(self, config: ServerConfig) -> None:
        """Apply settings that can change while serving (SIGHUP): limits, timeouts,
        the stream interval and the peer allow-list. New connections use them at once;
        open ones keep the allow-list they were admitted under."""
        self.config = config
        self.service.config = config
        self.models.reconfigure(max_queue=config.max_queue,
                                step_budget_s=config.stream_interval_s)
        self._warn_if_tcp_bypasses_allow_list()

    def _warn_if_tcp_bypasses_allow_list(self) -> None:
        """TCP peers carry no credentials, so ``--allow-user``/``--allow-group`` cannot
        apply to ``--http``: whoever reaches the loopback port is served. Say so."""
        if self.http_listeners and self.config.peers.restricted:
            addresses = ",".join(h.address for h in self.http_listeners)
            self.log.warning(
                "allow_list_bypassed_by_tcp", http=addresses,
                message="the allowed users and groups apply to the Unix socket only: any "
                        "local user can reach the --http TCP port")

    @property
    def http_listener(self) -> Listener | None:
        """The first HTTP-only listener (None: none)."""
        return self.http_listeners[0] if self.http_listeners else None

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def serve(
        self, bind: BindSpec | str | Listener, *,
        http: str | Listener | list[Listener] | None = None,
        task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``bind`` (or serve an open Listener, which it then owns) until
        :meth:`shutdown` or cancellation; with ``http`` also serve HTTP only there
        (``tcp:127.0.0.1:PORT``, ``fd://N``, several of them separated by commas, or
        open Listeners).

        Reports the bind address (``unix:PATH``) as started once it accepts connections.
        Raises ListenerError (before starting anything) when it cannot listen.
        """
        listener = bind if isinstance(bind, Listener) else \
            await open_listener(bind, backlog=self.config.backlog)
        self.listener = listener
        async with listener:
            if isinstance(http, str):
                http = await open_http_listeners(http, backlog=self.config.backlog)
            self.http_listeners = [http] if isinstance(http, Listener) else list(http or [])
            async with AsyncExitStack() as stack:
                for http_listener in self.http_listeners:
                    await stack.enter_async_context(http_listener)
                await self._run(listener, task_status)

    async def _run(self, listener: Listener, task_status: anyio.abc.TaskStatus[str]) -> None:
        async with anyio.create_task_group() as engine:
            await engine.start(self.models.run)
            if any(m.plan.config.rpc_workers for m in self.models):
                engine.start_soon(self._recover_workers)
            async with anyio.create_task_group() as conns:
                async with anyio.create_task_group() as accepting:
                    accepting.start_soon(self._accept_loop, listener, conns)
                    for http_listener in self.http_listeners:
                        accepting.start_soon(self._accept_loop, http_listener, conns, True)
                    self._warn_if_tcp_bypasses_allow_list()
                    self._ready(listener.address)
                    task_status.started(listener.address)
                    await self._stop.wait()
                    accepting.cancel_scope.cancel()
                await self._shutdown(listener)
                conns.cancel_scope.cancel()
            engine.cancel_scope.cancel()
        self.log.info("stopped")

    async def _recover_workers(self) -> None:
        """While a loaded model's remote worker is lost, probe it; once every worker
        answers, load that model again (on its compute thread, between forwards) so
        health goes back from ``degraded`` to ``ok``."""
        reported: set[str] = set()
        while True:
            await anyio.sleep(self.config.worker_probe_s)
            for served in self.models.loaded():
                runtime, scheduler = served.runtime, served.scheduler
                remote = runtime.remote if runtime is not None else None
                if remote is None or scheduler is None or runtime is None \
                        or not runtime.degraded:
                    continue
                if served.name not in reported:
                    self.log.error("worker_lost", model=served.name,
                                   workers=[a for a, _ in remote.lost],
                                   reasons=[r for _, r in remote.lost])
                    reported.add(served.name)
                if not await anyio.to_thread.run_sync(remote.all_answer):
                    continue
                try:
                    reloaded = await scheduler.run_sync(runtime.reload)
                except Exception as exc:  # still failing: keep probing
                    self.log.warning("worker_reload_failed", model=served.name,
                                     error=str(exc))
                    continue
                if reloaded:
                    self.log.info("workers_back", model=served.name,
                                  workers=[str(e) for e in remote.endpoints])
                    reported.discard(served.name)

    def _ready(self, address: str) -> None:
        m = self.service.model
        http = ",".join(h.address for h in self.http_listeners) or None
        self.log.info("ready", address=address, http=http, model=m.name, n_ctx=m.n_ctx,
                      slots=self.models.default.plan.config.n_seq_max,
                      proposers=list(self.service.proposers()),
                      models=[s.name for s in self.models])
        for hook in self.ready_hooks:
            hook(address)

    async def _shutdown(self, listener: Listener) -> None:
        self.log.info("shutting_down", in_flight=self.service.n_inflight,
                      connections=len(self._connections))
        await listener.aclose()  # no new connections; the socket file goes away now
        for http_listener in self.http_listeners:
            await http_listener.aclose()
        grace = self.config.shutdown_grace_s if self._grace_s is None else self._grace_s
        drained = await self.service.drain(self.config.drain_timeout_s, grace_s=grace)
        if not drained:
            self.log.warning("drain_timeout", in_flight=self.service.n_inflight)
        for conn in list(self._connections):
            conn.close()

    async def _accept_loop(self, listener: Listener, conns: anyio.abc.TaskGroup,
                           http_only: bool = False) -> None:
        while True:
            try:
                stream = await listener.accept()
            except anyio.ClosedResourceError:
                return
            except OSError as exc:
                self.log.error("accept_failed", error=str(exc))
                await anyio.sleep(0.1)
                continue
            self.service.counters["connections_total"] += 1
            if self._open >= self.config.max_connections:
                await self._refuse(stream, http_only)
                continue
            self._open += 1
            self.service.open_connections = self._open
            conns.start_soon(self._run_stream, stream, http_only)

    async def _refuse(self, stream: anyio.abc.SocketStream, http_only: bool) -> None:
        """Close a connection over the limit at once, so it holds no descriptor of ours;
        on the daemon's socket it first gets a ``busy`` error frame saying why."""
        limit = self.config.max_connections
        self.service.counters["connections_refused"] += 1
        self.log.warning("connection_refused", reason="max_connections", limit=limit)
        if not http_only:
            self.service.counters["errors_busy"] += 1
            frame = encode(error_message(
                ServerBusy(f"too many connections (limit {limit}); retry later")))
            sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
            with contextlib.suppress(OSError):
                sock.send(frame)  # a fresh socket's buffer takes one small frame
        with anyio.CancelScope(shield=True):
            await stream.aclose()

    async def _run_stream(self, stream: anyio.abc.SocketStream, http_only: bool) -> None:
        """Serve a new connection: HTTP-only listeners speak HTTP; on the daemon's own
        socket the first bytes tell an HTTP request from an NDJSON frame."""
        try:
            conn_id = next(self._ids)
            kind = Kind.HTTP if http_only else await sniff(stream, self.config.hello_timeout_s)
            if kind is Kind.GONE:
                self.log.info("hello_timeout", conn=conn_id)
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                return
            conn: Connection | HttpConnection
            if kind is Kind.HTTP:
                self.service.counters["connections_http"] += 1
                conn = HttpConnection(stream, self.service, conn_id=conn_id, log=self.log,
                                      streams=self.streams)
            else:
                conn = Connection(stream, self.service, conn_id=conn_id, log=self.log)
            await self._run_connection(conn)
        finally:
            self._open -= 1
            self.service.open_connections = self._open

    async def _run_connection(self, conn: Connection | HttpConnection) -> None:
        self._connections.add(conn)
        try:
            await conn.run()
        except Exception:
            # A bug in one connection must not take the daemon (and everyone else's
            # requests) down with it.
            self.log.exception("connection_crashed", conn=conn.conn_id)
        finally:
            self._connections.discard(conn)


@asynccontextmanager
async def serving(
    models: ModelRuntime | ModelSet, bind: BindSpec | str, config: ServerConfig | None = None,
    *, http: str | None = None,
) -> AsyncIterator[Server]:
    """Run a daemon in the current task group's event loop for the ``async with`` body.

    For tests, benchmarks and embedding. On exit the daemon shuts down gracefully (a
    ModelSet's models stay loaded: close them with :meth:`ModelSet.close`).
    """
    server = Server(models, config)
    body_error: Exception | None = None
    async with anyio.create_task_group() as tg:
        await tg.start(partial(server.serve, http=http), bind)
        try:
            yield server
        except Exception as exc:
            # Re-raised outside the task group so callers see their own exception, not
            # an ExceptionGroup; no point in a polite shutdown then.
            body_error = exc
            tg.cancel_scope.cancel()
        finally:
            # Leaving the block means "stop now": no grace period for what still runs.
            server.shutdown(grace_s=0)
    if body_error is not None:
        raise body_error
