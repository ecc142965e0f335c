"""How many CPUs this process may really use, and how llama.cpp's threads wait.

Why: llama.cpp's CPU threads meet at a barrier after every operation (OpenMP). On a
machine whose cores the daemon owns, threads that spin a short while at the barrier
before they sleep (libgomp's own default, the one llama-server runs with) decode
fastest, and an idle process still sleeps. When other busy processes compete for the
cores, a descheduled thread leaves the others spinning through whole time slices and a
decode collapses; threads that sleep at once (``OMP_WAIT_POLICY=passive``) then hold up
better, at a large cost on a quiet machine (docs/configuration.md, Threads, gives the
measurements). Fewer spinning threads hold up better still (one thread beside one busy
process decodes at the quiet one-thread rate), so ``spin`` is the default and the daemon
gives threads back while other processes take the cores (:class:`CpuMeter` measures
them, :func:`set_threads` applies the count; ``meshd.policy.threads`` decides);
``sleep`` remains a setting. The thread count defaults to the CPUs the process may actually use: its
affinity mask (``taskset``, systemd's ``CPUAffinity=``, a cpuset) capped by its cgroup's
CPU quota (``CPUQuota=``, container limits). ``meshd bench-threads`` measures the
trade-off on a given machine.

An explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment always wins.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import attrs

__all__ = ["DEFAULT_THREAD_WAIT", "THREAD_WAITS", "CpuMeter", "CpuReading",
           "apply_thread_wait", "openmp_wait_settings", "set_threads", "threads_spin",
           "usable_cpus"]

#: ``spin``: libgomp's default (spin a short while, then sleep); ``sleep``: sleep at once.
THREAD_WAITS: Final = ("spin", "sleep")
DEFAULT_THREAD_WAIT: Final = "spin"


def apply_thread_wait(mode: str) -> None:
    """Make llama.cpp's threads wait as ``mode`` says, unless the environment already
    chose (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``).

    The OpenMP runtime reads its settings once, when llama.cpp's library loads (on
    first use: :mod:`meshd.native.llama`): so ``sleep`` sets ``OMP_WAIT_POLICY=passive``
    and, where the runtime is already loaded, runs this same command again in place
    (``exec``: same process id, same open sockets) with it set."""
    if mode not in THREAD_WAITS:
        raise ValueError(f"thread wait {mode!r}: expected one of {', '.join(THREAD_WAITS)}")
    if mode == "spin" or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return  # the OpenMP runtime's own default, or the user's explicit choice
    os.environ["OMP_WAIT_POLICY"] = "passive"
    if _openmp_loaded():
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def openmp_wait_settings() -> tuple[str | None, str | None]:
    """The environment's ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` (None: unset), which
    decide how this process's llama.cpp threads wait."""
    return os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")


def threads_spin() -> bool:
    """Whether llama.cpp's idle threads spin at the barrier (libgomp's default, or
    ``OMP_WAIT_POLICY=active``) rather than sleep at once (``passive``, or a zero
    ``GOMP_SPINCOUNT``)."""
    policy, spincount = openmp_wait_settings()
    if policy is not None and policy.strip().lower() == "passive":
        return False
    return not (spincount is not None and spincount.strip() in ("0", "0k", "0K"))


def set_threads(contexts: Iterable[Any], threads: int) -> None:
    """Make the forwards of each llama.cpp context (anything with a ``ctx`` handle, or
    the handle itself) use ``threads`` threads from the next one on.

    ``llama_set_n_threads`` only records the count, which each forward reads when it
    starts: call it on the thread that runs the forwards, between them."""
    from .llama import lc

    for context in contexts:
        handle = getattr(context, "ctx", context)
        if handle:
            lc.llama_set_n_threads(handle, threads, threads)


def _openmp_loaded() -> bool:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "llama_cpp" in sys.modules
    return "libgomp" in maps or "libomp" in maps


