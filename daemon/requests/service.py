"""The daemon's service: what every connection asks of it, in one object.

Why one object over small modules: a connection is about bytes, framing, ids and tasks;
the service is what the daemon *says* and keeps daemon-wide (uptime, counters,
draining, the generations in flight), shared by every connection of both front ends.
Each of its jobs is a module of its own, and the service hands them its state:
the request lifecycle (:mod:`.preparing`: one pass from a ``RequestSpec`` to the engine
request; submitting it here), the generations in flight (:mod:`.registry`), holding a
model (:mod:`.holding`), the replies that are not generations (:mod:`.replies`:
welcome, models, health, stats; :mod:`.wire_tokens`: tokenize), the peer allow-list
and the plugins' connections.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import socket
import time
from collections.abc import AsyncIterator, Iterator

import anyio.to_thread
from structlog.typing import FilteringBoundLogger

from meshd.daemon.config.options import DEFAULT_MAX_TOKENS
from meshd.daemon.config.server import DEFAULT_SHUTDOWN_GRACE_S, ServerConfig
from meshd.daemon.models.model_set import ModelSet, ModelState, NoSuchModel, ServedModel
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.models.scheduler import Busy, GenerationHandle, GenerationRequest, Scheduler
from meshd.daemon.models.statistics import SchedulerStatistics
from meshd.daemon.requests import replies, wire_tokens
from meshd.daemon.requests.holding import hold, holding
from meshd.daemon.requests.inflight import InFlightGeneration
from meshd.daemon.requests.preparing import max_tokens_limit, prepare
from meshd.daemon.requests.registry import InFlightRegistry
from meshd.daemon.requests.replies import server_version
from meshd.daemon.requests.spec import RequestSpec
from meshd.daemon.system.peercred import peer_credentials
from meshd.plugins.remote_plugin import PluginRefused
from meshd.plugins.remote_plugin_set import is_plugin_hello
from meshd.protocol import (
    Detokenize,
    DetokenizeReply,
    Generate,
    Health,
    HealthReply,
    Hello,
    Load,
    LoadReply,
    ModelError,
    ModelInfo,
    Models,
    ModelsReply,
    ServerBusy,
    Stats,
    StatsReply,
    Tokenize,
    TokenizeReply,
    UnknownModel,
    Unload,
    UnloadReply,
    Welcome,
)

__all__ = ["DEFAULT_MAX_TOKENS", "DEFAULT_SHUTDOWN_GRACE_S", "InFlightGeneration", "ServerConfig",
           "Service", "peer_owner", "server_version"]


def peer_owner(sock: socket.socket | None) -> str | None:
    """Who a Unix-socket peer is, as history lookup keeps answers
    apart (``uid:N``, as the HTTP front end's ``stream_owner`` says it); None when the
    kernel gives no credentials (no history then)."""
    peer = peer_credentials(sock) if sock is not None else None
    return None if peer is None else f"uid:{peer.uid}"


class Service:
    """What the daemon answers; one per daemon, used by all its connections."""

    def __init__(self, models: ModelSet, config: ServerConfig | None = None) -> None:
        self.models = models
        self.config = config if config is not None else ServerConfig()
        self.started = time.monotonic()
        self.started_at = time.time()
        self.draining = False
        self.counters: collections.Counter[str] = collections.Counter()
        self.open_connections = 0
        self._inflight = InFlightRegistry(models)

    # ------------------------------------------------------------------ state

    @property
    def runtime(self) -> ModelRuntime:
        """The default model's runtime, while it is loaded (out-of-process plugins
        connect to it)."""
        runtime = self.models.default.runtime
        assert runtime is not None, "the default model is not loaded"
        return runtime

    @property
    def scheduler(self) -> Scheduler:
        """The default model's scheduler, while it is loaded."""
        scheduler = self.models.default.scheduler
        assert scheduler is not None, "the default model is not loaded"
        return scheduler

    def max_tokens_limit(self, runtime: ModelRuntime) -> int:
        return max_tokens_limit(self.config, runtime)

    @property
    def uptime_s(self) -> float:
        return max(0.0, time.monotonic() - self.started)

    # ------------------------------------------------------------------ replies

    def welcome(self, hello: Hello) -> Welcome:
        """The handshake answer (:func:`.replies.welcome`)."""
        return replies.welcome(hello, self.model, self.config.max_frame_size)

    def proposers(self) -> tuple[str, ...]:
        """Names ``generate.speculative.proposer`` may use on the default model (``off``
        is always allowed); installed ones that cannot serve it are left out."""
        return self.model.proposers

    def list_models(self, request: Models) -> ModelsReply:
        return ModelsReply(id=request.id, models=tuple(self.info(m) for m in self.models))

    @property
    def model(self) -> ModelInfo:
        """The default model."""
        return self.info(self.models.default)

    def info(self, served: ServedModel) -> ModelInfo:
        """What ``welcome`` and ``models`` say of a model (:func:`.replies.model_info`)."""
        return replies.model_info(self.models, served)

    def health(self, request: Health) -> HealthReply:
        """Answered from counters only: never waits for a model."""
        return replies.health(request, self.models, draining=self.draining,
                              uptime_s=self.uptime_s)

    def statistics(self) -> SchedulerStatistics:
        """Every model's figures together."""
        return replies.statistics(self.models)

    def stats(self, request: Stats) -> StatsReply:
        return replies.stats(request, self.models, self.counters,
                             open_connections=self.open_connections, uptime_s=self.uptime_s)

    async def tokenize(self, request: Tokenize) -> TokenizeReply:
        return await wire_tokens.tokenize(self.models, request, self.config.max_frame_size)

    async def detokenize(self, request: Detokenize) -> DetokenizeReply:
        return await wire_tokens.detokenize(self.models, request, self.config.max_frame_size)

    # ------------------------------------------------------------------ peers, plugins

    def admits_peer(self, sock: socket.socket | None, log: FilteringBoundLogger) -> bool:
        """Whether the allow-list serves this connection's peer (SO_PEERCRED); a refused
        peer is counted and logged here, for the native protocol and HTTP alike."""
        policy = self.config.peers
        if not policy.restricted or sock is None:
            return True
        peer = peer_credentials(sock)
        if policy.allows(peer):
            return True
        self.counters["connections_denied"] += 1
        log.warning("peer_denied", pid=peer.pid if peer else None,
                    uid=peer.uid if peer else None, gid=peer.gid if peer else None)
        return False

    async def plugin_ingress(self, first_frame: bytes, sock: socket.socket) -> bool:
        """Whether ``first_frame`` opened a proposer plugin's connection; if so, the
        default model's plugin host (loading the model if need be) takes over a duplicate
        of the socket (set-up on a worker thread, the link then lives in the host) and
        the connection ends here. The peer's SO_PEERCRED credentials go with it (a table
        may pin the plugin's uid/gid)."""
        if not is_plugin_hello(first_frame):
            return False
        peer = peer_credentials(sock)
        try:
            async with self.holding(None, None) as rt:  # the default model's
                await anyio.to_thread.run_sync(
                    functools.partial(rt.plugins.adopt, sock.dup(), first_frame, peer=peer))
        except (PluginRefused, ModelError, ServerBusy):  # (no model to attach to)
            self.counters["plugins_refused"] += 1
        return True

    # ------------------------------------------------------------------ models

    async def hold(self, name: str | None, request_id: str | None) -> ServedModel:
        """Hold the model ``name`` (None: the default) until :meth:`ModelSet.release`
        (:func:`.holding.hold`)."""
        return await hold(self.models, name, request_id)

    @contextlib.asynccontextmanager
    async def holding(self, name: str | None, request_id: str | None
                      ) -> AsyncIterator[ModelRuntime]:
        """The runtime of model ``name`` (None: the default), held for the block."""
        async with holding(self.models, name, request_id) as rt:
            yield rt

    async def load(self, request: Load) -> LoadReply:
        """Load a model now (``meshctl load``); it then stays for its keep-alive."""
        served = await self.hold(request.model, request.id)
        self.models.release(served, request.keep_alive)
        return LoadReply(id=request.id, model=self.info(served))

    async def unload(self, request: Unload) -> UnloadReply:
        """Unload a model now (``meshctl unload``); a busy one goes as soon as its last
        request ends (its keep-alive becomes 0). Unloading an unloaded model is no error."""
        try:
            served = self.models.get(request.model)
        except NoSuchModel:
            raise UnknownModel(f"no model named {request.model!r}; this daemon serves: "
                               f"{', '.join(self.models.models)}",
                               request_id=request.id) from None
        if not await self.models.unload(served, reason="request"):
            self.models.unload_when_idle(served)
        return UnloadReply(id=request.id, model=self.info(served),
                           unloaded=served.state is ModelState.UNLOADED)

    # ------------------------------------------------------------------ generate

    async def prepare(self, spec: RequestSpec | Generate, entry: InFlightGeneration
                      ) -> GenerationRequest:
        """Check a request and make its engine request once (:func:`.preparing.prepare`);
        ``entry`` then holds its model until :meth:`unregister`."""
        return await prepare(self.models, self.config, spec, entry)

    async def start(self, spec: RequestSpec | Generate, entry: InFlightGeneration
                    ) -> GenerationRequest:
        """The one request lifecycle of both front ends, between :meth:`register` and
        :meth:`unregister`: prepare (``entry`` then holds the model), then, unless the
        request was cancelled meanwhile, submit it and attach its handle to ``entry``
        (``entry.handle`` stays None for a request cancelled before it reached the
        scheduler). Raises what :meth:`prepare` and :meth:`submit` raise."""
        gen = await self.prepare(spec, entry)
        if not entry.cancelled:
            entry.attach(self.submit(gen, entry))
        return gen

    def submit(self, request: GenerationRequest, entry: InFlightGeneration,
               request_id: str | None = None, *, copy: InFlightGeneration | None = None
               ) -> GenerationHandle:
        """Queue an engine request on ``entry``'s model (held since :meth:`prepare`),
        cancelled by ``entry``'s latch (or, for another generation of the same request,
        ``copy``'s); raises ServerBusy when draining or the queue is full."""
        request_id = request_id or entry.id
        if self.draining:
            raise ServerBusy("the server is shutting down", request_id=request_id)
        assert entry.model is not None and entry.model.scheduler is not None
        try:
            return entry.model.scheduler.submit(request, (copy or entry).cancellation)
        except Busy as exc:
            raise ServerBusy(f"queue full ({exc})", request_id=request_id) from exc

    # ------------------------------------------------------------------ in flight

    def register(self, entry: InFlightGeneration) -> None:
        """Track a generation until :meth:`unregister` (for shutdown and cancel)."""
        self._inflight.register(entry)

    def unregister(self, entry: InFlightGeneration) -> None:
        """Stop tracking it and release the model it holds."""
        self._inflight.unregister(entry)

    def cancel_anywhere(self, request_id: str) -> bool:
        """Cancel the daemon's only in-flight generation with this id, on any connection
        (``meshctl cancel ID`` from another process); an ambiguous id cancels nothing."""
        return self._inflight.cancel_anywhere(request_id)

    def inflight(self) -> Iterator[InFlightGeneration]:
        return iter(self._inflight)

    @property
    def n_inflight(self) -> int:
        return len(self._inflight)

    async def drain(self, timeout_s: float, *, grace_s: float = 0.0) -> bool:
        """Refuse new work, let running generations finish for up to ``grace_s``, then
        cancel the rest (their clients get ``done`` with ``finish_reason: shutdown``) and
        wait for them to end. Returns whether all ended within ``timeout_s`` of that."""
        self.draining = True
        return await self._inflight.drain(timeout_s, grace_s=grace_s)
