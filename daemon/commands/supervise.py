"""The serving daemon's side of its service manager: signals, notify, watchdog, status.

Why in one place: these are the daemon's conversation with whoever runs it (systemd, a
supervisor, a person at a terminal), and their order matters:

- ``STATUS=`` lines while the model loads and calibrates, ``READY=1`` once the socket
  listens (the server's ready hook), then a status line while serving (active and queued
  requests, tokens/s) whenever it changes;
- ``WATCHDOG=1`` from the serving loop, and only while the engine is healthy: a
  llama.cpp call that has been running longer than the watchdog timeout means a wedged
  decode loop, so the pings stop and systemd restarts the service. While the model
  loads (before the serving loop exists) a thread pings instead;
- the first SIGTERM/SIGINT: ``STOPPING=1`` and a graceful shutdown (running requests get
  the grace period, then end with ``shutdown``); a second one forces the exit;
- SIGHUP: ``RELOADING=1`` (with ``MONOTONIC_USEC``), the configuration is read again and
  what can change live is applied, then ``READY=1``. A configuration that does not load
  is logged and the old one kept.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import anyio
import anyio.abc

from meshd.daemon.commands.server import Server
from meshd.daemon.config.server import ServerConfig
from meshd.daemon.models.timed_steps import Events, ProgressFactory, StepProgress
from meshd.daemon.system.logs import get_logger
from meshd.daemon.system.notify import Notifier, watchdog_interval

__all__ = [
    "STATUS_INTERVAL_S",
    "Reload",
    "Supervisor",
    "notifying_events",
    "notifying_progress",
    "pinging_while_starting",
]

STATUS_INTERVAL_S: Final = 5.0
"""How often the serving status line is refreshed (sent only when it changed)."""

Reload = Callable[[], tuple[ServerConfig, list[str]]]
"""Reads the configuration again and applies what is live outside the server (log
levels); returns the server's new settings and the live keys that changed
(``serve.max_tokens``, ``log.level``). Raises (with a message naming the key) when the
configuration is bad, before anything is applied."""


class _NotifyingStep:
    """One slow start-up step shown to systemd as ``STATUS=`` (every 10%) and to
    whatever display ``inner`` is (a terminal progress line)."""

    def __init__(self, what: str, notifier: Notifier, inner: StepProgress) -> None:
        self.what = what
        self.notifier = notifier
        self.inner = inner
        self._tenth = -1
        notifier.status(what)

    def update(self, fraction: float) -> None:
        self.inner.update(fraction)
        tenth = int(min(max(fraction, 0.0), 1.0) * 10)
        if tenth != self._tenth:
            self._tenth = tenth
            self.notifier.status(f"{self.what}: {tenth * 10}%")

    def done(self, result: str = "done") -> None:
        self.inner.done(result)


def notifying_progress(notifier: Notifier, inner: ProgressFactory) -> ProgressFactory:
    """A progress factory for ``ModelRuntime`` that also tells systemd what is going on
    while the model loads and calibrates."""
    def factory(what: str) -> StepProgress:
        return _NotifyingStep(what, notifier, inner(what))

    return factory


STEP_STATUS: Final = {"context_build": "building the context"}
"""Start-up steps that draw no progress of their own, by their events' kind
(``<kind>_started``), and the ``STATUS=`` each is shown as."""


def notifying_events(notifier: Notifier, inner: Events) -> Events:
    """An events hook for ``ModelRuntime`` that also tells systemd (and ``meshd demo``,
    which reads the same lines) about the start-up steps that have no progress display,
    so a status never names a step that has ended."""
    def events(event: str, **fields: Any) -> None:
        inner(event, **fields)
        status = STEP_STATUS.get(event.removesuffix("_started")) \
            if event.endswith("_started") else None
        if status is not None:
            notifier.status(status)

    return events


@contextmanager
def pinging_while_starting(notifier: Notifier) -> Iterator[None]:
    """Send ``WATCHDOG=1`` from a thread while the daemon starts (model load and
    calibration happen before any event loop runs and can take minutes)."""
    interval = watchdog_interval()
    if interval is None or not notifier.enabled:
        yield
        return
    stop = threading.Event()

    def ping() -> None:
        while not stop.wait(interval):
            notifier.watchdog()

    thread = threading.Thread(target=ping, name="meshd-watchdog-start", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Supervisor:
    """Runs beside :meth:`Server.serve` in the daemon's task group."""

    def __init__(self, server: Server, notifier: Notifier, *, reload: Reload | None = None,
                 status_interval_s: float = STATUS_INTERVAL_S) -> None:
        self.server = server
        self.notifier = notifier
        self.reload_config = reload
        self.status_interval_s = status_interval_s
        self.watchdog_s = watchdog_interval()
        #: True once a second signal cut the graceful shutdown short.
        self.forced = False
        self.reloads = 0
        self.log = get_logger("meshd.supervise")
        self._status: str | None = None
        self._tokens = 0
        self._tokens_at = time.monotonic()
        self._wedged_logged = False
        self._ready = False

    def on_ready(self, address: str) -> None:
        """The server's ready hook: the socket listens and the model is loaded."""
        self._ready = True
        self._status = self._serving_status()
        self.notifier.ready(self._status)

    async def run(self, scope: anyio.CancelScope) -> None:
        """Handle signals and keep systemd informed until cancelled; ``scope`` is what
        a forced stop cancels."""
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as sigs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._tick)
                await self._signals(sigs, scope)
                tg.cancel_scope.cancel()

    async def _signals(self, signals: Any, scope: anyio.CancelScope) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                self._reload()
            elif not self.server.stopping:
                self.log.info("signal_received", signal=name, action="graceful shutdown",
                              grace_s=self.server.config.shutdown_grace_s)
                self.notifier.stopping("stopping: finishing running requests")
                self.server.shutdown()
            else:
                self.log.warning("signal_received", signal=name, action="stopping now")
                self.forced = True
                scope.cancel()
                return

    def _reload(self) -> None:
        self.notifier.reloading()
        if self.reload_config is None:
            self.log.info("reload_skipped", reason="no configuration to reload")
        else:
            try:
                new, changed = self.reload_config()
            except Exception as exc:  # a bad file must not take a serving daemon down
                self.log.error("reload_failed", error=str(exc))
            else:
                self.server.reconfigure(new)
                self.reloads += 1
                self.log.info("reloaded", changed=changed)
        if not self.server.stopping:
            self.notifier.ready(self._serving_status())

    async def _tick(self) -> None:
        period = min(self.watchdog_s or self.status_interval_s, self.status_interval_s)
        last_status = 0.0
        while True:
            if self.watchdog_s is not None:
                self._watchdog()
            now = time.monotonic()
            if (self._ready and now - last_status >= self.status_interval_s
                    and not self.server.stopping):
                last_status = now
                status = self._serving_status()
                if status != self._status:
                    self._status = status
                    self.notifier.status(status)
            await anyio.sleep(period)

    def _watchdog(self) -> None:
        assert self.watchdog_s is not None
        busy = max((m.scheduler.native_busy_s() for m in self.server.models.loaded()
                    if m.scheduler is not None), default=0.0)
        if busy < 2 * self.watchdog_s:  # WATCHDOG_USEC; we ping at half of it
            self._wedged_logged = False
            self.notifier.watchdog()
        elif not self._wedged_logged:
            self._wedged_logged = True
            self.log.error("engine_wedged", busy_s=round(busy, 1),
                           watchdog_s=round(2 * self.watchdog_s, 1))

    def _serving_status(self) -> str:
        st = self.server.service.statistics()
        now = time.monotonic()
        rate = (st.tokens - self._tokens) / max(now - self._tokens_at, 1e-9)
        self._tokens, self._tokens_at = st.tokens, now
        loaded = len(self.server.models.loaded())
        models = f", {loaded} of {len(self.server.models.models)} models loaded" \
            if len(self.server.models.models) > 1 else ""
        return (f"serving: {st.active} active, {st.queued} queued, "
                f"{rate:.1f} tok/s{models}")
