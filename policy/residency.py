"""Which models stay loaded: room for a model about to load, and when an idle one expires.

Why here: a daemon serving several models by name holds only some of them in memory
(``--max-loaded``, ``--memory-limit``); making room means choosing whom to unload, and
that choice must never touch a model with requests in flight. Sans-I/O: the daemon
hands in what is loaded (sizes, whether busy, when last used, measured by its clock)
and applies the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["Resident", "expires_at", "room_for"]

KEEP_FOREVER = -1.0
"""A keep-alive that never expires (Ollama's ``keep_alive: -1``)."""


@attrs.frozen
class Resident:
    """A model that holds memory now (loaded, or loading)."""

    name: str
    size_bytes: int
    busy: bool
    """Requests in flight, or loading: never chosen."""
    last_used: float
    """When its last request ended (a monotonic clock's seconds)."""


def room_for(residents: Sequence[Resident], size_bytes: int, *, max_loaded: int | None,
             memory_limit: int | None) -> list[str] | None:
    """The models to unload, least recently used first, so that one more model of
    ``size_bytes`` fits both limits; ``[]`` when it fits already; ``None`` when it
    cannot fit without unloading a busy model (it then waits)."""
    count, held = len(residents), sum(r.size_bytes for r in residents)

    def fits(n: int, nbytes: int) -> bool:
        return ((max_loaded is None or n + 1 <= max_loaded)
                and (memory_limit is None or nbytes + size_bytes <= memory_limit))

    chosen: list[str] = []
    for r in sorted((r for r in residents if not r.busy), key=lambda r: r.last_used):
        if fits(count, held):
            break
        chosen.append(r.name)
        count, held = count - 1, held - r.size_bytes
    return chosen if fits(count, held) else None


def expires_at(last_used: float, keep_alive_s: float) -> float | None:
    """When an idle model's memory goes back: ``keep_alive_s`` after its last request;
    ``None`` (never) for a negative keep-alive."""
    return None if keep_alive_s < 0 else last_used + keep_alive_s
