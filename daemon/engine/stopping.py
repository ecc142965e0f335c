"""Stop strings that straddle tokens: an incremental matcher with no I/O.

The engine pushes the text of each committed token and gets back the text now safe to
stream: text is held back exactly as long as it could still begin a stop string. Why
Knuth-Morris-Pratt: clients choose the stop strings, so the cost must be linear in their
length. Rule: the first stop string to *complete* wins (the longest, among those
completing together), so a stop is reported on the very piece that completes it and the
engine never commits a token past it (see :class:`StopMatcher`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence, Set

from attrs import frozen

__all__ = ["StopMatcher", "StopResult", "cut_at_stop"]


@frozen
class StopResult:
    """What one :meth:`StopMatcher.push` released.

    ``text``: newly safe text to emit (possibly empty). ``stopped``: this piece
    completed a stop string; ``text`` then ends right before it, and the stop string
    and anything after it are dropped.
    """

    text: str
    stopped: bool = False


def _failure(stop: str) -> array[int]:
    """KMP's table: ``table[i]`` is the length of the longest proper prefix of
    ``stop[: i + 1]`` that is also its suffix. Linear time, one machine word per char."""
    table = array("q", bytes(8 * len(stop)))
    k = 0
    for i in range(1, len(stop)):
        ch = stop[i]
        while k and stop[k] != ch:
            k = table[k - 1]
        if stop[k] == ch:
            k += 1
        table[i] = k
    return table


class _Automaton:
    """One stop string's KMP state over the text pushed so far."""

    __slots__ = ("state", "stop", "table")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.table = _failure(stop)
        self.state = 0  # length of the longest prefix of ``stop`` the text ends with

    def step(self, ch: str) -> bool:
        """Advance over one character; whether the stop string completed with it."""
        stop, k = self.stop, self.state
        while k and stop[k] != ch:
            k = self.table[k - 1]
        if stop[k] == ch:
            k += 1
        self.state = k
        return k == len(stop)


class StopMatcher:
    """Incremental stop-string matcher over the committed text of one request.

    Memory is linear in the total length of the stop strings; each pushed character
    costs amortized constant time per stop string. Each stop keeps its KMP failure table
    and a state, the length of the longest prefix of the stop that the text so far ends
    with; the held-back text is the last ``max(state)`` characters, and a stop completes
    where its state reaches its length.

    The first stop to complete wins, the streaming rule servers use; among stops
    completing at the same point the one starting earliest, so none of its text leaks.
    So with stops ``["ab", "abc"]``, ``"abc"`` never fires, and with ``["bc", "abcd"]``
    on ``"abcd"`` the output is ``"a"``: waiting for the globally earliest occurrence
    would mean committing tokens past a completed stop.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            # A bare string is a Sequence[str] of characters; that is never meant.
            raise TypeError("stops must be a sequence of strings, not a string")
        for stop in stops:
            if not stop:
                raise ValueError("empty stop string: it would match before any text")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._automata = tuple(_Automaton(stop) for stop in self._stops)
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
        if not self._automata:
            return StopResult(buf)
        base = len(self._pending)
        for i, ch in enumerate(piece):
            completed = 0  # the longest stop completing at this character
            for automaton in self._automata:
                if automaton.step(ch):
                    completed = max(completed, len(automaton.stop))
            if completed:
                # The held-back invariant: a stop's start lies in pending + piece.
                self._stopped = True
                self._pending = ""
                return StopResult(buf[: base + i + 1 - completed], stopped=True)
        hold = max(automaton.state for automaton in self._automata)
        self._pending = buf[len(buf) - hold :]
        return StopResult(buf[: len(buf) - hold])

    def flush(self) -> str:
        """Release held-back text when the request finishes without a stop string.

        After a stop, or on a second call, this returns ``""``.
        """
        text, self._pending = self._pending, ""
        for automaton in self._automata:
            automaton.state = 0
        return text


def cut_at_stop(candidates: Sequence[int], eog: Set[int], text_of: Callable[[int], str],
                matcher: StopMatcher) -> tuple[list[str], int | None]:
    """A verified window's stop cut (between ``decision.accepted_prefix`` and
    ``decision.settle``): each candidate's text (``text_of``) goes through ``matcher`` in
    order until a stop string completes. Returns the text each candidate releases and the
    index of the one that completed a stop (None: none). End-of-generation tokens are
    not text: one ends the prefix, and is neither pushed nor given text."""
    texts: list[str] = []
    for j, token in enumerate(candidates):
        if token in eog:
            break
        result = matcher.push(text_of(token))
        texts.append(result.text)
        if result.stopped:
            return texts, j
    return texts, None
