"""The history store: bounded by its cap whatever is added, the oldest answers evicted,
drafts by frequency (ties: the newest), an owner's drafts only from its own answers;
and the history proposer inside a composite, priced by its own estimates."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.plugins.base import ProposerEnv, ProposerUnavailable
from meshd.plugins.composite import CompositeProposer, composite_factory
from meshd.plugins.history import (
    ANCHOR,
    BYTES_PER_TOKEN,
    PRIOR_FACTOR,
    HistoryProposer,
    HistoryStore,
    HistoryView,
    history_factory,
)
from meshd.plugins.registry import Registry
from meshd.plugins.resources import Need, Resources, requires
from meshd.policy.costs import CostCurve

from .fakes import FakeProposer, FixedTracker, request

answers = st.lists(st.tuples(st.lists(st.integers(0, 9), min_size=0, max_size=60),
                             st.sampled_from(["uid:1", "uid:2", "key:x"])), max_size=40)


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(0, 200), added=answers)
def test_the_store_never_exceeds_its_cap(cap: int, added: list[tuple[list[int], str]]) -> None:
    store = HistoryStore(cap)
    for tokens, owner in added:
        store.add(tokens, owner)
        assert store.kept <= cap
        assert store._arrays is None or len(store._arrays[0]) == cap  # the arrays themselves
        assert store.memory_bytes() <= BYTES_PER_TOKEN * cap + 8 * 16
        # Every match found is visible to the owner and has a continuation kept.
        for length, start in store.lookup(tokens, owner):
            assert length >= store.n
            assert store.total - store.capacity <= start < store.total


def test_measured_memory_per_token_is_within_the_bound() -> None:
    cap = 50_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = HistoryStore(cap)
        for i in range(300):  # six times the cap: the oldest are overwritten
            store.add([(i * 7 + j) % 5000 for j in range(1000)], f"uid:{i % 3}")
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.kept == cap
    assert used <= BYTES_PER_TOKEN * cap * 1.1, used / cap


def test_the_oldest_answers_are_evicted_first() -> None:
    store = HistoryStore(12)
    store.add([1, 2, 3, 4, 5, 6], "a")
    assert store.lookup([1, 2, 3], "a") == [(3, 3)]
    store.add([7, 8, 9, 10, 11, 12, 13, 14], "a")  # 14 tokens: the first two are gone
    assert store.lookup([1, 2, 3], "a") == []
    assert store.lookup([8, 9, 10], "a") == [(3, 10)]


def test_an_owner_drafts_only_from_its_own_answers_unless_shared() -> None:
    for shared in (False, True):
        store = HistoryStore(100, shared=shared)
        store.add([5, 6, 7, 8, 9], "uid:1")
        assert store.lookup([5, 6, 7], "uid:1") == [(3, 3)]
        assert store.lookup([5, 6, 7], "uid:2") == ([(3, 3)] if shared else [])


def test_the_most_frequent_continuation_wins_ties_go_to_the_newest() -> None:
    store = HistoryStore(1000)
    store.add([1, 2, 3, 4, 5], "a")
    store.add([1, 2, 3, 4, 6], "a")
    store.add([1, 2, 3, 4, 6], "a")
    starts = [s for _, s in store.lookup([1, 2, 3], "a")]
    draft, shares = store.continuation(starts, 4)
    assert draft == [4, 6] and shares == [1.0, 2 / 3]
    store.add([1, 2, 3, 4, 5], "a")  # 2 against 2: the newest answer's token
    starts = [s for _, s in store.lookup([1, 2, 3], "a")]
    assert store.continuation(starts, 4)[0] == [4, 5]


def test_the_longest_match_chooses_which_answers_are_followed() -> None:
    store = HistoryStore(1000)
    store.add([9, 1, 2, 3, 50, 51], "a")
    for _ in range(3):
        store.add([8, 1, 2, 3, 60, 61], "a")
    view = HistoryView(store, "a")
    prop = HistoryProposer(view)
    # The context ends "9 1 2 3": the one answer that matches 4 tokens, not the 3 others.
    got = prop.propose(request([7, 9, 1, 2, 3]))
    assert got is not None and got.tokens == (50, 51)
    assert got.acceptances and all(0.0 < p <= 1.0 for p in got.acceptances)


def test_remembering_keeps_the_prompts_end_only_by_default() -> None:
    store = HistoryStore(1000)
    prompt = list(range(100, 140))
    HistoryView(store, "a").remember(prompt, [1, 2, 3])
    assert store.kept == ANCHOR + 3
    HistoryView(store, "a", prompts=True).remember(prompt, [1, 2, 3])
    assert store.kept == ANCHOR + 3 + len(prompt) + 3


def test_without_a_view_the_proposer_is_unavailable() -> None:
    env = ProposerEnv(vocab_size=100, eog_tokens=frozenset())
    try:
        history_factory(env)
    except ProposerUnavailable:
        pass
    else:
        raise AssertionError("expected ProposerUnavailable")
    off = ProposerEnv(vocab_size=100, eog_tokens=frozenset(),
                      resources=Resources(history=HistoryView(HistoryStore(0), "a")))
    try:
        history_factory(off)
    except ProposerUnavailable:
        pass
    else:
        raise AssertionError("expected ProposerUnavailable")


def test_a_composite_prices_history_by_its_estimates_not_its_tracker() -> None:
    store = HistoryStore(1000)
    answer = [1, 2, 3, *range(10, 30)]
    for _ in range(4):
        store.add(answer, "a")
    history = HistoryProposer(HistoryView(store, "a"))
    other = FakeProposer("ngram", [99])
    curve = CostCurve((1.0, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9))
    # Both trackers say "never accepted": only history's own estimates can make it pay.
    comp = CompositeProposer([other, history], curve,
                             trackers=[FixedTracker([0.01]), FixedTracker([0.01])])
    got = comp.propose(request([1, 2, 3, 10, 11, 12, 13, 14, 15, 16]))
    assert got is not None and got.source == "history"
    assert got.tokens == tuple(range(17, 17 + len(got.tokens))) and len(got.tokens) > 1
    assert other.asked == []  # its bound could not pay


def test_a_third_party_child_of_a_composite_is_not_handed_the_history() -> None:
    seen: dict[str, object] = {}

    @requires(Need.HISTORY)
    def spy(env: ProposerEnv) -> FakeProposer:
        seen["history"] = env.resources.history
        return FakeProposer("spy", [1])

    registry = Registry()
    registry.register("history", history_factory)
    registry.register("spy", spy, third_party=True)
    view = HistoryView(HistoryStore(100), "uid:1")
    env = ProposerEnv(vocab_size=100, eog_tokens=frozenset(),
                      options={"proposers": ["spy", "history"]},
                      resources=Resources(cost_curve=CostCurve((1.0, 1.2, 1.4)),
                                          registry=registry, history=view))
    comp = composite_factory(env)
    assert [c.name for c in comp.children] == ["spy", "history"]
    assert seen == {"history": None}
    assert isinstance(comp.children[1], HistoryProposer) and comp.children[1].view is view
    assert registry.built_in("history") and not registry.built_in("spy")


def test_a_match_in_earlier_answers_needs_twice_the_length_for_prompt_lookups_odds() -> None:
    from meshd.plugins.match_stats import MatchStats

    own, other = MatchStats(), MatchStats(prior_factor=PRIOR_FACTOR)
    assert other.p(8) == pytest.approx(own.p(4)) and other.p(16) == pytest.approx(own.p(8))
    assert other.p(6) < own.p(6)
    # what this request measures still moves it: drafts from history that keep holding
    for _ in range(20):
        other.update(6, 4, 4)
    assert other.p(6) > MatchStats(prior_factor=PRIOR_FACTOR).p(6) + 0.2
