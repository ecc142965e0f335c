"""Prompt lookup: the longest earlier match at any length (checked against brute force),
incremental, bounded cost, and draft lengths set by match length, measured acceptance
and the cost curve."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.plugins.base import Outcome, ProposerEnv
from meshd.plugins.match_stats import (
    Calibration,
    MatchStats,
    SharedMatchStats,
    length_class,
    prior,
)
from meshd.plugins.ngram import NgramProposer, break_even, ngram_factory
from meshd.plugins.resources import Resources
from meshd.plugins.suffix_index import SuffixIndex
from meshd.policy.costs import CostCurve

from ..policy.curves import Q4_1
from .fakes import request

#: A machine where a batch of k + 1 rows costs k + 1 decodes at small k, less per row
#: at large k (shape of the measured Q4_1 curve, extended to 16 drafts).
CPU = CostCurve.from_row_costs({2: 1.74, 9: 4.9, 17: 8.5})


def longest_earlier_match(seq: Sequence[int]) -> int:
    """Brute force: the longest suffix of ``seq`` that also ends before its end."""
    t = len(seq)
    best = 0
    for n in range(1, t):
        if any(seq[e - n : e] == seq[t - n :] for e in range(n, t)):
            best = n
    return best


def is_occurrence(seq: Sequence[int], n: int, end: int) -> bool:
    t = len(seq)
    return n <= end < t and list(seq[end - n : end]) == list(seq[t - n :])


tokens = st.lists(st.integers(0, 3), max_size=120)


@settings(max_examples=150, deadline=None)
@given(seq=tokens)
def test_index_finds_the_longest_match_at_every_step(seq: list[int]) -> None:
    index = SuffixIndex()
    for t, tok in enumerate(seq, start=1):
        index.extend([tok])
        prefix = seq[:t]
        assert index.match_length == longest_earlier_match(prefix)
        chain = list(index.matches())
        if index.match_length == 0:
            assert chain == []
            continue
        assert chain[0] == (index.match_length, index.match_end)
        lengths = [n for n, _ in chain]
        assert lengths == sorted(set(lengths), reverse=True)
        assert all(is_occurrence(prefix, n, e) for n, e in chain)
    assert index.states <= 2 * max(1, len(seq))


def test_longest_match_beats_a_more_recent_shorter_one() -> None:
    # "a b c d" was copied from the first line; "x c d" occurs later too.
    first = [1, 2, 3, 4, 5, 6]
    seq = [*first, 9, 8, 3, 4, 7, 7, 1, 2, 3, 4]
    prop = NgramProposer(max_len=2, per_match=0)
    got = prop.propose(request(seq))
    assert got is not None and got.tokens == (5, 6)  # not (7, 7) from the later "3 4"


def test_draft_follows_an_occurrence_of_the_longest_match() -> None:
    rng = random.Random(3)
    for _ in range(200):
        seq = [rng.randrange(4) for _ in range(rng.randint(0, 60))]
        got = NgramProposer(min_n=1, max_len=6, per_match=0).propose(request(seq))
        n = longest_earlier_match(seq)
        if n == 0:
            assert got is None
            continue
        assert got is not None and 1 <= len(got.tokens) <= 6
        t = len(seq)
        # What followed the occurrence, repeating with its distance to the end (cycle).
        assert any(is_occurrence(seq, n, e) and list(got.tokens) ==
                   [seq[e + i % (t - e)] for i in range(len(got.tokens))]
                   for e in range(n, t))


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


def test_never_proposes_the_current_suffix_itself() -> None:
    assert NgramProposer(min_n=1).propose(request([4, 5, 6])) is None
    # Period-1 repetition: the only earlier occurrence is one back; its follower is
    # the last token, so the draft stops at the current end unless cycling (the
    # default: a repetition loop goes on as it went).
    straight = NgramProposer(min_n=1, cycle=False).propose(request([3, 3]))
    assert straight is not None and straight.tokens == (3,)
    cyc = NgramProposer(min_n=1, max_len=4, per_match=0).propose(request([3, 3]))
    assert cyc is not None and cyc.tokens == (3, 3, 3, 3)


def test_respects_min_n_request_max_len_and_stops_after_eog() -> None:
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramProposer().propose(request(seq, 2)).tokens == (3, 4)  # type: ignore[union-attr]
    assert NgramProposer().propose(request(seq, 0)) is None
    assert NgramProposer(min_n=3).propose(request(seq)) is None
    eog = NgramProposer(eog_tokens=frozenset({4})).propose(request(seq))
    assert eog is not None and eog.tokens == (3, 4)


def test_without_a_curve_the_draft_follows_the_evidence_of_the_match() -> None:
    """At most ``per_match`` tokens per matched token: a two-token coincidence proposes
    little, a long copied stretch a long draft."""
    text = list(range(10, 40))  # 30 distinct tokens
    weak = [*text, 99, 10, 11]  # only (10, 11) matches: 2 tokens of evidence
    got = NgramProposer(max_len=16).propose(request(weak))
    assert got is not None and got.tokens == tuple(text[2:6])  # 2 x 2 tokens
    strong = [*text, 99, *text[:12]]  # 12 tokens copied so far
    got = NgramProposer(max_len=16).propose(request(strong))
    assert got is not None and got.tokens == tuple(text[12:28])  # the full 16


def _costed(curve: CostCurve = CPU, **kw: object) -> NgramProposer:
    return NgramProposer(curve=lambda: curve, **kw)  # type: ignore[arg-type]


def test_with_a_cost_curve_short_matches_draft_nothing_and_long_ones_long() -> None:
    text = list(range(100, 160))
    weak = [*text, 99, 100, 101]  # a 2-token coincidence
    assert _costed().propose(request(weak)) is None
    strong = [*text, 99, *text[:30]]  # 30 tokens copied
    got = _costed().propose(request(strong, 16))
    assert got is not None and len(got.tokens) >= 4
    assert got.tokens == tuple(text[30 : 30 + len(got.tokens)])
    # On a machine where extra rows are nearly free, even a short match drafts.
    flat = CostCurve.sanitized([1.0 + 0.02 * k for k in range(17)])
    got = _costed(flat).propose(request(weak, 16))
    assert got is not None and len(got.tokens) >= 2


def test_measured_acceptance_at_a_match_length_sets_the_draft_length() -> None:
    """Where long matches keep failing (text that repeats phrases, not passages), the
    same match length stops drafting; where they hold, it drafts the longest window."""
    text = list(range(100, 160))
    seq = [*text, 99, *text[:20]]
    liar, honest = _costed(), _costed()
    for _ in range(30):
        liar.stats.update(20, 8, 0)
        honest.stats.update(20, 16, 16)
    assert liar.propose(request(seq, 16)) is None
    kept = honest.propose(request(seq, 16))
    assert kept is not None and kept.tokens == tuple(text[20:36])


def test_observe_learns_at_the_match_length_the_draft_was_taken_at() -> None:
    text = list(range(100, 160))
    prop = _costed()
    got = prop.propose(request([*text, 99, *text[:20]], 16))
    assert got is not None
    before, beyond = prop.stats.p(20), prop.stats.p(24)
    prop.observe(Outcome(len(got.tokens), 0, (5,)))  # position 0 rejected at length 20
    # Its class learns most; every length a little (the text copies less than hoped).
    assert before - prop.stats.p(20) > beyond - prop.stats.p(24) > 0


def test_without_shadows_a_probe_revives_a_match_length_that_stopped_paying() -> None:
    text = list(range(100, 160))
    seq = [*text, 99, *text[:20]]
    prop = _costed(shadow=False)
    for _ in range(30):
        prop.stats.update(20, 8, 0)
    drafts = [prop.propose(request(seq, 16)) for _ in range(400)]
    probes = [d for d in drafts if d is not None]
    assert probes and all(d.tokens == (text[20],) for d in probes)
    assert len(probes) < 40  # rare: their cost stays a few percent of a decode


def test_with_shadows_no_probe_is_verified_and_copying_still_revives_drafting() -> None:
    """A probe would verify what a shadow draft scores for free: with shadows on, a
    match length that stopped paying costs no verify row at all, and once the output
    is seen to copy again (shadows scoring the committed tokens), drafting resumes."""
    text = list(range(100, 400))
    seq = [*text, 99, *text[:20]]
    prop = _costed()
    for _ in range(30):
        prop.stats.update(20, 8, 0)
    assert all(prop.propose(request(seq, 16)) is None for _ in range(400))
    lengths: list[int] = []

    class Recording(NgramProposer):
        def _proposal(self, length: int, draft: list[int],  # type: ignore[no-untyped-def]
                      expected: float | None = None):
            lengths.append(len(draft))
            return super()._proposal(length, draft, expected)

    again = Recording(curve=lambda: CPU)
    again.stats = prop.stats
    steps, accepted = _decode(again, [*text, 99], text[:200])
    assert lengths[0] >= 2 and max(lengths) == 16  # no one-token probe; then long windows
    assert accepted > 100 and steps < 100


def test_a_match_that_cannot_pay_is_not_costed() -> None:
    """Below the curve's break-even first-position acceptance no draft length can pay,
    so the step reads one estimate, not a window's worth of them."""
    assert break_even(CPU, 1.02, 16) == pytest.approx(
        min((1.02 * CPU.cost(k) - 1) / k for k in range(1, 17)))
    assert break_even(CPU, 1.02, 0) == float("inf")
    text = list(range(100, 160))
    weak = [*text, 99, 100, 101]
    prop = _costed()
    asked: list[int] = []
    real = prop.stats.acceptances

    def counting(length: int, k: int) -> list[float]:
        asked.append(k)
        return real(length, k)

    prop.stats.acceptances = counting  # type: ignore[method-assign]
    assert prop.propose(request(weak, 16)) is None
    assert asked == []
    assert prop.propose(request([*text, 99, *text[:30]], 16)) is not None and asked


