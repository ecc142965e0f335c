"""Suffix automaton over a growing token sequence: the longest earlier match of its end.

Why a suffix automaton: prompt lookup should draft from the place the output is copying,
and the best evidence for it is the *longest* stretch of context that agrees. Fixed
n-grams know matches only up to their largest ``n`` and then choose blindly among equal
ones; the automaton finds the longest earlier suffix at any length, in amortised O(1) per
appended token, and so tells a copied line from a common phrase. It is the classic
online construction; each state also keeps ``recent``, the end of its newest occurrence.
After each append, ``match_length`` and ``match_end`` give the longest match and where
it ended (``tokens[match_end]`` followed it); :meth:`matches` walks the shorter ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class SuffixIndex:
    """Incremental suffix automaton; see the module docstring."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # State 0 is the root (the empty string).
        self._next: list[dict[int, int]] = [{}]
        self._link: list[int] = [-1]
        self._len: list[int] = [0]
        self._recent: list[int] = [0]
        self._last = 0
        #: The state of the longest suffix that also ends earlier (0: none).
        self._match = 0
        #: An earlier end (exclusive) of that suffix; 0 when there is none.
        self.match_end = 0

    @property
    def match_length(self) -> int:
        """Length of the longest suffix of :attr:`tokens` that also ends earlier."""
        return self._len[self._match]

    @property
    def states(self) -> int:
        """Automaton states (at most ``2 * len(tokens)``; the unit of memory)."""
        return len(self._len)

    def extend(self, new: Iterable[int]) -> None:
        """Append tokens, keeping the longest earlier match of the end current."""
        for tok in new:
            self._append(int(tok))

    def _append(self, c: int) -> None:
        nxt, link, length, recent = self._next, self._link, self._len, self._recent
        self.tokens.append(c)
        end = len(self.tokens)
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self._last] + 1)
        recent.append(end)
        p = self._last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p == -1:
            target = 0
        else:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                target = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                recent.append(recent[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = clone
                target = clone
        link[cur] = target
        self._last = cur
        # ``target`` is the longest suffix that occurred before; its ``recent`` still
        # holds an earlier end. Remember it, then mark this end as its newest.
        self._match = target
        self.match_end = recent[target] if target else 0
        if target:
            recent[target] = end

    def matches(self) -> Iterator[tuple[int, int]]:
        """``(length, end)`` of earlier matches of the sequence's end, longest first.

        The first is (:attr:`match_length`, :attr:`match_end`); each next one is the
        longest shorter suffix with more occurrences (the suffix link), whose end is an
        occurrence of it before the current end.
        """
        state = self._match
        if not state:
            return
        yield self._len[state], self.match_end
        t = len(self.tokens)
        state = self._link[state]
        while state > 0:
            end = self._recent[state]
            if end >= t:
                # Marked by the current end: an earlier end of a longer suffix in this
                # class also ends this one (suffixes of it share its occurrences).
                end = self.match_end
            yield self._len[state], end
            state = self._link[state]
