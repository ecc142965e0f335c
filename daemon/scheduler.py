"""The scheduler: admits requests into session slots and steps them together.

Why one loop for all sessions: the decode steps and verify windows of every active
request go into ONE llama.cpp forward per iteration (continuous batching), which is far
cheaper than one forward each. Every active request advances once per iteration, so
nobody starves; waiting requests are admitted first-come first-served as slots free up,
and the queue is bounded (``Busy`` beyond it).

Concurrency: the loop is one task owned by the server's task group (structured
concurrency). Every llama.cpp call runs in a worker thread through one capacity limiter
per model, so the event loop never blocks: health checks answer while tokens are
generated. Results reach each request through its own memory stream, so a slow client
never holds up the others.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from meshd.native.errors import CapacityError, NativeError
from meshd.native.session import verify_many
from meshd.policy.costs import CostModel
from meshd.policy.decision import Decision, FinishReason, RepairKind

from .engine import Generation, GenerationStats, TokenEvent, Window
from .histogram import Histogram
from .options import DEFAULT_MAX_QUEUE, DEFAULT_STREAM_INTERVAL_MS
from .runtime import ModelRuntime, RequestError
from .sampling import GREEDY, SamplingParams


class Busy(Exception):
    """The wait queue is full; the client should retry later."""


@attrs.frozen
class GenRequest:
    """A generation request in engine terms (token ids, not text)."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    proposer: str | None = None
    draft_max: int | None = None
    proposer_options: Mapping[str, object] | None = None


@attrs.frozen
class Finished:
    """The last event of a request."""

    finish: FinishReason
    stats: GenerationStats
    proposer: str | None
    """The proposer that ran (``None`` when speculation was refused at every step)."""


@attrs.frozen
class Failed:
    """The request failed; ``kind`` is "request" (bad input) or "model" (runtime)."""

    kind: str
    message: str


Event = TokenEvent | Finished | Failed


class RequestHandle:
    """The caller's side of one request: an event stream plus cancel()."""

    def __init__(self, request: GenRequest, send: MemoryObjectSendStream[Event],
                 receive: MemoryObjectReceiveStream[Event]) -> None:
        self.request = request
        self.events = receive
        self._send = send
        self.generation: Generation | None = None
        self.cancelled = False
        self.proposer: str | None = None
        self.submitted = time.monotonic()
        #: When tokens were last handed to the caller (None before the first token).
        self.last_token_at: float | None = None

    def cancel(self) -> None:
        """Stop at the next step boundary (a cut window is trimmed, never retired)."""
        self.cancelled = True
        if self.generation is not None:
            self.generation.cancel()


@attrs.define
class ProposerTotals:
    requests: int = 0
    drafts: int = 0
    """Verify windows that carried at least one drafted token."""
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = attrs.field(factory=list)


@attrs.define
class SchedulerStats:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected_busy: int = 0
    tokens: int = 0
    forwards: int = 0
    steps: int = 0
    proposers: dict[str, ProposerTotals] = attrs.field(factory=dict)
    #: Requests that ended, by finish reason (``error`` for failed ones).
    finish_reasons: collections.Counter[str] = attrs.field(factory=collections.Counter)
    #: One batched verify forward (every active session's window), in seconds.
    verify_seconds: Histogram = attrs.field(factory=Histogram)
    #: From submission to the first token handed to the request's caller.
    time_to_first_token_seconds: Histogram = attrs.field(factory=Histogram)
    #: Between tokens handed to the caller (tokens handed over together share the gap).
    inter_token_latency_seconds: Histogram = attrs.field(factory=Histogram)