def test_match_stats_prior_and_sharing() -> None:
    assert prior(0) == 0.0 and prior(4) == pytest.approx(0.5)
    assert prior(8) == pytest.approx(0.8) and prior(8, 4.0) == pytest.approx(16 / 17)
    # Short matches, the most common, are told apart one by one; long ones share.
    assert length_class(1) == 0 and length_class(5) != length_class(4)
    assert length_class(40) == length_class(47) and length_class(1000) == length_class(128)
    fresh = MatchStats()
    assert fresh.p(1) < fresh.p(8) < fresh.p(64)
    shared = SharedMatchStats()
    first = MatchStats(shared)
    for _ in range(20):
        first.update(12, 8, 0)  # long matches that fail at once
    first.close()
    second = MatchStats(shared)  # a later request starts from what the first measured
    assert second.p(12) < fresh.p(12) - 0.2
    first.close()  # closing twice adds nothing
    assert MatchStats(shared).p(12) == pytest.approx(second.p(12))
    # Long matches that hold make short ones trusted too (the text is being copied);
    # long matches that fail make every length less trusted.
    copying, phrasing = MatchStats(), MatchStats()
    for _ in range(5):
        copying.update(12, 8, 8)
        phrasing.update(12, 8, 0)
    assert copying.factor > 1.5 and phrasing.factor < 0.5
    assert copying.p(3) > fresh.p(3) + 0.1 > phrasing.p(3) + 0.2
    # Censored outcomes (cut short by the budget) are no rejection.
    cut, rejected = MatchStats(), MatchStats()
    cut.update(4, 4, 2, censored=True)
    rejected.update(4, 4, 2)
    assert cut.p(6) > rejected.p(6) and cut.p(6) >= fresh.p(6)


