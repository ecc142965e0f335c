"""Each pytest-xdist worker on CPUs of its own.

llama.cpp's threads meet at a barrier after every operation and spin there a while
(native/cpus.py): two workers whose runtimes each take every CPU leave each other's
threads spinning through whole time slices, and both decode many times slower than
either would alone. So each worker gets its share of the CPUs (one each on a 2-core
machine) before llama.cpp loads: runtimes and daemons that size their threads by the
usable CPUs take that share, as under ``taskset``. A ``quiet_machine`` test (which
runs alone, see quiet_machine.py) gets every CPU back for its run.

The affinity mask is per thread; threads inherit it when they start. So the share is
set on every thread of the worker, and subprocesses inherit it from their parent.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

_ALL: set[int] = set()  # the CPUs the run started with
_SHARE: set[int] = set()  # this worker's share of them


def _set_every_thread(cpus: set[int]) -> None:
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(task), cpus)


def pin_worker() -> None:
    """Keep this xdist worker on its share of the CPUs (nothing outside xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2:
        return
    number = worker.removeprefix("gw")
    if not number.isdigit():
        return
    cpus = sorted(os.sched_getaffinity(0))
    index = int(number)
    per_worker = max(1, len(cpus) // count)
    start = (index * per_worker) % len(cpus)
    _ALL.update(cpus)
    _SHARE.update(cpus[start:start + per_worker])
    _set_every_thread(_SHARE)


@contextmanager
def every_cpu() -> Iterator[None]:
    """Every CPU for the duration (where :func:`pin_worker` pinned this worker)."""
    if not _SHARE:
        yield
        return
    _set_every_thread(_ALL)
    try:
        yield
    finally:
        _set_every_thread(_SHARE)
