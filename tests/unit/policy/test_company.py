"""The company check: drafting in shared forwards is held off where it measurably earns
less than plain steps, and tried again later; where it earns more, it goes on."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshd.policy.company import HOLD_STEPS, MIN_STEPS, PLAIN_EVERY, CompanyCheck


def run(check: CompanyCheck, steps: int, *, n: int = 4, drafted_rate: float,
        plain_rate: float = 100.0) -> list[bool]:
    """``steps`` steps of a group whose plan always drafts: whether each one drafted.
    A drafting step commits 2n tokens at ``drafted_rate``, a plain one n tokens at
    ``plain_rate`` (tokens per second)."""
    out = []
    for _ in range(steps):
        drafts = check.may_draft(n)
        tokens = 2 * n if drafts else n
        rate = drafted_rate if drafts else plain_rate
        check.observe(n, drafted=drafts, tokens=tokens, seconds=tokens / rate)
        out.append(drafts)
    return out


def test_drafting_that_pays_goes_on_with_a_plain_step_now_and_then() -> None:
    check = CompanyCheck()
    drafted = run(check, 200, drafted_rate=130.0)
    assert check.holds == 0
    # Every other step is plain until the plain rate is known, then one in PLAIN_EVERY + 1.
    assert drafted[:2 * MIN_STEPS] == [True, False] * MIN_STEPS
    plain = drafted.count(False)
    assert 200 // (PLAIN_EVERY + 1) <= plain <= MIN_STEPS + 200 // PLAIN_EVERY


def test_drafting_that_loses_is_held_off_and_tried_again_on_fresh_evidence() -> None:
    check = CompanyCheck()
    drafted = run(check, 400, drafted_rate=80.0)
    assert check.holds >= 2
    held = [False] * HOLD_STEPS
    first_hold = next(i for i in range(len(drafted)) if drafted[i:i + HOLD_STEPS] == held)
    assert first_hold <= 2 * MIN_STEPS + 1  # judged once both arms have MIN_STEPS
    # Each retry drafts until its fresh evidence says so again, then holds at once.
    assert drafted.count(True) <= MIN_STEPS * (check.holds + 1)


def test_group_sizes_are_judged_apart() -> None:
    check = CompanyCheck()
    run(check, 200, n=4, drafted_rate=80.0)
    assert check.holds >= 1
    holds = check.holds
    drafted = run(check, 40, n=2, drafted_rate=130.0)  # pairs: drafting pays
    assert check.holds == holds and drafted.count(True) > 30


def test_no_judgement_before_both_arms_have_evidence() -> None:
    check = CompanyCheck()
    for _ in range(MIN_STEPS + PLAIN_EVERY):
        check.observe(4, drafted=True, tokens=4, seconds=1.0)  # 4 tok/s: dreadful
    assert check.holds == 0  # no plain step measured yet
    check.forget()
    assert check.may_draft(4)


@given(st.lists(st.tuples(st.integers(1, 6), st.booleans(), st.integers(0, 40),
                          st.floats(0.0, 2.0)), max_size=300))
def test_any_history_leaves_a_valid_answer(steps: list[tuple[int, bool, int, float]]) -> None:
    """Whatever steps it is fed (lone requests and empty steps ignored), the check
    answers, and drafting is never off for longer than a hold and one plain step."""
    check = CompanyCheck()
    for n, drafted, tokens, seconds in steps:
        check.may_draft(n)
        check.observe(n, drafted=drafted, tokens=tokens, seconds=seconds)
    for n in range(1, 7):
        assert any(check.may_draft(n) for _ in range(HOLD_STEPS + 2))
