"""Whether ``auto`` follows the MTP head for a new request, after earlier ones dropped it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.policy.head_choice import HeadChoice


def serve(choice: HeadChoice, n: int) -> list[bool]:
    """Which of the next ``n`` requests would follow the head (none of them ends)."""
    out = []
    for _ in range(n):
        if choice.due:
            out.append(True)
        else:
            choice.skip()
            out.append(False)
    return out


def test_a_head_nobody_dropped_is_followed_by_every_request() -> None:
    choice = HeadChoice()
    for _ in range(10):
        assert choice.due
        choice.ended(dropped=False)


def test_after_a_drop_the_head_is_tried_again_ever_more_rarely() -> None:
    choice = HeadChoice(explore_every=4, max_every=16)
    gaps = []
    for _ in range(5):
        assert choice.due
        choice.ended(dropped=True)
        follows = serve(choice, 40)
        gaps.append(follows.index(True))
    assert gaps == [4, 8, 16, 16, 16]


def test_a_head_kept_to_the_end_is_followed_again_at_once() -> None:
    choice = HeadChoice(explore_every=4)
    choice.ended(dropped=True)
    assert serve(choice, 5) == [False] * 4 + [True]
    choice.ended(dropped=False)
    assert serve(choice, 3) == [True] * 3


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        HeadChoice(explore_every=0)
    with pytest.raises(ValueError):
        HeadChoice(explore_every=8, max_every=4)


@given(st.lists(st.booleans(), max_size=60))
def test_the_head_is_never_skipped_longer_than_max_every(outcomes: list[bool]) -> None:
    choice = HeadChoice(explore_every=2, max_every=8)
    skipped = 0
    for dropped in outcomes:
        while not choice.due:
            choice.skip()
            skipped += 1
            assert skipped <= 8
        skipped = 0
        choice.ended(dropped=dropped)


def test_a_dropped_head_is_explored_by_one_request_at_a_time() -> None:
    """Requests that start together (a burst of clients) while the head stands dropped:
    only the first one that finds it due follows it; the rest wait for its outcome."""
    choice = HeadChoice(explore_every=4, max_every=16)
    choice.ended(dropped=True)
    serve(choice, 4)  # the interval passes
    follows = []
    for _ in range(4):
        if choice.due:
            choice.following()
            follows.append(True)
        else:
            choice.skip()
            follows.append(False)
    assert follows == [True, False, False, False]
    choice.ended(dropped=False)  # the explorer found the head pays again
    assert choice.due


def test_following_a_head_nobody_dropped_changes_nothing() -> None:
    choice = HeadChoice()
    for _ in range(5):
        choice.following()
        assert choice.due
