"""The verify-cost model follows what forwards actually cost, and rejects noisy curves."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.policy.costs import MIN_SAMPLES, REBUILD_EVERY, WINDOW, CostModel, is_plausible

Q4_1 = [1.0, 1.75, 2.32, 3.40, 3.9, 4.3, 4.7, 5.0, 5.4]


def test_plausibility() -> None:
    assert is_plausible(Q4_1)
    # Curves measured here while other jobs hogged both cores:
    assert not is_plausible([1.0, 0.898, 0.545, 1.228, 2.879, 3.259, 2.146, 2.125, 3.484])
    assert not is_plausible([1.0, 1.50, 1.55, 0.998, 1.79, 3.34, 3.49, 1.68, 3.88])
    assert not is_plausible([1.0])
    assert not is_plausible([1.0, 1.8, 2.2, 2.5, 3.1, 3.6, 4.1, 4.4, 18.3])


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
    assert curve.cost(2) == pytest.approx(2.32)  # no samples: the calibrated ratio
    assert curve.cost(0) == 1.0


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
