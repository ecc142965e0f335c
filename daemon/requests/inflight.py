"""One generation a connection serves, as the service tracks it.

Why its own module: both front ends, the service's registry (shutdown, cancelling from
another connection) and the events' shared finish reason name it; it holds what a
request is between its registration and its end: its id and owner, the model it holds,
its handle once admitted, and its cancellation.
"""

from __future__ import annotations

from meshd.daemon.engine.cancellation import Cancellation
from meshd.daemon.models.model_set import ServedModel
from meshd.daemon.models.scheduler import GenerationHandle

__all__ = ["InFlightGeneration"]


class InFlightGeneration:
    """One generation a connection is serving: its id and (once admitted) its handle.

    Its :class:`~meshd.daemon.engine.cancellation.Cancellation` is the request's one
    cancel latch: handed to the scheduler with the request (:meth:`Service.submit`) and
    by it to the engine, so a ``cancel`` that arrives before the request reached the
    scheduler (while the prompt is being tokenized) is remembered there.
    """

    def __init__(self, request_id: str, owner: str | None = None) -> None:
        self.id = request_id
        # Who asked (``peer_owner``; None: unknown, no history).
        self.owner = owner
        self.handle: GenerationHandle | None = None
        #: The model serving it (set by ``Service.prepare``).
        self.model: ServedModel | None = None
        #: Whether it holds that model (released by ``Service.unregister``).
        self.holds = False
        #: The keep-alive the request asked for (None: the model's own).
        self.keep_alive: float | None = None
        self.cancellation = Cancellation()
        #: Cancelled because the daemon is shutting down (``done`` says ``shutdown``).
        self.shutdown = False

    @property
    def cancelled(self) -> bool:
        return self.cancellation.cancelled

    def attach(self, handle: GenerationHandle) -> None:
        """The handle the scheduler gave this request (it shares the cancel latch)."""
        assert handle.cancellation is self.cancellation
        self.handle = handle

    def cancel(self) -> None:
        """Stop at the next step boundary (idempotent)."""
        self.cancellation.cancel()
