"""How many CPUs this process may really use, and how llama.cpp's threads wait.

Why: llama.cpp's CPU threads meet at a barrier after every operation (OpenMP). On a
machine whose cores the daemon owns, threads that spin a short while at the barrier
before they sleep (libgomp's own default, the one llama-server runs with) decode
fastest, and an idle process still sleeps. When other busy processes compete for the
cores, a descheduled thread leaves the others spinning through whole time slices and a
decode collapses; threads that sleep at once (``OMP_WAIT_POLICY=passive``) then hold up
better, at a large cost on a quiet machine (docs/configuration.md, Threads, gives the
measurements). So ``spin`` is the default and ``sleep`` is a setting for shared
machines. The thread count defaults to the CPUs the process may actually use: its
affinity mask (``taskset``, systemd's ``CPUAffinity=``, a cpuset) capped by its cgroup's
CPU quota (``CPUQuota=``, container limits). ``meshd bench-threads`` measures the
trade-off on a given machine.

An explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment always wins.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Final

__all__ = ["DEFAULT_THREAD_WAIT", "THREAD_WAITS", "apply_thread_wait", "openmp_wait_settings",
           "usable_cpus"]

#: ``spin``: libgomp's default (spin a short while, then sleep); ``sleep``: sleep at once.
THREAD_WAITS: Final = ("spin", "sleep")
DEFAULT_THREAD_WAIT: Final = "spin"


def apply_thread_wait(mode: str) -> None:
    """Make llama.cpp's threads wait as ``mode`` says, unless the environment already
    chose (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``).

    The OpenMP runtime reads its settings once, when llama.cpp's library loads, and
    meshd's modules load it on import: so ``sleep`` sets ``OMP_WAIT_POLICY=passive`` and,
    where the runtime is already loaded, runs this same command again in place
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
