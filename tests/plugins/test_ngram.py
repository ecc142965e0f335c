"""Prompt lookup: agrees with a brute-force reference, is incremental, and costs O(1)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.plugins.base import Outcome, ProposerEnv
from meshd.plugins.ngram import NgramIndex, NgramProposer, ngram_factory

from .fakes import request


def reference(
    seq: Sequence[int],
    min_n: int,
    max_n: int,
    max_len: int,
    eog: frozenset[int] = frozenset(),
    cycle: bool = False,
) -> tuple[int, ...] | None:
    """Scan everything: longest suffix, most recent earlier occurrence, its follower."""
    t = len(seq)
    for n in range(min(max_n, t), min_n - 1, -1):
        suffix = list(seq[t - n :])
        for e in range(t - 1, n - 1, -1):
            if list(seq[e - n : e]) == suffix:
                period = t - e
                length = max_len if cycle else min(max_len, period)
                out: list[int] = []
                for i in range(length):
                    out.append(seq[e + i % period])
                    if out[-1] in eog:
                        break
                return tuple(out) if out else None
    return None


tokens = st.lists(st.integers(0, 3), max_size=120)
ngram_sizes = st.tuples(st.integers(1, 4), st.integers(0, 3)).map(lambda p: (p[0], p[0] + p[1]))


@settings(max_examples=150, deadline=None)
@given(seq=tokens, sizes=ngram_sizes, max_len=st.integers(1, 10), cycle=st.booleans())
def test_every_step_matches_brute_force(
    seq: list[int], sizes: tuple[int, int], max_len: int, cycle: bool
) -> None:
    min_n, max_n = sizes
    # The reference knows the lookup rule, not the match-length bound on the draft.
    prop = NgramProposer(min_n=min_n, max_n=max_n, max_len=max_len, cycle=cycle, per_match=0)
    for t in range(len(seq) + 1):
        got = prop.propose(request(seq[:t]))
        want = reference(seq[:t], min_n, max_n, max_len, cycle=cycle)
        assert (got.tokens if got else None) == want


@settings(max_examples=150, deadline=None)
@given(seq=tokens, sizes=ngram_sizes, max_len=st.integers(1, 10))
def test_proposal_really_followed_an_earlier_occurrence(
    seq: list[int], sizes: tuple[int, int], max_len: int
) -> None:
    min_n, max_n = sizes
    got = NgramProposer(min_n=min_n, max_n=max_n, max_len=max_len).propose(request(seq))
    if got is None:
        return
    t, draft = len(seq), list(got.tokens)
    assert 1 <= len(draft) <= max_len
    # Some n-gram suffix (n >= min_n) occurred ending at e < t, and draft followed it there.
    assert any(
        seq[e - n : e] == seq[t - n :] and seq[e : e + len(draft)] == draft
        for n in range(min_n, min(max_n, t) + 1)
        for e in range(n, t)
    )


@settings(max_examples=100, deadline=None)
@given(
    seq=tokens,
    cuts=st.lists(st.integers(0, 120), max_size=12),
    via_observe=st.lists(st.booleans(), min_size=12, max_size=12),
    request_max=st.integers(1, 10),
)
def test_incremental_equals_rebuilt(
    seq: list[int], cuts: list[int], via_observe: list[bool], request_max: int
) -> None:
    """Growing the sequence in arbitrary chunks, some announced by observe() first,
    gives exactly what a fresh proposer computes on the whole sequence."""
    inc = NgramProposer()
    prev = 0
    for i, cut in enumerate(sorted({min(c, len(seq)) for c in cuts} | {len(seq)})):
        if via_observe[i % len(via_observe)] and cut > prev:
            inc.observe(Outcome(proposed=0, accepted=0, committed=tuple(seq[prev:cut])))
        got = inc.propose(request(seq[:cut], request_max))
        fresh = NgramProposer().propose(request(seq[:cut], request_max))
        assert got == fresh
        prev = cut
    assert inc.rebuilds == 0
    assert inc.index.tokens == seq


def test_contradicting_request_rebuilds() -> None:
    prop = NgramProposer(min_n=1)
    prop.propose(request([1, 2, 3, 1]))
    prop.observe(Outcome(1, 1, (2, 9)))  # the engine then reports something else
    got = prop.propose(request([1, 2, 3, 1, 2, 3]))
    assert prop.rebuilds == 1
    assert got == NgramProposer(min_n=1).propose(request([1, 2, 3, 1, 2, 3]))
    prop.propose(request([5, 5]))  # shorter than what was indexed
    assert prop.rebuilds == 2 and prop.index.tokens == [5, 5]


def test_prefers_longest_then_most_recent() -> None:
    #      0  1  2  3  4  5  6  7  8  9 10 11 12
    seq = [7, 1, 2, 8, 9, 2, 5, 1, 2, 6, 0, 1, 2]
    # Suffix (1, 2) occurred before, followed by 8 (at 3) and by 6 (at 9): most recent wins.
    assert NgramProposer(max_len=2).propose(request(seq)).tokens == (6, 0)  # type: ignore[union-attr]
    # (0, 1, 2) and (6, 0, 1, 2) never occurred before; with min_n=3 there is no match.
    assert NgramProposer(min_n=3, max_n=4).propose(request(seq)) is None


def test_never_proposes_the_current_suffix_itself() -> None:
    assert NgramProposer(min_n=1).propose(request([4, 5, 6])) is None
    # Period-1 repetition: the only earlier occurrence is one back; its follower is
    # the last token, so the draft stops at the current end unless cycling.
    assert NgramProposer(min_n=1).propose(request([3, 3])).tokens == (3,)  # type: ignore[union-attr]
    cyc = NgramProposer(min_n=1, max_len=4, cycle=True, per_match=0).propose(request([3, 3]))
    assert cyc is not None and cyc.tokens == (3, 3, 3, 3)


def test_respects_request_max_len_and_stops_after_eog() -> None:
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramProposer().propose(request(seq, 2)).tokens == (3, 4)  # type: ignore[union-attr]
    assert NgramProposer().propose(request(seq, 0)) is None
    eog = NgramProposer(eog_tokens=frozenset({4})).propose(request(seq))
    assert eog is not None and eog.tokens == (3, 4)


class CountingSeq(Sequence[int]):
    """A token sequence that counts element reads (to prove nothing is re-scanned)."""

    def __init__(self, data: list[int]) -> None:
        self.data = data
        self.reads = 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        self.reads += len(self.data[i]) if isinstance(i, slice) else 1
        return self.data[i]


def test_cost_per_step_does_not_grow_with_context() -> None:
    """Per step: index work <= (#n sizes) * (new tokens + 1), request reads <= new + 1,
    whether the context is 100 or 5000 tokens long."""
    import random

    rng = random.Random(0)
    seq = [rng.randrange(50) for _ in range(5000)]
    prop = NgramProposer(min_n=2, max_n=4)
    sizes = 3
    data: list[int] = []
    t = 0
    while t < len(seq):
        step = rng.randint(1, 4)
        new = seq[t : t + step]
        if rng.random() < 0.5:
            prop.observe(Outcome(0, 0, tuple(new)))
        data.extend(new)
        t += len(new)
        tokens = CountingSeq(data)
        before = prop.index.ops
        prop.propose(request(tokens, 8))
        assert prop.index.ops - before <= sizes * (len(new) + 1)
        assert tokens.reads <= len(new) + 1
        assert prop.index.size() <= sizes * len(data)
    assert prop.rebuilds == 0


def test_index_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        NgramIndex(0, 2)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_factory_reads_options() -> None:
    env = ProposerEnv(
        vocab_size=10, eog_tokens=frozenset({9}), options={"min_n": 1, "max_n": 2, "max_len": 3}
    )
    prop = ngram_factory(env)
    assert (prop.index.min_n, prop.index.max_n, prop.max_len) == (1, 2, 3)
    assert prop.eog_tokens == {9} and prop.capabilities.max_len == 3
    assert ngram_factory(ProposerEnv(vocab_size=10, eog_tokens=frozenset())).index.max_n == 4
    # max_n defaults to at least min_n.
    assert ngram_factory(ProposerEnv(10, frozenset(), options={"min_n": 6})).index.max_n == 6
    for bad in ({"min_n": 0}, {"max_len": "8"}, {"min_n": 3, "max_n": 2}, {"cycle": 1}):
        with pytest.raises(ValueError):
            ngram_factory(ProposerEnv(vocab_size=10, eog_tokens=frozenset(), options=bad))


def test_draft_length_follows_the_evidence_of_the_match() -> None:
    """A draft may be at most ``per_match`` tokens per token of context that matched: a
    two-token coincidence proposes little, a long copied stretch a long draft."""
    text = list(range(10, 40))  # 30 distinct tokens
    weak = [*text, 99, 10, 11]  # only (10, 11) matches: 2 tokens of evidence
    got = NgramProposer(max_len=16).propose(request(weak))
    assert got is not None and got.tokens == tuple(text[2:6])  # 2 x 2 tokens
    strong = [*text, 99, *text[:12]]  # 12 tokens copied so far
    got = NgramProposer(max_len=16).propose(request(strong))
    assert got is not None and got.tokens == tuple(text[12:28])  # the full 16
    assert NgramProposer(max_len=16, per_match=0).propose(request(weak)).tokens == tuple(
        text[2:18])  # type: ignore[union-attr]
