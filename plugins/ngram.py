"""Prompt lookup (n-gram) proposer: draft what followed the last time this suffix occurred.

Why: rewriting, editing, quoting and code refactoring copy long runs of the prompt into
the output; when the last few tokens occurred earlier, the tokens that followed them are
a free, often correct, draft. It costs no model work, so it is the one proposer that can
pay even where verify batches are expensive, as long as the adaptive layer only uses it
when its measured acceptance is high enough.

Rule: for ``n`` from ``max_n`` down to ``min_n``, take the last ``n`` tokens of
prompt + committed tokens; if that n-gram occurred earlier (an occurrence followed by at
least one token, which excludes the current suffix itself), propose the tokens that
followed its **most recent** such occurrence, up to ``max_len`` tokens (and never past
the current end of the sequence). The longest matching ``n`` wins. A draft stops after
the first end-of-generation token (nothing after it can be committed).

Defaults: ``min_n = 2`` (single-token matches are mostly noise: common tokens recur
everywhere and their followers disagree), ``max_n = 4`` (longer contexts rarely change
the match once 4 tokens agree, and each ``n`` costs one dict insert per token),
``max_len = 16`` (a long window pays only while the output copies the input nearly
token for token, e.g. JSON reformatting; the adaptive layer truncates further).
``per_match = 2``: a draft is at most twice as long as the context that matched (the
suffix extended backwards while it agrees with the earlier occurrence, up to 32): a
two-token coincidence proposes 4 tokens, a long copied stretch the full ``max_len``
(measured: JSON reformatting on SmolLM2 1.50 -> 1.65x Q4_1, 1.48 -> 1.72x Q8_0).
Option ``cycle`` (default off) lets a match at distance ``p < max_len`` continue
periodically (``draft[i] = seq[e + i % p]``), which catches repetition loops; off, such
drafts stop at the current end.

Cost: the index maps each n-gram to the position after its latest occurrence, one dict
per ``n``. It is extended only by the tokens added since the previous call (the engine
passes the whole sequence each step; it is never re-scanned), so a lookup is
``max_n - min_n + 1`` dict probes and an update ``(max_n - min_n + 1)`` inserts per new
token, independent of the context length. :attr:`NgramIndex.ops` counts both so tests
can assert that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .base import Capabilities, Outcome, Proposal, ProposalRequest, ProposerEnv
from .registry import bool_option, int_option

DEFAULT_MIN_N = 2
DEFAULT_MAX_N = 4
DEFAULT_MAX_LEN = 16
#: Draft tokens allowed per token of matched context (0: no such bound).
DEFAULT_PER_MATCH = 2
#: How far back a match is measured (its length only bounds the draft).
MATCH_CAP = 32


class NgramIndex:
    """Incremental suffix index: n-gram -> position right after its latest occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # _last[n - min_n][gram] = e: tokens[e - n:e] == gram, e < len(tokens), e maximal.
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        #: dict probes + inserts so far (the unit of cost; see module docstring).
        self.ops = 0

    def extend(self, new: Iterable[int]) -> None:
        """Append tokens; each gives the n-grams that end just before it a continuation."""
        toks = self.tokens
        for tok in new:
            e = len(toks)
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self._last[n - self.min_n][tuple(toks[e - n : e])] = e
                self.ops += 1
            toks.append(int(tok))

    def lookup(self) -> tuple[int, int] | None:
        """``(n, e)`` for the longest suffix with an earlier occurrence ending at ``e``."""
        toks = self.tokens
        t = len(toks)
        for n in range(min(self.max_n, t), self.min_n - 1, -1):
            self.ops += 1
            e = self._last[n - self.min_n].get(tuple(toks[t - n :]))
            if e is not None:
                return n, e
        return None

    def size(self) -> int:
        """Entries across all n (bounded by ``len(tokens) * (max_n - min_n + 1)``)."""
        return sum(len(d) for d in self._last)


