"""Typed errors of the native layer.

Why typed: the daemon maps each to a wire error code and decides whether a session can go
on. A failed repair must never be silently ignored, because the next token would then be
computed on a state that still holds rejected drafts.
"""

from __future__ import annotations


class NativeError(Exception):
    """Base class of every error raised by meshd.native."""


class ModelLoadError(NativeError):
    """A GGUF file could not be loaded (missing, unreadable, unsupported architecture)."""


class CapacityError(NativeError):
    """A request does not fit: context length, sequence slots or memory."""


class RuntimeStateError(NativeError):
    """A llama.cpp call on a session failed; names the session and the positions involved.

    After this error the session is marked unusable: its state can no longer be trusted.
    """

    def __init__(self, message: str, *, seq_id: int | None = None,
                 positions: tuple[int, int] | None = None) -> None:
        where = []
        if seq_id is not None:
            where.append(f"seq {seq_id}")
        if positions is not None:
            where.append(f"positions [{positions[0]}, {positions[1]})")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.seq_id = seq_id
        self.positions = positions


class RollbackRefused(RuntimeStateError):
    """An in-place recurrent rollback was asked for outside the window where it is exact.

    llama.cpp's ``seq_rm`` on a recurrent memory also returns True for rollbacks it
    cannot do exactly (it then restores a stale snapshot), so we refuse them here.
    """


class SessionUnusable(RuntimeStateError):
    """The session's state is no longer trustworthy after an earlier failure."""


class RemoteWorkerError(NativeError):
    """A remote worker (llama.cpp RPC server) failed; ``endpoint`` names it."""

    def __init__(self, message: str, *, endpoint: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class WorkerUnreachable(RemoteWorkerError):
    """A worker cannot be reached (refused, timed out, busy, incompatible version)."""


class WorkerLost(RemoteWorkerError):
    """A worker's connection dropped: the layers it held are gone, so every forward of
    the model fails until the worker is back and the model is loaded again."""
