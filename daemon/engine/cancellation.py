"""One request's cancellation, latched once and read by every layer that acts on it.

Why one latch: a cancel may come from the client, its disconnect, another connection or
the daemon's shutdown, at any point of the request's life: before it reaches the
scheduler (while its prompt is tokenized), while it waits, while its prompt is
prefilled, while it decodes. The service, the scheduler and the engine each used to
keep a flag and pass the cancel on; now the request's one :class:`Cancellation` is
shared by all of them (made with the request, handed to the scheduler and the
engine's ``Generation``), so a cancel is never lost between them, and each reads it
where it acts: the scheduler finishes a request still waiting, drops a prompt between
prefill chunks; the engine stops at the next step boundary (``finish_reason``
``cancelled``).
"""

from __future__ import annotations

import threading

__all__ = ["Cancellation"]


class Cancellation:
    """Set once (idempotent), read from the event loop and the compute thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: int | None = None

    def cancel(self, at_emitted: int = 0) -> None:
        """Stop at the next step boundary, or (``at_emitted``) once that many tokens are
        committed; the earliest of several cancels holds."""
        with self._lock:
            self._at = at_emitted if self._at is None else min(self._at, at_emitted)

    @property
    def cancelled(self) -> bool:
        return self._at is not None

    def room(self, committed: int) -> int | None:
        """How many more tokens may commit after ``committed`` (None: not cancelled)."""
        with self._lock:
            at = self._at
        return None if at is None else max(0, at - committed)
