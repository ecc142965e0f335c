"""Tests that measure an idle machine, run in parallel (pytest-xdist) with the others.

A test marked ``quiet_machine`` (the calibration waits for quiet, the thread count is
given back beside busy processes) would see the other workers' tests as load and take
its busy branch or skip. So each test takes a machine-wide lock around its whole run
(setup, call, teardown, where module fixtures load their models): shared for every
test, exclusive for a quiet one, which so runs alone while the other workers wait
between two of their tests. Under xdist the quiet tests are collected first and run back
to back under one exclusive hold (tests/integration/conftest.py): the others wait once.
``--dist loadgroup`` would not do: it keeps a group on one worker, but the other workers
go on beside it.

``flock`` locks, so the kernel drops a crashed worker's lock. A turnstile taken before
the lock lets a waiting quiet test in before tests that start after it asked (shared
locks are granted beside one another, so a stream of them could keep it out).
Without xdist nothing runs beside a test and nothing is locked.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MARKER = "quiet_machine"


def is_xdist_worker() -> bool:
    """Whether this process is a pytest-xdist worker (other workers run beside it)."""
    return "PYTEST_XDIST_WORKER" in os.environ


def _lock_dir() -> Path | None:
    """Where this user's parallel runs keep the lock; ``None`` when not an xdist worker."""
    if not is_xdist_worker():
        return None
    directory = Path(tempfile.gettempdir()) / f"meshd-tests-{os.getuid()}"
    directory.mkdir(exist_ok=True)
    return directory


@contextmanager
def machine_share(*, exclusive: bool) -> Iterator[None]:
    """Hold the machine alone (``exclusive``) or beside other non-exclusive holders."""
    directory = _lock_dir()
    if directory is None:
        yield
        return
    with open(directory / "turnstile", "a") as turnstile, \
            open(directory / "machine", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
