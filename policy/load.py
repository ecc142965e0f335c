"""Whether this process had its CPUs to itself while it worked: judged from measured times.

Why: llama.cpp's CPU threads meet at a barrier after every operation of a forward. When
another busy process takes a core, one of them is descheduled and the others wait for
it through whole time slices: a forward can take 10-50 times longer (SmolLM2 Q4_1 on 2
cores beside one ``while True: pass``: 1.4 tokens/s instead of 88). A measurement taken
then says nothing about the model, and a thread count that needs every core no longer
has them.

Two quantities are measured around a stretch of work and handed in (:class:`Load`):

- the CPU time other processes used on this process's CPUs (the kernel's per-CPU
  counters minus this process's own CPU time), where it can be read: the direct measure
  of company, whatever the threads do while they wait;
- this process's CPU time against what its threads would use alone: threads that spin
  at the barrier (libgomp's default) use their cores all the time, so a share well
  below 1 means the cores went to someone else. Threads that sleep at the barrier use
  less by design, so the share only counts where they spin (or where there is one
  thread, which never waits).

Pure computation: the caller reads the clocks and counters.
"""

from __future__ import annotations

import math

import attrs

__all__ = ["OTHERS_BUSY", "SHARE_BUSY", "SHARE_MIN_S", "SLACK", "Load", "busy", "cores_left",
           "might_yield", "threads_that_fit"]

#: Other processes' CPU use (in cores, beyond the counters' resolution) from which a
#: stretch of work counts as shared with them.
OTHERS_BUSY = 0.25
#: Spinning threads that got less than this share of their cores were descheduled.
SHARE_BUSY = 0.8
#: The shortest stretch whose share is a sign: over a few milliseconds (the forwards
#: of a tiny model), waking a worker thread for each sub-millisecond forward, and the
#: one-thread Python between them, move the share as much as company does, and a
#: descheduled thread costs whole time slices, so company shows as a long stretch.
SHARE_MIN_S = 0.05
#: How much of a core of company a thread count tolerates before it gives that core up
#: (and how much room it wants before it takes one back): a quarter of a core of
#: background work (a shell, a cron job) is no reason to give up a thread.
SLACK = 0.25


@attrs.frozen
class Load:
    """What one stretch of work measured about its company.

    ``wall_s``: its wall time; ``cpu_s``: this process's CPU time over it (all its
    threads); ``forward_s``: the part of ``wall_s`` spent in forwards (None: all of it),
    the rest ran on one thread; ``threads``: llama.cpp's thread count during it;
    ``cpus``: the CPUs this process may use; ``spins``: whether idle threads spin at the
    barrier; ``others_s``: CPU seconds other processes used on this process's CPUs
    meanwhile (None: unknown), ``resolution_s`` how coarse that figure is (the kernel
    counts in ticks), ``others_nice_s`` how much of it was at a lower priority.
    """

    wall_s: float
    cpu_s: float
    threads: int
    cpus: int
    spins: bool = True
    others_s: float | None = None
    resolution_s: float = 0.0
    forward_s: float | None = None
    #: Of ``others_s``, the CPU seconds of processes at a lower priority (``nice``;
    #: None: unknown).
    others_nice_s: float | None = None

    def others_low(self) -> float | None:
        """Other processes' CPU use in cores, the counters' resolution given to the
        doubt (the least it can have been); None: unknown."""
        if self.others_s is None or self.wall_s <= 0:
            return None
        return max(0.0, self.others_s - self.resolution_s) / self.wall_s

    def others_high(self) -> float | None:
        """The most other processes' CPU use can have been, in cores; None: unknown."""
        if self.others_s is None or self.wall_s <= 0:
            return None
        return max(0.0, self.others_s + self.resolution_s) / self.wall_s

    def share(self) -> float | None:
        """This process's CPU time against what its threads use alone (spinning at the
        barrier: every thread all through the forwards, one thread outside them); None
        where that is not known (sleeping threads with company of their own) or not a
        sign (a stretch under :data:`SHARE_MIN_S`)."""
        if self.wall_s < SHARE_MIN_S or not (self.spins or self.threads == 1):
            return None
        used = min(self.threads, self.cpus)
        forward = self.wall_s if self.forward_s is None else min(self.forward_s, self.wall_s)
        alone = used * forward + (self.wall_s - forward)
        return self.cpu_s / alone if alone > 0 else None


def might_yield(load: Load) -> bool:
    """Whether the company may give its cores back to more threads: unknown counters,
    or processes at a lower priority (``nice``) among it, which the kernel's scheduler
    shortchanges once this process's threads want the cores (the counters cannot show
    that room: those processes take whatever is idle)."""
    if load.others_s is None or load.others_nice_s is None:
        return True
    return load.others_nice_s > max(load.resolution_s, OTHERS_BUSY * load.wall_s)


def busy(load: Load) -> bool:
    """Whether the work shared its CPUs with other busy processes."""
    others = load.others_low()
    if others is not None and others > OTHERS_BUSY:
        return True
    share = load.share()
    return share is not None and share < SHARE_BUSY


def cores_left(load: Load) -> float | None:
    """The cores other processes left this process during ``load`` (None: unknown), by
    the counters where they can be read, else by the CPU time the process got where its
    threads spin and got less than their share."""
    others = load.others_low()
    if others is not None:
        return max(0.0, load.cpus - others)
    share = load.share()
    if share is not None and share < SHARE_BUSY:
        return load.cpu_s / load.wall_s if load.wall_s > 0 else None
    return None


def threads_that_fit(cores: float, *, slack: float = SLACK) -> int:
    """The thread count ``cores`` of free CPU hold (at least 1)."""
    if not math.isfinite(cores):
        return 1
    return max(1, math.floor(cores + slack))
