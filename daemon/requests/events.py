"""The one event vocabulary going out, and what every front end does with it alike.

Why one place: a generation's events (committed tokens, then one ``Finished`` or one
``GenerationFailed``) reach the NDJSON and HTTP front ends as the same records; each
front end only formats them (``token``/``done`` frames, SSE chunks, JSON answers). What
they would otherwise each write again is here: reading the events in batches (one write
carries what is already there), the finish reason a shutdown turns a cancellation into,
and the ``request_finished`` log line.
"""

from __future__ import annotations

from typing import Any, Final

import anyio
from structlog.typing import FilteringBoundLogger

from meshd.daemon.engine.generation import TokenEvent
from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.models.scheduler import Event, Finished, GenerationFailed, GenerationHandle
from meshd.daemon.requests.inflight import InFlightGeneration
from meshd.policy.decision import FinishReason

__all__ = ["MAX_EVENTS_PER_WRITE", "Event", "Finished", "GenerationFailed", "GenerationHandle",
           "TokenEvent", "finish_reason", "is_final", "log_finished", "receive_batch"]

MAX_EVENTS_PER_WRITE: Final = 256
"""Most events one batch (one write) carries."""


def is_final(event: Event) -> bool:
    """Whether ``event`` ends its generation (``Finished`` or ``GenerationFailed``)."""
    return isinstance(event, Finished | GenerationFailed)


async def receive_batch(handle: GenerationHandle) -> list[Event]:
    """The next events of a stream: at least one, and whatever else is already there (up
    to :data:`MAX_EVENTS_PER_WRITE`), so one write carries them; a stream that ends
    without its result gives a failure."""
    try:
        batch: list[Event] = [await handle.events.receive()]
    except anyio.EndOfStream:
        return [GenerationFailed("model", "the generation ended without a result")]
    while not is_final(batch[-1]) and len(batch) < MAX_EVENTS_PER_WRITE:
        try:
            batch.append(handle.events.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
    return batch


def finish_reason(finish: FinishReason, entry: InFlightGeneration) -> FinishReason:
    """The finish reason a client is told: a cancellation by the daemon's shutdown is
    ``shutdown``."""
    if finish is FinishReason.CANCELLED and entry.shutdown:
        return FinishReason.SHUTDOWN
    return finish


def log_finished(log: FilteringBoundLogger, request_id: str, finish: str,
                 stats: GenerationStats, proposer: str | None, prompt_tokens: int,
                 **extra: Any) -> None:
    """The ``request_finished`` line every front end logs for a generation that ended
    (``extra``: what a front end adds, such as the fields it ignored)."""
    wall_s = stats.wall_ms / 1e3
    log.info(
        "request_finished",
        id=request_id,
        finish_reason=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=stats.emitted,
        proposer=proposer or "off",
        drafted=stats.drafted,
        accepted=stats.accepted,
        target_forwards=stats.decode_forwards,
        prefill_forwards=stats.session.prefill_forwards,
        wall_ms=round(stats.wall_ms, 2),
        tokens_per_s=round(stats.emitted / wall_s, 2) if wall_s > 0 else None,
        **extra,
    )
