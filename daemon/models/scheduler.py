"""The scheduler: admits requests into session slots, delivers their events, counts.

Why one loop for all sessions: every active request advances once per iteration, in ONE
engine step over all of them (:func:`meshd.daemon.engine.generation.step_many`: shared forwards,
continuous batching), cheaper than a forward each, and nobody starves; waiting requests
are admitted first-come first-served as slots free up, up to a bounded queue (``Busy``).
An admitted request's prompt is prefilled a chunk at a time after each step of the
requests already decoding (:class:`~meshd.daemon.engine.prefill.Prefills`), so a long prompt
never stops their tokens, and a request whose client left is dropped between chunks.

The scheduler is purely async: it decides when to admit and when to step and hands the
work to the model's compute thread (:mod:`.compute`); how a step is taken is the
engine's, and it never touches a sequence session. The loop is one task of the server's
task group and never blocks the event loop, so health checks answer while tokens are
generated. While the set of running requests stays the same, the compute thread steps
on and posts tokens every stream interval, so delivery never holds a step; each request
gets its own memory stream, so a slow client never holds up the others.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from meshd.daemon.config.options import DEFAULT_MAX_QUEUE, DEFAULT_STREAM_INTERVAL_MS
from meshd.daemon.engine.cancellation import Cancellation
from meshd.daemon.engine.generation import Generation, TokenEvent
from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.engine.prefill import Prefills
from meshd.daemon.engine.request_errors import RequestError
from meshd.daemon.engine.sampling import GREEDY, SamplingParams
from meshd.daemon.engine.step_runs import StepRun, run_steps
from meshd.daemon.models.compute import ComputeThread, loop_poster
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.models.statistics import (
    ProposerStatistics,
    RuntimeFigures,
    SchedulerCounters,
    SchedulerStatistics,
)
from meshd.native.errors import CapacityError
from meshd.policy.decision import FinishReason

#: The longest admissions wait for running requests to end so that a hybrid model's
#: context can get its rollback snapshots back (a few seconds of one request's decoding).
SNAPSHOT_WAIT_S = 5.0

#: The longest an admission waits for requests still being prepared (rendered and
#: tokenized: a burst of requests reaches the queue a few milliseconds apart), so that
#: they are prefilled together and get their first tokens together.
GATHER_S = 0.02


class Busy(Exception):
    """The wait queue is full; the client should retry later."""


@attrs.frozen
class GenerationRequest:
    """What to generate, in engine terms (token ids, not text).

    One request is one *generation* throughout the daemon: the wire's ``generate``
    message becomes a :class:`GenerationRequest`, a connection tracks it as an
    :class:`~meshd.daemon.requests.inflight.InFlightGeneration`, its caller holds a
    :class:`GenerationHandle`, and the engine runs it as a
    :class:`~meshd.daemon.engine.generation.Generation`.
    """

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    proposer: str | None = None
    draft_max: int | None = None
    proposer_options: Mapping[str, object] | None = None
    grammar: str | None = None
    """The output constraint, compiled (llguidance's grammar text)."""
    logprobs: int | None = None
    """Report each token's log-probability with this many alternatives (None: not)."""
    owner: str | None = None
    """Who asked (``uid:N`` on the Unix socket, ``key:HASH`` or ``tcp`` over TCP): whose
    earlier answers history lookup may draft from and keeps this one as (None: none)."""


@attrs.frozen
class Finished:
    """The last event of a request."""

    finish: FinishReason
    stats: GenerationStats
    proposer: str | None
    """The proposer that ran (``None`` when speculation was refused at every step)."""


@attrs.frozen
class GenerationFailed:
    """The request failed; ``kind`` is "request" (bad input) or "model" (runtime)."""

    kind: str
    message: str
    stats: GenerationStats | None = None
    """What the generation did before it failed (None: it never started)."""


Event = TokenEvent | Finished | GenerationFailed


class GenerationHandle:
    """The caller's side of one generation: its event stream, plus cancel()."""

    def __init__(self, request: GenerationRequest, send: MemoryObjectSendStream[Event],
                 receive: MemoryObjectReceiveStream[Event],
                 cancellation: Cancellation | None = None) -> None:
        self.request = request
        self.events = receive
        self._send = send
        self.generation: Generation | None = None
        #: The request's cancel latch (the caller's, shared with its engine generation).
        self.cancellation = cancellation if cancellation is not None else Cancellation()
        self.proposer: str | None = None
        self.submitted = time.monotonic()
        #: When tokens were last handed to the caller (None before the first token).
        self.last_token_at: float | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancellation.cancelled

    def cancel(self) -> None:
        """Stop at the next step boundary (a cut window is trimmed, never retired)."""
        self.cancellation.cancel()


class Scheduler:
    """Owns one ModelRuntime's sessions; ``run`` is the engine loop."""

    def __init__(self, runtime: ModelRuntime, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 step_budget_s: float = DEFAULT_STREAM_INTERVAL_MS / 1000,
                 compute: ComputeThread | None = None,
                 counters: SchedulerCounters | None = None) -> None:
        """``counters``: where to count (a model served again after an unload keeps
        counting where it left off)."""
        self.runtime = runtime
        self.max_queue = max_queue
        #: Hand the tokens of steps run back to back to the event loop at most this
        #: often. Every hand-off wakes the event loop and the client; on a small machine
        #: each wake-up preempts one of llama.cpp's threads and stalls the forward. The
        #: first token is never held back; later ones arrive at most this far apart.
        self.step_budget_s = step_budget_s
        #: The model's compute thread (the one the runtime was loaded on, else a new one
        #: this scheduler owns and ends with its loop).
        self.compute = compute if compute is not None else ComputeThread()
        self._owns_compute = compute is None
        self._waiting: collections.deque[GenerationHandle] = collections.deque()
        #: Requests decoding.
        self._active: list[GenerationHandle] = []
        #: Requests admitted whose prompts are being prefilled (in ``_prefills``).
        self._prefilling: list[GenerationHandle] = []
        #: Their prompts, prefilled a chunk at a time (used on the compute thread only).
        self._prefills = Prefills()
        self._wakeup = anyio.Event()
        self._counters = counters if counters is not None else SchedulerCounters()
        self._figures = self._runtime_figures()
        self.started = time.monotonic()
        self._native_since: float | None = None
        #: Since when admissions wait for a context rebuild (see _holding_for_snapshots).
        self._hold_since: float | None = None
        #: Requests being prepared for :meth:`submit` (see :meth:`preparing`).
        self._preparing = 0
        #: Requests handed to the compute thread to start (neither waiting nor active).
        self._admitting = 0

    # ------------------------------------------------------------------ API

    @property
    def active(self) -> int:
        """Requests holding a slot: decoding, or their prompts being prefilled."""
        return len(self._active) + len(self._prefilling)

    def running(self) -> list[Generation]:
        """The generation of every request holding a slot now (decoding, or its prompt
        being prefilled)."""
        return [h.generation for h in [*self._active, *self._prefilling]
                if h.generation is not None]

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def statistics(self) -> SchedulerStatistics:
        """The scheduler's figures now, frozen: safe to keep and to read anywhere."""
        return SchedulerStatistics.of(self._counters, active=self.active,
                                      queued=len(self._waiting), runtime=self._figures)

    def _runtime_figures(self) -> RuntimeFigures:
        """Read the runtime's state; only where nothing else changes it (the compute
        thread, or before the loop runs)."""
        rt = self.runtime
        return RuntimeFigures(
            idle_slots=rt.idle_slots, cached_sessions=len(rt.prefix_cache),
            prefix_cache_tokens=rt.prefix_cache.tokens,
            checkpoint_bytes=sum(h.generation.checkpoint_held_bytes
                                 for h in list(self._active) if h.generation is not None),
        )

    def submit(self, request: GenerationRequest, cancellation: Cancellation | None = None
               ) -> GenerationHandle:
        """Queue a request; raises Busy when it would wait for a slot while
        ``max_queue`` requests already do. ``cancellation``: the request's cancel latch
        (its caller's; a request cancelled before this finishes ``cancelled`` without
        running), a fresh one by default.

        Requests that have a free slot pass through the queue too, for a moment (the
        loop admits them), so only those beyond the free slots count against
        ``max_queue``: with 0, a request is admitted while a slot is free and refused
        when none is, instead of always.
        """
        slots = self.runtime.context.config.n_seq_max
        free = max(0, slots - self.active - self._admitting)
        if len(self._waiting) >= free + self.max_queue:
            self._counters.rejected_busy += 1
            raise Busy(f"all {slots} slots are busy and {len(self._waiting) - free} "
                       f"requests wait for one (at most {self.max_queue})")
        send, receive = anyio.create_memory_object_stream[Event](max_buffer_size=math.inf)
        handle = GenerationHandle(request, send, receive, cancellation)
        self._waiting.append(handle)
        self._counters.requests += 1
        self._wakeup.set()
        return handle

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Around a request's preparation (rendering, tokenizing) before :meth:`submit`:
        an admission waits a moment (:data:`GATHER_S`) for it, so that requests sent
        together are prefilled together."""
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1
            self._wakeup.set()

    async def _gather(self) -> None:
        """Wait, at most :data:`GATHER_S`, for requests still being prepared while
        there are slots for them."""
        deadline = time.monotonic() + GATHER_S
        while (self._preparing and len(self._waiting) < self.runtime.idle_slots
               and (left := deadline - time.monotonic()) > 0):
            self._wakeup = anyio.Event()
            with anyio.move_on_after(left):
                await self._wakeup.wait()

    async def run_sync(self, fn: Callable[..., Any], *args: Any,
                       interrupt: Callable[[], None] | None = None) -> Any:
        """Run a blocking llama.cpp call on the model's compute thread (``interrupt``:
        see :meth:`ComputeThread.run`)."""
        def timed() -> Any:
            self._native_since = time.monotonic()
            try:
                return fn(*args)
            finally:
                self._native_since = None
                self._figures = self._runtime_figures()

        return await self.compute.run(timed, interrupt=interrupt)

    def native_busy_s(self) -> float:
        """How long the llama.cpp call running now has been running without a sign of
        progress (0 when none).

        The watchdog's measure of a wedged engine: a run of steps reports progress at
        every step, and one admission (a prefill, perhaps a draft model's load) is
        bounded, so a call that goes far longer without progress is stuck.
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
                if not self._active and not self._prefilling:
                    if not self._waiting:
                        self._wakeup = anyio.Event()
                        await self._wakeup.wait()
                    continue
                await self._step()
                await anyio.lowlevel.checkpoint()
        finally:
            with anyio.CancelScope(shield=True):
                self._prefills.clear()  # the compute thread has no call of ours now
                for handle in [*self._active, *self._prefilling, *self._waiting]:
                    gen = handle.generation
                    if gen is not None:
                        await self.run_sync(gen.close)  # idempotent
                    self._finish(handle, GenerationFailed("model", "the server is shutting down",
                                                gen.stats if gen is not None else None))
                self._active.clear()
                self._prefilling.clear()
                self._waiting.clear()
                if self._owns_compute:
                    self.compute.close()

    def _holding_for_snapshots(self) -> bool:
        """Whether admissions wait for the running requests to end, so that the runtime
        can rebuild its context with the rollback snapshots speculation wants back.

        Why: the context can only be rebuilt while no request runs on it, and under a
        steady stream of overlapping requests that moment never comes by itself, so a
        hybrid model that dropped its snapshots in a quiet spell would serve every later
        speculating request without them (each window checkpointed and replayed, no
        shared forwards). Waiting is bounded by :data:`SNAPSHOT_WAIT_S`; past it,
        admissions go on and the switch waits for an idle moment."""
        if not self.active or not self.runtime.ledger.snapshots_wanted_back:
            self._hold_since = None
            return False
        now = time.monotonic()
        if self._hold_since is None:
            self._hold_since = now
        return now - self._hold_since < SNAPSHOT_WAIT_S

    async def _admit(self) -> None:
        """Admit every waiting request a slot is free for, in one call: their
        generations are opened and their prompts queued for prefill
        (:meth:`~meshd.daemon.engine.prefill.Prefills.add`), which the steps run a chunk at a
        time; requests that arrive together are prefilled together."""
        while self._waiting and self.runtime.idle_slots > 0:
            if self._holding_for_snapshots():
                return
            await self._gather()
            batch: list[GenerationHandle] = []
            while self._waiting and len(batch) < self.runtime.idle_slots:
                handle = self._waiting.popleft()
                if handle.cancelled:
                    self._finish(handle, Finished(FinishReason.CANCELLED, GenerationStats(),
                                                  None))
                    continue
                batch.append(handle)
            if not batch:
                continue
            self._admitting = len(batch)
            try:
                results = await self.run_sync(_open_and_begin, self.runtime, self._prefills,
                                              [h.request for h in batch], self.running())
            except BaseException:
                self._waiting.extendleft(reversed(batch))  # still owed their last event
                raise
            finally:
                self._admitting = 0
            # No await from here until the generations are owned by ``_prefilling``: a
            # cancelled loop closes what it owns (see ``run``).
            for handle, result in zip(batch, results, strict=True):
                if isinstance(result, GenerationFailed):
                    self._finish(handle, result)
                    continue
                result.cancellation = handle.cancellation  # (one latch for both)
                handle.generation = result
                handle.proposer = result.proposer_name
                self._prefilling.append(handle)
                self._counters.prompt_tokens += len(handle.request.prompt)

    async def _step(self) -> None:
        """Run engine steps of the decoding requests, each followed by prefill chunks of
        the prompts admitted (:func:`~.step_runs.run_steps`), until one request ends or its prompt
        is done, a client of a prompt left, or requests wait for admission."""
        if any(h.cancelled for h in self._prefilling):
            await self._drop_cancelled()
        active = list(self._active)
        gens = [h.generation for h in active if h.generation is not None]
        assert len(gens) == len(active)
        prefilling = list(self._prefilling)
        owner = {id(h.generation): h for h in prefilling}
        left = {h for h in prefilling if h.cancelled}  # prefilling for copies still wanted
        post = loop_poster()

        def progress(part: StepRun) -> None:
            # On the compute thread, between steps: the tokens so far, handed to the
            # event loop without waiting for it.
            post(self._progress, active, part)

        def beat() -> None:  # on the compute thread: a sign of life for the watchdog
            self._native_since = time.monotonic()

        def skip(gen: Generation) -> bool:  # a prompt whose client left waits
            handle = owner.get(id(gen))
            return handle is None or handle.cancelled

        interrupted = False

        def interrupt() -> None:  # the loop is cancelled: come back after this step
            nonlocal interrupted
            interrupted = True

        def should_yield() -> bool:
            return (interrupted or bool(self._waiting)
                    or any(h.cancelled and h not in left for h in prefilling))

        ran = await self.run_sync(run_steps, gens, self._prefills, skip, self.step_budget_s,
                                  should_yield, progress, beat, interrupt=interrupt)
        self._count_steps(ran)
        for handle, result in zip(active, ran.outcomes, strict=True):
            if isinstance(result, Exception):
                gen = handle.generation
                assert gen is not None
                await self.run_sync(self.runtime.finish, gen)
                self._active.remove(handle)
                self._finish(handle, GenerationFailed("model", str(result), gen.stats))
                continue
            self._deliver(handle, result)
        for gen, outcome in ran.started:  # prompts done: the requests decode from now
            handle = owner[id(gen)]
            self._prefilling.remove(handle)
            if isinstance(outcome, Exception):
                await self.run_sync(self.runtime.finish, gen)
                self._finish(handle, GenerationFailed("model", str(outcome), gen.stats))
                continue
            self._active.append(handle)
            self._deliver(handle, outcome)
        for handle in list(self._active):
            if await self._maybe_done(handle):
                self._active.remove(handle)
        if any(h.cancelled for h in self._prefilling):
            await self._drop_cancelled()

    async def _drop_cancelled(self) -> None:
        """Finish the requests whose clients left while their prompts were being
        prefilled (``cancelled``), their slots freed: what was prefilled goes to the
        prefix cache, as a finished request's sequence does."""
        owner = {id(h.generation): h for h in self._prefilling}

        def cancelled(gen: Generation) -> bool:
            handle = owner.get(id(gen))
            return handle is None or handle.cancelled

        dropped = await self.run_sync(_drop_unstarted, self.runtime, self._prefills, cancelled)
        for gen in dropped:
            handle = owner.get(id(gen))
            if handle is None:
                continue
            self._prefilling.remove(handle)
            self._finish(handle, Finished(FinishReason.CANCELLED, gen.stats, None))

    def _count_steps(self, ran: StepRun) -> None:
        self._counters.steps += ran.steps
        self._counters.forwards += ran.steps + ran.prefill_forwards
        for forward in ran.forwards:
            (self._counters.decode_seconds if forward.plain
             else self._counters.verify_seconds).observe(forward.seconds)
        for seconds in ran.host_seconds:
            self._counters.step_host_seconds.observe(seconds)

    def _progress(self, handles: Sequence[GenerationHandle], part: StepRun) -> None:
        """Steps still running on the compute thread: count them, deliver their tokens."""
        self._count_steps(part)
        for handle, events in zip(handles, part.outcomes, strict=True):
            assert isinstance(events, list)
            self._deliver(handle, events)

    def _deliver(self, handle: GenerationHandle, events: Sequence[TokenEvent]) -> None:
        self._time_tokens(handle, sum(len(ev.tokens) for ev in events))
        for ev in events:
            self._counters.tokens += len(ev.tokens)
            try:
                handle._send.send_nowait(ev)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                handle.cancel()  # nobody is listening any more
                return

    def _time_tokens(self, handle: GenerationHandle, n: int) -> None:
        """Time to first token and inter-token latency, as the caller receives them."""
        if n <= 0:
            return
        now = time.monotonic()
        if handle.last_token_at is None:
            self._counters.time_to_first_token_seconds.observe(now - handle.submitted)
            handle.last_token_at = now
            n -= 1
        self._counters.inter_token_latency_seconds.observe((now - handle.last_token_at) / max(n, 1),
                                                       times=n)
        handle.last_token_at = now

    async def _maybe_done(self, handle: GenerationHandle) -> bool:
        gen = handle.generation
        assert gen is not None
        if not gen.done:
            return False
        await self.run_sync(self.runtime.finish, gen)  # releases the slot
        assert gen.finish is not None
        ran = gen.stats.proposer_that_ran(handle.proposer)
        self._account(ran, gen.stats)
        self._finish(handle, Finished(gen.finish, gen.stats, ran))
        return True

    def _account(self, proposer: str | None, st: GenerationStats) -> None:
        if proposer is None:
            return
        totals = self._counters.proposers
        totals[proposer] = totals.get(proposer, ProposerStatistics()).plus(st)
        for source in st.source_drafted:  # a composite's children, each on its own
            if source != proposer:
                key = f"{proposer}/{source}"
                totals[key] = totals.get(key, ProposerStatistics()).plus_source(st, source)

    def _finish(self, handle: GenerationHandle, event: Finished | GenerationFailed) -> None:
        self._counters.request_seconds.observe(time.monotonic() - handle.submitted)
        if isinstance(event, GenerationFailed):
            self._counters.failed += 1
            self._counters.finish_reasons["error"] += 1
        elif event.finish is FinishReason.CANCELLED:
            self._counters.cancelled += 1
            self._counters.finish_reasons[event.finish.value] += 1
        else:
            self._counters.completed += 1
            self._counters.finish_reasons[event.finish.value] += 1
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            handle._send.send_nowait(event)
        handle._send.close()


def _open_and_begin(runtime: ModelRuntime, prefills: Prefills,
                    requests: Sequence[GenerationRequest],
                    running: Sequence[Generation] = ()) -> list[Generation | GenerationFailed]:
    """Open a generation for each request and queue its prompt in ``prefills`` (a
    prefix copied from ``running`` sequences where one holds it): each one's
    generation, or why it failed. Runs on the compute thread: the runtime may load a
    draft model, trim or evict cached sessions, and copy sequences.

    First, the context rebuild the rollback evidence asks for (it happens only while no
    request runs, before anything binds to the context)."""
    runtime.apply_rollback_depth()
    results: list[Generation | GenerationFailed] = []
    opened: list[Generation] = []
    try:
        for request in requests:
            try:
                gen = runtime.generation(
                    request.prompt, max_tokens=request.max_tokens, sampling=request.sampling,
                    stop=request.stop, proposer=request.proposer,
                    draft_max=request.draft_max, proposer_options=request.proposer_options,
                    grammar=request.grammar, logprobs=request.logprobs,
                    owner=request.owner,
                )
            except (RequestError, CapacityError, ValueError) as exc:
                results.append(GenerationFailed("request", str(exc)))
                continue
            opened.append(gen)
            results.append(gen)
        begun = iter(prefills.add(opened, running=running))
    except BaseException:
        for gen in opened:
            gen.close()
        raise
    for i, result in enumerate(results):
        if isinstance(result, GenerationFailed):
            continue
        failure = next(begun)
        if failure is not None:
            runtime.finish(result)
            results[i] = GenerationFailed("model", str(failure), result.stats)
    return results


def _drop_unstarted(runtime: ModelRuntime, prefills: Prefills,
                    cancelled: Callable[[Generation], bool]) -> list[Generation]:
    """Take the generations whose clients left out of ``prefills`` and close them;
    what each session holds goes to the prefix cache (a client that asks again
    prefills only the rest). Nothing goes to the speculation ledger: they never
    decoded. Runs on the compute thread."""
    dropped = prefills.cancel(cancelled)
    for gen in dropped:
        runtime.finish(gen, decoded=False)
    return dropped