class Scheduler:
    """Owns one ModelRuntime's sessions; ``run`` is the engine loop."""

    def __init__(self, runtime: ModelRuntime, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 step_budget_s: float = DEFAULT_STREAM_INTERVAL_MS / 1000) -> None:
        self.runtime = runtime
        self.max_queue = max_queue
        #: Run steps back to back on the worker thread for up to this long before handing
        #: events to the event loop. Every hand-off wakes the event loop and the client;
        #: on a 2-core machine each wake-up preempts one of llama.cpp's busy-waiting
        #: threads and stalls the forward. Measured on SmolLM2 through the socket: 0.94x
        #: of in-process throughput with 20 ms batches, 1.02x with 100 ms. The first
        #: token is never held back; later ones arrive at most this far apart.
        self.step_budget_s = step_budget_s
        self.limiter = anyio.CapacityLimiter(1)
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._active: list[RequestHandle] = []
        self._wakeup = anyio.Event()
        self.stats = SchedulerStats()
        self.started = time.monotonic()
        self._native_since: float | None = None

    # ------------------------------------------------------------------ API

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def checkpoint_bytes(self) -> int:
        """State checkpoints held by the active sessions right now."""
        return sum(h.generation.session.checkpoint_held_bytes
                   for h in list(self._active) if h.generation is not None)

    def submit(self, request: GenRequest) -> RequestHandle:
        """Queue a request; raises Busy when the queue is full."""
        if len(self._waiting) >= self.max_queue:
            self.stats.rejected_busy += 1
            raise Busy(f"{len(self._waiting)} requests are already waiting")
        send, receive = anyio.create_memory_object_stream[Event](max_buffer_size=math.inf)
        handle = RequestHandle(request, send, receive)
        self._waiting.append(handle)
        self.stats.requests += 1
        self._wakeup.set()
        return handle

    async def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking llama.cpp call on a worker thread, one at a time per model."""
        def timed() -> Any:
            self._native_since = time.monotonic()
            try:
                return fn(*args)
            finally:
                self._native_since = None

        return await anyio.to_thread.run_sync(timed, limiter=self.limiter)

    def native_busy_s(self) -> float:
        """How long the llama.cpp call running now has been running (0 when none).

        The watchdog's measure of a wedged engine: one call is bounded by the step
        budget plus one forward, so a call that runs far longer is stuck.
        """
        since = self._native_since
        return time.monotonic() - since if since is not None else 0.0

    # ------------------------------------------------------------------ loop

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """The engine loop; runs until cancelled by its owner."""
        task_status.started()
        try:
            while True:
                await self._admit()
                if not self._active:
                    if not self._waiting:
                        self._wakeup = anyio.Event()
                        await self._wakeup.wait()
                    continue
                await self._step()
                await anyio.lowlevel.checkpoint()
        finally:
            with anyio.CancelScope(shield=True):
                for handle in [*self._active, *self._waiting]:
                    if handle.generation is not None:
                        await self.run_sync(handle.generation.close)  # idempotent
                    self._finish(handle, Failed("model", "the server is shutting down"))
                self._active.clear()
                self._waiting.clear()

    async def _admit(self) -> None:
        while self._waiting and self.runtime.idle_slots > 0:
            handle = self._waiting.popleft()
            if handle.cancelled:
                self._finish(handle, Finished(FinishReason.CANCELLED, GenerationStats(), None))
                continue
            req = handle.request
            try:
                gen = self.runtime.generation(
                    req.prompt, max_tokens=req.max_tokens, sampling=req.sampling,
                    stop=req.stop, proposer=req.proposer, draft_max=req.draft_max,
                    proposer_options=req.proposer_options,
                )
            except (RequestError, CapacityError, ValueError) as exc:
                self._finish(handle, Failed("request", str(exc)))
                continue
            handle.generation = gen
            handle.proposer = self.runtime.resolve_proposer(req.proposer)
            self._active.append(handle)  # owned from here on, also if we are cancelled
            try:
                events = await self.run_sync(gen.start)
            except NativeError as exc:
                self._active.remove(handle)
                await self.run_sync(gen.close)
                self._finish(handle, Failed("model", str(exc)))
                continue
            self.stats.forwards += 1
            self._deliver(handle, events)
            if handle.cancelled:
                gen.cancel()
            if await self._maybe_done(handle):
                self._active.remove(handle)

    async def _step(self) -> None:
        active = list(self._active)
        results, steps = await self.run_sync(
            _run_steps, [h.generation for h in active], self.runtime.costs,
            self.step_budget_s, lambda: bool(self._waiting), self.stats.verify_seconds,
        )
        self.stats.steps += steps
        self.stats.forwards += steps
        for handle, result in zip(active, results, strict=True):
            if isinstance(result, BaseException):
                gen = handle.generation
                assert gen is not None
                await self.run_sync(gen.close)
                self._active.remove(handle)
                self._finish(handle, Failed("model", str(result)))
                continue
            self._deliver(handle, result)
            if await self._maybe_done(handle):
                self._active.remove(handle)

    def _deliver(self, handle: RequestHandle, events: Sequence[TokenEvent]) -> None:
        self._time_tokens(handle, sum(len(ev.tokens) for ev in events))
        for ev in events:
            self.stats.tokens += len(ev.tokens)
            try:
                handle._send.send_nowait(ev)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                handle.cancel()  # nobody is listening any more
                return

    def _time_tokens(self, handle: RequestHandle, n: int) -> None:
        """Time to first token and inter-token latency, as the caller receives them."""
        if n <= 0:
            return
        now = time.monotonic()
        if handle.last_token_at is None:
            self.stats.time_to_first_token_seconds.observe(now - handle.submitted)
            handle.last_token_at = now
            n -= 1
        self.stats.inter_token_latency_seconds.observe((now - handle.last_token_at) / max(n, 1),
                                                       times=n)
        handle.last_token_at = now

    async def _maybe_done(self, handle: RequestHandle) -> bool:
        gen = handle.generation
        assert gen is not None
        if not gen.done:
            return False
        await self.run_sync(gen.close)  # releases the slot
        assert gen.finish is not None
        ran = gen.stats.proposer_that_ran(handle.proposer)
        self._account(ran, gen.stats)
        self._finish(handle, Finished(gen.finish, gen.stats, ran))
        return True

    def _account(self, proposer: str | None, st: GenerationStats) -> None:
        if proposer is None:
            return
        tot = self.stats.proposers.setdefault(proposer, ProposerTotals())
        tot.requests += 1
        tot.drafts += st.drafted_per_position[0] if st.drafted_per_position else 0
        tot.drafted += st.drafted
        tot.accepted += st.accepted
        for i, n in enumerate(st.accepted_per_position):
            if i >= len(tot.accepted_per_position):
                tot.accepted_per_position.append(0)
            tot.accepted_per_position[i] += n

    def _finish(self, handle: RequestHandle, event: Finished | Failed) -> None:
        if isinstance(event, Failed):
            self.stats.failed += 1
            self.stats.finish_reasons["error"] += 1
        elif event.finish is FinishReason.CANCELLED:
            self.stats.cancelled += 1
            self.stats.finish_reasons[event.finish.value] += 1
        else:
            self.stats.completed += 1
            self.stats.finish_reasons[event.finish.value] += 1
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            handle._send.send_nowait(event)
        handle._send.close()


def _run_steps(
    gens: Sequence[Generation | None], costs: CostModel | None, budget_s: float,
    should_yield: Callable[[], bool], verify_seconds: Histogram | None = None,
) -> tuple[list[list[TokenEvent] | BaseException], int]:
    """Steps back to back until one request ends or fails, the budget is spent, or new
    requests wait for admission. Runs on the worker thread."""
    t_end = time.perf_counter() + budget_s
    total: list[list[TokenEvent] | BaseException] = [[] for _ in gens]
    steps = 0
    while True:
        results = _step_all(gens, costs, verify_seconds)
        steps += 1
        failed = False
        for i, result in enumerate(results):
            acc = total[i]
            if isinstance(result, BaseException):
                total[i] = result
                failed = True
            elif isinstance(acc, list):
                acc.extend(result)
        if failed or any(g is None or g.done for g in gens):
            return total, steps
        if time.perf_counter() >= t_end or should_yield():
            return total, steps


def _step_all(
    gens: Sequence[Generation | None], costs: CostModel | None = None,
    verify_seconds: Histogram | None = None,
) -> list[list[TokenEvent] | BaseException]:
    """One iteration for every active generation: ONE forward for all their windows.

    Runs on a worker thread. Repairs that decode (restore-and-replay) go after the
    in-place ones, because an in-place rollback is only exact before any other forward.
    """
    out: list[list[TokenEvent] | BaseException] = [[] for _ in gens]
    live = [g for g in gens if g is not None]
    if len(live) > 1 and (live[0].session.recurrent or live[0].session.mtp is not None):
        # Recurrent state and the MTP companion are kept per sequence by llama.cpp in ways
        # a mixed batch can break: a recurrent batch of several sequences is split into
        # equal per-sequence micro-batches, so a sequence's in-place rollback may reach
        # past its last micro-batch (the stale-snapshot trap), and a divergence was seen
        # with several MTP sessions in one forward. Until that is pinned down, such
        # sessions take their steps one after another (each window repaired right after
        # its own forward), which is exact.
        for i, gen in enumerate(gens):
            assert gen is not None
            c = gen.session.counters
            forward_ms = c.decode_ms + c.verify_ms
            try:
                out[i] = gen.step()  # records its own forward in the cost model
            except Exception as exc:
                out[i] = exc
            if verify_seconds is not None and c.decode_ms + c.verify_ms > forward_ms:
                verify_seconds.observe((c.decode_ms + c.verify_ms - forward_ms) / 1e3)
        return out
    planned: list[tuple[int, Generation, Window]] = []
    for i, gen in enumerate(gens):
        assert gen is not None
        try:
            planned.append((i, gen, gen.plan()))
        except Exception as exc:
            out[i] = exc
    if not planned:
        return out
    try:
        t0 = time.perf_counter()
        logits = verify_many([(g.session, [w.last, *w.draft]) for _, g, w in planned])
        elapsed = time.perf_counter() - t0
        if costs is not None:
            costs.record(sum(len(w.draft) + 1 for _, _, w in planned), elapsed)
        if verify_seconds is not None:
            verify_seconds.observe(elapsed)
    except Exception as exc:
        for i, _, _ in planned:
            out[i] = exc
        return out
    decided: list[tuple[int, Generation, Window, Decision]] = []
    for (i, gen, window), rows in zip(planned, logits, strict=True):
        try:
            decided.append((i, gen, window, gen.decide_window(window, rows)))
        except Exception as exc:
            out[i] = exc
    decided.sort(key=lambda t: t[3].repair.kind is RepairKind.RESTORE_AND_REPLAY)
    for i, gen, window, decision in decided:
        try:
            out[i] = gen.apply(window, decision)
        except Exception as exc:
            out[i] = exc
    return out
