"""The thread count of a model's forwards, adapted while other processes use the CPUs.

The policy is :class:`meshd.policy.threads.ThreadTuner` (its docstring has the measured
reasons); this is where it meets the machine. Every forward the cost model records is
heard here, on the model's compute thread, right after it ran: forwards are gathered
into windows of :data:`~meshd.policy.threads.WINDOW_S` or more, each window's clocks
and counters become a :class:`~meshd.policy.load.Load`, and a new count is applied with
``llama_set_n_threads`` on every context of the model (target, MTP head, draft models)
before the next forward. A gap between forwards (the model was idle) starts a new
window, so idle time never counts as company.

Only where the model runs on this machine's CPUs with more than one thread: layers on
an accelerator or remote workers do not share these cores' barrier.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from meshd.native.context import TargetContext
from meshd.native.cpus import CpuMeter, CpuReading, set_threads, threads_spin, usable_cpus
from meshd.native.model import Model
from meshd.policy.load import Load
from meshd.policy.threads import WINDOW_S, ThreadTuner

__all__ = ["GAP_S", "ThreadTuning", "TunedModel"]


class _Draft(Protocol):
    @property
    def context(self) -> TargetContext: ...


class TunedModel(Protocol):
    """What the tuning reads of a runtime (:class:`~meshd.daemon.models.runtime.ModelRuntime`)."""

    @property
    def context(self) -> TargetContext: ...

    @property
    def model(self) -> Model: ...

    @property
    def remote(self) -> object | None: ...

    @property
    def _drafts(self) -> Mapping[str, _Draft]: ...

#: A gap this long between two forwards (the model was idle, or between requests)
#: starts a new window.
GAP_S = 0.5


class ThreadTuning:
    """Applies :class:`ThreadTuner` to one model's contexts (see the module docstring)."""

    def __init__(self, runtime: TunedModel, full: int, *,
                 events: Callable[..., None] | None = None,
                 meter: CpuMeter | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._runtime = runtime
        self._clock = clock
        self._events = events
        self.meter = meter if meter is not None else CpuMeter()
        self.spins = threads_spin()
        self.tuner = ThreadTuner(full)
        self._start: CpuReading | None = None
        self._forward_s = 0.0
        self._last_end = 0.0
        #: The contexts the current count was applied to (a rebuilt or new one gets it).
        self._applied: set[int] = set()

    @classmethod
    def for_runtime(cls, runtime: TunedModel, *,
                    events: Callable[..., None] | None = None) -> ThreadTuning | None:
        """The tuning of ``runtime``'s forwards (None where it does not apply)."""
        config = runtime.context.config
        full = config.n_threads or usable_cpus()
        if full < 2 or runtime.model.gpu_layers != 0 or runtime.remote is not None:
            return None
        return cls(runtime, full, events=events)

    @property
    def threads(self) -> int:
        """The thread count the forwards use now."""
        return self.tuner.threads

    @property
    def full(self) -> int:
        return self.tuner.full

    def _contexts(self) -> list[Any]:
        rt = self._runtime
        contexts: list[Any] = []
        for context in (rt.context, *(d.context for d in list(rt._drafts.values()))):
            contexts.append(context)
            if context.mtp is not None:
                contexts.append(context.mtp)
        return contexts

    def _apply(self, threads: int, *, force: bool = False) -> None:
        contexts = self._contexts()
        ids = {id(c) for c in contexts}
        if force or ids != self._applied:
            set_threads(contexts, threads)
            self._applied = ids

    def forward(self, rows: int, seconds: float, sequences: int) -> None:
        """One forward of the model just ran (the cost model's listener; on the compute
        thread, before the next forward)."""
        now = self._clock()
        if self._start is None or (now - seconds) - self._last_end > GAP_S:
            self._start, self._forward_s, self._last_end = self.meter.read(), 0.0, now
            return
        self._forward_s += seconds
        self._last_end = now
        if now - self._start.wall_s < WINDOW_S:
            return
        start, end = self._start, self.meter.read()
        before = self.tuner.threads
        load = Load(wall_s=end.wall_s - start.wall_s, cpu_s=end.cpu_s - start.cpu_s,
                    threads=before, cpus=self.meter.cpus, spins=self.spins,
                    others_s=self.meter.others_s(start, end),
                    resolution_s=self.meter.resolution_s, forward_s=self._forward_s,
                    others_nice_s=self.meter.others_nice_s(start, end))
        after = self.tuner.observe(load, now)
        self._start, self._forward_s = end, 0.0
        if after != before:
            self._apply(after, force=True)
            if self._events is not None:
                _, _, reason = self.tuner.changes[-1]
                self._events("threads_adapted", threads=after, full=self.full, reason=reason)
        elif after != self.full:
            self._apply(after)  # a context made since (a rebuild, a draft model)

    @contextlib.contextmanager
    def full_threads(self) -> Iterator[None]:
        """Run the block with the full thread count (the calibration measures what the
        configured count costs), then the adapted one again."""
        if self.tuner.threads != self.full:
            self._apply(self.full, force=True)
        try:
            yield
        finally:
            if self.tuner.threads != self.full:
                self._apply(self.tuner.threads, force=True)
            self._start = None  # the block's forwards are no window's
