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
import contextlib
import functools
import importlib.metadata
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.to_thread
import attrs
from structlog.typing import FilteringBoundLogger

from meshd.daemon.config.options import DEFAULT_MAX_TOKENS
from meshd.daemon.config.server import DEFAULT_SHUTDOWN_GRACE_S, ServerConfig
from meshd.daemon.engine.constraint import ConstraintError
from meshd.daemon.engine.request_errors import RequestError
from meshd.daemon.engine.sampling import SamplingParams, with_chosen_seed
from meshd.daemon.models.mapping import sampling_params
from meshd.daemon.models.model_set import (
    LoadFailed,
    ModelSet,
    ModelState,
    NoRoom,
    NoSuchModel,
    ServedModel,
)
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.models.scheduler import Busy, GenerationHandle, GenerationRequest, Scheduler
from meshd.daemon.models.statistics import SchedulerStatistics
from meshd.daemon.requests.prompt_fit import PromptTooLong
from meshd.daemon.requests.prompting import spec_grammar, spec_prompt
from meshd.daemon.requests.spec import RequestSpec
from meshd.daemon.system.peercred import peer_credentials
from meshd.native.tokenizer import TooManyTokens
from meshd.plugins.remote_plugin import PluginRefused
from meshd.plugins.remote_plugin_set import is_plugin_hello
from meshd.protocol import (
    PROPOSER_OFF,
    BadRequest,
    Detokenize,
    DetokenizeReply,
    FrameTooLarge,
    Generate,
    Health,
    HealthReply,
    HealthStatus,
    Hello,
    Load,
    LoadReply,
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
    UnknownModel,
    Unload,
    UnloadReply,
    UnsupportedVersion,
    Welcome,
)
from meshd.protocol.versions import speaks, unsupported_message

__all__ = ["DEFAULT_MAX_TOKENS", "DEFAULT_SHUTDOWN_GRACE_S", "InFlightGeneration", "ServerConfig",
           "Service", "server_version"]



def server_version() -> str:
    """meshd's installed version (``0+unknown`` when run from an uninstalled tree)."""
    try:
        return importlib.metadata.version("meshd")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def peer_owner(sock: socket.socket | None) -> str | None:
    """Who a Unix-socket peer is, as history lookup keeps answers
    apart (``uid:N``, as the HTTP front end's ``stream_owner`` says it); None when the
    kernel gives no credentials (no history then)."""
    peer = peer_credentials(sock) if sock is not None else None
    return None if peer is None else f"uid:{peer.uid}"