def usable_cpus() -> int:
    """CPUs in this process's affinity mask, capped by its cgroup CPU quota (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def _cgroup_quota() -> float | None:
    """The cgroup CPU limit in CPUs (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            limit = _read(Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max")
            if limit:
                quota, _, period = limit.partition(" ")
                if quota != "max" and quota.isdigit() and period.isdigit() and int(period):
                    return int(quota) / int(period)
        elif "cpu" in controllers.split(","):
            base = Path("/sys/fs/cgroup") / controllers / path.lstrip("/")
            quota_text = _read(base / "cpu.cfs_quota_us")
            period_text = _read(base / "cpu.cfs_period_us")
            if quota_text and period_text and quota_text.lstrip("-").isdigit():
                quota_us, period_us = int(quota_text), int(period_text)
                if quota_us > 0 and period_us > 0:
                    return quota_us / period_us
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


@attrs.frozen
class CpuReading:
    """Clocks and counters at one moment (see :class:`CpuMeter`)."""

    wall_s: float
    cpu_s: float
    #: Busy CPU seconds of this process's CPUs, all processes (None: not readable).
    machine_busy_s: float | None
    #: Of them, by processes at a lower priority (``nice``), this one's excepted.
    machine_nice_s: float | None = None


class CpuMeter:
    """Reads this process's CPU time and the busy time of the CPUs it may use, so that
    the CPU time other processes took on them in between can be told
    (:meth:`others_s`).

    The kernel's per-CPU counters (``/proc/stat``) count in ticks (``resolution_s``
    each side of a difference). They say something only where the CPUs this process may
    use are the ones it is limited to: under a cgroup CPU quota smaller than its
    affinity mask (a container's share of a bigger machine) other processes' use of
    those CPUs is no measure of this one's room, and the meter reads None."""

    def __init__(self, stat_path: str = "/proc/stat") -> None:
        self._path = stat_path
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = list(range(os.cpu_count() or 1))
        self.cpus = len(cpus)
        self._names = {f"cpu{n}" for n in cpus}
        self._tick_s = 1.0 / (os.sysconf("SC_CLK_TCK") or 100)
        quota = _cgroup_quota()
        self._usable = (quota is None or quota >= self.cpus) and self._busy()[0] is not None
        try:
            self._niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
        except (AttributeError, OSError):
            self._niced = False
        #: How coarse a difference of two readings' busy time is, in seconds.
        self.resolution_s = 2 * self._tick_s * self.cpus

    @property
    def counters_usable(self) -> bool:
        return self._usable

    def read(self) -> CpuReading:
        busy, nice = self._busy() if self._usable else (None, None)
        return CpuReading(time.perf_counter(), time.process_time(), busy, nice)

    def others_s(self, before: CpuReading, after: CpuReading) -> float | None:
        """CPU seconds other processes used on this process's CPUs between two
        readings (None: unknown)."""
        if before.machine_busy_s is None or after.machine_busy_s is None:
            return None
        return (after.machine_busy_s - before.machine_busy_s) - (after.cpu_s - before.cpu_s)

    def others_nice_s(self, before: CpuReading, after: CpuReading) -> float | None:
        """Of :meth:`others_s`, the CPU seconds of processes at a lower priority
        (``nice``: they yield much of their share to this one's threads)."""
        if before.machine_nice_s is None or after.machine_nice_s is None:
            return None
        nice = after.machine_nice_s - before.machine_nice_s
        if self._niced:  # this process's own time is counted there
            nice -= after.cpu_s - before.cpu_s
        return max(0.0, nice)

    def _busy(self) -> tuple[float | None, float | None]:
        """Busy seconds of this process's CPUs since boot (user, nice, system, irq,
        softirq and steal: a hypervisor's other guests take the core just as well), and
        of them the nice ones."""
        try:
            with open(self._path) as f:
                lines = f.read().splitlines()
        except OSError:
            return None, None
        ticks = nice = seen = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if name in self._names:
                fields = rest.split()
                if len(fields) < 8:
                    return None, None
                ticks += sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7))
                nice += int(fields[1])
                seen += 1
        if seen != len(self._names):
            return None, None
        return ticks * self._tick_s, nice * self._tick_s
