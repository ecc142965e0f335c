"""Adaptive draft length: the objective, the curve repairs, the policy and its probes."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.policy.acceptance import AcceptanceTracker, Explorer
from meshd.policy.costs import CostCurve, choose_k, expected_committed, ratios, speedup_limit
from meshd.policy.draft_length import EXPLORED, LONGER_EVERY, AdaptiveK

from .curves import Q4_1, Q8_0

prob = st.floats(0.0, 1.0)
accs = st.lists(prob, min_size=1, max_size=10)
increments = st.lists(st.floats(0.0, 3.0), min_size=1, max_size=10)


@st.composite
def curves(draw: st.DrawFn) -> CostCurve:
    steps = draw(increments)
    return CostCurve(tuple(itertools.accumulate([1.0, *steps])))


# --- the machine.md examples -----------------------------------------------------------


def test_machine_examples() -> None:
    assert Q4_1.costs[:4] == (1.0, 1.75, 2.32, 3.40) and Q4_1.cost(7) == 5.40
    assert Q4_1.cost(5) == pytest.approx(4.40)  # interpolated between 4 and 8 rows
    assert choose_k(Q4_1, 0.4, 8) == 0
    assert choose_k(Q8_0, 0.9, 8) >= 2
    # The physical limits quoted in machine.md: ~1.4x for Q4_1, ~2.1x for Q8_0.
    k, r = speedup_limit(Q4_1)
    assert k == 7 and r == pytest.approx(8 / 5.40)
    k, r = speedup_limit(Q8_0)
    assert k == 4 and r == pytest.approx(5 / 2.36)
    assert speedup_limit(Q4_1, 0.0) == (0, 1.0)


def test_margin_keeps_noise_from_switching_speculation_on() -> None:
    curve = CostCurve((1.0, 1.5))
    # E(1) = 1 + a; with a = 0.52 the ratio is 1.0133: better than 1, not by 2%.
    assert speedup_limit(curve, 0.52)[0] == 1
    assert choose_k(curve, 0.52, 4) == 0
    assert choose_k(curve, 0.52, 4, margin=1.0) == 1
    assert choose_k(curve, 0.6, 4) == 1


def test_choose_k_is_capped_by_k_max_and_the_curve() -> None:
    free = CostCurve((1.0,) * 6)
    assert choose_k(free, 0.9, 3) == 3
    assert choose_k(free, 0.9, 50) == 5
    assert choose_k(free, 0.9, 0) == 0
    assert choose_k(Q8_0, 0.99, 2, draft_cost=0.0) == 2
    # A draft that costs as much as a decode per token never pays.
    assert choose_k(Q8_0, 1.0, 4, draft_cost=1.0) == 0


# --- expected_committed ----------------------------------------------------------------


@given(acc=accs, k=st.integers(0, 12))
def test_expected_committed_is_the_mean_of_committed_tokens(acc: list[float], k: int) -> None:
    """Against the distribution itself: accepted = a with probability
    prod_{i<a} acc[i] * (1 - acc[a]) (or prod of all k for a = k); commits a + 1."""
    a_at = [acc[min(i, len(acc) - 1)] for i in range(k)]
    mean = 0.0
    for a in range(k + 1):
        p = math.prod(a_at[:a]) * (1.0 - a_at[a] if a < k else 1.0)
        mean += p * (a + 1)
    assert expected_committed(acc, k) == pytest.approx(mean)
    assert 1.0 <= expected_committed(acc, k) <= k + 1 + 1e-12


def test_expected_committed_basics() -> None:
    assert expected_committed(0.5, 0) == 1.0
    assert expected_committed(0.5, 2) == 1.75
    assert expected_committed([1.0, 0.0, 1.0], 3) == 2.0
    assert expected_committed([0.5], 3) == 1.875  # short lists repeat their last value
    with pytest.raises(ValueError):
        expected_committed([], 1)
    with pytest.raises(ValueError):
        expected_committed(0.5, -1)


# --- choose_k properties ---------------------------------------------------------------


def brute_best(curve: CostCurve, acc: list[float], k_max: int) -> float:
    top = min(k_max, curve.max_k)
    return max(expected_committed(acc, k) / curve.cost(k) for k in range(top + 1))


@settings(max_examples=200)
@given(curve=curves(), acc=accs, k_max=st.integers(0, 12))
def test_choose_k_maximises_the_ratio(curve: CostCurve, acc: list[float], k_max: int) -> None:
    k = choose_k(curve, acc, k_max, margin=1.0)
    assert 0 <= k <= min(k_max, curve.max_k)
    best = brute_best(curve, acc, k_max)
    got = expected_committed(acc, k) / curve.cost(k)
    assert got == pytest.approx(best, rel=1e-12)
    strict = choose_k(curve, acc, k_max)
    assert strict == (k if best > 1.02 else 0)


@settings(max_examples=200)
@given(steps=st.lists(st.floats(1.0, 3.0), min_size=1, max_size=10), acc=accs)
def test_no_speculation_when_verify_costs_as_much_as_decoding_each_row(
    steps: list[float], acc: list[float]
) -> None:
    curve = CostCurve(tuple(itertools.accumulate([1.0, *steps])))  # c(k) >= k + 1
    assert choose_k(curve, acc, 12) == 0
    assert choose_k(curve, acc, 12, margin=1.0 + 1e-9) == 0


@settings(max_examples=300)
@given(
    curve=curves(),
    low=accs,
    bumps=st.lists(st.floats(0.0, 1.0), min_size=10, max_size=10),
    k_max=st.integers(0, 12),
)
def test_higher_acceptance_never_chooses_a_smaller_k(
    curve: CostCurve, low: list[float], bumps: list[float], k_max: int
) -> None:
    """True for this objective: E(k+1)/E(k) = 1 + 1/sum_{j<=k} 1/prod_{i=j..k} acc_i
    increases with every acc_i, so the ratio has increasing differences in (k, acc)
    (Topkis). Exact float ties may still flip, so a decrease must be a tie."""
    high = [a + (1.0 - a) * b for a, b in zip(low, bumps, strict=False)]
    k_low, k_high = choose_k(curve, low, k_max), choose_k(curve, high, k_max)
    if k_high < k_low:
        rs = ratios(curve, high, k_max)
        assert rs[k_high] == pytest.approx(rs[k_low], rel=1e-9)


# --- CostCurve ---------------------------------------------------------------------------


def test_curve_repairs_noisy_measurements() -> None:
    curve = CostCurve.sanitized([0.97, 0.95, 1.6, 1.5, 2.0])
    # 2 rows "cheaper" than a decode is noise: raised. 3 rows dearer than 4: a window of
    # 2 drafts is padded to 3 and priced at 4 rows.
    assert curve.costs == (1.0, 1.0, 1.5, 1.5, 2.0)
    assert [curve.padded_length(k) for k in range(5)] == [0, 1, 3, 3, 4]
    timed = CostCurve.from_times(0.010, {2: 0.0175, 4: 0.034, 3: 0.0232})
    assert timed.costs == pytest.approx((1.0, 1.75, 2.32, 3.40))
    dip = CostCurve.from_row_costs({1: 0.9, 2: 1.8, 3: 1.7, 5: 2.7})
    assert dip.costs == pytest.approx((1.0, 1.8, 1.8, 2.25, 2.7))
    assert CostCurve.from_row_costs({}).costs == (1.0,)


def test_windows_are_priced_at_the_cheaper_forward_of_whole_row_blocks() -> None:
    """Measured on a 1B Q8_0 model: 8 rows cost less than 5, 6 or 7, 12 less than 9-11."""
    rows = [1.0, 1.82, 2.11, 2.31, 2.90, 3.27, 3.43, 2.68, 3.26, 3.62, 3.76, 3.35, 4.00]
    curve = CostCurve.sanitized(rows)
    assert [curve.padded_length(k) for k in range(13)] == [
        0, 1, 2, 3, 7, 7, 7, 7, 8, 11, 11, 11, 12]
    assert curve.costs[4:8] == (2.68,) * 4
    # No look-ahead: the running maximum alone, no padding.
    plain = CostCurve.sanitized(rows, lookahead=0)
    assert plain.pad == () and plain.costs[7] == 3.43
    # Up to 8 drafts (a rollback depth of 8) at acceptance 0.9: 7 drafts in 8 rows pay
    # 2.13x, where without padding the best is 8 drafts at 1.79x.
    k, r = speedup_limit(curve, 0.9, k_max=8)
    assert k == 7 and r == pytest.approx(expected_committed(0.9, 7) / 2.68)
    k0, r0 = speedup_limit(plain, 0.9, k_max=8)
    assert k0 == 8 and r0 < 0.85 * r


@given(raw=st.lists(st.floats(0.01, 40.0), min_size=1, max_size=34),
       lookahead=st.integers(0, 9))
def test_padding_never_prices_a_window_dearer(raw: list[float], lookahead: int) -> None:
    curve = CostCurve.sanitized([1.0, *raw[1:]], lookahead=lookahead)
    measured = [1.0, *raw[1:]]
    assert all(b >= a for a, b in itertools.pairwise(curve.costs))
    for k in range(len(measured)):
        j = curve.padded_length(k)
        assert k <= j <= min(k + lookahead, curve.max_k)
        # Priced at the padded forward (raised only to keep the curve non-decreasing),
        # and never above what the unpadded running maximum would have said.
        assert curve.costs[k] >= measured[j] or k == 0
        assert curve.costs[k] <= max([1.0, *measured[1:k + 1]]) + 1e-12


@given(points=st.dictionaries(st.integers(1, 12), st.floats(0.01, 20.0), max_size=8))
def test_measured_curves_are_always_valid(points: dict[int, float]) -> None:
    curve = CostCurve.from_row_costs(points)
    assert curve.costs[0] == 1.0
    assert all(b >= a for a, b in itertools.pairwise(curve.costs))
    assert curve.max_k == max([1, *points]) - 1


def test_curve_validation() -> None:
    for bad in [(), (2.0,), (1.0, 0.9), (1.0, math.nan), (1.0, -1.0)]:
        with pytest.raises(ValueError):
            CostCurve(bad)
    with pytest.raises(ValueError):
        CostCurve.sanitized([1.0, math.inf])
    with pytest.raises(ValueError):
        CostCurve.from_row_costs({0: 1.0})
    with pytest.raises(ValueError):
        CostCurve.from_times(0.0, {2: 1.0})
    with pytest.raises(ValueError):
        Q8_0.cost(Q8_0.max_k + 1)


# --- AcceptanceTracker -------------------------------------------------------------------


def test_tracker_learns_per_position_rates() -> None:
    tracker = AcceptanceTracker(decay=1.0)
    assert tracker.acceptances(3) == (0.5, 0.5, 0.5)
    # 4 drafts each time; position 0 always accepted, position 1 accepted half the time.
    for i in range(200):
        tracker.update(4, 1 if i % 2 else 4)
    acc = tracker.acceptances(4)
    assert acc[0] == pytest.approx(1.0, abs=0.01)
    assert acc[1] == pytest.approx(0.5, abs=0.01)
    assert acc[2] == pytest.approx(1.0, abs=0.02) and acc[3] == pytest.approx(1.0, abs=0.02)


def test_tracker_prior_carries_down_the_positions_and_decay_forgets() -> None:
    tracker = AcceptanceTracker(prior=0.5, prior_weight=2.0, decay=0.9)
    for _ in range(50):  # one-token probes, all accepted
        tracker.update(1, 1)
    acc = tracker.acceptances(3)
    assert acc[0] > 0.9 and acc[1] == acc[0] and acc[2] == acc[0]  # untested: inherit
    for _ in range(50):
        tracker.update(1, 0)
    assert tracker.acceptance(0) < 0.1  # old evidence faded


def test_tracker_censoring_and_bounds() -> None:
    tracker = AcceptanceTracker(decay=1.0)
    tracker.update(3, 1, censored=True)  # cut short after one: position 1 not rejected
    tracker.update(0, 0)  # no evidence
    assert tracker.updates == 1
    assert tracker.acceptance(1) == tracker.acceptance(0) > 0.5
    with pytest.raises(ValueError):
        tracker.update(2, 3)
    small = AcceptanceTracker(max_positions=2, decay=1.0)
    small.update(5, 5)
    assert len(small.acceptances(6)) == 6 and small.acceptances(6)[5] == small.acceptance(1)
    for kwargs in [{"prior": 1.0}, {"prior_weight": 0.0}, {"decay": 0.0}, {"max_positions": 0}]:
        with pytest.raises(ValueError):
            AcceptanceTracker(**kwargs)  # type: ignore[arg-type]


# --- exploration and the controller ------------------------------------------------------


def test_explorer_schedule_backs_off_and_resets() -> None:
    ex = Explorer(every=4, max_every=16)
    assert [ex.idle_step() for _ in range(4)] == [False, False, False, True]
    assert ex.idle_step()  # stays due until a probe is issued
    ex.probed()
    ex.probe_result(0)
    assert ex.interval == 8
    ex.probe_result(0)
    ex.probe_result(0)
    assert ex.interval == 16
    ex.probe_result(1)
    assert ex.interval == 4
    ex.probe_result(0)
    ex.speculated()
    assert (ex.interval, ex.idle) == (4, 0)
    off = Explorer(every=0)
    assert not any(off.idle_step() for _ in range(1000))
    with pytest.raises(ValueError):
        Explorer(every=8, max_every=4)


def test_adaptive_k_probes_when_off_and_recovers() -> None:
    ctl = AdaptiveK(Q4_1, explorer=Explorer(every=8, max_every=64), probe_budget=math.inf)
    ks = [ctl.next_k() for _ in range(8)]
    assert ks == [0] * 7 + [1]  # the 8th plain step becomes a one-token probe
    ctl.observe(1, 0)  # failed probe: back off to 16
    ks = [ctl.next_k() for _ in range(16)]
    assert ks == [0] * 15 + [1]
    ctl.observe(0, 0)  # proposer had nothing: the probe stays due
    assert ctl.next_k() == 1
    # A proposer that is always right: probes raise the estimates until it pays.
    steps = 0
    while True:
        k = ctl.next_k()
        steps += 1
        if k > 1:
            break
        ctl.observe(k, k)
        assert steps < 200
    assert k >= 2  # speculation switched on by evidence alone


def test_adaptive_k_stays_off_for_a_bad_proposer() -> None:
    ctl = AdaptiveK(Q8_0, AcceptanceTracker(prior=0.3))
    issued = 0
    for _ in range(2000):
        k = ctl.next_k()
        issued += k > 0
        ctl.observe(k, 0)
    assert issued < 2000 * 0.02  # backed-off probes only


def test_a_hit_probe_is_followed_by_a_long_window() -> None:
    """A copy region is used at once: after a fully accepted one-token probe the streak
    estimates (optimistic until they have evidence) choose a long window; a miss ends
    the streak and plain decoding resumes until the next probe."""
    ctl = AdaptiveK(MEASURED_Q8_0, k_max=8, explorer=Explorer(every=4), probe_budget=math.inf)
    ks = [ctl.next_k() for _ in range(4)]
    assert ks == [0, 0, 0, 1]  # plain decoding until the first probe is due
    ctl.observe(1, 1)
    k = ctl.next_k()
    assert ctl.streak and k >= 4
    ctl.observe(k, k)
    assert ctl.next_k() >= 4  # still copying: still long
    ctl.observe(k, 2)
    assert not ctl.streak  # a miss: the next step decides from the other estimates
    assert ctl.next_k() == choose_k(MEASURED_Q8_0, ctl.tracker, 8)


def test_streak_tracker_learns_that_streaks_do_not_last() -> None:
    """Where a hit is rarely followed by more hits, failed long windows teach the streak
    tracker and it stops drafting long after a hit (old evidence fades, so it retries
    now and then)."""
    ctl = AdaptiveK(MEASURED_Q4_1, k_max=8, explorer=Explorer(every=1, max_every=1))
    long_windows = []
    for step in range(2000):
        k = ctl.next_k()
        if k > 1:
            long_windows.append(step)
        ctl.observe(k, min(k, 1))  # only ever the first draft is right
    # A retry every ~17 steps once learnt (each costs 0.38 of a decode here: ~2%).
    assert sum(1 for step in long_windows if step >= 1000) <= 1000 / 12, long_windows


# --- streaks: copying comes in runs ----------------------------------------------------


#: Cost curves measured on this machine (SmolLM2-135M, 2 threads) by ``meshd bench``.
MEASURED_Q4_1 = CostCurve((1.0, 1.76, 2.14, 2.59, 3.18, 3.59, 4.10, 4.29, 4.94))
MEASURED_Q8_0 = CostCurve((1.0, 1.90, 2.21, 2.30, 2.83, 3.02, 3.30, 3.30, 3.64))


def _bursty_speedup(ctl: AdaptiveK, seed: int, n_tokens: int = 20000) -> float:
    """Tokens per unit of cost on a text that alternates copy runs (a draft token is
    right with p 0.99) and free text (p 0.05), switching every ~60 tokens on average.

    A window of k drafts starting at token t commits the drafts up to the first wrong
    one plus the target's own token, and costs ``c(k)``; a plain step costs 1.
    """
    import random

    rng = random.Random(seed)
    right: list[bool] = []
    copying = False
    while len(right) < n_tokens + 64:
        if rng.random() < 1 / 60:
            copying = not copying
        right.append(rng.random() < (0.99 if copying else 0.05))
    t, cost = 0, 0.0
    while t < n_tokens:
        k = ctl.next_k()
        accepted = 0
        while accepted < k and right[t + accepted]:
            accepted += 1
        ctl.observe(k, accepted)
        cost += ctl.curve.cost(k)
        t += accepted + 1
    return t / cost


def test_streaks_pay_on_text_that_copies_in_runs() -> None:
    """With acceptance tracked apart right after a fully accepted window, the controller
    drafts long inside copy runs and little outside; one pooled estimate cannot."""
    for curve in (MEASURED_Q4_1, MEASURED_Q8_0):
        for seed in range(3):
            pooled = _bursty_speedup(AdaptiveK(curve, k_max=8, streaks=False), seed)
            split = _bursty_speedup(AdaptiveK(curve, k_max=8), seed)
            assert split > pooled * 1.04, (curve, seed, pooled, split)


def test_streaks_change_nothing_on_a_steady_source() -> None:
    """Acceptance that does not come in runs (an MTP head's, roughly): both states see the
    same rate, so the streak split neither helps nor hurts much."""
    import random

    for curve in (MEASURED_Q4_1, MEASURED_Q8_0):
        results = []
        for streaks in (False, True):
            ctl = AdaptiveK(curve, k_max=8, streaks=streaks)
            rng = random.Random(7)
            t, cost = 0, 0.0
            while t < 20000:
                k = ctl.next_k()
                accepted = 0
                while accepted < k and rng.random() < 0.8:
                    accepted += 1
                ctl.observe(k, accepted)
                cost += curve.cost(k)
                t += accepted + 1
            results.append(t / cost)
        assert results[1] == pytest.approx(results[0], rel=0.05), (curve, results)


def test_a_streak_ends_with_a_miss_or_a_plain_step() -> None:
    ctl = AdaptiveK(Q8_0, k_max=8, explorer=Explorer(every=1))
    k = ctl.next_k()
    assert k > 0
    ctl.observe(k, k)
    assert ctl.streak
    k = ctl.next_k()
    ctl.observe(k, k - 1)  # one draft rejected
    assert not ctl.streak
    assert ctl.streak_trackers[0].updates == 1 and ctl.tracker.updates == 1
    off = AdaptiveK(Q8_0, k_max=8, streaks=False)
    off.observe(3, 3)
    assert not off.streak


def test_costly_probes_come_rarely() -> None:
    """A proposer whose drafting costs many decodes (a draft model catching up on every
    token since its last draft) is probed only as often as the probe budget allows."""
    for draft_cost, most in ((0.0, None), (8.0, 1)):
        ctl = AdaptiveK(MEASURED_Q4_1, k_max=8, draft_cost=draft_cost)
        probes, steps = 0, 600
        for _ in range(steps):
            k = ctl.next_k()
            probes += k > 0
            ctl.observe(k, k)  # even a draft that is always right
        expected_cost = probes * (MEASURED_Q4_1.cost(1) - 1 + draft_cost - 1.0) / steps
        if most is not None:
            assert expected_cost <= 0.035 and probes <= 2 + steps // 260, probes
        else:
            assert probes > steps // 2  # free drafting that is always right: speculate


#: The Q8_0 curve up to k = 16 (measured as above).
MEASURED_Q8_0_16 = CostCurve((1.0, 1.97, 2.29, 2.44, 3.18, 3.34, 3.67, 3.67, 4.02, 4.38, 4.50,
                              4.50, 4.87, 5.05, 5.26, 5.26, 5.60))


def test_deeper_in_a_copy_run_the_windows_grow() -> None:
    """Text that copies in long runs whose start is uncertain (a run begins with a few
    tokens that may still diverge): the controller learns that acceptance is near 1 deep
    in a run and drafts its longest windows there, shorter ones near the start."""
    import random

    rng = random.Random(3)
    ctl = AdaptiveK(MEASURED_Q8_0_16, k_max=16)
    by_bucket: dict[int, list[int]] = {0: [], 1: [], 2: [], 3: []}
    pos_in_run = -1  # < 0: free text
    for _ in range(20000):
        run_before = ctl.run
        k = ctl.next_k()
        accepted = 0
        while accepted < k:
            if pos_in_run < 0:
                right = rng.random() < 0.05
            else:
                right = rng.random() < (0.75 if pos_in_run < 4 else 0.998)
            if not right:
                break
            accepted += 1
            pos_in_run = pos_in_run + 1 if pos_in_run >= 0 else (0 if rng.random() < 0.3 else -1)
        ctl.observe(k, accepted)
        if k > 0:
            bucket = sum(1 for start in (1, 4, 16) if run_before >= start)
            by_bucket[bucket].append(k)
        # The text moves on by the committed tokens; runs end now and then.
        if pos_in_run >= 0 and rng.random() < 0.02:
            pos_in_run = -1
        elif pos_in_run < 0 and rng.random() < 0.03:
            pos_in_run = 0
    mean = {b: sum(ks) / len(ks) for b, ks in by_bucket.items() if ks}
    assert mean[3] >= 12, mean
    assert mean[3] > mean[1] + 3, mean


def test_the_length_is_chosen_within_reach_not_cut_to_it() -> None:
    """Deep in a copy run the best window overall is the longest; a proposer that drafts
    at most 8 must get the best window within 8 (7 drafts: 8 rows, a whole block), not
    the overall choice cut to 8 (9 rows, a block dearer)."""
    rows = [1.0, 1.82, 2.11, 2.31, 2.90, 3.27, 3.43, 2.68, 3.26, 3.62, 3.76, 3.35, 4.00,
            4.2, 4.5, 4.03, 4.66]
    adaptive = AdaptiveK(CostCurve.sanitized(rows), AcceptanceTracker(prior=0.99))
    assert adaptive.next_k() > 8
    assert adaptive.next_k(8) == 7
    assert adaptive.next_k(0) == 0


def test_without_streaks_one_estimate_per_position_whatever_the_last_window_did() -> None:
    """A model's own head does not draft in copy runs: after a fully accepted window its
    controller decides from the same estimates (and learns into them), where prompt
    lookup switches to its optimistic streak estimates."""
    head = AdaptiveK(Q8_0, AcceptanceTracker(prior=0.6), k_max=8, streaks=False)
    lookup = AdaptiveK(Q8_0, AcceptanceTracker(prior=0.6), k_max=8)
    for controller in (head, lookup):
        controller.observe(3, 3)
    assert head.current_tracker() is head.tracker and head.tracker.updates == 1
    assert lookup.current_tracker() is not lookup.tracker
    assert head.acceptances() != lookup.acceptances()


# --- longer windows tried where their positions were never verified -----------------

#: A 1B model's curve on 2 cores, where 3 rows cost what 4 do: at a flat acceptance of
#: 0.85 one draft is best (1.225x) and three come within 2% (1.202x).
PAIRS = [1.0, 1.36, 2.2, 2.2, 3.0, 3.0, 3.8, 3.8]


def _controller(tracker: AcceptanceTracker) -> AdaptiveK:
    return AdaptiveK(CostCurve.sanitized(PAIRS), tracker, streaks=False, draft_cost=0.15)


def test_a_longer_window_is_tried_now_and_then_while_its_positions_are_unverified() -> None:
    """Positions never verified follow the ones before them; windows of one draft never
    verify the second, so without a try now and then the estimate never moves (a head
    whose later drafts are likelier than its first would draft 1 token a step for good:
    seen on a daemon whose earlier requests left a flat pooled estimate)."""
    ak = _controller(AcceptanceTracker(prior=0.85))  # a flat estimate, nothing verified
    ks = [ak.next_k() for _ in range(2 * LONGER_EVERY)]
    assert ks.count(1) == 2 * LONGER_EVERY - 2
    assert [i for i, k in enumerate(ks) if k > 1] == [LONGER_EVERY - 1, 2 * LONGER_EVERY - 1]
    assert all(k == 3 for k in ks if k > 1)  # the next length within reach (3 rows cost 4)


def test_no_longer_window_is_tried_where_verified_positions_say_it_loses() -> None:
    tracker = AcceptanceTracker(prior=0.85)
    for _ in range(4):
        tracker.update(7, 2)  # every position within reach verified: two drafts kept
    assert all(tracker.evidence(i) >= EXPLORED for i in range(3))
    ak = _controller(tracker)
    ks = [ak.next_k() for _ in range(4 * LONGER_EVERY)]
    assert len(set(ks)) == 1  # one length chosen on the estimates alone, no tries
