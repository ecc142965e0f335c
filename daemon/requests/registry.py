"""Every generation in flight, daemon-wide: what a connection cannot see on its own.

Why its own job: the shutdown waits for (then cancels) every generation, and ``meshctl
cancel ID`` stops a request another connection started; both need the one view of what
runs. An entry is registered before its request is prepared and unregistered when it
ends, which releases the model it held.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio

from meshd.daemon.models.model_set import ModelSet
from meshd.daemon.requests.inflight import InFlightGeneration

__all__ = ["InFlightRegistry"]


class InFlightRegistry:
    """The generations in flight, by request id (ids are the clients': several
    connections may use one)."""

    def __init__(self, models: ModelSet) -> None:
        self._models = models
        self._entries: dict[str, list[InFlightGeneration]] = {}
        self._n = 0
        self._idle = anyio.Event()
        self._idle.set()

    def register(self, entry: InFlightGeneration) -> None:
        """Track a generation until :meth:`unregister`."""
        self._entries.setdefault(entry.id, []).append(entry)
        self._n += 1
        if self._idle.is_set():
            self._idle = anyio.Event()

    def unregister(self, entry: InFlightGeneration) -> None:
        """Stop tracking ``entry`` and release the model it holds (idempotent)."""
        if entry.holds and entry.model is not None:
            entry.holds = False
            self._models.release(entry.model, entry.keep_alive)
        entries = self._entries.get(entry.id, [])
        if entry in entries:
            entries.remove(entry)
            self._n -= 1
            if not entries:
                del self._entries[entry.id]
        if self._n == 0:
            self._idle.set()

    def cancel_anywhere(self, request_id: str) -> bool:
        """Cancel the only generation in flight with this id, on any connection; an id in
        flight on several connections is ambiguous and nothing is cancelled."""
        entries = self._entries.get(request_id, [])
        if len(entries) != 1:
            return False
        entries[0].cancel()
        return True

    def __iter__(self) -> Iterator[InFlightGeneration]:
        for entries in list(self._entries.values()):
            yield from list(entries)

    def __len__(self) -> int:
        return self._n

    async def drain(self, timeout_s: float, *, grace_s: float = 0.0) -> bool:
        """Let running generations finish for up to ``grace_s``, then cancel the rest
        (marked ``shutdown``) and wait for them to end. Returns whether all ended within
        ``timeout_s`` of that."""
        if grace_s > 0:
            with anyio.move_on_after(grace_s):
                await self._idle.wait()
        for entry in self:
            entry.shutdown = True
            entry.cancel()
        with anyio.move_on_after(timeout_s):
            await self._idle.wait()
        return self._n == 0
