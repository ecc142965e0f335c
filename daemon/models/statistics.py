"""The scheduler's statistics: counted on the event loop, read as frozen snapshots.

Why snapshots (as trio's ``statistics()`` methods): the ``stats`` op, ``/metrics``, the
health answer and the watchdog read these figures while requests run. Handing them the
live, mutable counters (or letting them reach into sessions that the model's worker
thread is changing) would let a reader see half an update. So the scheduler keeps its
counters (:class:`SchedulerCounters`) on the event loop only, the runtime's figures are
taken on the worker thread at the end of each call it runs there
(:class:`RuntimeFigures`), and :meth:`Scheduler.statistics` returns one frozen
:class:`SchedulerStatistics` of both, safe to keep and read anywhere.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import attrs

from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.models.histogram import Histogram, HistogramSnapshot

#: Upper bounds in seconds for host time per decode step (well under a forward).
HOST_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
#: Upper bounds in seconds for a whole request, queue wait included (up to many minutes).
REQUEST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                     320.0, 640.0)

__all__ = ["ProposerStatistics", "RuntimeFigures", "SchedulerCounters", "SchedulerStatistics"]


@attrs.frozen
class ProposerStatistics:
    """One proposer's totals over the requests it ran for."""

    requests: int = 0
    drafts: int = 0
    """Verify windows that carried at least one drafted token."""
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def merged(self, other: ProposerStatistics) -> ProposerStatistics:
        """Both totals together (one proposer's figures on two models)."""
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = [*self.accepted_per_position, *[0] * (n - len(self.accepted_per_position))]
        b = [*other.accepted_per_position, *[0] * (n - len(other.accepted_per_position))]
        return ProposerStatistics(
            requests=self.requests + other.requests, drafts=self.drafts + other.drafts,
            drafted=self.drafted + other.drafted, accepted=self.accepted + other.accepted,
            accepted_per_position=tuple(x + y for x, y in zip(a, b, strict=True)))

    def plus_source(self, st: GenerationStats, source: str) -> ProposerStatistics:
        """These totals with one finished request's drafts of ``source`` added (a
        composite's child: ``stats`` and ``/metrics`` list it as ``PROPOSER/SOURCE``)."""
        return ProposerStatistics(
            requests=self.requests + 1,
            drafts=self.drafts + st.source_windows.get(source, 0),
            drafted=self.drafted + st.source_drafted.get(source, 0),
            accepted=self.accepted + st.source_accepted.get(source, 0),
            accepted_per_position=self.accepted_per_position,
        )

    def plus(self, st: GenerationStats) -> ProposerStatistics:
        """These totals with one more finished request's figures added."""
        per_position = list(self.accepted_per_position)
        for i, n in enumerate(st.accepted_per_position):
            if i >= len(per_position):
                per_position.append(0)
            per_position[i] += n
        return ProposerStatistics(
            requests=self.requests + 1,
            drafts=self.drafts + (st.drafted_per_position[0] if st.drafted_per_position else 0),
            drafted=self.drafted + st.drafted,
            accepted=self.accepted + st.accepted,
            accepted_per_position=tuple(per_position),
        )


@attrs.frozen
class RuntimeFigures:
    """The model runtime's state as the worker thread last left it."""

    idle_slots: int = 0
    cached_sessions: int = 0
    prefix_cache_tokens: int = 0
    checkpoint_bytes: int = 0
    """State checkpoints held by the active sessions."""


