"""How many threads llama.cpp's forwards use while other processes want the CPUs.

Why: llama.cpp's threads meet at a barrier after every operation, so a forward runs at
the pace of its slowest thread; with another busy process on the machine one thread is
always the one descheduled. Measured on a 2-core Xeon, SmolLM2-135M Q4_1, decode
tokens/s (quiet / beside one ``python -c "while True: pass"``):

- 2 threads spinning at the barrier (libgomp's default): 88 / 1.4;
- 2 threads sleeping at the barrier (``OMP_WAIT_POLICY=passive``): 34 / 36-44;
- 1 thread: 53 / 54.

So the configured count spins at full speed on a quiet machine, and a thread is given
back while another process uses its core: one thread beside the busy process decodes at
the one-thread quiet rate, 60% of the quiet two-thread rate, where keeping both threads
loses 98% of it and sleeping threads lose 60% of it on a quiet machine.

The rules, one call per window of forwards (the caller aggregates forwards into windows
of :data:`WINDOW_S` or more and measures each as a :class:`~meshd.policy.load.Load`):

- fewer: where the cores other processes left this one (:func:`cores_left`) hold fewer
  threads than run now, that many run: after one window where the kernel's counters
  show the company (the next window undoes a wrong drop), after :data:`DROP_AFTER` in a
  row where only the threads' share of their cores does;
- more: where the kernel's counters show room for more threads, at once (one window);
- probe: where they cannot show it (unknown counters, or company at a lower priority,
  a ``nice``'d batch job that takes only idle CPU and yields to the full count), the
  full count runs one window every probe interval; it stays if that window had the
  cores to itself, else the count goes back and the interval doubles,
  :data:`PROBE_FIRST_S` up to :data:`PROBE_MAX_S` without counters,
  :data:`PROBE_FIRST_COUNTED_S` up to :data:`PROBE_MAX_COUNTED_S` with them. Company at
  the same priority never yields, so it is never tried against: a try costs a slow
  forward (a second and more beside busy processes).

A quiet machine never loses a thread: both measures need other processes' CPU use (or a
share of the cores the threads never got), beyond the counters' resolution and a
quarter of a core of slack. Sans-I/O: times are handed in.
"""

from __future__ import annotations

import attrs

from .load import Load, cores_left, might_yield, threads_that_fit

__all__ = ["DROP_AFTER", "PROBE_FIRST_COUNTED_S", "PROBE_FIRST_S", "PROBE_MAX_COUNTED_S",
           "PROBE_MAX_S", "WINDOW_S", "ThreadTuner"]

#: The shortest window of forwards judged at once (seconds): long enough for the
#: kernel's tick counters (10 ms) to say something, short enough to react within a
#: second.
WINDOW_S = 0.25
#: Windows in a row that must find too little room before a thread is given back.
DROP_AFTER = 2
#: The first wait before the full count is tried again where no counter can show room,
#: and the longest (doubling between them while tries find company).
PROBE_FIRST_S = 2.0
PROBE_MAX_S = 16.0
#: The same where the counters show room (they bring the full count back as soon as
#: the company leaves; a try is only for company that would yield to it, a ``nice``'d
#: job): a try under real company costs a slow forward (a second and more beside
#: three busy processes), so they are rare.
PROBE_FIRST_COUNTED_S = 8.0
PROBE_MAX_COUNTED_S = 64.0


@attrs.define
class ThreadTuner:
    """The thread count for the next window of forwards, from the last windows' loads.

    ``full``: the configured count (never exceeded); ``threads``: the count now.
    """

    full: int = attrs.field()
    threads: int = attrs.field()
    #: Windows in a row that found too little room for ``threads``.
    short: int = 0
    #: Wait before the next try of the full count (doubling while tries fail).
    probe_every_s: float = PROBE_FIRST_S
    #: When the full count is tried next (None: running it).
    next_probe_at: float | None = None
    #: The count a running try came from (None: no try running).
    probing_from: int | None = None
    #: Changes made, for the log and tests: (time, threads, reason).
    changes: list[tuple[float, int, str]] = attrs.field(factory=list)

    @full.validator
    def _check_full(self, _attribute: object, full: int) -> None:
        if full < 1:
            raise ValueError(f"full thread count must be >= 1, got {full}")

    @threads.default
    def _threads_default(self) -> int:
        return self.full

    def observe(self, load: Load, now: float) -> int:
        """Judge one window (run with ``load.threads`` threads) at time ``now``; returns
        the count for the next window."""
        if self.full == 1:
            return 1
        left = cores_left(load)
        fit = min(self.full, threads_that_fit(left)) if left is not None else None
        if self.probing_from is not None:
            return self._judge_probe(load, fit, now)
        if fit is not None and fit < load.threads:
            self.short += 1
            # Where the counters show the company, a wrong drop is undone by the next
            # window (they show the room): one window is enough. Without them only a
            # try undoes it, seconds later: two in a row.
            if self.short >= (1 if load.others_s is not None else DROP_AFTER):
                self._set(fit, now, f"other processes left {left:.2f} cores")
                self.probe_every_s = max(self.probe_every_s, _first(load))
                self.next_probe_at = now + self.probe_every_s
            return self.threads
        self.short = 0
        if self.threads < self.full:
            room = self._room(load)
            if room > self.threads:
                self._set(room, now, "the other processes' CPU use is down")
                if self.threads == self.full:
                    self.probe_every_s, self.next_probe_at = _first(load), None
            elif (self.next_probe_at is not None and now >= self.next_probe_at
                  and might_yield(load)):
                self.probing_from = self.threads
                self._set(self.full, now, "trying the full count again")
        return self.threads

    def _judge_probe(self, load: Load, fit: int | None, now: float) -> int:
        back, self.probing_from = self.probing_from, None
        assert back is not None
        self.short = 0
        if fit is not None and fit < load.threads:
            self._set(max(back, fit), now, "the full count still has company")
            counted = load.others_s is not None
            top = PROBE_MAX_COUNTED_S if counted else PROBE_MAX_S
            self.probe_every_s = min(top, self.probe_every_s * 2)
            self.next_probe_at = now + self.probe_every_s
        else:
            self.probe_every_s, self.next_probe_at = _first(load), None
        return self.threads

    def _room(self, load: Load) -> int:
        """The count the counters show room for (the current one where they cannot
        tell)."""
        high = load.others_high()
        if high is None:
            return self.threads
        return min(self.full, threads_that_fit(load.cpus - high))

    def _set(self, threads: int, now: float, reason: str) -> None:
        self.short = 0
        if threads != self.threads:
            self.threads = threads
            self.changes.append((now, threads, reason))
            del self.changes[:-16]


def _first(load: Load) -> float:
    """The first wait before a try, by whether the counters can show room."""
    return PROBE_FIRST_COUNTED_S if load.others_s is not None else PROBE_FIRST_S
