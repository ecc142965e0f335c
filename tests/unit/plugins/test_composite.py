"""Composite: picks the best expected speedup (vs brute force), routes outcomes, probes."""

from __future__ import annotations

import itertools

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from meshd.plugins.base import Outcome, Proposer, ProposerEnv, ProposerUnavailable
from meshd.plugins.composite import CompositeProposer, composite_factory
from meshd.plugins.ngram import ngram_factory
from meshd.plugins.registry import Registry
from meshd.plugins.resources import Resources
from meshd.policy.acceptance import Explorer
from meshd.policy.costs import CostCurve, expected_committed

from ..policy.curves import Q4_1, Q8_0
from .fakes import FakeProposer, FixedTracker, request


def no_probes() -> Explorer:
    return Explorer(every=0)


@st.composite
def curves(draw: st.DrawFn) -> CostCurve:
    steps = draw(st.lists(st.floats(0.0, 1.5), min_size=1, max_size=8))
    return CostCurve(tuple(itertools.accumulate([1.0, *steps])))


child_specs = st.lists(
    st.tuples(
        st.integers(0, 8),  # draft length (0: nothing to offer)
        st.integers(1, 10),  # child's capabilities.max_len
        st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),  # acceptance per position
        st.sampled_from([0.0, 0.0, 0.1, 0.5]),  # draft cost per token
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(curve=curves(), specs=child_specs, request_max=st.integers(0, 10))
def test_picks_the_best_expected_speedup(
    curve: CostCurve, specs: list[tuple[int, int, list[float], float]], request_max: int
) -> None:
    children = [
        FakeProposer(f"c{i}", range(100 * i, 100 * i + n), cap)
        for i, (n, cap, _, _) in enumerate(specs)
    ]
    comp = CompositeProposer(
        children,
        curve,
        trackers=[FixedTracker(acc) for _, _, acc, _ in specs],
        draft_costs=[dc for *_, dc in specs],
        explorer=no_probes(),
    )
    # Brute force over every (child, prefix length) the limits allow.
    best, options = 1.0, []
    for i, (n, cap, acc, dc) in enumerate(specs):
        for k in range(1, min(n, cap, request_max, curve.max_k) + 1):
            r = expected_committed(acc, k) / (curve.cost(k) + k * dc)
            options.append((r, i, k))
            best = max(best, r)
    got = comp.propose(request([0], request_max))
    event("none" if best <= comp.margin else "picked")
    if best <= comp.margin:
        assert got is None and comp.last_choice is None
        return
    choice = comp.last_choice
    assert got is not None and choice is not None
    assert choice.ratio == pytest.approx(best, rel=1e-12)
    assert got.tokens == children[choice.child].draft[: choice.k]
    assert (choice.ratio, choice.child, choice.k) in options


def test_speculation_that_does_not_pay_proposes_nothing() -> None:
    ngram = FakeProposer("ngram", [1, 2, 3, 4])
    comp = CompositeProposer([ngram], Q4_1, trackers=[FixedTracker([0.4])], explorer=no_probes())
    assert comp.propose(request([0])) is None
    assert ngram.asked == []  # cannot pay at any length: not even asked
    comp2 = CompositeProposer([ngram], Q8_0, trackers=[FixedTracker([0.9])], explorer=no_probes())
    got = comp2.propose(request([0]))
    assert got is not None and got.tokens == (1, 2, 3) and comp2.last_choice.k == 3  # type: ignore[union-attr]


def test_better_ratio_beats_first_non_empty() -> None:
    first = FakeProposer("first", [1, 2, 3, 4, 5, 6])
    second = FakeProposer("second", [7, 8])
    comp = CompositeProposer(
        [first, second],
        Q8_0,
        trackers=[FixedTracker([0.55]), FixedTracker([0.97])],
        explorer=no_probes(),
    )
    got = comp.propose(request([0]))
    assert got is not None and got.tokens == (7, 8)
    assert first.asked == []  # its best possible ratio is below what second delivered


def test_observe_routes_to_the_used_child_only() -> None:
    a, b = FakeProposer("a", [1, 2]), FakeProposer("b", [3, 4])
    ta, tb = FixedTracker([0.1]), FixedTracker([0.95])
    comp = CompositeProposer([a, b], Q8_0, trackers=[ta, tb], explorer=no_probes())
    comp.propose(request([0]))
    assert comp.last_choice is not None and comp.last_choice.name == "b"
    comp.observe(Outcome(proposed=2, accepted=1, committed=(3, 9)))
    assert b.observed == [Outcome(2, 1, (3, 9))]
    assert a.observed == [Outcome(0, 0, (3, 9))]  # told what was committed, nothing else
    assert tb.seen == [(2, 1, False)] and ta.seen == []
    comp.observe(Outcome(proposed=0, accepted=0, committed=(5,)))  # a plain step
    assert tb.seen == [(2, 1, False)] and b.observed[-1] == Outcome(0, 0, (5,))
    comp.propose(request([0]))
    comp.observe(Outcome(proposed=2, accepted=2, committed=(3, 4)))  # cut short: censored
    assert tb.seen[-1] == (2, 2, True)
    comp.close()
    assert a.closed and b.closed
    assert comp.used == {"a": 0, "b": 2}


def test_probes_round_robin_when_nothing_pays() -> None:
    a, b = FakeProposer("a", [1, 2]), FakeProposer("b", [3, 4])
    ta, tb = FixedTracker([0.2]), FixedTracker([0.2])
    comp = CompositeProposer(
        [a, b], Q4_1, trackers=[ta, tb], explorer=Explorer(every=3, max_every=12)
    )
    results = []
    for _ in range(9):
        got = comp.propose(request([0]))
        results.append(got.tokens if got else None)
        comp.observe(Outcome(len(got.tokens), 0, (0,)) if got else Outcome(0, 0, (0,)))
    # Probe after 3 idle steps (child a), then back off to 6 (child b).
    assert results == [None, None, (1,), None, None, None, None, None, (3,)]
    assert ta.seen == [(1, 0, False)] and tb.seen == [(1, 0, False)]
    assert comp.explorer.interval == 12


def test_probe_waits_for_a_child_with_something() -> None:
    empty = FakeProposer("empty", [])
    comp = CompositeProposer([empty], Q4_1, trackers=[FixedTracker([0.2])], explorer=Explorer(1))
    assert comp.propose(request([0])) is None
    assert comp.explorer.due  # still owed
    empty.draft = (5, 6)
    got = comp.propose(request([0]))
    assert got is not None and got.tokens == (5,) and comp.last_choice.probe  # type: ignore[union-attr]


def test_capabilities_combine_children() -> None:
    a, b = FakeProposer("a", [1], max_len=3), FakeProposer("b", [2], max_len=12)
    comp = CompositeProposer([a, b], Q8_0)
    assert comp.capabilities.max_len == Q8_0.max_k
    assert not comp.capabilities.needs_mtp_head
    with pytest.raises(ValueError):
        CompositeProposer([], Q8_0)
    with pytest.raises(ValueError):
        CompositeProposer([a], Q8_0, trackers=[])


def test_end_to_end_with_ngram_on_repetitive_text() -> None:
    """Engine-like loop with a greedy 'target' that repeats a phrase: the composite
    learns the n-gram proposer is right and commits several tokens per verify."""
    phrase = [10, 11, 12, 13, 14, 15, 16, 17]
    target = phrase * 12
    env = ProposerEnv(vocab_size=100, eog_tokens=frozenset())
    comp = CompositeProposer([ngram_factory(env)], Q8_0, explorer=Explorer(every=4))
    seq = list(target[:8])
    verifies = 0
    while len(seq) < len(target):
        prop = comp.propose(request(seq, 8))
        draft = prop.tokens if prop else ()
        truth = target[len(seq) : len(seq) + len(draft) + 1]
        accepted = next(
            (i for i, (d, t) in enumerate(zip(draft, truth, strict=False)) if d != t), len(draft)
        )
        accepted = min(accepted, len(truth))
        committed = tuple(truth[: accepted + 1])
        seq.extend(committed)
        comp.observe(Outcome(len(draft), accepted, committed))
        verifies += 1
    assert seq[: len(target)] == target
    assert verifies < len(target) - 8  # fewer verifies than plain decode's one per token


class Boom:
    def __call__(self, env: ProposerEnv) -> Proposer:
        raise ProposerUnavailable("no head")


def make_registry() -> Registry:
    reg = Registry()
    reg.register("ngram", ngram_factory)
    reg.register("mtp", Boom())
    return reg


def test_factory_builds_children_from_the_registry() -> None:
    env = ProposerEnv(
        vocab_size=100,
        eog_tokens=frozenset(),
        resources=Resources(cost_curve=Q8_0, registry=make_registry()),
        options={"ngram": {"max_len": 3}, "priors": {"ngram": 0.8}, "probe_every": 5},
    )
    comp = composite_factory(env)
    assert [c.name for c in comp.children] == ["ngram"]  # mtp unavailable: skipped
    assert comp.children[0].capabilities.max_len == 3
    assert comp.trackers[0].prior == 0.8 and comp.explorer.every == 5
    assert comp.curve is Q8_0
    raw = composite_factory(
        ProposerEnv(
            100,
            frozenset(),
            resources=Resources(registry=make_registry()),
            options={"cost_curve": [1.0, 1.3, 1.2]},
        )
    )
    # A 2-row window dearer than 3 rows: priced at 3 rows (padded), as the runtime's are.
    assert raw.curve.costs == (1.0, 1.2, 1.2) and raw.curve.padded_length(1) == 2


def test_factory_errors() -> None:
    reg = Resources(registry=make_registry())
    # No curve (--fixed-k): every window costs one decode, the longest draft is taken.
    blind = composite_factory(ProposerEnv(100, frozenset(), resources=reg,
                                          options={"proposers": ["ngram"]}))
    assert set(blind.curve.costs) == {1.0} and blind.curve.max_k == blind.capabilities.max_len
    res = attrs.evolve(reg, cost_curve=Q8_0)
    with pytest.raises(ProposerUnavailable, match="no child"):
        composite_factory(
            ProposerEnv(100, frozenset(), resources=res, options={"proposers": ["mtp"]})
        )
    for bad in [{"proposers": "ngram"}, {"proposers": ["composite"]}, {"ngram": 3}, {"priors": 1}]:
        with pytest.raises(ValueError):
            composite_factory(ProposerEnv(100, frozenset(), resources=res, options=bad))