@attrs.define
class SchedulerCounters:
    """What the scheduler counts; changed and read on the event loop only."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected_busy: int = 0
    tokens: int = 0
    #: Prompt tokens of admitted requests (those a prefix-cache hit reused included).
    prompt_tokens: int = 0
    forwards: int = 0
    steps: int = 0
    proposers: dict[str, ProposerStatistics] = attrs.field(factory=dict)
    #: Requests that ended, by finish reason (``error`` for failed ones).
    finish_reasons: collections.Counter[str] = attrs.field(factory=collections.Counter)
    #: One batched verify forward (a window with drafts or filler), in seconds.
    verify_seconds: Histogram = attrs.field(factory=Histogram)
    #: One batched plain decode forward (every window one row), in seconds.
    decode_seconds: Histogram = attrs.field(factory=Histogram)
    #: From submission to the request's end (its ``done``), queue wait included.
    request_seconds: Histogram = attrs.field(factory=lambda: Histogram(REQUEST_BUCKETS_S))
    #: One decode step's time on the compute thread outside its forwards (planning,
    #: drafting, deciding, repairing, sampling, handing tokens on), in seconds.
    step_host_seconds: Histogram = attrs.field(factory=lambda: Histogram(HOST_BUCKETS_S))
    #: From submission to the first token handed to the request's caller.
    time_to_first_token_seconds: Histogram = attrs.field(factory=Histogram)
    #: Between tokens handed to the caller (tokens handed over together share the gap).
    inter_token_latency_seconds: Histogram = attrs.field(factory=Histogram)


@attrs.frozen
class SchedulerStatistics:
    """The scheduler's figures at one moment (see the module docstring)."""

    requests: int
    completed: int
    cancelled: int
    failed: int
    rejected_busy: int
    tokens: int
    prompt_tokens: int
    forwards: int
    steps: int
    active: int
    """Requests decoding now."""
    queued: int
    """Requests waiting for a slot."""
    proposers: Mapping[str, ProposerStatistics]
    finish_reasons: Mapping[str, int]
    verify_seconds: HistogramSnapshot
    decode_seconds: HistogramSnapshot
    request_seconds: HistogramSnapshot
    step_host_seconds: HistogramSnapshot
    time_to_first_token_seconds: HistogramSnapshot
    inter_token_latency_seconds: HistogramSnapshot
    runtime: RuntimeFigures

    def plus(self, other: SchedulerStatistics) -> SchedulerStatistics:
        """Two models' figures as one daemon's (the ``stats`` op's totals)."""
        proposers = dict(self.proposers)
        for name, tot in other.proposers.items():
            proposers[name] = proposers[name].merged(tot) if name in proposers else tot
        reasons = collections.Counter(self.finish_reasons)
        reasons.update(other.finish_reasons)
        a, b = self.runtime, other.runtime
        counts = {f: getattr(self, f) + getattr(other, f) for f in _SUMMED}
        hists = {f: getattr(self, f).plus(getattr(other, f)) for f in _HISTOGRAMS}
        return SchedulerStatistics(
            **counts, **hists, proposers=proposers, finish_reasons=dict(reasons),
            runtime=RuntimeFigures(
                idle_slots=a.idle_slots + b.idle_slots,
                cached_sessions=a.cached_sessions + b.cached_sessions,
                prefix_cache_tokens=a.prefix_cache_tokens + b.prefix_cache_tokens,
                checkpoint_bytes=a.checkpoint_bytes + b.checkpoint_bytes))

    @classmethod
    def of(cls, counters: SchedulerCounters, *, active: int, queued: int,
           runtime: RuntimeFigures) -> SchedulerStatistics:
        c = counters
        return cls(
            requests=c.requests, completed=c.completed, cancelled=c.cancelled,
            failed=c.failed, rejected_busy=c.rejected_busy, tokens=c.tokens,
            prompt_tokens=c.prompt_tokens,
            forwards=c.forwards, steps=c.steps, active=active, queued=queued,
            proposers=dict(c.proposers), finish_reasons=dict(c.finish_reasons),
            verify_seconds=c.verify_seconds.snapshot(),
            decode_seconds=c.decode_seconds.snapshot(),
            request_seconds=c.request_seconds.snapshot(),
            step_host_seconds=c.step_host_seconds.snapshot(),
            time_to_first_token_seconds=c.time_to_first_token_seconds.snapshot(),
            inter_token_latency_seconds=c.inter_token_latency_seconds.snapshot(),
            runtime=runtime,
        )


_SUMMED = ("requests", "completed", "cancelled", "failed", "rejected_busy", "tokens",
           "prompt_tokens", "forwards", "steps", "active", "queued")
_HISTOGRAMS = ("verify_seconds", "decode_seconds", "request_seconds", "step_host_seconds",
               "time_to_first_token_seconds", "inter_token_latency_seconds")