def test_long_copies_that_held_raise_trust_in_short_matches() -> None:
    """Drafts at lengths where the curve already expects 99% that all held are
    evidence of copying, never against it: a copied document must not make the next
    request start its copies more timidly."""
    fresh = MatchStats()
    copying = MatchStats()
    for length in (18, 46, 78, 110):
        copying.update(length, 31, 31)
    assert copying.factor > 1.0
    assert copying.p(2) > fresh.p(2) and copying.p(4) > fresh.p(4)


def test_a_copied_request_does_not_make_the_next_one_draft_on_short_matches() -> None:
    """The pool carries how each match length fared, not whether a text was copied:
    after a reformatted document, a new request trusts short matches no more than a
    fresh one (its own drafts and shadows decide), but long ones more."""
    shared = SharedMatchStats()
    first = MatchStats(shared)
    for length in (18, 46, 78, 110):
        first.update(length, 31, 31)
    assert first.factor > 1.0
    first.close()
    second, fresh = MatchStats(shared), MatchStats()
    assert second.factor == pytest.approx(1.0)
    assert second.p(3) == pytest.approx(fresh.p(3))
    assert second.p(40) > fresh.p(40)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 200), st.integers(0, 6), st.integers(0, 6)),
                max_size=12),
       st.integers(1, 200))
