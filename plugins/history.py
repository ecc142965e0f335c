"""History lookup: draft what this daemon already wrote after the same context.

Why: programs ask a local daemon for similar things again and again (agent loops, the
same SQL shapes over one schema, one edit over many files); their answers repeat one
another far more than their own prompts, and prompt lookup forgets each answer when its
request ends. This source keeps the committed output of finished requests (one
:class:`HistoryStore` per model) and drafts, from the longest earlier match of the
current sequence's end, the continuation those answers took most often (ties: the newest).

Why not Arctic Inference's ``SuffixDecodingCache``: ``arctic-inference`` 0.3.0 comes as
an sdist only (226 kB), whose ``setup.py`` imports torch (``torch>=2.10`` is a build
requirement) and builds its C++ tree with cmake and nanobind; it does not install into
this venv without torch, and the package registers itself as a vLLM plugin. Its cache is
bounded by a count of requests (``max_cached_requests``), not of tokens, and knows no
owners. Why not extend :class:`~meshd.plugins.suffix_index.SuffixIndex`: a suffix
automaton cannot forget (no deletion), so eviction would mean rebuilds, and in Python
each state is a dict (412 bytes a token measured on 20,000 tokens); the cap would buy a
tenth of the answers. Instead: a ring buffer of the kept tokens with zlib-style hash
chains over their 3-grams (numpy arrays, 28 to 36 bytes a token of capacity: 4 the
token, 8 the chain link, 8 its answer's id, and 8 per chain head, one to two heads per
token; measured 28.4 MB for 1,000,000 tokens, adding 0.3 µs a token, a lookup about
20 µs). The chains give every earlier occurrence of the last 3 tokens, newest first;
each is extended backwards to its true match length, and the draft follows the longest
ones token by token, choosing at each position the most frequent next token among them
(ties: the newest) and stopping where the answers disagree too much. Memory is fixed by the cap
(``[speculation] history_tokens``); the oldest tokens are overwritten; nothing is ever
written to disk.

Privacy: every kept answer carries its owner (the peer's uid on the Unix socket, the API
key's digest over TCP); a draft only ever follows answers of the requesting owner,
unless the store is shared (``[speculation] history_shared``). A request whose owner is
unknown neither drafts from the store nor adds to it. Drafts are verified like every
other proposer's, so the store changes speed, never output.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from meshd.policy.costs import DEFAULT_MARGIN, CostCurve, ratios

from .base import Capabilities, Outcome, Proposal, ProposalRequest, ProposerEnv, ProposerUnavailable
from .match_stats import MatchStats, SharedMatchStats
from .registry import int_option
from .resources import Need, requires

#: Tokens hashed per chain key: the shortest match the store can find.
HASH_N = 3
#: Earlier occurrences examined per lookup (newest first): bounds a step's cost.
MAX_CHAIN = 48
#: Longest match measured backwards (longer ones are as good as certain).
MAX_MATCH = 64
#: The prior odds of a match in earlier answers, against one in the request's own text
#: (prompt lookup's curve): a match needs twice the length for the same odds. Why: a few
#: tokens shared with another answer are mostly a common phrase (a story's "once upon a
#: time"), where a request repeating its own text usually goes on; at the prompt-lookup
#: prior, history's drafts on stories that repeat nothing cost 7% of the decode rate
#: before each request had learned otherwise. What requests measure still moves it.
PRIOR_FACTOR = 0.25
#: Drafts stop once the followed answers' agreement (product of shares) falls below this.
MIN_SUPPORT = 0.3
DEFAULT_MAX_LEN = 32
#: Draft tokens allowed per matched token when there is no cost curve.
DEFAULT_PER_MATCH = 2
#: Prompt tokens kept before each answer (its end: the chat template's turn header, the
#: question's last words), so an answer is drafted from its first token; the owner's
#: own, like the answer.
ANCHOR = 16
#: Bytes a kept token of capacity costs at most (the arrays; checked by
#: tests/unit/plugins/test_history.py), besides about 200 bytes per kept answer.
BYTES_PER_TOKEN = 36
#: ``[speculation] history_tokens``'s default: 28.4 MB per loaded model (measured; the
#: arrays fill as answers come), the answers of some 2,500 agent turns of 400 tokens.
DEFAULT_HISTORY_TOKENS = 1_000_000

CurveSource = Callable[[], CostCurve | None]


_U64 = (1 << 64) - 1
_P = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9)


def _hash3(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each 3-gram ``(a[i], b[i], c[i])`` (as :func:`_hash3_one`)."""
    with np.errstate(over="ignore"):
        x = (a.astype(np.uint64) * np.uint64(_P[0])) ^ (b.astype(np.uint64) * np.uint64(_P[1])) \
            ^ (c.astype(np.uint64) * np.uint64(_P[2]))
        mixed: np.ndarray = x ^ (x >> np.uint64(29))
    return mixed


