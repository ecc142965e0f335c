"""Idle work on the compute thread: pieces run only after a quiet spell, on the thread
itself, are paused (their slot given back) before any call, never hold a call up longer
than one piece, and stop when done or broken."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from meshd.daemon.models.compute import IDLE_AFTER_S, ComputeThread


class Pieces:
    def __init__(self, n: int, piece_s: float = 0.01, every_s: float = 0.0) -> None:
        self.left = n
        self.piece_s = piece_s
        self.every_s = every_s
        self.log: list[tuple[str, float]] = []
        self.threads: set[int] = set()

    def step(self) -> float | None:
        self.threads.add(threading.get_ident())
        self.log.append(("step", time.monotonic()))
        time.sleep(self.piece_s)
        self.left -= 1
        return None if self.left <= 0 else self.every_s

    def pause(self) -> None:
        self.log.append(("pause", time.monotonic()))


def wait_for(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_idle_work_runs_on_the_thread_after_a_quiet_spell_until_done() -> None:
    compute = ComputeThread()
    try:
        ident = compute.call(threading.get_ident)
        work = Pieces(5)
        t0 = time.monotonic()
        compute.set_idle_work(work)
        wait_for(lambda: work.left == 0)
        assert work.threads == {ident}
        first = work.log[0][1]
        assert first - t0 >= IDLE_AFTER_S * 0.9
        wait_for(lambda: compute.idle_work is None)  # done: dropped
    finally:
        compute.close()


def test_a_call_waits_for_one_piece_at_most_and_the_work_is_paused_first() -> None:
    compute = ComputeThread()
    try:
        compute.call(lambda: None)
        work = Pieces(10_000, piece_s=0.05)
        compute.set_idle_work(work)
        wait_for(lambda: any(kind == "step" for kind, _ in work.log))
        events: list[str] = []
        t0 = time.monotonic()
        compute.call(lambda: events.append(f"call after {work.log[-1][0]}"))
        assert time.monotonic() - t0 < 0.05 + 0.1
        assert events == ["call after pause"]
        # Calls back to back keep the work away; it resumes after a quiet spell.
        n = len(work.log)
        for _ in range(20):
            compute.call(time.sleep, 0.005)
        assert [k for k, _ in work.log[n:]] == []
        wait_for(lambda: len(work.log) > n)
        compute.set_idle_work(None)
    finally:
        compute.close()


def test_a_wait_asked_by_the_work_is_honoured() -> None:
    compute = ComputeThread()
    try:
        compute.call(lambda: None)
        work = Pieces(3, piece_s=0.0, every_s=0.3)
        compute.set_idle_work(work)
        wait_for(lambda: work.left == 0)
        steps = [t for kind, t in work.log if kind == "step"]
        assert all(b - a >= 0.29 for a, b in itertools.pairwise(steps))
    finally:
        compute.close()


def test_broken_idle_work_is_dropped_and_the_thread_serves_on() -> None:
    class Broken:
        def step(self) -> float | None:
            raise RuntimeError("bug")

        def pause(self) -> None:
            pass

    compute = ComputeThread()
    try:
        compute.call(lambda: None)
        compute.set_idle_work(Broken())
        wait_for(lambda: compute.idle_error is not None)
        assert compute.idle_work is None
        assert compute.call(lambda: 7) == 7
        assert ComputeThread.current() is None
        assert compute.call(ComputeThread.current) is compute
    finally:
        compute.close()


def test_close_ends_a_thread_that_waits_between_pieces() -> None:
    compute = ComputeThread()
    compute.call(lambda: None)
    work = Pieces(100, piece_s=0.0, every_s=60.0)
    compute.set_idle_work(work)
    wait_for(lambda: work.left < 100)
    t0 = time.monotonic()
    compute.close()
    assert time.monotonic() - t0 < 1.0
    assert work.log[-1][0] == "pause"


@pytest.mark.parametrize("n", [1])
def test_idle_work_before_the_first_call_waits_for_the_thread(n: int) -> None:
    compute = ComputeThread()
    work = Pieces(n)
    compute.set_idle_work(work)  # nothing started yet: nothing runs
    time.sleep(IDLE_AFTER_S + 0.1)
    assert work.left == n
    try:
        compute.call(lambda: None)
        wait_for(lambda: work.left == 0)
    finally:
        compute.close()