class InFlightGeneration:
    """One generation a connection is serving: its id and (once admitted) its handle.

    A ``cancel`` may arrive before the request reached the scheduler (while the prompt
    is being tokenized), so cancellation is remembered and applied on :meth:`attach`.
    """

    def __init__(self, request_id: str, owner: str | None = None) -> None:
        self.id = request_id
        # Who asked (``peer_owner``; None: unknown, no history).
        self.owner = owner
        self.handle: GenerationHandle | None = None
        #: The model serving it (set by ``Service.prepare``).
        self.model: ServedModel | None = None
        #: Whether it holds that model (released by ``Service.unregister``).
        self.holds = False
        #: The keep-alive the request asked for (None: the model's own).
        self.keep_alive: float | None = None
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

    def __init__(self, models: ModelSet, config: ServerConfig | None = None) -> None:
        self.models = models
        self.config = config if config is not None else ServerConfig()
        self.started = time.monotonic()
        self.started_at = time.time()
        self.draining = False
        self.counters: collections.Counter[str] = collections.Counter()
        self.open_connections = 0
        self._inflight: dict[str, list[InFlightGeneration]] = {}
        self._n_inflight = 0
        self._idle = anyio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ limits

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
        limit = self.config.max_tokens_limit
        return limit if limit is not None else runtime.context.config.n_ctx_seq

    @property
    def uptime_s(self) -> float:
        return max(0.0, time.monotonic() - self.started)

    # ------------------------------------------------------------------ simple replies

    def welcome(self, hello: Hello) -> Welcome:
        """The handshake answer, in the hello's protocol version when the server speaks it
        (every version from the first to the current: an older client is answered as its
        version defines, which the protocol connection sees to from then on); raises
        UnsupportedVersion for any other."""
        if not speaks(hello.protocol_version):
            raise UnsupportedVersion(unsupported_message(hello.protocol_version),
                                     request_id=hello.id)
        capabilities = ["speculation", "tokenize", "models"]
        info = self.model
        if info.has_chat_template:
            capabilities.insert(0, "chat")
        return Welcome(
            id=hello.id,
            protocol_version=hello.protocol_version,
            server_version=server_version(),
            model=info,
            capabilities=tuple(capabilities),
            proposers=self.proposers(),
            max_frame_size=self.config.max_frame_size,
        )

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
        """What ``welcome`` and ``models`` say of a model: measured while it is loaded,
        remembered after, configured before its first load."""
        base = served.info or ModelInfo(name=served.name,
                                        n_ctx=served.plan.config.n_ctx_seq,
                                        size_bytes=served.plan.size_bytes or None)
        rt = served.runtime
        if rt is not None and served.state is ModelState.LOADED:  # (plugins come and go)
            base = attrs.evolve(base, proposers=tuple(rt.usable_proposers()))
        return attrs.evolve(base, loaded=served.state is ModelState.LOADED,
                            state=served.state.value, default=served is self.models.default,
                            keep_alive_s=self.models.keep_alive_of(served))

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
        """Answered from counters only: never waits for a model."""
        loaded = [m for m in self.models.loaded() if m.runtime is not None]
        degraded = any(m.runtime.degraded for m in loaded if m.runtime is not None)
        return HealthReply(
            id=request.id,
            status=(HealthStatus.DRAINING if self.draining
                    else HealthStatus.DEGRADED if degraded else HealthStatus.OK),
            uptime_s=self.uptime_s,
            active_requests=sum(m.scheduler.active for m in loaded if m.scheduler),
            queued_requests=sum(m.scheduler.queued for m in loaded if m.scheduler),
            models={m.name: m.state.value for m in self.models},
        )

    def statistics(self) -> SchedulerStatistics:
        """Every model's figures together."""
        return functools.reduce(SchedulerStatistics.plus,
                                (m.statistics() for m in self.models))

    def stats(self, request: Stats) -> StatsReply:
        st = self.statistics()
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
        for served in self.models.loaded():
            if served.runtime is not None:
                for key, value in served.runtime.plugin_counters().items():
                    counters[key] = counters.get(key, 0) + value
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

    # ------------------------------------------------------------------ tokenizer

    async def tokenize(self, request: Tokenize) -> TokenizeReply:
        """Tokenize on a worker thread: the vocabulary is read-only and needs no
        context lock, and a multi-megabyte text must not stall the event loop. No more
        ids are stored than a reply frame could carry (each takes 2 bytes or more)."""
        most = self.config.max_frame_size // 2
        try:
            async with self.holding(None, request.id) as rt:
                tok = rt.model.tokenizer
                tokens = await anyio.to_thread.run_sync(lambda: tok.tokenize(
                    request.text, add_special=request.add_special, max_tokens=most))
        except TooManyTokens as exc:
            raise FrameTooLarge(
                f"tokenize: the text is {exc.n_tokens} tokens; a reply of more than {most} "
                f"would be above the frame limit of {self.config.max_frame_size} bytes",
                request_id=request.id) from None
        return TokenizeReply(id=request.id, tokens=tuple(tokens))

    async def detokenize(self, request: Detokenize) -> DetokenizeReply:
        async with self.holding(None, request.id) as rt:
            return await self._detokenize(request, rt)

    async def _detokenize(self, request: Detokenize, rt: ModelRuntime) -> DetokenizeReply:
        n_vocab = rt.model.info.n_vocab
        for i, token in enumerate(request.tokens):
            if token >= n_vocab:
                raise BadRequest.invalid_field(
                    f"detokenize.tokens[{i}]",
                    f"must be a token id below the vocabulary size {n_vocab} (got {token})",
                ).with_request_id(request.id)
        tok = rt.model.tokenizer
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

    # ------------------------------------------------------------------ models

    async def hold(self, name: str | None, request_id: str | None) -> ServedModel:
        """Hold the model ``name`` (None: the default), loading it first if need be,
        until :meth:`ModelSet.release`. Raises UnknownModel, ServerBusy or ModelError."""
        try:
            return await self.models.acquire(name)
        except NoSuchModel:
            known = ", ".join(self.models.models)
            raise UnknownModel(f"no model named {name!r}; this daemon serves: {known}",
                               request_id=request_id) from None
        except NoRoom as exc:
            raise ServerBusy(str(exc), request_id=request_id) from None
        except LoadFailed as exc:
            raise ModelError(f"model {name or self.models.default.name!r} did not load: "
                             f"{exc}", request_id=request_id) from None

    @contextlib.asynccontextmanager
    async def holding(self, name: str | None, request_id: str | None
                      ) -> AsyncIterator[ModelRuntime]:
        """The runtime of model ``name`` (None: the default), held for the block."""
        served = await self.hold(name, request_id)
        try:
            assert served.runtime is not None
            yield served.runtime
        finally:
            self.models.release(served)

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
        """Check a request and turn it into an engine request for its model, which
        ``entry`` then holds until :meth:`unregister`: every check made once, the prompt
        rendered and tokenized once, the constraint compiled once (:mod:`.prompting`).

        Raises BadRequest (limits, unknown proposer, no chat template), UnknownModel,
        ServerBusy (no room for the model), ModelError (the prompt does not fit the
        context, the model did not load), attributed to the request's id; ApiError for
        what only HTTP can ask (token-id prompts, template variables, tools the
        template offers).
        """
        if isinstance(spec, Generate):
            spec = RequestSpec(spec)
        request = spec.generate
        rid = request.id
        served = await self.hold(request.model, rid)
        entry.model, entry.holds, entry.keep_alive = served, True, request.keep_alive
        rt, scheduler = served.runtime, served.scheduler
        assert rt is not None and scheduler is not None
        limit = self.max_tokens_limit(rt)
        if spec.n_predict is not None:  # (llama-server's: -1 the context, clamped)
            max_tokens = limit if spec.n_predict == -1 else max(1, min(spec.n_predict, limit))
        else:
            # A request that sets no limit goes on until the model stops or the context
            # ends (the engine stops there), as llama-server's; the operator may cap it.
            max_tokens = request.max_tokens or self.config.max_tokens_default or limit
            if request.max_tokens is not None and request.max_tokens > limit:
                raise BadRequest.invalid_field(
                    "generate.max_tokens", f"must be at most {limit} (got {request.max_tokens})"
                ).with_request_id(rid)
            max_tokens = min(max_tokens, limit)
        proposer = request.speculative.proposer
        if proposer is not None and proposer != PROPOSER_OFF:
            problem = rt.proposer_problem(proposer)
            if problem is not None:
                raise BadRequest.invalid_field(
                    "generate.speculative.proposer", problem).with_request_id(rid)
        n_vocab = rt.model.info.n_vocab
        for key in request.sampling.logit_bias or {}:
            if int(key) >= n_vocab:
                raise BadRequest.invalid_field(
                    "generate.sampling.logit_bias",
                    f"token id {key} is not below the vocabulary size {n_vocab}"
                ).with_request_id(rid)
        try:
            # Unseeded sampling gets a daemon-chosen seed (reported in ``done``), so it
            # can be verified exactly and speculation runs for API clients by default.
            sampling = with_chosen_seed(sampling_params(request.sampling), self.config.seed)
        except ValueError as exc:
            raise BadRequest(f"generate.sampling: {exc}", request_id=rid) from exc
        sampling = _with_spec_sampling(sampling, spec)
        try:
            with scheduler.preparing():  # admissions wait a moment for it
                prompt = await anyio.to_thread.run_sync(spec_prompt, rt, spec)
        except PromptTooLong as exc:
            raise ModelError(str(exc), request_id=rid) from exc
        except (RequestError, ValueError) as exc:
            field = "generate.messages" if request.messages is not None else "generate.prompt"
            raise BadRequest(f"{field}: {exc}", request_id=rid) from exc
        try:
            grammar = await anyio.to_thread.run_sync(spec_grammar, rt, spec, prompt)
        except ConstraintError as exc:
            kind = request.constraint.kind if request.constraint is not None else "grammar"
            raise BadRequest.invalid_field(
                "generate.constraint", f"the {kind} does not compile: {exc}"
            ).with_request_id(rid) from exc
        n_ctx = rt.context.config.n_ctx_seq
        if not prompt.tokens:
            raise BadRequest("generate.prompt: tokenizes to no tokens", request_id=rid)
        if len(prompt.tokens) + 1 > n_ctx:
            too_long = rt.prompt_too_long(len(prompt.tokens))
            raise ModelError(str(too_long), request_id=rid) from too_long
        options = request.speculative.options
        if request.prediction and proposer in (None, "auto", "prediction"):
            # Predicted Outputs: drafted from by the prediction proposer (a request
            # that names another proposer keeps it).
            try:
                predicted = await anyio.to_thread.run_sync(functools.partial(
                    rt.model.tokenizer.tokenize, request.prediction,
                    add_special=False, max_tokens=n_ctx))
            except TooManyTokens as exc:
                raise BadRequest.invalid_field("generate.prediction", str(exc)
                                               ).with_request_id(rid) from exc
            proposer, options = "prediction", {**(options or {}), "tokens": predicted}
        return GenerationRequest(
            prompt=prompt.tokens, max_tokens=max_tokens, sampling=sampling,
            stop=tuple(request.stop), proposer=proposer,
            draft_max=request.speculative.draft_max,
            proposer_options=options, grammar=grammar,
            logprobs=spec.logprobs if spec.logprobs is not None else request.logprobs,
            owner=entry.owner,  # (whose earlier answers history lookup may draft from)
        )

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
               request_id: str | None = None) -> GenerationHandle:
        """Queue an engine request on ``entry``'s model (held since :meth:`prepare`);
        raises ServerBusy when draining or the queue is full."""
        request_id = request_id or entry.id
        if self.draining:
            raise ServerBusy("the server is shutting down", request_id=request_id)
        assert entry.model is not None and entry.model.scheduler is not None
        try:
            return entry.model.scheduler.submit(request)
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
        if entry.holds and entry.model is not None:
            entry.holds = False
            self.models.release(entry.model, entry.keep_alive)
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


def _with_spec_sampling(sampling: SamplingParams, spec: RequestSpec) -> SamplingParams:
    """``sampling`` with what a front end adds beyond ``generate``'s: biases by token id,
    a seed offset (``n_cmpl`` copies), ``min_tokens``."""
    changes: dict[str, Any] = {}
    if spec.logit_bias_ids is not None:
        changes["logit_bias"] = spec.logit_bias_ids
    if spec.seed_offset and spec.generate.sampling.seed is not None \
            and sampling.seed is not None:
        changes["seed"] = (sampling.seed + spec.seed_offset) % (1 << 64)
    if spec.min_tokens:
        changes["min_tokens"] = spec.min_tokens
    return attrs.evolve(sampling, **changes) if changes else sampling
