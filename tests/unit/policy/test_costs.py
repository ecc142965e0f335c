"""The verify-cost model follows what forwards actually cost, and rejects noisy curves."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.policy.acceptance import PooledAcceptance
from meshd.policy.costs import (
    MAX_SHIFT,
    MIN_SAMPLES,
    REBUILD_EVERY,
    WINDOW,
    CostCurve,
    CostModel,
    RepairCost,
    choose_k,
    is_plausible,
    ratios,
    spot_agrees,
    within_rows,
)

Q4_1 = [1.0, 1.75, 2.32, 3.40, 3.9, 4.3, 4.7, 5.0, 5.4]


def test_a_cached_curve_is_checked_on_its_first_sizes_by_their_extra_cost() -> None:
    # Measured here for a 1B model: a calibration taken while other work ran, and a
    # quiet re-measurement of its first sizes.
    skewed, quiet = [1.0, 1.19, 2.04, 1.94], [1.0, 1.45, 2.24, 2.35]
    assert is_plausible(skewed)  # plausible, yet its 2-row forward is far too cheap
    assert not spot_agrees(skewed, quiet)
    # Two quiet calibrations of the same model, minutes apart, agree.
    assert spot_agrees([1.0, 1.39, 2.03, 2.08], quiet)
    assert spot_agrees(quiet, quiet[:2])  # only the sizes measured are compared


@given(st.lists(st.floats(1.0, 8.0), min_size=2, max_size=9))
def test_a_curve_agrees_with_itself_and_not_with_one_twice_as_dear(extra: list[float],
                                                                    ) -> None:
    curve = [1.0, *extra]
    assert spot_agrees(curve, curve)
    assert not spot_agrees(curve, [1.0, *(1.0 + 2 * (c - 1.0) + 0.25 for c in extra)])


def test_plausibility() -> None:
    assert is_plausible(Q4_1)
    # Curves measured here while other jobs hogged both cores:
    assert not is_plausible([1.0, 0.898, 0.545, 1.228, 2.879, 3.259, 2.146, 2.125, 3.484])
    assert not is_plausible([1.0, 1.50, 1.55, 0.998, 1.79, 3.34, 3.49, 1.68, 3.88])
    assert not is_plausible([1.0])
    # Forwards of whole blocks of rows cost less than slightly narrower ones (1B Q8_0).
    assert is_plausible([1.0, 1.82, 2.11, 2.31, 2.90, 3.27, 3.43, 2.68, 3.26, 3.62, 3.76, 3.35])
    assert not is_plausible([1.0, 1.8, 2.2, 2.5, 3.1, 3.6, 4.1, 4.4, 18.3])


def test_a_contended_curve_is_capped_at_its_rows() -> None:
    """Measured while other work ran: a 2-row forward at 2.94 decodes. Kept as is, the
    curve would price every window out; capped, no size costs more than its rows."""
    loaded = [1.0, 2.94, 3.3, 3.1, 6.9]
    assert within_rows(loaded) == [1.0, 2.0, 3.0, 3.1, 5.0]
    assert within_rows(Q4_1) == Q4_1
    capped = ratios(CostCurve.sanitized(within_rows(loaded)), 0.95, 4)
    raw = ratios(CostCurve.sanitized(loaded), 0.95, 4)
    assert all(c >= r for c, r in zip(capped, raw, strict=True))
    assert capped[1] > raw[1]


def test_forget_drops_the_samples_and_keeps_the_calibration() -> None:
    model = CostModel(Q4_1)
    for _ in range(WINDOW):
        model.record(1, 0.010)
        model.record(3, 0.040)
    assert model.decode_seconds() == pytest.approx(0.010)
    assert model.curve().cost(2) != pytest.approx(Q4_1[2])
    model.forget()
    assert model.decode_seconds() is None
    assert model.curve().costs == CostCurve.sanitized(Q4_1).costs


def test_online_samples_replace_the_calibration() -> None:
    model = CostModel(Q4_1)
    assert model.curve().costs == pytest.approx(Q4_1)
    # The machine turns out to verify 2 rows almost as cheaply as 1 (e.g. a GPU).
    for _ in range(max(MIN_SAMPLES, REBUILD_EVERY)):
        model.record(1, 0.010)
        model.record(2, 0.011)
        model.record(99, 5.0)  # beyond the curve: ignored
    curve = model.curve()
    assert curve.cost(1) == pytest.approx(1.1)
    # No samples of its own: the calibrated ratio. Cheaper than calibrated needs each
    # size's own evidence (a curve too cheap drafts where it loses).
    assert curve.cost(2) == pytest.approx(2.32)
    assert curve.cost(0) == 1.0


def test_sizes_not_yet_measured_follow_the_measured_ones() -> None:
    """Windows at a request's context cost more than the short calibration measured
    (alike at every size): a few forwards of the sizes actually used make the whole
    curve dearer, not only those sizes; until there are enough of them, nothing moves."""
    model = CostModel(Q4_1)
    for _ in range(MIN_SAMPLES):
        model.record(1, 0.010)
    for rows in (2, 5, 9):  # one forward each: no size has a median of its own
        model.record(rows, 0.010 * (1.0 + 1.3 * (Q4_1[rows - 1] - 1.0)))
    for _ in range(REBUILD_EVERY):
        model.record(99, 1.0)  # ignored sizes count nothing
    assert model.curve().costs == pytest.approx(Q4_1)  # too few multi-row forwards
    for rows in (3, 4, 6):
        model.record(rows, 0.010 * (1.0 + 1.3 * (Q4_1[rows - 1] - 1.0)))
    for _ in range(REBUILD_EVERY):
        model.record(1, 0.010)
    curve = model.curve()
    for k in range(1, len(Q4_1)):
        assert curve.cost(k) == pytest.approx(1.0 + 1.3 * (Q4_1[k] - 1.0))
    # A measurement far off (a stalled forward) moves the curve at most MAX_SHIFT-fold.
    stalled = CostModel(Q4_1)
    for rows in range(2, 2 + MIN_SAMPLES):
        stalled.record(1, 0.010)
        stalled.record(rows, 1.0)
    for _ in range(REBUILD_EVERY):
        stalled.record(1, 0.010)
    assert stalled.curve().cost(8) == pytest.approx(1.0 + MAX_SHIFT * (Q4_1[8] - 1.0))


@given(seconds=st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=3 * WINDOW))
def test_only_the_last_window_of_samples_counts(seconds: list[float]) -> None:
    """The online curve is built from the most recent WINDOW samples per size only (a
    busy spell long ago no longer counts once enough new forwards were measured)."""
    model = CostModel(Q4_1)
    for t in seconds:
        model.record(1, t)
    recent = seconds[-WINDOW:]
    expected = sorted(recent)[len(recent) // 2] if len(recent) % 2 else (
        sum(sorted(recent)[len(recent) // 2 - 1: len(recent) // 2 + 1]) / 2)
    if len(recent) >= MIN_SAMPLES:
        assert model.decode_seconds() == pytest.approx(expected)
    else:
        assert model.decode_seconds() is None


# The 1B hybrid synthetic model measured here (quiet machine): 2 rows 1.83x, 4 rows
# 2.97x, 33 rows 7.26x one decode; sizes between interpolated.
HYBRID_1B = CostCurve.from_row_costs({2: 1.83, 4: 2.97, 9: 4.3, 13: 5.0, 33: 7.26})


def test_windows_within_the_in_place_rollback_repair_for_free() -> None:
    repair = RepairCost(rollback_window=8, checkpoint=0.3)
    for k in range(9):
        assert repair.expected(HYBRID_1B, 0.7, k) == 0.0
    # Beyond it: the checkpoint always, plus a replay of the kept rows where more rows
    # are rejected than the in-place rollback undoes (k - a > 8: a < 4 of 12 accepted).
    assert repair.expected(HYBRID_1B, 1.0, 12) == pytest.approx(0.3)
    assert repair.expected(HYBRID_1B, 0.0, 12) == pytest.approx(0.3 + HYBRID_1B.cost(0))
    acc = 0.9
    want = 0.3 + sum(acc ** a * (1 - acc) * HYBRID_1B.cost(a) for a in range(4))
    assert repair.expected(HYBRID_1B, acc, 12) == pytest.approx(want)
    # Without an in-place rollback every rejection replays.
    want = sum(acc ** a * (1 - acc) * HYBRID_1B.cost(a) for a in range(12))
    assert RepairCost(rollback_window=0).expected(HYBRID_1B, acc, 12) == pytest.approx(want)


def test_repairs_keep_a_recurrent_model_from_drafting_past_its_rollback() -> None:
    """At acceptance 0.9 the free-repair objective tempts a long window on a curve that
    flattens; with the restore-and-replay charged, windows stay within the rollback."""
    free = choose_k(HYBRID_1B, 0.9, 32)
    charged = choose_k(HYBRID_1B, 0.9, 32, repair=RepairCost(rollback_window=8))
    assert free > 8
    assert 0 < charged <= 8
    # An attention-only model (no repair cost) is unchanged by the option's absence.
    assert ratios(HYBRID_1B, 0.9, 32) == ratios(HYBRID_1B, 0.9, 32, repair=None)
    # The charged ratio never exceeds the free one.
    rf = ratios(HYBRID_1B, 0.9, 32)
    rc = ratios(HYBRID_1B, 0.9, 32, repair=RepairCost(rollback_window=8, checkpoint=0.1))
    assert all(c <= f for c, f in zip(rc, rf, strict=True))
    assert rc[:9] == rf[:9]


def test_pooled_acceptance_is_conditional_and_forgets_old_requests() -> None:
    pool = PooledAcceptance(decay=0.5, min_drafts=10)
    assert pool.conditional() == [] and pool.estimates() == []
    pool.add([0, 0], [0, 0])  # a request that drafted nothing adds nothing
    assert pool.drafted == 0
    # 8 windows drafted 2 tokens: 6 accepted the first, 3 of those the second too.
    pool.add([6, 3], [8, 8])
    assert pool.conditional() == pytest.approx([0.75, 0.5])
    assert pool.estimates() == [pool.conditional()]
    # A later request that accepted everything weighs twice as much as the old one.
    pool.add([8, 8, 8], [8, 8, 8])
    assert pool.drafted == pytest.approx(8 + 24)
    u0, u1 = (3 + 8) / (4 + 8), (1.5 + 8) / (4 + 8)
    assert pool.conditional() == pytest.approx([u0, u1 / u0, 1.0])


def test_pooled_prior_is_the_mean_conditional_acceptance_kept_off_the_bounds() -> None:
    pool = PooledAcceptance(min_drafts=10)
    assert pool.prior() is None
    pool.add([6, 3], [8, 8])
    assert pool.prior() == pytest.approx((0.75 + 0.5) / 2)
    pool.add([100, 100], [100, 100])
    assert pool.prior() == 0.95


def test_row_cost_of_forwards_wider_than_the_curve() -> None:
    """Several requests' windows in one forward: wider than the calibrated curve."""
    model = CostModel(Q4_1)  # 9 rows at most
    assert model.row_cost(1) == 1.0
    assert model.row_cost(9) == pytest.approx(Q4_1[8])
    # Unmeasured: every further row at the curve's average extra cost per row.
    per_row = (Q4_1[8] - 1.0) / 8
    assert model.row_cost(13) == pytest.approx(Q4_1[8] + 4 * per_row)
    # Measured (one-row decodes give the scale): the median is used, and sizes between
    # the curve's end and a measured width are interpolated.
    for _ in range(MIN_SAMPLES):
        model.record(1, 0.010)
        model.record(17, 0.060)
    assert model.row_cost(17) == pytest.approx(6.0)
    assert model.row_cost(13) == pytest.approx(Q4_1[8] + (6.0 - Q4_1[8]) / 2)
    assert model.row_cost(21) == pytest.approx(6.0 + 4 * 5.0 / 16)
    model.forget()
    assert model.row_cost(17) == pytest.approx(Q4_1[8] + 8 * per_row)
    with pytest.raises(ValueError):
        model.row_cost(0)


