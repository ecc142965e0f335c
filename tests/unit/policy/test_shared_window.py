"""One window length for requests sharing a hybrid model's forward (sans-I/O rules)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.policy.costs import expected_committed
from meshd.policy.shared_window import (
    Member,
    RunningAcceptance,
    SharedPlan,
    plan_at,
    plan_shared,
)


def measured_rows(rows: int) -> float:
    """Row costs of a 1B hybrid model (Q8_0, 2 threads): cheap up to 9 rows, then each
    row costs its compute."""
    table = {1: 1.0, 2: 1.89, 4: 2.42, 8: 2.79, 16: 4.08, 32: 6.70}
    xs = sorted(table)
    if rows in table:
        return table[rows]
    lo = max(x for x in xs if x < rows)
    hi = [x for x in xs if x > rows]
    if not hi:
        return table[lo] + (rows - lo) * (table[lo] - table[16]) / (lo - 16)
    h = min(hi)
    return table[lo] + (table[h] - table[lo]) * (rows - lo) / (h - lo)


def member(acc: float | None, cap: int = 8, draft_cost: float = 0.0) -> Member:
    return Member(None if acc is None else (acc,) * cap, cap, draft_cost)


def length(group: list[Member], max_length: int = 8, margin: float = 1.02) -> int:
    return plan_shared(group, measured_rows, max_length=max_length, margin=margin).length


def test_a_group_drafts_shorter_than_one_request_alone_would() -> None:
    alone = length([member(0.9)])
    four = length([member(0.9)] * 4)
    assert alone >= 7  # 9 rows cost 2.8 decodes: a long window pays alone
    assert 0 < four < alone  # with 3 others the forward is past its cheap part


def test_the_chosen_length_pays_best_for_the_group() -> None:
    group = [member(0.9, draft_cost=0.07), member(0.6, draft_cost=0.07), member(None)]
    best = length(group, margin=1.0)
    ratios = [plan_at(group, n, measured_rows)[0] for n in range(9)]
    assert ratios[best] == max(ratios)


def test_a_dear_head_does_not_hold_the_others_back() -> None:
    """A member whose drafts cost as much as a decode each (a tiny model's MTP head)
    rides with filler, and the cheap drafters still draft."""
    cheap = member(0.9)
    dear = member(0.9, draft_cost=1.0)
    plan = plan_shared([cheap, dear, cheap, member(None)], measured_rows, max_length=8)
    assert plan.length > 0
    assert plan.drafts[0] == plan.drafts[2] == plan.length
    assert plan.drafts[1] == 0 and plan.drafts[3] == 0


def test_nobody_drafting_means_a_plain_shared_decode() -> None:
    assert plan_shared([member(None)] * 3, measured_rows, max_length=8) == SharedPlan(
        0, (0, 0, 0))
    assert length([]) == 0


def test_poor_acceptance_decodes_plainly() -> None:
    assert length([member(0.05)] * 4) == 0


def test_riders_cost_their_filler_rows() -> None:
    drafting = [member(0.8)]
    with_riders = [member(0.8), member(None), member(None), member(None)]
    # Three riders pay rows at every length, so the same drafts buy less per cost.
    assert plan_at(with_riders, 3, measured_rows)[0] < 4 * plan_at(drafting, 3,
                                                                    measured_rows)[0]
    assert plan_at(with_riders, 0, measured_rows)[0] == pytest.approx(4 / measured_rows(4))


@given(accs=st.lists(st.one_of(st.none(), st.floats(0.0, 1.0)), min_size=1, max_size=6),
       caps=st.lists(st.integers(0, 10), min_size=6, max_size=6),
       max_length=st.integers(0, 10))
def test_never_longer_than_the_rollback_or_any_cap(accs: list[float | None], caps: list[int],
                                                   max_length: int) -> None:
    group = [member(a, c) for a, c in zip(accs, caps, strict=False)]
    plan = plan_shared(group, measured_rows, max_length=max_length)
    n = plan.length
    assert 0 <= n <= max_length
    assert all(0 <= d <= min(n, m.cap) for d, m in zip(plan.drafts, group, strict=True))
    assert all(d == 0 for d, m in zip(plan.drafts, group, strict=True) if m.acceptance is None)
    if n > 0:
        assert max(plan.drafts) == n
        assert plan_at(group, n, measured_rows)[0] > plan_at(group, 0, measured_rows)[0]


@given(low=st.floats(0.0, 0.95), extra=st.floats(0.0, 0.05), size=st.integers(1, 5))
def test_better_acceptance_never_shortens_the_window(low: float, extra: float,
                                                     size: int) -> None:
    worse = length([member(low)] * size)
    better = length([member(low + extra)] * size)
    assert better >= worse


def test_running_acceptance_follows_positions() -> None:
    acc = RunningAcceptance(prior=0.5)
    assert acc.rates(3) == [0.5, 0.5, 0.5]
    for _ in range(30):
        acc.observe(4, 2)  # the first two drafts right, the third wrong
    rates = acc.rates(5)
    assert rates[0] > 0.9 and rates[1] > 0.9  # the prior still weighs a little
    assert rates[2] < 0.2
    assert rates[3] == pytest.approx(rates[2])  # never reached: leans on the one before
    assert expected_committed(rates, 4) == pytest.approx(3.0, abs=0.15)


def test_running_acceptance_forgets_old_windows() -> None:
    acc = RunningAcceptance(prior=0.5)
    for _ in range(30):
        acc.observe(3, 3)
    assert acc.rates(1)[0] > 0.9
    for _ in range(30):
        acc.observe(3, 0)
    assert acc.rates(1)[0] < 0.2


@pytest.mark.parametrize("bad", [(-1, 0), (2, 3), (2, -1)])
def test_running_acceptance_rejects_impossible_windows(bad: tuple[int, int]) -> None:
    drafted, matched = bad
    acc = RunningAcceptance()
    if drafted <= 0:
        acc.observe(drafted, matched)  # nothing drafted: nothing learned
        assert acc.rates(1) == [acc.prior]
        return
    with pytest.raises(ValueError):
        acc.observe(drafted, matched)


def test_member_checks_its_numbers() -> None:
    with pytest.raises(ValueError):
        Member((0.5,), cap=2)
    with pytest.raises(ValueError):
        Member((1.5, 0.5), cap=2)
    with pytest.raises(ValueError):
        Member(None, cap=-1)


def test_a_proposer_that_seldom_has_drafts_does_not_pad_the_group() -> None:
    """Prompt lookup on free text: right half the time when it drafts, but it drafts on
    one step in ten; everyone's filler rows would be paid on every step."""
    acc = RunningAcceptance(prior=0.5)
    for step in range(40):
        acc.asked(step % 10 == 0)
    assert acc.offer_rate < 0.2
    seldom = Member(tuple(acc.rates(8)), 8, 0.0, acc.offer_rate)
    always = Member(tuple(acc.rates(8)), 8, 0.0, 1.0)
    assert plan_shared([seldom] * 4, measured_rows, max_length=8).length == 0
    assert plan_shared([always] * 4, measured_rows, max_length=8).length > 0
    with pytest.raises(ValueError):
        Member((0.5,), 1, 0.0, 1.5)