def test_a_hit_never_lowers_the_copy_factor_and_a_miss_never_raises_it(
        outcomes: list[tuple[int, int, int]], length: int) -> None:
    base = MatchStats()
    for n, hits, misses in outcomes:
        for _ in range(hits):
            base.record(n, True)
        for _ in range(misses):
            base.record(n, False)
    f = base.factor
    hit, miss = copy.deepcopy(base), copy.deepcopy(base)
    hit.record(length, True)
    miss.record(length, False)
    assert hit.factor >= f * (1 - 1e-9)
    assert miss.factor <= f * (1 + 1e-9)


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
    """Per step the request is read only where it is new, and the automaton stays
    within 2 states per token, whether the context is 100 or 5000 tokens long."""
    rng = random.Random(0)
    seq = [rng.randrange(50) for _ in range(5000)]
    prop = _costed(Q4_1)
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
        prop.propose(request(tokens, 8))
        assert tokens.reads <= len(new) + 1
        assert prop.index.states <= 2 * len(data)
    assert prop.rebuilds == 0


def test_factory_reads_options_and_resources() -> None:
    env = ProposerEnv(
        vocab_size=10, eog_tokens=frozenset({9}), options={"min_n": 1, "max_len": 3}
    )
    prop = ngram_factory(env)
    assert (prop.min_n, prop.max_len) == (1, 3) and prop.cycle and prop.shadow
    assert not ngram_factory(ProposerEnv(10, frozenset(), options={"shadow": False})).shadow
    assert prop.eog_tokens == {9} and prop.capabilities.max_len == 3
    assert not prop.capabilities.decides_length  # no cost curve: the engine decides
    shared = SharedMatchStats()
    live = ngram_factory(ProposerEnv(10, frozenset(), resources=Resources(
        cost_curve_now=lambda: Q4_1, match_stats=shared)))
    assert live.capabilities.decides_length and live.curve is not None
    assert live.curve() is Q4_1 and live.stats.shared is shared
    # A fixed curve is the composite's (it chooses lengths): the child drafts by rule.
    assert ngram_factory(ProposerEnv(10, frozenset(), resources=Resources(cost_curve=Q4_1))
                         ).curve is None
    off = ngram_factory(ProposerEnv(10, frozenset(),
                                    resources=Resources(cost_curve_now=lambda: Q4_1),
                                    options={"adaptive": False}))
    assert off.curve is None
    for bad in ({"min_n": 0}, {"max_len": "8"}, {"cycle": 1}, {"adaptive": "yes"},
                {"shadow": "no"}):
        with pytest.raises(ValueError):
            ngram_factory(ProposerEnv(vocab_size=10, eog_tokens=frozenset(), options=bad))


