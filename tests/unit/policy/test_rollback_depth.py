"""The rollback depth follows what requests do with speculation (sans-I/O rules)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.policy.rollback_depth import (
    ACTIVE_SHARE,
    QUIET_REQUESTS,
    RequestOutcome,
    RollbackDepth,
)

PLAIN = RequestOutcome(tokens=100, accepted=0)
SPECULATED = RequestOutcome(tokens=100, accepted=60)


def test_snapshots_are_dropped_after_quiet_requests_in_a_row() -> None:
    depth = RollbackDepth(8)
    for _ in range(QUIET_REQUESTS - 1):
        depth.ended(PLAIN)
        assert depth.wanted == 8
    depth.ended(SPECULATED)  # one that speculated starts the count again
    for _ in range(QUIET_REQUESTS - 1):
        depth.ended(PLAIN)
    assert depth.wanted == 8
    depth.ended(PLAIN)
    assert depth.wanted == 0
    depth.switched(0, decode_s=0.040)
    assert depth.depth == 0 and depth.wanted == 0


def test_a_request_that_speculates_brings_the_snapshots_back() -> None:
    depth = RollbackDepth(3, quiet_requests=1)
    depth.ended(PLAIN)
    depth.switched(0, decode_s=None)
    for _ in range(5):
        depth.ended(PLAIN)
        assert depth.wanted == 0
    depth.ended(SPECULATED)
    assert depth.wanted == 3
    depth.switched(3, decode_s=0.036)
    assert depth.wanted == 3 and depth.quiet == 0


def test_a_dropped_head_counts_as_quiet_unless_it_pays_with_snapshots() -> None:
    dropped = RequestOutcome(tokens=100, accepted=30, dropped_head=True)
    assert not dropped.speculated
    assert RequestOutcome(tokens=100, accepted=3, dropped_head=True,
                          head_pays_with_snapshots=True).speculated
    assert not RequestOutcome(tokens=0, accepted=0).speculated


def test_a_dropped_head_drops_the_snapshots_at_once() -> None:
    depth = RollbackDepth(8)
    depth.ended(RequestOutcome(tokens=100, accepted=30, dropped_head=True))
    assert depth.wanted == 0
    depth.switched(0, decode_s=0.040)
    assert "MTP head" in depth.describe()


def test_snapshots_not_expected_are_dropped_until_a_request_speculates() -> None:
    depth = RollbackDepth(8)
    depth.not_expected()
    assert depth.wanted == 0
    depth.switched(0, decode_s=None)
    assert "default proposer is off" in depth.describe()
    depth.ended(PLAIN)
    assert depth.wanted == 0
    depth.ended(SPECULATED)
    assert depth.wanted == 8


@given(st.integers(1, 400), st.integers(0, 400))
def test_speculated_means_a_share_of_accepted_drafts(tokens: int, accepted: int) -> None:
    accepted = min(accepted, tokens)
    outcome = RequestOutcome(tokens=tokens, accepted=accepted)
    assert outcome.speculated == (accepted >= ACTIVE_SHARE * tokens)


def test_snapshot_overhead_is_measured_from_both_depths() -> None:
    depth = RollbackDepth(8, quiet_requests=1)
    assert depth.snapshot_overhead(0.036) == 0.0  # never ran without them: unknown
    depth.ended(PLAIN)
    depth.switched(0, decode_s=0.039)
    assert depth.snapshot_overhead(0.036) == pytest.approx(0.039 / 0.036 - 1.0)
    assert depth.snapshot_overhead(None) == 0.0
    assert depth.snapshot_overhead(0.041) == 0.0  # noise never makes it negative


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RollbackDepth(0)
    with pytest.raises(ValueError):
        RollbackDepth(4, quiet_requests=0)


def test_a_rebuild_that_did_not_get_its_depth_stops_the_switching() -> None:
    """llama.cpp could not make the context with snapshots (memory) and the old depth
    came back: trying again on every request would fail alike, dropping the cached
    sessions each time."""
    depth = RollbackDepth(8, quiet_requests=1)
    depth.ended(PLAIN)
    depth.switched(0, decode_s=0.040)
    assert not depth.stuck and "dropped" in depth.describe()
    depth.ended(SPECULATED)
    assert depth.wanted == 8
    depth.switched(0, decode_s=0.038)  # asked for 8, got 0
    assert depth.stuck and "could not" in depth.describe()
    for _ in range(5):
        depth.ended(SPECULATED)
        assert depth.wanted == 0
