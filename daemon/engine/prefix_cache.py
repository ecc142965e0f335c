"""Prefix cache: finished sessions keep their KV so a request sharing the prefix reuses it.

Why: chat clients resend the whole conversation each turn, and tools resend the same long
system prompt. Prefilling it again costs far more than generating a short answer. A
finished session's sequence stays in its slot (bounded in entries and tokens, evicted
least-recently-used when a slot or memory is needed); a new request whose prompt shares a
prefix with its history takes that session over and prefills only the rest.

What can be reused depends on the state: an attention-only KV is trimmed to the common
prefix, or, when a slot is free, copied up to it into a new session so that the entry
stays whole (chats that open with one system prompt would otherwise take each other's
histories over, turn after turn, and prefill their own again); a recurrent state (and
an MTP head's carried hidden row) cannot be cut at an arbitrary position, so there only a
history that is entirely a prefix of the new prompt is reused.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from meshd.native.session import SequenceSession

if TYPE_CHECKING:
    from meshd.native.context import TargetContext

#: Reusing fewer tokens than this is not worth holding a session for.
MIN_REUSE = 8

#: llama.cpp copies a sequence across streams only whole (its whole context's KV), so a
#: copy pays only for a prefix at least this long.
MIN_SHARED = 64


@attrs.define
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    stored: int = 0
    evictions: int = 0
    #: Hits that copied a prefix of an entry into a new session, the entry kept whole.
    branches: int = 0


@attrs.define
class _Entry:
    session: SequenceSession
    history: list[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Finished sessions by their token history, LRU, bounded by entries and tokens."""

    def __init__(self, context: TargetContext, *, max_entries: int, max_tokens: int) -> None:
        self.context = context
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return sum(len(e.history) for e in self._entries.values())

    def store(self, session: SequenceSession, history: Sequence[int]) -> None:
        """Keep ``session`` (whose state holds exactly ``history``), or close it."""
        if (self.max_entries <= 0 or not session.usable or len(history) < MIN_REUSE
                or len(history) != session.n_past or len(history) > self.max_tokens):
            session.close()
            return
        session.retire()  # a checkpoint is no use to anyone now
        with self._lock:
            self._entries[session.seq_id] = _Entry(session, list(history))
            self._entries.move_to_end(session.seq_id)
            self.stats.stored += 1
            while len(self._entries) > self.max_entries or self.tokens > self.max_tokens:
                self._evict_locked()

    def lookup(self, prompt: Sequence[int], *, need_mtp: bool = False,
               branch: Callable[[], SequenceSession] | None = None,
               ) -> tuple[SequenceSession, int] | None:
        """Take the session sharing the longest usable prefix with ``prompt``.

        Returns the session, already cut back to the reused prefix, and the number of
        prompt tokens it holds (always < len(prompt): the last prompt token is decoded
        again to get the next-token logits). None on a miss. ``need_mtp``: only a
        session that followed the MTP head will do (the head cannot catch up later).
        ``branch``: opens a new session (on a free slot); where the entry holds more
        than the prompt shares with it and copying can, the shared prefix is copied into
        that session and the entry stays cached whole.
        """
        with self._lock:
            best: tuple[int, int] | None = None
            for seq_id, entry in self._entries.items():
                if need_mtp and entry.session.mtp is None:
                    continue
                c = min(common_prefix(entry.history, prompt), len(prompt) - 1)
                exact_only = entry.session.recurrent or entry.session.mtp is not None
                if exact_only and c < len(entry.history):
                    continue
                if c >= MIN_REUSE and (best is None or c > best[1]):
                    best = (seq_id, c)
            if best is None:
                self.stats.misses += 1
                return None
            entry = self._entries[best[0]]
            reuse = best[1]
            if branch is not None and self._branches(entry, reuse):
                self._entries.move_to_end(best[0])
            else:
                branch = None
                del self._entries[best[0]]
        if branch is not None:
            return self._branch(entry.session, reuse, branch)
        session = entry.session
        if reuse < session.n_past:
            try:
                session.trim(reuse)
            except Exception:
                session.close()
                self.stats.misses += 1
                return None
        self.stats.hits += 1
        self.stats.reused_tokens += reuse
        return session, reuse

    @staticmethod
    def _branches(entry: _Entry, reuse: int) -> bool:
        """Whether a hit on ``entry`` copies its first ``reuse`` tokens instead of taking
        it over: only a part of it is reused, long enough to pay for the copy, and the
        state is one a prefix can be copied of."""
        held = entry.session
        return (MIN_SHARED <= reuse < len(entry.history) and not held.recurrent
                and held.mtp is None and held.context.holds_from_start(held.seq_id))

    def _branch(self, donor: SequenceSession, reuse: int,
                branch: Callable[[], SequenceSession]) -> tuple[SequenceSession, int]:
        session = branch()
        try:
            session.share_prefix(donor, reuse)
        except BaseException:
            session.close()
            raise
        self.stats.hits += 1
        self.stats.branches += 1
        self.stats.reused_tokens += reuse
        return session, reuse

    def evict_one(self) -> bool:
        """Free the least recently used entry's slot; False when the cache is empty."""
        with self._lock:
            if not self._entries:
                return False
            self._evict_locked()
            return True

    def _evict_locked(self) -> None:
        _, entry = self._entries.popitem(last=False)
        entry.session.close()
        self.stats.evictions += 1

    def clear(self) -> None:
        while self.evict_one():
            pass