def _decode(prop: NgramProposer, prompt: Sequence[int], truth: Sequence[int],
            max_len: int = 16) -> tuple[int, int]:
    """Verify drafts against ``truth`` as the engine does with greedy decoding; returns
    (verify steps, draft tokens accepted)."""
    seq, pos, steps, accepted = list(prompt), 0, 0, 0
    while pos < len(truth):
        got = prop.propose(request(seq, max_len))
        draft = list(got.tokens) if got is not None else []
        a = 0
        while a < len(draft) and pos + a < len(truth) and draft[a] == truth[pos + a]:
            a += 1
        committed = tuple(truth[pos : pos + a + 1])
        if draft:
            prop.observe(Outcome(len(draft), a, committed))
        seq += committed
        pos += len(committed)
        steps += 1
        accepted += a
    return steps, accepted


def test_steps_that_draft_nothing_still_measure_what_a_draft_would_have_done() -> None:
    """Rows of a table whose cells repeat after a short match (``-51`` is always
    followed by ``5\\n``, then a new row label): the prior trusts such short matches
    too little to draft on them, but the tokens committed meanwhile show that they
    hold, so drafting starts without a single verify spent on finding that out."""
    dash, five, one, newline = 1, 5, 6, 2
    rows = [[1000 + i, dash, five, one, five, newline] for i in range(60)]
    prompt, truth = [7, 8, 9], [t for row in rows for t in row]
    flat = CostCurve.from_row_costs({2: 1.42, 5: 1.79, 9: 2.03, 17: 2.2})
    blind = _costed(flat, shadow=False)
    seeing = _costed(flat)
    blind_steps, blind_accepted = _decode(blind, prompt, truth)
    steps, accepted = _decode(seeing, prompt, truth)
    assert seeing.stats.p(3) > prior(3)
    assert accepted > blind_accepted and steps < blind_steps


class _Untrusting(Calibration):
    """A calibration that never corrects the estimates (the proposer without one)."""

    def factor(self, length: int) -> float:
        return 1.0


def test_drafts_that_keep_falling_short_of_the_estimates_are_trusted_less() -> None:
    """Estimates that promise more than the drafts get (here a stand-in that always
    says 0.9, while the text never goes on as the match did) are trusted less once the
    drafts' outcomes fall short: the proposer stops drafting there within a few
    windows, where the estimates alone would draft every step."""
    text = list(range(100, 160))
    seq = [*text, 99, *text[:6]]  # a 6-token match; the text will not follow it

    def optimistic(prop: NgramProposer) -> NgramProposer:
        prop.stats.acceptances = lambda length, k: [0.9] * k  # type: ignore[method-assign]
        prop.stats.p = lambda length: 0.9  # type: ignore[method-assign]
        return prop

    blind, calibrated = optimistic(_costed()), optimistic(_costed())
    blind.calibration = _Untrusting()
    drafted = {"blind": 0, "calibrated": 0}
    for _ in range(30):
        for name, prop in (("blind", blind), ("calibrated", calibrated)):
            got = prop.propose(request(seq, 16))
            if got is not None:
                drafted[name] += 1
                prop.observe(Outcome(len(got.tokens), 0, (7,)))  # rejected at once
    assert drafted["blind"] == 30
    assert drafted["calibrated"] <= 5


def test_calibration_only_lowers_trust_and_only_at_the_lengths_that_fell_short() -> None:
    cal = Calibration()
    assert cal.factor(5) == 1.0
    for _ in range(10):
        cal.observe(5, 2.0, 0)  # drafts at length 5 expected 2 tokens and got none
        cal.observe(20, 3.0, 8)  # long ones did better than expected
    assert cal.factor(5) < 0.2 and cal.factor(4) == cal.factor(7) == cal.factor(5)
    assert cal.factor(20) == 1.0 and cal.factor(3) == 1.0
    for _ in range(40):
        cal.observe(5, 2.0, 2)  # the text changed: drafts there hold again
    assert cal.factor(5) > 0.9
    with pytest.raises(ValueError):
        cal.observe(5, -1.0, 0)
