"""Third-party in-process proposers, held to a deadline like out-of-process ones.

Why: the engine calls ``propose`` on the model's compute thread for every request at
once, so a third-party proposer that sleeps, loops or waits on the network would stall
every request on the model. So each such plugin gets a worker thread
(:class:`PluginWorker`) and ``propose`` is waited for until the plugin's ``deadline_ms``;
``observe`` and ``close`` are handed over without waiting, in order. A late call is
dropped (``late``; its answer, if it comes, ``stale``) and the plugin skipped while it
runs (``stuck``); exceptions are ``plugin_error``, malformed answers ``garbage``. Counts
go to :class:`~meshd.plugins.remote_plugin.PluginCounters`, like out-of-process plugins', and each
kind of fault is logged once per episode. Only proposers the registry marks isolatable
run here (:meth:`meshd.plugins.registry.Registry.isolatable`: third-party, touching no
llama.cpp object); factories still run on the compute thread.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import structlog

from .base import Outcome, Proposal, ProposalRequest, Proposer
from .remote_plugin import PluginCounters

__all__ = ["GuardedProposer", "PluginGuard", "PluginGuards", "PluginWorker"]

log = structlog.get_logger("meshd.plugins.guard")

T = TypeVar("T")
_Job = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class PluginWorker:
    """One thread running one plugin's calls, in order (started on first use).

    Not joined on close: a call that never returns must not hold up the daemon's
    shutdown (the thread is a daemon thread).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._outstanding = 0
        self._closed = False

    @property
    def idle(self) -> bool:
        """No call is queued or running."""
        return self._outstanding == 0

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)``; after :meth:`close` the call is dropped (cancelled)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                future.cancel()
                return future
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"meshd-plugin-{self.name}")
                self._thread.start()
            self._outstanding += 1
            self._jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        """Let queued calls finish, then end the thread; returns at once."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn(*args)
                    except BaseException as exc:  # the plugin's code may raise anything
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._lock:
                    self._outstanding -= 1


class PluginGuard:
    """One isolated plugin: its worker, its deadline, its counters and fault episodes."""

    def __init__(self, name: str, deadline_s: float) -> None:
        self.name = name
        self.deadline_s = deadline_s
        self.worker = PluginWorker(name)
        self.counters = PluginCounters()
        self._lock = threading.Lock()
        #: A call missed its deadline and the worker has not been idle since.
        self._overdue = False
        #: Fault kinds logged in the current episode.
        self._logged: set[str] = set()
        self.log = log.bind(plugin=name)

    def wrap(self, proposer: Proposer, vocab_size: int) -> GuardedProposer:
        return GuardedProposer(self, proposer, vocab_size)

    @property
    def stuck(self) -> bool:
        """A call that missed its deadline is still running (or queued behind one)."""
        with self._lock:
            if self._overdue and self.worker.idle:
                self._overdue = False
            return self._overdue

    def fault(self, kind: str, detail: str = "") -> None:
        """Count one fault; log it if it is the first of its kind in this episode."""
        with self._lock:
            self.counters.faults[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
            if kind == "late":
                self._overdue = True
        if first:
            self.log.warning("plugin_fault", kind=kind, detail=detail[:200],
                             note="counted; not logged again until the plugin answers "
                                  "in time")

    def answered(self, proposed: bool) -> None:
        """An answer in time (a proposal or nothing): ends a fault episode."""
        with self._lock:
            if proposed:
                self.counters.proposals += 1
            else:
                self.counters.abstains += 1
            ended, self._logged = self._logged, set()
        if ended:
            self.log.info("plugin_recovered", after=sorted(ended))

    def stale(self) -> None:
        """A late call returned after all (its answer is discarded)."""
        with self._lock:
            self.counters.stale += 1

    def flat(self) -> dict[str, int]:
        with self._lock:
            return self.counters.flat(self.name)

    def close(self) -> None:
        self.worker.close()


class GuardedProposer:
    """One request's third-party proposer, called through its plugin's worker."""

    def __init__(self, guard: PluginGuard, inner: Proposer, vocab_size: int) -> None:
        self.guard = guard
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.vocab_size = vocab_size

    def propose(self, request: ProposalRequest) -> Proposal | None:
        guard = self.guard
        if guard.stuck:
            guard.fault("stuck", "an earlier call has not returned; step skipped")
            return None
        deadline = time.monotonic() + guard.deadline_s
        # A copy: the engine extends its token list while a late call may still read.
        asked = attrs.evolve(request, tokens=tuple(request.tokens), deadline=deadline)
        future = guard.worker.submit(self.inner.propose, asked)
        try:
            answer = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            if not future.cancel():  # running: its answer, if any, is stale
                future.add_done_callback(
                    lambda f: guard.stale() if not f.exception() else None)
            guard.fault("late", f"no answer within {guard.deadline_s * 1e3:.0f} ms")
            return None
        except concurrent.futures.CancelledError:
            return None  # the runtime is closing
        except Exception as exc:
            guard.fault("plugin_error", f"propose: {type(exc).__name__}: {exc}")
            raise  # the engine counts it against the request too
        return self._checked(answer, request.max_len)

    def _checked(self, answer: object, k: int) -> Proposal | None:
        """Count what is wrong with ``answer``; None for what the engine cannot read."""
        guard = self.guard
        if answer is None:
            guard.answered(False)
            return None
        tokens = answer.tokens if isinstance(answer, Proposal) else None
        if not isinstance(answer, Proposal) or not isinstance(tokens, tuple | list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            guard.fault("garbage", f"propose returned {type(answer).__name__}"
                        f"{'' if tokens is None else ' with tokens ' + type(tokens).__name__}")
            return None
        if not tokens:
            guard.answered(False)
            return answer
        reason = ("negative" if min(tokens) < 0 else
                  "out_of_vocab" if max(tokens) >= self.vocab_size else
                  "oversize" if len(tokens) > k else None)
        if reason is not None:
            guard.fault(reason, f"{len(tokens)} tokens (asked for at most {k}), ids "
                                f"{min(tokens)}..{max(tokens)} of {self.vocab_size}")
            return answer
        guard.answered(True)
        return answer

    def _post(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        guard = self.guard

        def failed(future: concurrent.futures.Future[None]) -> None:
            exc = None if future.cancelled() else future.exception()
            if exc is not None:
                guard.fault("plugin_error", f"{what}: {type(exc).__name__}: {exc}")

        guard.worker.submit(fn, *args).add_done_callback(failed)

    def observe(self, outcome: Outcome) -> None:
        if not self.guard.stuck:  # a stuck plugin misses what it did not draft for
            self._post("observe", self.inner.observe, outcome)

    def close(self) -> None:
        self._post("close", self.inner.close)


class PluginGuards:
    """Every isolated plugin of one runtime, by name."""

    def __init__(self, deadlines: Mapping[str, float]) -> None:
        self.guards = {name: PluginGuard(name, s) for name, s in deadlines.items()}

    def __bool__(self) -> bool:
        return bool(self.guards)

    def get(self, name: str) -> PluginGuard | None:
        return self.guards.get(name)

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in sorted(self.guards):
            out.update(self.guards[name].flat())
        return out

    def close(self) -> None:
        for guard in self.guards.values():
            guard.close()
