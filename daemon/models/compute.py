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

Idle work (:meth:`ComputeThread.set_idle_work`): what the model does when nobody asks
for anything, such as measuring its cost curve, runs here too, in small pieces, only
once the thread has had no call for :data:`IDLE_AFTER_S`: a call that arrives waits at
most for the piece running, and the work is told to let go of what it holds (a sequence
slot) before the call runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import anyio

__all__ = ["IDLE_AFTER_S", "ComputeThread", "IdleWork", "loop_poster"]

T = TypeVar("T")

_Job = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...]]

#: How long the thread must have had no call before idle work runs (a run of requests
#: hands it calls back to back, a few milliseconds apart at most).
IDLE_AFTER_S = 0.2

_current = threading.local()


class IdleWork(Protocol):
    """Work a compute thread runs in pieces while it has nothing else to do."""

    def step(self) -> float | None:
        """Run one small piece: the seconds until the next one is wanted (0: as soon
        as the thread is idle again), None when there is nothing left to do."""

    def pause(self) -> None:
        """A call is about to run on the thread: let go of what the pieces hold."""


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
        self._idle: IdleWork | None = None
        #: Not before this (``time.monotonic()``) does the idle work run again.
        self._idle_at = 0.0
        #: What the idle work raised, if it did (it is dropped then).
        self.idle_error: BaseException | None = None

    @staticmethod
    def current() -> ComputeThread | None:
        """The compute thread the caller runs on (None: not on one)."""
        return getattr(_current, "thread", None)

    def set_idle_work(self, work: IdleWork | None) -> None:
        """Run ``work`` in pieces whenever the thread has been idle for
        :data:`IDLE_AFTER_S` (None: stop running the current one after its piece)."""
        with self._lock:
            self._idle, self._idle_at = work, 0.0
            running = self._thread is not None
        if running:
            self.submit(_nothing)  # wakes a thread waiting for calls with no timeout

    @property
    def idle_work(self) -> IdleWork | None:
        return self._idle

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

    def _loop(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        _current.thread = self
        last_call = time.monotonic()
        holding: IdleWork | None = None  # idle work that ran since the last call
        while True:
            work = self._idle
            if work is None:
                job = jobs.get()
            else:
                wait = max(last_call + IDLE_AFTER_S, self._idle_at) - time.monotonic()
                try:
                    job = jobs.get(timeout=wait) if wait > 0 else jobs.get_nowait()
                except queue.Empty:
                    holding = work
                    self._run_idle(work)
                    continue
            if job is None:
                break
            if holding is not None:
                self._pause(holding)
                holding = None
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                last_call = time.monotonic()
        if holding is not None:
            self._pause(holding)

    def _run_idle(self, work: IdleWork) -> None:
        try:
            delay = work.step()
        except Exception as exc:  # a bug in the work: it stops, the thread goes on
            self.idle_error = exc
            delay = None
        with self._lock:
            if self._idle is not work:
                return
            if delay is None:
                self._idle = None
            else:
                self._idle_at = time.monotonic() + max(0.0, delay)

    def _pause(self, work: IdleWork) -> None:
        try:
            work.pause()
        except Exception as exc:
            self.idle_error = exc


def _nothing() -> None:
    pass


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
