"""The daemon: a listener, the scheduler's engine loop, and one task per connection.

Why this shape (structured concurrency, as in trio): :meth:`Server.serve` owns every
task it starts; it reports readiness through ``task_status.started()`` once the socket
listens, and nothing outlives it. Shutting down is a sequence, not a cancellation
storm: stop accepting and remove the socket, refuse new work, cancel every generation
so its client gets ``done`` with ``finish_reason: cancelled``, wait (bounded) for those
to be delivered, then close the connections and stop the engine loop. Cancelling
``serve`` from outside (a test's task group, a second Ctrl-C) skips the politeness but
still closes every generation's session and removes the socket.

The same code runs on asyncio (uvloop when installed) and trio through anyio.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc

from meshd.protocol import ServerBusy, encode

from .connection import Connection
from .listener import BindSpec, Listener, open_listener
from .logs import get_logger
from .runtime import ModelRuntime
from .scheduler import Scheduler
from .service import ServerConfig, Service

__all__ = ["Server", "serving"]

ReadyHook = Callable[[str], None]
"""Called with the bind address once the daemon accepts connections (systemd notify)."""


class Server:
    """Serves one ModelRuntime over the protocol; run it with :meth:`serve`."""

    def __init__(self, runtime: ModelRuntime, config: ServerConfig | None = None, *,
                 ready_hooks: tuple[ReadyHook, ...] = ()) -> None:
        self.runtime = runtime
        self.config = config = config if config is not None else ServerConfig()
        self.scheduler = Scheduler(runtime, max_queue=config.max_queue,
                                   step_budget_s=config.stream_interval_s)
        self.service = Service(runtime, self.scheduler, config)
        self.ready_hooks = ready_hooks
        self.log = get_logger("meshd.server")
        self.listener: Listener | None = None
        self._connections: set[Connection] = set()
        self._ids = itertools.count(1)
        self._starting = 0  # connections accepted whose task has not begun yet
        self._stop = anyio.Event()

    def shutdown(self) -> None:
        """Begin a graceful shutdown (call from the event loop; idempotent)."""
        self._stop.set()

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def serve(
        self, bind: BindSpec | str | Listener, *,
        task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``bind`` (or serve an open Listener, which it then owns) until
        :meth:`shutdown` or cancellation.

        Reports the bind address (``unix:PATH``) as started once it accepts connections.
        Raises ListenerError (before starting anything) when it cannot listen.
        """
        listener = bind if isinstance(bind, Listener) else \
            await open_listener(bind, backlog=self.config.backlog)
        self.listener = listener
        async with listener, anyio.create_task_group() as engine:
            await engine.start(self.scheduler.run)
            async with anyio.create_task_group() as conns:
                async with anyio.create_task_group() as accepting:
                    accepting.start_soon(self._accept_loop, listener, conns)
                    self._ready(listener.address)
                    task_status.started(listener.address)
                    await self._stop.wait()
                    accepting.cancel_scope.cancel()
                await self._shutdown(listener)
                conns.cancel_scope.cancel()
            engine.cancel_scope.cancel()
        self.log.info("stopped")

    def _ready(self, address: str) -> None:
        m = self.service.model
        self.log.info("ready", address=address, model=m.name, n_ctx=m.n_ctx,
                      slots=self.runtime.context.config.n_seq_max,
                      proposers=list(self.service.proposers()))
        for hook in self.ready_hooks:
            hook(address)

    async def _shutdown(self, listener: Listener) -> None:
        self.log.info("shutting_down", in_flight=self.service.n_inflight,
                      connections=len(self._connections))
        await listener.aclose()  # no new connections; the socket file goes away now
        drained = await self.service.drain(self.config.drain_timeout_s)
        if not drained:
            self.log.warning("drain_timeout", in_flight=self.service.n_inflight)
        for conn in list(self._connections):
            conn.close()

    async def _accept_loop(self, listener: Listener, conns: anyio.abc.TaskGroup) -> None:
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
            if len(self._connections) + self._starting >= self.config.max_connections:
                await self._refuse(stream)
                continue
            conn = Connection(stream, self.service, conn_id=next(self._ids), log=self.log)
            self._starting += 1
            conns.start_soon(self._run_connection, conn)

    async def _refuse(self, stream: anyio.abc.SocketStream) -> None:
        """Answer a connection over the limit with a ``busy`` error and close it at once
        (it gets a typed answer, and holds no descriptor of ours afterwards)."""
        limit = self.config.max_connections
        self.service.counters["connections_refused"] += 1
        self.service.counters["errors_busy"] += 1
        self.log.warning("connection_refused", reason="max_connections", limit=limit)
        frame = encode(ServerBusy(f"too many connections (limit {limit}); retry later")
                       .to_message())
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        with contextlib.suppress(OSError):
            sock.send(frame)  # a fresh socket's buffer takes one small frame
        with anyio.CancelScope(shield=True):
            await stream.aclose()

    async def _run_connection(self, conn: Connection) -> None:
        self._starting -= 1
        self._connections.add(conn)
        self.service.open_connections = len(self._connections)
        try:
            await conn.run()
        except Exception:
            # A bug in one connection must not take the daemon (and everyone else's
            # requests) down with it.
            self.log.exception("connection_crashed", conn=conn.conn_id)
        finally:
            self._connections.discard(conn)
            self.service.open_connections = len(self._connections)


@asynccontextmanager
async def serving(
    runtime: ModelRuntime, bind: BindSpec | str, config: ServerConfig | None = None
) -> AsyncIterator[Server]:
    """Run a daemon in the current task group's event loop for the ``async with`` body.

    For tests, benchmarks and embedding. On exit the daemon shuts down gracefully.
    """
    server = Server(runtime, config)
    body_error: Exception | None = None
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, bind)
        try:
            yield server
        except Exception as exc:
            # Re-raised outside the task group so callers see their own exception, not
            # an ExceptionGroup; no point in a polite shutdown then.
            body_error = exc
            tg.cancel_scope.cancel()
        finally:
            server.shutdown()
    if body_error is not None:
        raise body_error
