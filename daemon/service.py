"""The daemon's answers to protocol requests, shared by every connection.

Why separate from the connection: a connection is about bytes, framing, ids and tasks;
this is about what the daemon *says*: the ``welcome``, health and statistics, turning a
``generate`` into an engine request (rendering chat, tokenizing, checking limits) and
refusing what cannot be served with the right error code. It also keeps the daemon-wide
view a connection cannot have: uptime, counters, draining, and every generation in
flight (for shutdown and for cancelling a request from another connection).
"""

from __future__ import annotations

import collections
import functools
import importlib.metadata
import socket
import time
from collections.abc import Iterator
from typing import Final

import anyio
import anyio.to_thread
import attrs
from structlog.typing import FilteringBoundLogger

from meshd.native.tokenizer import TooManyTokens
from meshd.plugins.host import PluginRefused
from meshd.plugins.hosts import is_plugin_hello
from meshd.protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    PROPOSER_OFF,
    PROTOCOL_VERSION,
    BadRequest,
    Detokenize,
    DetokenizeReply,
    FrameTooLarge,
    Generate,
    Health,
    HealthReply,
    HealthStatus,
    Hello,
    ModelError,
    ModelInfo,
    Models,
    ModelsReply,
    ProposerStats,
    ServerBusy,
    Stats,
    StatsReply,
    Tokenize,
    TokenizeReply,
    UnsupportedVersion,
    Welcome,
)

from .constraint import ConstraintError
from .http.config import HttpConfig
from .mapping import model_info, sampling_params
from .options import DEFAULT_MAX_QUEUE, DEFAULT_MAX_TOKENS, DEFAULT_STREAM_INTERVAL_MS
from .peercred import PeerPolicy, peer_credentials
from .prompt_fit import PromptTooLong, prompt_tokens
from .request_errors import RequestError
from .runtime import ModelRuntime
from .sampling import with_chosen_seed
from .scheduler import Busy, GenerationHandle, GenerationRequest, Scheduler

__all__ = ["DEFAULT_MAX_TOKENS", "DEFAULT_SHUTDOWN_GRACE_S", "InFlightGeneration", "ServerConfig",
           "Service", "server_version"]



DEFAULT_SHUTDOWN_GRACE_S: Final = 30.0
"""Seconds running generations may go on after SIGTERM (systemd's stop timeout is 90)."""


def server_version() -> str:
    """meshd's installed version (``0+unknown`` when run from an uninstalled tree)."""
    try:
        return importlib.metadata.version("meshd")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@attrs.frozen
class ServerConfig:
    """Per-daemon limits and timeouts (the model side is ``RuntimeConfig``)."""

    max_tokens_default: int = DEFAULT_MAX_TOKENS
    max_tokens_limit: int | None = None
    """Largest ``max_tokens`` accepted; ``None`` means the per-session context length."""
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    max_queue: int = DEFAULT_MAX_QUEUE
    """Generations waiting for a slot before new ones are answered ``busy``."""
    stream_interval_s: float = DEFAULT_STREAM_INTERVAL_MS / 1000
    """Tokens are streamed in batches at most this far apart (after the first token)."""
    max_requests_per_connection: int = 256
    """Concurrent requests one connection may have in flight before ``busy``."""
    hello_timeout_s: float = 10.0
    """A connection that does not say ``hello`` within this is closed."""
    idle_timeout_s: float = 300.0
    """After the handshake, a connection with no request in flight that sends no frame
    for this long is closed (each connection holds a file descriptor)."""
    frame_timeout_s: float = 30.0
    """A frame that has begun must be complete (newline) within this; else the client
    gets a ``bad_request`` error and the connection is closed."""
    max_connections: int = 1024
    """Open connections at once; one more is answered ``busy`` and closed."""
    backlog: int | None = None
    """Listen backlog; ``None`` takes the system's maximum (``net.core.somaxconn``)."""
    send_timeout_s: float = 60.0
    """A client that takes longer than this to accept one write is disconnected."""
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    """On shutdown, how long running generations may go on to finish normally; those
    still running then end with ``done`` and ``finish_reason: shutdown``."""
    drain_timeout_s: float = 10.0
    """On shutdown, how long cancelled generations get to end with ``done``."""
    worker_probe_s: float = 1.0
    """While a remote worker is lost, how often it is probed to reload the model."""
    peers: PeerPolicy = attrs.field(factory=PeerPolicy)
    """Which peers (by uid/gid from the socket's credentials) are served."""
    http: HttpConfig = attrs.field(factory=HttpConfig)
    """Limits and timeouts of HTTP connections (Unix socket and ``--http``)."""