def test_forwards_of_several_sequences_are_priced_apart_from_the_curve() -> None:
    """A group's forward costs more than one sequence's of as many rows; counted in
    the curve, it would make a request left alone afterwards draft too little."""
    model = CostModel(Q4_1)
    for _ in range(REBUILD_EVERY * MIN_SAMPLES):
        model.record(1, 0.010)
        model.record(4, 0.034)  # one request's 4-row window
        model.record(4, 0.050, sequences=4)  # four requests' 1-row decodes
        model.record(8, 0.070, sequences=4)  # four requests' 2-row windows
    curve = model.curve()
    assert curve.forward_costs[3] == pytest.approx(3.4)
    assert model.row_cost(4) == pytest.approx(3.4)
    # A group is priced from the group forwards measured at its width ...
    assert model.row_cost(4, 4) == pytest.approx(5.0)
    assert model.row_cost(8, 4) == pytest.approx(7.0)
    # ... between them linearly, and where none of its width were measured, from the
    # curve (two sequences: nothing of theirs measured).
    assert model.row_cost(6, 4) == pytest.approx(6.0)
    assert model.row_cost(8, 2) == pytest.approx(Q4_1[7])
    with pytest.raises(ValueError):
        model.row_cost(4, 0)


@given(rows=st.integers(1, 200))
def test_row_cost_never_falls_as_rows_grow(rows: int) -> None:
    model = CostModel(Q4_1)
    assert model.row_cost(rows + 1) >= model.row_cost(rows) >= 1.0


@given(st.lists(st.floats(0.0, 3.0), min_size=1, max_size=16), st.floats(0.5, 20.0))
def test_the_longest_draft_within_a_cost_is_the_last_that_fits(extra: list[float],
                                                               bound: float) -> None:
    curve = CostCurve.sanitized([1.0, *(1.0 + sum(extra[:i + 1]) for i in range(len(extra)))])
    k = curve.longest_within(bound)
    assert 0 <= k <= curve.max_k
    assert k == 0 or curve.cost(k) <= bound
    assert k == curve.max_k or curve.cost(k + 1) > bound


def test_two_decodes_of_the_machines_curve_hold_a_one_token_draft() -> None:
    # Q4_1 on the benchmark machine: a 2-row window costs 1.75 decodes, a 3-row 2.32
    assert CostCurve.sanitized(Q4_1).longest_within(2.0) == 1