class NgramProposer:
    """Prompt-lookup proposer for one request (see the module docstring for the rule)."""

    name = "ngram"

    def __init__(
        self,
        *,
        min_n: int = DEFAULT_MIN_N,
        max_n: int = DEFAULT_MAX_N,
        max_len: int = DEFAULT_MAX_LEN,
        cycle: bool = False,
        eog_tokens: frozenset[int] = frozenset(),
        per_match: int = DEFAULT_PER_MATCH,
    ) -> None:
        if max_len < 1:
            raise ValueError("max_len must be >= 1")
        if per_match < 0:
            raise ValueError("per_match must be >= 0")
        self.per_match = per_match
        self.capabilities = Capabilities(max_len=max_len)
        self.max_len = max_len
        self.cycle = cycle
        self.eog_tokens = eog_tokens
        self.index = NgramIndex(min_n, max_n)
        # Tokens [0, _confirmed) of the index were seen in a request; the rest came from
        # observe() and are checked against the next request before being trusted.
        self._confirmed = 0
        #: Times the index had to be rebuilt because a request contradicted it.
        self.rebuilds = 0

    def _sync(self, tokens: Sequence[int]) -> None:
        """Bring the index up to ``tokens``, touching only what it has not seen."""
        have = self.index.tokens
        n_have = len(have)
        consistent = len(tokens) >= n_have and all(
            tokens[i] == have[i] for i in range(max(0, self._confirmed - 1), n_have)
        )
        if not consistent:
            # Not an extension of what we indexed (the engine rewound or reused us):
            # rare, so rebuild rather than support un-indexing.
            self.rebuilds += 1
            self.index = NgramIndex(self.index.min_n, self.index.max_n)
            n_have = 0
        self.index.extend(tokens[i] for i in range(n_have, len(tokens)))
        self._confirmed = len(tokens)

    def propose(self, request: ProposalRequest) -> Proposal | None:
        self._sync(request.tokens)
        limit = min(self.max_len, request.max_len)
        if limit <= 0:
            return None
        hit = self.index.lookup()
        if hit is None:
            return None
        n, e = hit
        toks = self.index.tokens
        period = len(toks) - e
        if self.per_match:
            limit = min(limit, self.per_match * self._match_length(n, e))
        if not self.cycle:
            limit = min(limit, period)
        draft: list[int] = []
        for i in range(limit):
            tok = toks[e + i % period]
            draft.append(tok)
            if tok in self.eog_tokens:
                break
        return Proposal(tuple(draft))

    def _match_length(self, n: int, e: int) -> int:
        """How many tokens before ``e`` agree with the current suffix (>= ``n``, capped)."""
        toks = self.index.tokens
        t = len(toks)
        length = n
        while length < MATCH_CAP and e - length - 1 >= 0 and \
                toks[e - length - 1] == toks[t - length - 1]:
            length += 1
        return length

    def observe(self, outcome: Outcome) -> None:
        """Index the committed tokens now; the next request confirms them (cheaply)."""
        self.index.extend(outcome.committed)

    def close(self) -> None:
        self.index = NgramIndex(self.index.min_n, self.index.max_n)
        self._confirmed = 0


def ngram_factory(env: ProposerEnv) -> NgramProposer:
    """Entry point ``ngram``. Options: ``min_n``, ``max_n``, ``max_len``, ``cycle``,
    ``per_match``."""
    opts = env.options
    min_n = int_option(opts, "min_n", DEFAULT_MIN_N, minimum=1)
    max_n = int_option(opts, "max_n", max(DEFAULT_MAX_N, min_n), minimum=min_n)
    return NgramProposer(
        min_n=min_n,
        max_n=max_n,
        max_len=int_option(opts, "max_len", DEFAULT_MAX_LEN, minimum=1),
        cycle=bool_option(opts, "cycle", False),
        eog_tokens=env.eog_tokens,
        per_match=int_option(opts, "per_match", DEFAULT_PER_MATCH, minimum=0),
    )
