"""Slow start-up steps: shown on a terminal, and logged with their durations whatever
the terminal.

Why: loading a model, building its context and calibrating take seconds to minutes. The
progress line on stderr is drawn only on a terminal, so under systemd, a pipe or
``meshd demo`` a slow start would be silent. So each step also reports
``<kind>_started`` and ``<kind>_done`` (with ``seconds``) to an events hook, which
``meshd serve`` logs; ``meshd generate`` passes none and keeps its progress line only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

__all__ = ["Events", "Notes", "ProgressFactory", "StepProgress", "TimedStep", "slow_step",
           "timed"]


class StepProgress(Protocol):
    """A slow step's progress display (``meshd.clients.terminal.Progress`` on a terminal)."""

    def update(self, fraction: float) -> None: ...

    def done(self, result: str = "done") -> None: ...


Events = Callable[..., None]
"""``events(name, **fields)``: report one event (the daemon logs it at info)."""
Notes = Callable[[str, str], None]
"""``notes(event, message)``: something the user should know (a capped --ctx, a
recalibration); the CLI prints it, the daemon logs it."""
ProgressFactory = Callable[[str], StepProgress]
"""``progress(what)``: a display for one slow step (model load, calibration)."""


class _Silent:
    def update(self, fraction: float) -> None:
        pass

    def done(self, result: str = "done") -> None:
        pass


def slow_step(what: str, kind: str, *, progress: ProgressFactory | None,
              events: Events | None, **fields: object) -> StepProgress:
    """One slow step: drawn by ``progress`` (None: not shown) and reported to ``events``
    as ``<kind>_started`` / ``<kind>_done`` (None: not reported)."""
    bar = progress(what) if progress is not None else _Silent()
    return TimedStep(kind, bar, events, **fields) if events is not None else bar


class TimedStep:
    """A step's progress display that also reports its start and its end."""

    def __init__(self, kind: str, inner: StepProgress, events: Events,
                 **fields: object) -> None:
        self.kind = kind
        self.inner = inner
        self.events = events
        self.fields = fields
        self._t0 = time.monotonic()
        events(f"{kind}_started", **fields)

    def update(self, fraction: float) -> None:
        self.inner.update(fraction)

    def done(self, result: str = "done") -> None:
        self.inner.done(result)
        self.events(f"{self.kind}_done", seconds=round(time.monotonic() - self._t0, 3),
                    **self.fields)


@contextmanager
def timed(kind: str, events: Events | None, **fields: object) -> Iterator[None]:
    """Report ``<kind>_started`` now and ``<kind>_done`` when the block ends normally
    (a failure is reported by whoever catches it)."""
    if events is None:
        yield
        return
    t0 = time.monotonic()
    events(f"{kind}_started", **fields)
    yield
    events(f"{kind}_done", seconds=round(time.monotonic() - t0, 3), **fields)
