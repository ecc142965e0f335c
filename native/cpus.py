"""How many CPUs this process may really use, and how llama.cpp's threads should wait.

Why: llama.cpp's CPU threads meet at a barrier after every operation (OpenMP). Spinning
there is fastest on an idle machine, but when another process competes for the cores a
descheduled thread leaves the others spinning through whole time slices, and a decode
collapses (the README's section on threads gives a measurement). meshd is a long-running
daemon on machines it shares, so it defaults to threads that sleep at the barrier
(``OMP_WAIT_POLICY=passive``) and to as many threads as the CPUs it may actually use: its
affinity mask (``taskset``, systemd's ``CPUAffinity=``, a cpuset) capped by its cgroup's
CPU quota (``CPUQuota=``, container limits). ``meshd bench-threads`` measures the
trade-off on a given machine.

An explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment always wins.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Final

__all__ = ["DEFAULT_WAIT_POLICY", "apply_wait_policy_default", "usable_cpus"]

DEFAULT_WAIT_POLICY: Final = "passive"


def apply_wait_policy_default() -> None:
    """Set ``OMP_WAIT_POLICY=passive`` unless the user chose a policy. Must run before
    llama.cpp's library is loaded: the OpenMP runtime reads it once, when it loads."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY


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