class InFlightGeneration:
    """One generation a connection is serving: its id and (once admitted) its handle.

    A ``cancel`` may arrive before the request reached the scheduler (while the prompt
    is being tokenized), so cancellation is remembered and applied on :meth:`attach`.
    """

    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self.handle: GenerationHandle | None = None
        self.cancelled = False
        #: Cancelled because the daemon is shutting down (``done`` says ``shutdown``).
        self.shutdown = False

    def attach(self, handle: GenerationHandle) -> None:
        self.handle = handle
        if self.cancelled:
            handle.cancel()

    def cancel(self) -> None:
        """Stop at the next step boundary (idempotent)."""
        self.cancelled = True
        if self.handle is not None:
            self.handle.cancel()


class Service:
    """What the daemon answers; one per daemon, used by all its connections."""

    def __init__(self, runtime: ModelRuntime, scheduler: Scheduler,
                 config: ServerConfig = ServerConfig()) -> None:
        self.runtime = runtime
        self.scheduler = scheduler
        self.config = config
        self.started = time.monotonic()
        self.started_at = time.time()
        self.draining = False
        self.counters: collections.Counter[str] = collections.Counter()
        self.open_connections = 0
        self._model_info = model_info(runtime)
        self._inflight: dict[str, list[InFlightGeneration]] = {}
        self._n_inflight = 0
        self._idle = anyio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ limits

    @property
    def max_tokens_limit(self) -> int:
        limit = self.config.max_tokens_limit
        return limit if limit is not None else self.runtime.context.config.n_ctx_seq

    @property
    def uptime_s(self) -> float:
        return max(0.0, time.monotonic() - self.started)

    # ------------------------------------------------------------------ simple replies

    def welcome(self, hello: Hello) -> Welcome:
        """The handshake answer; raises UnsupportedVersion for another protocol version."""
        if hello.protocol_version != PROTOCOL_VERSION:
            raise UnsupportedVersion(
                f"server speaks protocol {PROTOCOL_VERSION}, not {hello.protocol_version}",
                request_id=hello.id,
            )
        capabilities = ["speculation", "tokenize"]
        if self._model_info.has_chat_template:
            capabilities.insert(0, "chat")
        return Welcome(
            id=hello.id,
            protocol_version=PROTOCOL_VERSION,
            server_version=server_version(),
            model=self._model_info,
            capabilities=tuple(capabilities),
            proposers=self.proposers(),
            max_frame_size=self.config.max_frame_size,
        )

    def proposers(self) -> tuple[str, ...]:
        """Names ``generate.speculative.proposer`` may use on this model (``off`` is
        always allowed); installed ones that cannot serve it are left out."""
        return tuple(self.runtime.usable_proposers())

    def models(self, request: Models) -> ModelsReply:
        return ModelsReply(id=request.id, models=(self._model_info,))

    @property
    def model(self) -> ModelInfo:
        return self._model_info

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

    def health(self, request: Health) -> HealthReply:
        """Answered from counters only: never waits for the model."""
        return HealthReply(
            id=request.id,
            status=(HealthStatus.DRAINING if self.draining
                    else HealthStatus.DEGRADED if self.runtime.degraded else HealthStatus.OK),
            uptime_s=self.uptime_s,
            active_requests=self.scheduler.active,
            queued_requests=self.scheduler.queued,
        )

    def stats(self, request: Stats) -> StatsReply:
        st = self.scheduler.statistics()
        counters: dict[str, float] = {
            "requests_total": st.requests,
            "requests_completed": st.completed,
            "requests_cancelled": st.cancelled,
            "requests_failed": st.failed,
            "tokens_generated": st.tokens,
            "prompt_tokens": st.prompt_tokens,
            "forwards": st.forwards,
            "steps": st.steps,
            "active_requests": st.active,
            "queued_requests": st.queued,
            "idle_slots": st.runtime.idle_slots,
            "cached_sessions": st.runtime.cached_sessions,
            "connections_open": self.open_connections,
            # Every busy refusal is counted where its answer is sent (the connection),
            # the scheduler's queue-full ones included.
            "errors_busy": 0,
            "prefix_cache_tokens": st.runtime.prefix_cache_tokens,
            "checkpoint_bytes": st.runtime.checkpoint_bytes,
        }
        for reason, n in st.finish_reasons.items():
            counters[f"finish_{reason}"] = n
        for name, snap in (("verify_seconds", st.verify_seconds),
                           ("decode_seconds", st.decode_seconds),
                           ("request_seconds", st.request_seconds),
                           ("step_host_seconds", st.step_host_seconds),
                           ("time_to_first_token_seconds", st.time_to_first_token_seconds),
                           ("inter_token_latency_seconds", st.inter_token_latency_seconds)):
            counters[f"{name}_count"] = snap.count
            counters[f"{name}_sum"] = snap.sum
        for key, value in sorted(self.counters.items()):
            counters[key] = counters.get(key, 0) + value
        counters.update(self.runtime.plugin_counters())
        proposers = {
            name: ProposerStats(
                requests=tot.requests, drafted=tot.drafted, accepted=tot.accepted,
                accepted_per_position=tuple(tot.accepted_per_position),
            )
            for name, tot in st.proposers.items()
        }
        return StatsReply(
            id=request.id, uptime_s=self.uptime_s, counters=counters, proposers=proposers
        )

    # ------------------------------------------------------------------ plugins

    async def plugin_ingress(self, first_frame: bytes, sock: socket.socket) -> bool:
        """Whether ``first_frame`` opened a proposer plugin's connection; if so, the
        plugin host takes over a duplicate of the socket (set-up on a worker thread,
        the link then lives in the host) and the connection ends here. The peer's
        SO_PEERCRED credentials go with it (a table may pin the plugin's uid/gid)."""
        plugins = self.runtime.plugins
        if not is_plugin_hello(first_frame):
            return False
        peer = peer_credentials(sock)
        try:
            await anyio.to_thread.run_sync(
                functools.partial(plugins.adopt, sock.dup(), first_frame, peer=peer))
        except PluginRefused:
            self.counters["plugins_refused"] += 1
        return True

    # ------------------------------------------------------------------ tokenizer

    async def tokenize(self, request: Tokenize) -> TokenizeReply:
        """Tokenize on a worker thread: the vocabulary is read-only and needs no
        context lock, and a multi-megabyte text must not stall the event loop. No more
        ids are stored than a reply frame could carry (each takes 2 bytes or more)."""
        tok = self.runtime.model.tokenizer
        most = self.config.max_frame_size // 2
        try:
            tokens = await anyio.to_thread.run_sync(lambda: tok.tokenize(
                request.text, add_special=request.add_special, max_tokens=most))
        except TooManyTokens as exc:
            raise FrameTooLarge(
                f"tokenize: the text is {exc.n_tokens} tokens; a reply of more than {most} "
                f"would be above the frame limit of {self.config.max_frame_size} bytes",
                request_id=request.id) from None
        return TokenizeReply(id=request.id, tokens=tuple(tokens))

    async def detokenize(self, request: Detokenize) -> DetokenizeReply:
        n_vocab = self._model_info.n_vocab
        for i, token in enumerate(request.tokens):
            if token >= n_vocab:
                raise BadRequest.invalid_field(
                    f"detokenize.tokens[{i}]",
                    f"must be a token id below the vocabulary size {n_vocab} (got {token})",
                ).with_request_id(request.id)
        tok = self.runtime.model.tokenizer
        limit = self.config.max_frame_size

        def detokenize() -> str:
            # The pieces' sizes first: a reply larger than a frame is never built.
            size = sum(len(tok.piece(t)) for t in request.tokens)
            if size > limit:
                raise FrameTooLarge(
                    f"detokenize: the text is {size} bytes, above the frame limit of "
                    f"{limit}", request_id=request.id)
            return tok.detokenize(request.tokens)

        text = await anyio.to_thread.run_sync(detokenize)
        return DetokenizeReply(id=request.id, text=text)

    # ------------------------------------------------------------------ generate

    async def prepare(self, request: Generate) -> GenerationRequest:
        """Check a ``generate`` and turn it into an engine request.

        Raises BadRequest (limits, unknown proposer, no chat template) or ModelError
        (the prompt does not fit the context), attributed to the request's id.
        """
        rid = request.id
        max_tokens = request.max_tokens or self.config.max_tokens_default
        limit = self.max_tokens_limit
        if request.max_tokens is not None and request.max_tokens > limit:
            raise BadRequest.invalid_field(
                "generate.max_tokens", f"must be at most {limit} (got {request.max_tokens})"
            ).with_request_id(rid)
        max_tokens = min(max_tokens, limit)
        proposer = request.speculative.proposer
        if proposer is not None and proposer != PROPOSER_OFF:
            problem = self.runtime.proposer_problem(proposer)
            if problem is not None:
                raise BadRequest.invalid_field(
                    "generate.speculative.proposer", problem).with_request_id(rid)
        n_vocab = self.runtime.model.info.n_vocab
        for key in request.sampling.logit_bias or {}:
            if int(key) >= n_vocab:
                raise BadRequest.invalid_field(
                    "generate.sampling.logit_bias",
                    f"token id {key} is not below the vocabulary size {n_vocab}"
                ).with_request_id(rid)
        try:
            # Unseeded sampling gets a daemon-chosen seed (reported in ``done``), so it
            # can be verified exactly and speculation runs for API clients by default.
            sampling = with_chosen_seed(sampling_params(request.sampling))
        except ValueError as exc:
            raise BadRequest(f"generate.sampling: {exc}", request_id=rid) from exc
        try:
            with self.scheduler.preparing():  # admissions wait a moment for it
                prompt = await anyio.to_thread.run_sync(self._prompt_tokens, request)
        except PromptTooLong as exc:
            raise ModelError(str(exc), request_id=rid) from exc
        except (RequestError, ValueError) as exc:
            field = "generate.messages" if request.messages is not None else "generate.prompt"
            raise BadRequest(f"{field}: {exc}", request_id=rid) from exc
        grammar = None
        if request.constraint is not None:
            constraint = request.constraint
            try:
                grammar = await anyio.to_thread.run_sync(
                    self.runtime.compile_constraint, constraint.kind, constraint.value)
            except ConstraintError as exc:
                raise BadRequest.invalid_field(
                    "generate.constraint", f"the {constraint.kind} does not compile: {exc}"
                ).with_request_id(rid) from exc
        n_ctx = self.runtime.context.config.n_ctx_seq
        if not prompt:
            raise BadRequest("generate.prompt: tokenizes to no tokens", request_id=rid)
        if len(prompt) + 1 > n_ctx:
            raise ModelError(self.runtime.prompt_too_long(len(prompt)), request_id=rid)
        options = request.speculative.options
        if request.prediction and proposer in (None, "auto"):
            # Predicted Outputs: drafted from by the prediction proposer (a request
            # that names its proposer keeps it).
            try:
                predicted = await anyio.to_thread.run_sync(functools.partial(
                    self.runtime.model.tokenizer.tokenize, request.prediction,
                    add_special=False, max_tokens=n_ctx))
            except TooManyTokens as exc:
                raise BadRequest.invalid_field("generate.prediction", str(exc)
                                               ).with_request_id(rid) from exc
            proposer, options = "prediction", {**(options or {}), "tokens": predicted}
        return GenerationRequest(
            prompt=tuple(prompt), max_tokens=max_tokens, sampling=sampling,
            stop=tuple(request.stop), proposer=proposer,
            draft_max=request.speculative.draft_max,
            proposer_options=options, grammar=grammar, logprobs=request.logprobs,
        )

    def _prompt_tokens(self, request: Generate) -> list[int]:
        """Render (chat) and tokenize, exactly as ``meshd generate`` does; blocking.
        Raises PromptTooLong before tokenizing more than the context holds."""
        rt = self.runtime
        if request.messages is not None:
            text = rt.render_chat([{"role": m.role, "content": m.content}
                                   for m in request.messages])
            return prompt_tokens(rt, text, chat=True)
        assert request.prompt is not None
        return prompt_tokens(rt, request.prompt, chat=False)

    def submit(self, request: GenerationRequest, request_id: str) -> GenerationHandle:
        """Queue an engine request; raises ServerBusy when draining or the queue is full."""
        if self.draining:
            raise ServerBusy("the server is shutting down", request_id=request_id)
        try:
            return self.scheduler.submit(request)
        except Busy as exc:
            raise ServerBusy(f"queue full ({exc})", request_id=request_id) from exc

    # ------------------------------------------------------------------ in-flight

    def register(self, entry: InFlightGeneration) -> None:
        """Track a generation until :meth:`unregister` (for shutdown and cancel)."""
        self._inflight.setdefault(entry.id, []).append(entry)
        self._n_inflight += 1
        if self._idle.is_set():
            self._idle = anyio.Event()

    def unregister(self, entry: InFlightGeneration) -> None:
        entries = self._inflight.get(entry.id, [])
        if entry in entries:
            entries.remove(entry)
            self._n_inflight -= 1
            if not entries:
                del self._inflight[entry.id]
        if self._n_inflight == 0:
            self._idle.set()

    def cancel_anywhere(self, request_id: str) -> bool:
        """Cancel the daemon's only in-flight generation with this id, on any connection.

        Lets ``meshctl cancel ID`` stop a request started by another process. Ids are
        chosen by clients, so an id in flight on several connections is ambiguous and
        nothing is cancelled.
        """
        entries = self._inflight.get(request_id, [])
        if len(entries) != 1:
            return False
        entries[0].cancel()
        return True

    def inflight(self) -> Iterator[InFlightGeneration]:
        for entries in list(self._inflight.values()):
            yield from list(entries)

    @property
    def n_inflight(self) -> int:
        return self._n_inflight

    async def drain(self, timeout_s: float, *, grace_s: float = 0.0) -> bool:
        """Refuse new work, let running generations finish for up to ``grace_s``, then
        cancel the rest (their clients get ``done`` with ``finish_reason: shutdown``) and
        wait for them to end. Returns whether all ended within ``timeout_s`` of that."""
        self.draining = True
        if grace_s > 0:
            with anyio.move_on_after(grace_s):
                await self._idle.wait()
        for entry in self.inflight():
            entry.shutdown = True
            entry.cancel()
        with anyio.move_on_after(timeout_s):
            await self._idle.wait()
        return self._n_inflight == 0
