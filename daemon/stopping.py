"""Stop strings that straddle tokens: an incremental matcher with no I/O.

The engine pushes the text of each committed token (already cut on UTF-8 boundaries)
and gets back the text that is now safe to stream. A stop string may arrive split over
many small pieces, so text is held back exactly as long as it could still be the
beginning of a stop string, and never longer: a suffix of the pending text that is a
proper prefix of some stop string is held, everything before it is released.

Matching rule: the first stop string to *complete* wins. Among stop strings completing
at the same point, the one starting earliest (the longest) wins, so that none of its
text leaks. This is the streaming rule servers use: a stop is reported on the very
piece that completes it, which lets the engine map it to a token index (the
``stop_after`` predicate of :mod:`meshd.policy.decision`) without committing a token
it should not have. Its one consequence worth knowing: with stops ``["ab", "abc"]``,
``"abc"`` can never fire (``"ab"`` completes first), and with ``["bc", "abcd"]`` on text
``"abcd"`` the output is ``"a"``, not ``""``, because ``"bc"`` completed first. Waiting to
find the globally earliest occurrence would mean committing tokens past a completed
stop.
"""

from __future__ import annotations

from collections.abc import Sequence

from attrs import frozen

__all__ = ["StopMatcher", "StopResult"]


@frozen
class StopResult:
    """What one :meth:`StopMatcher.push` released.

    ``text``: newly safe text to emit (possibly empty). ``stopped``: this piece
    completed a stop string; ``text`` then ends right before it, and the stop string
    and anything after it are dropped.
    """

    text: str
    stopped: bool = False


class StopMatcher:
    """Incremental stop-string matcher over the committed text of one request."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            # A bare string is a Sequence[str] of characters; that is never meant.
            raise TypeError("stops must be a sequence of strings, not a string")
        for stop in stops:
            if not stop:
                raise ValueError("empty stop string: it would match before any text")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        # Proper prefixes of every stop: a pending suffix in this set may still grow
        # into a match, so it must be held back.
        self._prefixes: frozenset[str] = frozenset(
            stop[:i] for stop in self._stops for i in range(1, len(stop))
        )
        self._max_hold = max((len(stop) - 1 for stop in self._stops), default=0)
        self._pending = ""
        self._stopped = False

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings, deduplicated, in the given order."""
        return self._stops

    @property
    def stopped(self) -> bool:
        """A stop string has completed; nothing more will be emitted."""
        return self._stopped

    @property
    def held(self) -> str:
        """Text pushed but not yet released (it may still start a stop string)."""
        return self._pending

    def push(self, piece: str) -> StopResult:
        """Add the text of one committed token; return what is now safe to emit."""
        if self._stopped:
            raise RuntimeError("push() after a stop string completed")
        buf = self._pending + piece
        match = self._first_completed(buf)
        if match is not None:
            self._stopped = True
            self._pending = ""
            return StopResult(buf[:match], stopped=True)
        hold = self._holdback(buf)
        self._pending = buf[len(buf) - hold :]
        return StopResult(buf[: len(buf) - hold])

    def flush(self) -> str:
        """Release held-back text when the request finishes without a stop string.

        After a stop, or on a second call, this returns ``""``.
        """
        text, self._pending = self._pending, ""
        return text

    def _first_completed(self, buf: str) -> int | None:
        """Start index of the first stop string to complete in ``buf``, or None.

        The held-back invariant means no stop string can start in already released
        text, so searching ``pending + piece`` finds every match the piece completes.
        A stop's first occurrence is also its earliest-ending one, so one ``find`` per
        stop suffices; ties on the end go to the earliest start.
        """
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self._stops:
            start = buf.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else best[1]

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        for length in range(min(len(buf), self._max_hold), 0, -1):
            if buf[len(buf) - length :] in self._prefixes:
                return length
        return 0
