"""The one thread that makes a model's llama.cpp calls (an actor fed through a queue).

Why one thread, for the model's whole life: every thread that calls into ggml becomes
the master of an OpenMP team of its own, with its own worker threads. A model loaded on
the main thread and served from a pool of worker threads has several teams; an idle
team's threads spin at their barrier for a while (or forever under
``OMP_WAIT_POLICY=active``) and steal the cores the serving team needs. Here load,
calibration, prefill, verify, the MTP head, draft models and context rebuilds all run
on this thread, so exactly one team exists.

Why not ``anyio.to_thread``: its pool hands a call to whichever idle worker thread it
has, and retires idle ones after a while, so successive steps of one model land on
different threads (each a new team). The event loop hands work over through a queue and
is woken by the loop's own thread-safe callback (``call_soon_threadsafe`` on asyncio,
``run_sync_soon`` on trio), so delivering a result never waits for the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

__all__ = ["ComputeThread", "loop_poster"]

T = TypeVar("T")

_Job = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class ComputeThread:
    """A long-lived thread running submitted calls one at a time, in order.

    The thread starts on the first call and runs until :meth:`close` (a later call
    starts a fresh one). Calls from the thread itself run inline, so code already on it
    may call back without deadlocking.
    """

    def __init__(self, name: str = "meshd-compute") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def ident(self) -> int | None:
        """The running thread's id (None before the first call or after close)."""
        thread = self._thread
        return thread.ident if thread is not None else None

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)``; its future completes on this thread."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._thread is None:
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._loop, args=(self._jobs,),
                                                name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread and wait for it (for synchronous callers:
        start-up before the event loop, shutdown after it)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any,
                  interrupt: Callable[[], None] | None = None) -> T:
        """Run ``fn(*args)`` on the thread; the calling task waits without blocking the
        event loop. As with ``anyio.to_thread.run_sync``, a call that has begun is not
        abandoned and its result is not lost: on cancellation ``interrupt()`` (if given)
        asks it to return early, its result is returned, and the cancellation takes
        effect at the caller's next checkpoint (anyio's cancellation is level-triggered)."""
        done = anyio.Event()
        post = loop_poster()
        future = self.submit(fn, *args)
        future.add_done_callback(lambda _: post(done.set))
        try:
            await done.wait()
        except anyio.get_cancelled_exc_class():
            if interrupt is not None:
                interrupt()
            with anyio.CancelScope(shield=True):
                await done.wait()
        return future.result()

    def close(self) -> None:
        """Let queued calls finish, then end the thread (idempotent)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._jobs.put(None)
        if thread is not threading.current_thread():
            thread.join()

    @staticmethod
    def _loop(jobs: queue.SimpleQueue[_Job | None]) -> None:
        while (job := jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)


def loop_poster() -> Callable[..., None]:
    """``post(fn, *args)``: run ``fn(*args)`` soon on the current event loop's thread,
    called from any thread, without waiting for it. Posts run in the order made."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        import trio

        token = trio.lowlevel.current_trio_token()
        post: Callable[..., object] = token.run_sync_soon
    else:
        post = loop.call_soon_threadsafe

    def posting(fn: Callable[..., None], *args: Any) -> None:
        # A loop that has already ended has nobody left to tell.
        with contextlib.suppress(Exception):
            post(fn, *args)

    return posting
