"""The compute thread: one thread for every call of a model, in order, never the loop's."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from meshd.daemon.models.compute import ComputeThread

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_every_call_runs_on_one_thread_that_is_not_the_loops() -> None:
    compute = ComputeThread()
    try:
        first = compute.call(threading.get_ident)  # as serve loads the model
        seen = [await compute.run(threading.get_ident) for _ in range(5)]
        async with anyio.create_task_group() as tg:  # concurrent callers too
            for _ in range(4):
                tg.start_soon(lambda: compute.run(lambda: seen.append(threading.get_ident())))
        assert set(seen) == {first}
        assert first != threading.get_ident()
        assert compute.ident == first
    finally:
        compute.close()


async def test_calls_run_in_the_order_submitted_and_errors_reach_the_caller() -> None:
    compute = ComputeThread()
    order: list[int] = []
    try:
        futures = [compute.submit(order.append, i) for i in range(50)]
        for f in futures:
            f.result()
        assert order == list(range(50))

        def boom() -> None:
            raise ValueError("bad prompt")

        with pytest.raises(ValueError, match="bad prompt"):
            await compute.run(boom)
        assert await compute.run(lambda: 42) == 42  # the thread survives an error
    finally:
        compute.close()


async def test_the_event_loop_keeps_running_while_a_call_runs() -> None:
    compute = ComputeThread()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.01)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            await compute.run(time.sleep, 0.3)
            tg.cancel_scope.cancel()
        assert ticks >= 10
    finally:
        compute.close()


async def test_a_cancelled_caller_interrupts_the_call_and_waits_for_it() -> None:
    compute = ComputeThread()
    stop = threading.Event()
    finished = threading.Event()

    def loop_until_stopped() -> None:
        stop.wait(10)
        finished.set()

    results: list[int] = []

    def work() -> int:
        loop_until_stopped()
        return 7

    try:
        with anyio.move_on_after(0.1) as scope:
            results.append(await compute.run(work, interrupt=stop.set))
            await anyio.sleep(0)  # the next checkpoint: the cancellation arrives here
            results.append(-1)
        assert scope.cancelled_caught
        assert stop.is_set()
        assert finished.is_set()  # the cancellation took effect only once it returned
        assert results == [7]  # and its result was not lost
    finally:
        compute.close()


def test_close_ends_the_thread_after_queued_calls_and_a_later_call_restarts_it() -> None:
    compute = ComputeThread()
    done: list[int] = []
    compute.submit(time.sleep, 0.05)
    compute.submit(done.append, 1)
    first = compute.ident
    compute.close()
    assert done == [1]
    assert compute.ident is None
    assert not any(t.ident == first for t in threading.enumerate())
    assert compute.call(lambda: 7) == 7
    compute.close()
    compute.close()  # idempotent