def _hash3_one(a: int, b: int, c: int) -> int:
    x = ((a * _P[0]) & _U64) ^ ((b * _P[1]) & _U64) ^ ((c * _P[2]) & _U64)
    return x ^ (x >> 29)


class HistoryStore:
    """One model's earlier answers, bounded, with the owner of each (thread-safe).

    Positions are absolute (they only grow); position ``p`` lives in slot
    ``p % capacity``, and is kept while ``p >= total - capacity``. Chain links and
    heads hold ``p + 1`` (0: none). The arrays are allocated, zeroed, when the first
    answer is kept (untouched pages cost no memory); an answer is added in a few
    vectorised passes (about 0.1 µs a token), so finishing a long answer does not hold
    up the compute thread.
    """

    def __init__(self, capacity: int, *, shared: bool = False) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.shared = shared
        self.n = HASH_N
        self.total = 0
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        # Fast scalar reads of the same arrays (numpy's own indexing boxes each value).
        self._views: tuple[memoryview, memoryview, memoryview, memoryview] | None = None
        self._mask = 0
        #: Answers still (partly) kept: (doc id, end position exclusive), oldest first.
        self._docs: deque[tuple[int, int]] = deque()
        #: Each kept answer's owner.
        self._owner: dict[int, str] = {}
        self._next_doc = 1
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.capacity >= self.n + 1

    @property
    def kept(self) -> int:
        """Tokens kept now (at most :attr:`capacity`)."""
        return min(self.total, self.capacity)

    def memory_bytes(self) -> int:
        """Bytes of the arrays (the store's memory, bounded by the capacity)."""
        return 0 if self._arrays is None else sum(a.nbytes for a in self._arrays)

    def _allocate(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self._arrays is None:
            cap = self.capacity
            size = 1 << max(4, (cap - 1).bit_length())
            self._mask = size - 1
            self._arrays = (np.zeros(cap, np.int32), np.zeros(cap, np.int64),
                            np.zeros(cap, np.int64), np.zeros(size, np.int64))
            tok, prev, doc, head = self._arrays
            self._views = (tok.data, prev.data, doc.data, head.data)
        return self._arrays

    def add(self, tokens: Sequence[int], owner: str) -> None:
        """Keep ``tokens`` (one answer) as ``owner``'s, evicting the oldest as needed."""
        if not self.enabled or len(tokens) <= self.n:
            return
        # An answer longer than the store keeps only its end (it cannot match otherwise).
        toks = np.asarray(tokens[-self.capacity:], dtype=np.int64)
        with self._lock:
            tok, prev, doc, head = self._allocate()
            cap = self.capacity
            d = self._next_doc
            self._next_doc += 1
            self._owner[d] = owner
            start = self.total
            pos = np.arange(start, start + len(toks), dtype=np.int64)
            slots = pos % cap
            tok[slots] = toks
            doc[slots] = d
            prev[slots] = 0
            # Link each 3-gram's end to the previous end of the same key: within this
            # answer by sorting on (key, position), the first of each key to the old head.
            keys = _hash3(toks[:-2], toks[1:-1], toks[2:]) & np.uint64(self._mask)
            ends = pos[2:]
            order = np.lexsort((ends, keys))
            ks, ps = keys[order].astype(np.int64), ends[order]
            same = ks[1:] == ks[:-1]
            links = head[ks]
            links[1:] = np.where(same, ps[:-1] + 1, links[1:])
            prev[ps % cap] = links
            last = np.append(~same, True)
            head[ks[last]] = ps[last] + 1
            self.total = start + len(toks)
            self._docs.append((d, self.total))
            low = self.total - cap
            while self._docs and self._docs[0][1] <= low:
                gone, _end = self._docs.popleft()
                self._owner.pop(gone, None)

    def lookup(self, context: Sequence[int], owner: str
               ) -> list[tuple[int, int]]:
        """``(match length, position after the match)`` of the earlier occurrences of
        ``context``'s end in ``owner``'s answers (all answers when shared), longest
        first, then newest; at most :data:`MAX_CHAIN` examined."""
        n = self.n
        if not self.enabled or len(context) < n or self._views is None:
            return []
        a, b, c = int(context[-3]), int(context[-2]), int(context[-1])
        out: list[tuple[int, int]] = []
        with self._lock:
            tok, prev, doc, head = self._views
            cap = self.capacity
            low = max(0, self.total - cap)
            p = head[_hash3_one(a, b, c) & self._mask] - 1
            steps = 0
            reach = min(MAX_MATCH, len(context))
            while p >= low and steps < MAX_CHAIN:
                steps += 1
                s = p % cap
                nxt = prev[s] - 1
                d = doc[s]
                if (p + 1 >= self.total or doc[(p + 1) % cap] != d
                        or not (self.shared or self._owner.get(d) == owner)):
                    p = nxt
                    continue  # no continuation in its answer, or not visible to owner
                length = 0
                while (length < reach and p - length >= low
                       and doc[(p - length) % cap] == d
                       and tok[(p - length) % cap] == int(context[-1 - length])):
                    length += 1
                if length >= n:
                    out.append((length, p + 1))
                p = nxt
        out.sort(key=lambda m: (-m[0], -m[1]))
        return out

    def continuation(self, starts: Sequence[int], limit: int,
                     eog: frozenset[int] = frozenset()) -> tuple[list[int], list[float]]:
        """Up to ``limit`` tokens following the answers at ``starts``: at each position
        the most frequent next token among those still agreeing (ties: the newest),
        until their agreement falls below :data:`MIN_SUPPORT` or none goes on; and
        each token's share of the answers that reached its position."""
        draft: list[int] = []
        shares: list[float] = []
        if self._views is None:
            return draft, shares
        with self._lock:
            tok, _prev, doc, _head = self._views
            cap = self.capacity
            low = max(0, self.total - cap)
            alive = [(s, doc[s % cap]) for s in starts if s >= low]
            support = 1.0
            for j in range(limit):
                counts: dict[int, tuple[int, int]] = {}
                for s, d in alive:
                    p = s + j
                    if p >= self.total or doc[p % cap] != d:
                        continue
                    t = tok[p % cap]
                    count, newest = counts.get(t, (0, -1))
                    counts[t] = (count + 1, max(newest, s))
                if not counts:
                    break
                best = max(counts, key=lambda t: counts[t])
                total = sum(c for c, _ in counts.values())
                share = counts[best][0] / total
                support *= share
                if draft and support < MIN_SUPPORT:
                    break
                draft.append(best)
                shares.append(share)
                if best in eog:
                    break
                alive = [(s, d) for s, d in alive
                         if s + j < self.total and tok[(s + j) % cap] == best
                         and doc[(s + j) % cap] == d]
        return draft, shares


class HistoryView:
    """One request's window on a :class:`HistoryStore`: its owner's answers only."""

    def __init__(self, store: HistoryStore, owner: str, *, prompts: bool = False,
                 stats: SharedMatchStats | None = None) -> None:
        self.store = store
        self.owner = owner
        #: Keep the prompt with the answer (off by default: prompts carry the most
        #: private text, and answers repeat more than prompts do).
        self.prompts = prompts
        #: Acceptance by match length of history drafts, pooled across requests.
        self.stats = stats

    def remember(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Keep a finished request's committed output after its prompt's last
        :data:`ANCHOR` tokens (its whole prompt, if configured)."""
        head = list(prompt) if self.prompts else list(prompt[-ANCHOR:])
        self.store.add([*head, *output], self.owner)


class HistoryProposer:
    """Drafts from earlier answers of the request's owner (see the module docstring)."""

    name = "history"

    def __init__(self, view: HistoryView, *, max_len: int = DEFAULT_MAX_LEN,
                 per_match: int = DEFAULT_PER_MATCH, eog_tokens: frozenset[int] = frozenset(),
                 curve: CurveSource | None = None, margin: float = DEFAULT_MARGIN) -> None:
        self.view = view
        self.max_len = max_len
        self.per_match = per_match
        self.eog_tokens = eog_tokens
        self.curve = curve
        self.margin = margin
        self.capabilities = Capabilities(max_len=max_len, decides_length=curve is not None,
                                         estimates=True)
        self.stats = MatchStats(view.stats, prior_factor=PRIOR_FACTOR)
        self._pending: int | None = None

    def propose(self, request: ProposalRequest) -> Proposal | None:
        self._pending = None
        limit = min(self.max_len, request.max_len)
        if limit <= 0:
            return None
        matches = self.view.store.lookup(request.tokens, self.view.owner)
        if not matches:
            return None
        length = matches[0][0]
        starts = [s for n, s in matches if n == length]
        curve = self.curve() if self.curve is not None else None
        if curve is None and self.per_match:
            limit = min(limit, self.per_match * length)
        else:
            limit = min(limit, curve.max_k) if curve is not None else limit
        draft, shares = self.view.store.continuation(starts, limit, self.eog_tokens)
        if not draft:
            return None
        # Position i continues a match of length + i (as prompt lookup's drafts do),
        # and only as often as the earlier answers that reached it agreed on it.
        acc = [p * share for p, share in
               zip(self.stats.acceptances(length, len(draft)), shares, strict=True)]
        if curve is not None:
            rs = ratios(curve, acc, len(draft))
            k = max(range(len(rs)), key=lambda j: (rs[j], -j))
            if k == 0 or rs[k] <= self.margin:
                return None
            draft, acc = draft[:k], acc[:k]
        self._pending = length
        return Proposal(tuple(draft), acceptances=tuple(acc))

    def observe(self, outcome: Outcome) -> None:
        length, self._pending = self._pending, None
        if length is not None and outcome.proposed > 0:
            censored = len(outcome.committed) <= outcome.accepted
            self.stats.update(length, outcome.proposed, outcome.accepted, censored=censored)

    def close(self) -> None:
        self.stats.close()


@requires(Need.HISTORY, Need.LIVE_COST_CURVE)
def history_factory(env: ProposerEnv) -> HistoryProposer:
    """Entry point ``history``. Options: ``max_len``, ``per_match``. Declared resources:
    the model's history store as the request's owner sees it (none when the store is
    off or the owner unknown: then this proposer is unavailable, and a composite goes
    on without it) and the live cost curve (without it, inside a composite, drafts
    follow the per-match rule and the composite chooses their length)."""
    view = env.resources.history
    if not isinstance(view, HistoryView) or not view.store.enabled:
        raise ProposerUnavailable("no history for this request ([speculation] "
                                  "history_tokens = 0, or its owner is unknown)")
    opts = env.options
    live = env.resources.cost_curve_now
    curve: CurveSource | None = None
    if callable(live):
        def curve() -> CostCurve | None:
            value = live()
            return value if isinstance(value, CostCurve) else None
    return HistoryProposer(
        view, max_len=int_option(opts, "max_len", DEFAULT_MAX_LEN, minimum=1),
        per_match=int_option(opts, "per_match", DEFAULT_PER_MATCH, minimum=0),
        eog_tokens=env.eog_tokens, curve=curve)
