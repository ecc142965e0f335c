"""The cost calibration in pieces: quiet pieces make the curve, busy ones are dropped and
waited out, a curve measured under load is never cached, a cached one is checked and
kept unless a quiet check disagrees. The machine is simulated: each piece's forwards
are priced by a true curve, and a busy piece's times are what the 2-core Xeon measured
beside a busy process (one-row forwards 30 times slower, so wide ones look cheap)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.policy.calibration import (
    MAX_SAMPLES_FACTOR,
    PIECE_S,
    REPS,
    RETRY_FIRST_S,
    RETRY_MAX_S,
    SPOT_REPS,
    SYNC_RETRIES,
    Calibration,
    Phase,
    Piece,
    Timed,
)
from meshd.policy.costs import conservative_prior, is_plausible

TRUE = [1.0, 1.75, 2.32, 3.40, 3.9, 4.3, 4.7, 5.0, 5.4]  # SmolLM2 Q4_1, 2 threads
UNIT_S = 0.011
QUIET = dict(wall_s=0.1, cpu_s=0.2, threads=2, cpus=2, others_s=0.001, resolution_s=0.04)
BUSY = dict(wall_s=0.1, cpu_s=0.1, threads=2, cpus=2, others_s=0.099, resolution_s=0.04)


def load(kind: dict[str, float]):  # type: ignore[no-untyped-def]
    from meshd.policy.load import Load

    return Load(**kind)  # type: ignore[arg-type]


def timed(piece: Piece, curve: list[float], *, busy: bool = False,
          noise: random.Random | None = None) -> Timed:
    if piece.phase is Phase.MTP:
        return Timed(overheads=(0.3,) * piece.steps, draft_costs=(0.2,) * piece.steps)
    times = []
    for rows in piece.rows:
        t = UNIT_S * curve[rows - 1] * (noise.uniform(0.97, 1.03) if noise else 1.0)
        if busy and rows == 1:
            t *= 30  # the descheduled thread: a one-row forward 30 times slower
        times.append((rows, t))
    return Timed(times=tuple(times))


def drive(cal: Calibration, curve: list[float], busy: list[bool] | None = None,
          noise: random.Random | None = None, limit: int = 2000) -> list[Piece]:
    pieces = []
    now = 0.0
    busy = list(busy or [])
    while not cal.done and len(pieces) < limit:
        now += cal.wait_s(now)
        piece = cal.next_piece()
        assert piece is not None
        pieces.append(piece)
        b = busy.pop(0) if busy else False
        cal.feed(piece, timed(piece, curve, busy=b, noise=noise), load(BUSY if b else QUIET), now)
        now += 0.01
    return pieces


def test_a_fresh_calibration_measures_every_size_from_quiet_pieces_and_caches_it() -> None:
    cal = Calibration(8)
    assert cal.outcome().costs is None  # the runtime uses the conservative prior meanwhile
    pieces = drive(cal, TRUE)
    out = cal.outcome()
    assert out.costs == pytest.approx(TRUE) and out.cache
    assert cal.busy_pieces == 0 and not cal.notes
    # Small pieces: past the first (which learns the one-row time), none holds more than
    # PIECE_S of forwards, estimated dear (a size not measured yet at its rows).
    for piece in pieces[1:]:
        sizes = [r for r in piece.rows if r > 1]
        cost = sum(UNIT_S * TRUE[r - 1] for r in piece.rows)
        assert cost <= PIECE_S * 1.05 or len(set(sizes)) == 1, piece


def test_busy_pieces_are_dropped_and_waited_out_and_change_nothing() -> None:
    cal = Calibration(8)
    pattern = [True, True, True, False, True, False] * 8
    drive(cal, TRUE, busy=pattern)
    out = cal.outcome()
    assert out.costs == pytest.approx(TRUE) and out.cache
    assert cal.busy_pieces == pattern.count(True) or cal.busy_pieces > 0


def test_waits_after_busy_pieces_double_and_reset_after_a_quiet_one() -> None:
    cal = Calibration(4)
    waits = []
    for busy in [True, True, True, True, True, True, True, False]:
        piece = cal.next_piece()
        assert piece is not None
        cal.feed(piece, timed(piece, TRUE, busy=busy), load(BUSY if busy else QUIET), 100.0)
        waits.append(cal.wait_s(100.0))
    assert waits == [RETRY_FIRST_S, 2.0, 4.0, 8.0, 16.0, RETRY_MAX_S, RETRY_MAX_S, 0.0]


def test_a_machine_that_stays_busy_never_caches_a_curve() -> None:
    """Waiting for quiet: nothing measured under load is ever used or kept."""
    cal = Calibration(8)
    drive(cal, TRUE, busy=[True] * 300, limit=300)
    assert not cal.done
    out = cal.outcome()
    assert out.costs is None and not out.cache


def test_a_run_that_cannot_wait_gives_up_on_a_busy_machine_and_caches_nothing() -> None:
    """In-process, beside a busy process: a few tries, then the prior (no drafts) for
    this run, and a note that says why; never a curve measured under load."""
    cal = Calibration(8, wait_for_quiet=False)
    pieces = drive(cal, TRUE, busy=[True] * 1000)
    out = cal.outcome()
    assert cal.done and cal.tainted and len(pieces) == SYNC_RETRIES + 1
    assert out.costs is None and not out.cache
    assert [event for event, _ in cal.notes] == ["calibration_skipped"]


def test_without_waiting_a_moments_company_is_run_again_before_it_counts() -> None:
    cal = Calibration(8, wait_for_quiet=False)
    drive(cal, TRUE, busy=[True] * SYNC_RETRIES)
    assert not cal.tainted and cal.outcome().cache


def test_a_piece_cut_short_counts_as_busy() -> None:
    cal = Calibration(4)
    first = cal.next_piece()
    assert first is not None
    cal.feed(first, timed(first, TRUE), load(QUIET), 0.0)
    piece = cal.next_piece()
    assert piece is not None and piece.budget_s is not None
    cal.feed(piece, Timed(times=((1, 0.5),), cut=True), load(QUIET), 1.0)
    assert cal.busy_pieces == 1 and cal.wait_s(1.0) == RETRY_FIRST_S


def test_a_cached_curve_that_a_quiet_check_confirms_is_kept_without_a_write() -> None:
    cal = Calibration(8, TRUE)
    pieces = drive(cal, TRUE)
    assert {p.phase for p in pieces} == {Phase.CHECK}
    assert max(r for p in pieces for r in p.rows) == 4  # only the first sizes
    out = cal.outcome()
    assert out.costs == tuple(TRUE) and not out.cache and not cal.notes


def test_a_cached_curve_that_a_quiet_check_contradicts_is_measured_again() -> None:
    skewed = [1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08]
    assert is_plausible(skewed)
    cal = Calibration(8, skewed)
    drive(cal, TRUE)
    out = cal.outcome()
    assert out.costs == pytest.approx(TRUE) and out.cache
    assert [event for event, _ in cal.notes] == ["recalibrating"]


def test_a_check_under_load_never_throws_the_cached_curve_away() -> None:
    """The failure measured in production: a restart beside a busy process read
    c(1)=0.66 in its check and measured for 551 s. Waiting for quiet, busy checks are
    dropped; without waiting, a busy check keeps the cached curve."""
    waiting = Calibration(8, TRUE)
    drive(waiting, TRUE, busy=[True] * 20)
    assert waiting.outcome().costs == tuple(TRUE) and not waiting.notes
    assert waiting.busy_pieces == 20
    hurried = Calibration(8, TRUE, wait_for_quiet=False)
    drive(hurried, TRUE, busy=[True] * 100)
    assert hurried.done and hurried.outcome().costs == tuple(TRUE)
    assert not hurried.outcome().cache and not hurried.notes


def test_an_implausible_cache_or_one_of_other_sizes_is_measured() -> None:
    assert Calibration(8, [1.0, 0.66, 2.0, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5]).phase is Phase.CURVE
    assert Calibration(8, TRUE[:5]).phase is Phase.CURVE


def test_the_mtp_head_is_measured_first_in_pieces() -> None:
    cal = Calibration(4, has_mtp=True)
    pieces = drive(cal, TRUE)
    assert pieces[0].phase is Phase.MTP
    assert sum(p.steps for p in pieces if p.phase is Phase.MTP) == 15
    assert cal.outcome().mtp == (0.3, 0.2)
    failed = Calibration(4, has_mtp=True)
    piece = failed.next_piece()
    assert piece is not None
    failed.feed(piece, Timed(failed=True), load(QUIET), 0.0)
    assert failed.phase is Phase.CURVE and failed.outcome().mtp is None


def test_a_repeat_that_disagrees_asks_for_more_samples() -> None:
    cal = Calibration(1)
    # Five quiet ratios of a 2-row forward, two far off.
    for ratio in [1.75, 1.74, 3.5, 1.76, 3.6]:
        piece = Piece(Phase.CURVE, rows=(1, 2, 1))
        cal.feed(piece, Timed(times=((1, 0.01), (2, 0.01 * ratio), (1, 0.01))),
                 load(QUIET), 0.0)
    assert not cal.done
    for _ in range(MAX_SAMPLES_FACTOR * REPS):
        piece = Piece(Phase.CURVE, rows=(1, 2, 1))
        cal.feed(piece, Timed(times=((1, 0.01), (2, 0.0175), (1, 0.01))), load(QUIET), 0.0)
        if cal.done:
            break
    assert cal.done and cal.outcome().costs == pytest.approx((1.0, 1.75))


def test_an_implausible_quiet_measurement_is_taken_again_then_capped_and_not_cached() -> None:
    flat = [1.0, 0.9, 0.9, 0.9, 0.9]  # a 2-row forward cheaper than one row
    cal = Calibration(4)
    drive(cal, flat)
    out = cal.outcome()
    assert cal.restarts > 1 and cal.done and not out.cache
    assert out.costs is not None and all(c <= k + 1 for k, c in enumerate(out.costs))


def test_the_prior_never_lets_a_window_pay() -> None:
    from meshd.policy.costs import CostCurve, speedup_limit

    prior = CostCurve.sanitized(conservative_prior(32))
    for acc in (0.5, 0.9, 0.999, 1.0):
        k, speedup = speedup_limit(prior, acc)
        assert speedup <= 1.0 + 1e-12 and k == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.05, 1.2), min_size=1, max_size=12), st.randoms(use_true_random=False),
       st.lists(st.booleans(), max_size=200))
def test_busy_pieces_at_any_moment_never_change_the_curve(
        steps: list[float], rng: random.Random, busy: list[bool]) -> None:
    curve = [1.0]
    for s in steps:
        curve.append(curve[-1] + s)
    if not is_plausible(curve):
        return
    quiet_only = Calibration(len(steps))
    drive(quiet_only, curve)
    mixed = Calibration(len(steps))
    drive(mixed, curve, busy=busy)
    assert mixed.done
    assert mixed.outcome().costs == pytest.approx(quiet_only.outcome().costs)
    assert mixed.outcome().cache


def test_pieces_of_a_tiny_model_hold_several_rounds() -> None:
    cal = Calibration(4)
    tiny = 0.0002 / UNIT_S
    first = cal.next_piece()
    assert first is not None
    cal.feed(first, Timed(times=tuple((r, 0.0002 * TRUE[r - 1]) for r in first.rows)),
             load(QUIET), 0.0)
    piece = cal.next_piece()
    assert piece is not None
    assert piece.rows.count(5) == REPS, (piece, tiny)
    assert SPOT_REPS == 3


def test_a_recalibration_replaces_the_prior_in_the_same_cost_model() -> None:
    """Requests running when the idle calibration finishes hold the runtime's cost
    model: the measured curve replaces the prior in it, the forwards recorded stay."""
    from meshd.policy.costs import MIN_SAMPLES, CostModel

    model = CostModel(conservative_prior(8))
    heard: list[tuple[int, float, int]] = []
    model.listener = lambda rows, seconds, sequences: heard.append((rows, seconds, sequences))
    for _ in range(MIN_SAMPLES):
        model.record(1, 0.011)
    assert heard[-1] == (1, 0.011, 1) and len(heard) == MIN_SAMPLES
    assert model.curve().costs[1] == 2.0
    model.recalibrated(TRUE)
    assert model.curve().forward_costs[1] == pytest.approx(1.75)
    assert model.decode_seconds() == pytest.approx(0.011)
    with pytest.raises(ValueError):
        model.recalibrated(TRUE[:3])
