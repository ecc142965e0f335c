"""The step gate: refusals in order, the budget, the cost model's say, the MTP head."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.policy.costs import CostCurve, CostModel
from meshd.policy.gate import (
    HEAD_CHECK_DRAFTS,
    HEAD_CHECK_EVERY,
    HEAD_CHECK_FORWARDS,
    HEAD_EVIDENCE_K,
    HEAD_EVIDENCE_WINDOWS,
    HEAD_VALUE_STEPS,
    HeadLoad,
    HeadValue,
    Refusal,
    StepFacts,
    StepGate,
    Verdict,
    mtp_head_pays,
)

#: Verifying k drafts costs k + 1 decodes: nothing can pay.
DEAR = [1.0 + k for k in range(9)]
#: A GPU-like curve: extra rows are nearly free.
CHEAP = [1.0 + 0.05 * k for k in range(9)]


def facts(k_max: int = 8, *, exact: bool = True, head: HeadLoad | None = None) -> StepFacts:
    return StepFacts(exact_verifiable=exact, k_max=k_max, head=head)


@given(exact=st.booleans(), k_max=st.integers(-3, 12),
       adaptive=st.booleans(), cheap=st.booleans())
def test_refusals_come_in_order_and_k_stays_in_budget(
    exact: bool, k_max: int, adaptive: bool, cheap: bool
) -> None:
    gate = StepGate(CostModel(CHEAP if cheap else DEAR), draft_max=8, adaptive=adaptive)
    verdict = gate.verdict(facts(k_max, exact=exact))
    if not exact:
        assert verdict == Verdict(0, Refusal.UNSEEDED_SAMPLING)
    elif k_max <= 0:
        assert verdict == Verdict(0, Refusal.BUDGET)
    elif not adaptive:
        assert verdict == Verdict(k_max)  # the length is not the gate's to choose
    else:
        assert 0 <= verdict.k <= k_max and not verdict.drop_head
        assert (verdict.refusal is Refusal.COST_MODEL) == (verdict.k == 0)


def test_without_a_cost_model_the_budget_decides() -> None:
    gate = StepGate(None, draft_max=8, adaptive=True)
    assert gate.adaptive is None
    assert gate.verdict(facts(5)) == Verdict(5)


def test_the_cost_model_refuses_where_verifying_costs_a_decode_per_row() -> None:
    """Where every row costs a decode, the only windows are the explorer's rare
    one-token probes; every other step is refused by the cost model."""
    gate = StepGate(CostModel(DEAR), draft_max=8, adaptive=True)
    verdicts = []
    for _ in range(200):
        verdicts.append(v := gate.verdict(facts()))
        if v.k:
            gate.verified(v.k, 0)  # the probe missed
    assert all(v.k in (0, 1) for v in verdicts)
    probes = sum(v.k for v in verdicts)
    assert 1 <= probes <= 10  # failed probes back off
    assert sum(v.refusal is Refusal.COST_MODEL for v in verdicts) == 200 - probes


def test_good_acceptance_on_a_cheap_curve_drafts_long() -> None:
    gate = StepGate(CostModel(CHEAP), draft_max=8, adaptive=True)
    for _ in range(40):
        v = gate.verdict(facts())
        if v.k:
            gate.verified(v.k, v.k)
    assert gate.verdict(facts()).k == 8
    assert gate.verdict(facts(3)).k == 3  # never past the budget


def test_drafting_time_is_a_running_average_per_token() -> None:
    gate = StepGate(CostModel(CHEAP), draft_max=8, adaptive=True)
    gate.drafted(0.004, 4)
    assert gate.draft_s_per_token == pytest.approx(0.001)
    gate.drafted(0.002, 0)  # an empty proposal counts as one token of time
    assert gate.draft_s_per_token == pytest.approx(0.8 * 0.001 + 0.2 * 0.002)


def test_drafting_is_charged_to_the_cost_model_once_decodes_are_timed() -> None:
    costs = CostModel(CHEAP)
    gate = StepGate(costs, draft_max=8, adaptive=True)
    gate.drafted(0.005, 1)
    gate.verdict(facts())
    assert gate.adaptive is not None and gate.adaptive.draft_cost == 0.0  # no decode time
    for _ in range(8):
        costs.record(1, 0.010)
    gate.verdict(facts())
    assert gate.adaptive.draft_cost == pytest.approx(0.5)


def head(forwards: int, *, forward_ms: float, head_ms: float, drafted: int = 0) -> HeadLoad:
    return HeadLoad(forwards=forwards, forward_ms=forward_ms, head_ms=head_ms,
                    drafted=drafted)


def test_a_head_as_dear_as_its_body_is_dropped_once_timings_settle() -> None:
    gate = StepGate(CostModel(DEAR), draft_max=8, adaptive=True)
    gate.drafted(0.010, 1)
    dear = {"forward_ms": 200.0, "head_ms": 100.0}
    assert not gate.verdict(facts(head=head(HEAD_CHECK_FORWARDS - 1, **dear))).drop_head
    verdict = gate.verdict(facts(head=head(HEAD_CHECK_FORWARDS, **dear)))
    assert verdict == Verdict(0, Refusal.MTP_HEAD_DROPPED, drop_head=True)
    assert gate.adaptive is None  # the rest of the request decodes plainly
    assert gate.verdict(facts()) == Verdict(8)


def test_a_cheap_head_is_judged_every_few_forwards_and_kept() -> None:
    gate = StepGate(CostModel(CHEAP), draft_max=8, adaptive=True)
    gate.drafted(0.0001, 1)
    light = {"forward_ms": 100.0, "head_ms": 2.0}
    for n in range(HEAD_CHECK_FORWARDS, HEAD_CHECK_FORWARDS + 3 * HEAD_CHECK_EVERY):
        assert not gate.verdict(facts(head=head(n, **light))).drop_head
    # Between two judgements even a head that has turned dear is not looked at.
    dear = {"forward_ms": 1000.0, "head_ms": 900.0}  # catch-up 9x the body: never pays
    due = HEAD_CHECK_FORWARDS + 3 * HEAD_CHECK_EVERY  # judged last at due - EVERY
    assert not gate.verdict(facts(head=head(due - 1, **dear))).drop_head
    assert gate.verdict(facts(head=head(due, **dear))).drop_head


def test_a_head_is_never_judged_before_any_draft_was_timed() -> None:
    gate = StepGate(CostModel(DEAR), draft_max=8, adaptive=True)
    verdict = gate.verdict(facts(head=head(1000, forward_ms=200.0, head_ms=100.0)))
    assert not verdict.drop_head


def test_measured_acceptance_too_low_for_the_catch_up_drops_the_head() -> None:
    gate = StepGate(CostModel(CHEAP), draft_max=8, adaptive=True)
    gate.drafted(0.0001, 1)
    for _ in range(60):
        gate.verified(4, 0)  # the head is always wrong
    load = {"forward_ms": 130.0, "head_ms": 30.0}
    assert not gate.verdict(facts(head=head(HEAD_CHECK_FORWARDS, **load))).drop_head
    assert gate.verdict(facts(head=head(HEAD_CHECK_FORWARDS + HEAD_CHECK_EVERY, **load,
                                       drafted=HEAD_CHECK_DRAFTS))).drop_head


def test_mtp_head_economics() -> None:
    """The judgement behind dropping a head, on numbers: a real model's head (one layer
    of many: ~5% catch-up, ~0.1 decode per draft) pays at good acceptance; a head as
    dear as the body never does; measured acceptance too low to beat the catch-up
    loses it."""
    q8 = CostCurve((1.0, 1.9, 2.2, 2.3, 2.8, 3.0, 3.3, 3.3, 3.6))
    assert mtp_head_pays(q8, overhead=0.05, draft_cost=0.1, k_max=8, acceptances=[[0.85] * 8])
    assert not mtp_head_pays(q8, overhead=0.9, draft_cost=0.9, k_max=8)
    cheap = CostCurve([1.0 + 0.05 * k for k in range(9)])
    assert mtp_head_pays(cheap, overhead=0.3, draft_cost=0.1, k_max=8)  # bound only
    assert not mtp_head_pays(cheap, overhead=0.3, draft_cost=0.1, k_max=8,
                             acceptances=[[0.1] * 8, [0.2] * 8])



def test_acceptance_measured_by_earlier_requests_starts_drafting_at_once() -> None:
    """The 1B hybrid's curve (2 rows 1.83, 4 rows 2.97 decodes): a new request with the
    generic prior decodes plainly until probes measure the proposer; one that starts
    from the acceptance earlier requests measured (0.9) drafts on its first step, and
    one whose proposer measured poorly (0.3) does not."""
    curve = [1.0, 1.83, 2.4, 2.97, 3.24, 3.5, 3.77, 4.03, 4.3]
    assert StepGate(CostModel(curve), draft_max=8, adaptive=True).verdict(facts()).k == 0
    assert StepGate(CostModel(curve), draft_max=8, adaptive=True,
                    prior=0.9).verdict(facts()).k > 0
    assert StepGate(CostModel(curve), draft_max=8, adaptive=True,
                    prior=0.3).verdict(facts()).k == 0


#: A realistic 1B hybrid model's verify curve on 2 CPU cores (k + 1 rows, in decodes).
HYBRID_1B = [1.0, 1.9, 2.15, 2.4, 2.7, 2.95, 3.15, 3.35, 3.55]


def simulate_head(acceptance: float, seed: int, steps: int = 128,
                  overhead: float = 0.065) -> tuple[int, int | None]:
    """Follow a head whose drafts are each right with probability ``acceptance`` for
    ``steps`` steps; return (tokens drafted, the step it was dropped at or None)."""
    import random

    rng = random.Random(seed)
    gate = StepGate(CostModel(HYBRID_1B), draft_max=8, adaptive=True)
    drafted = 0
    for step in range(steps):
        load = HeadLoad(forwards=step, forward_ms=40.0 * (1 + overhead) * step,
                        head_ms=40.0 * overhead * step, drafted=drafted)
        verdict = gate.verdict(facts(head=load))
        if verdict.drop_head:
            return drafted, step
        if verdict.k:
            gate.drafted(0.004 * verdict.k, verdict.k)  # 0.1 decode per drafted token
            accepted = 0
            while accepted < verdict.k and rng.random() < acceptance:
                accepted += 1
            drafted += verdict.k
            gate.verified(verdict.k, accepted)
    return drafted, None


def test_a_followed_head_gathers_evidence_before_the_cost_model_would_draft() -> None:
    """With the generic prior the cost model would decode plainly for many steps; a
    followed head (whose catch-up is paid anyway) drafts short windows until it has
    verified HEAD_EVIDENCE_WINDOWS windows."""
    gate = StepGate(CostModel(HYBRID_1B), draft_max=8, adaptive=True)
    assert gate.verdict(facts()).k == 0  # a free proposer waits for probes
    gate = StepGate(CostModel(HYBRID_1B), draft_max=8, adaptive=True)
    for _ in range(HEAD_EVIDENCE_WINDOWS):
        verdict = gate.verdict(facts(head=head(0, forward_ms=0.0, head_ms=0.0)))
        assert verdict.k == HEAD_EVIDENCE_K and not verdict.drop_head
        gate.verified(verdict.k, 0)
    assert gate.verdict(facts(head=head(0, forward_ms=0.0, head_ms=0.0))).k in (0, 1)


def test_a_head_that_buys_nothing_is_dropped() -> None:
    """Where no window pays (every row costs a decode) a followed head first drafts its
    evidence windows, then decodes plainly while its catch-up is still paid: once it
    has been followed HEAD_VALUE_STEPS steps, what it bought (fewer tokens than plain
    decoding would have given for that time) drops it."""
    gate = StepGate(CostModel(DEAR), draft_max=8, adaptive=True)
    load = head(HEAD_CHECK_FORWARDS, forward_ms=106.0, head_ms=6.0)
    verdicts = []
    while not (verdicts and verdicts[-1].drop_head) and len(verdicts) < 100:
        verdicts.append(v := gate.verdict(facts(head=load)))
        if v.k:
            gate.verified(v.k, 1)  # half of each evidence window is right
    assert [v.k for v in verdicts[:HEAD_EVIDENCE_WINDOWS]] == [HEAD_EVIDENCE_K] * 8
    assert len(verdicts) == HEAD_VALUE_STEPS + 1
    assert verdicts[-1] == Verdict(0, Refusal.MTP_HEAD_DROPPED, drop_head=True)
    assert gate.head_value.ratio < 1.0


def test_head_value_counts_tokens_against_their_cost() -> None:
    value = HeadValue()
    assert value.ratio == float("inf")
    value.add(1, 1.06)  # a plain step with the head's catch-up
    assert value.ratio == pytest.approx(1 / 1.06)
    value.add(5, 2.4)  # a window that committed 5 tokens for 2.4 decodes
    assert value.ratio == pytest.approx((0.98 + 5) / (1.06 * 0.98 + 2.4))


@pytest.mark.parametrize("seed", range(12))
def test_a_good_head_is_kept_and_a_poor_one_dropped_early(seed: int) -> None:
    """On a realistic hybrid curve with a 6.5% catch-up: a head right 90% of the time
    is never dropped in a 128-token request; one right half the time (no length pays)
    is dropped within the first 48 steps, having drafted little."""
    drafted, dropped_at = simulate_head(0.9, seed)
    assert dropped_at is None and drafted > 128
    drafted, dropped_at = simulate_head(0.5, seed)
    assert dropped_at is not None and dropped_at <= 48, (drafted, dropped_at)


@pytest.mark.parametrize("held_from", [0, HEAD_EVIDENCE_WINDOWS])
def test_a_head_its_company_never_lets_draft_is_dropped(held_from: int) -> None:
    """A head right 90% of the time, which alone would keep drafting, while the plan of
    a forward shared with other requests holds every step plain: each such step paid
    the head's catch-up for one token, so after HEAD_VALUE_STEPS of them the head is
    dropped, evidence windows or not."""
    gate = StepGate(CostModel(HYBRID_1B), draft_max=8, adaptive=True)
    load = head(HEAD_CHECK_FORWARDS, forward_ms=106.0, head_ms=6.0)
    for _ in range(held_from):  # drafted alone first: every window accepted
        v = gate.verdict(facts(head=load))
        gate.verified(v.k, v.k)
    assert gate.head_value.ratio > 1.0
    steps = 0
    while not (v := gate.verdict(facts(head=load))).drop_head and steps < 200:
        assert v.k > 0  # alone, it would draft
        gate.held_plain()
        steps += 1
    assert v == Verdict(0, Refusal.MTP_HEAD_DROPPED, drop_head=True)
    assert HEAD_VALUE_STEPS - held_from <= steps <= 4 * HEAD_VALUE_STEPS
    assert gate.head_value.ratio < 1.0


def test_held_plain_steps_count_only_while_a_head_is_followed() -> None:
    gate = StepGate(CostModel(HYBRID_1B), draft_max=8, adaptive=True)
    gate.verdict(facts())  # prompt lookup, say: no head
    for _ in range(3 * HEAD_VALUE_STEPS):
        gate.held_plain()
    assert gate.head_value.steps == 0
    assert not gate.verdict(facts()).drop_head
