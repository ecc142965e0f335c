"""Tests for the sans-I/O speculation decision (meshd.policy.decision).

Three layers:

* a closed-form oracle for the commit walk (how many tokens, which finish), written
  differently from the implementation's loop, checked exhaustively on small windows
  and by hypothesis on random ones;
* a reference model of the runtime state ("the KV as a list of tokens", with a
  checkpoint and an in-place rollback that enforce llama.cpp's preconditions) that
  applies each repair and proves that rejected drafts leave no trace;
* unit tests for the named situations (drafted EOG, budget inside a window, stop
  string mid-window, zero-length window, the rollback trap, validation).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.daemon.engine.stopping import StopResult, cut_at_stop
from meshd.policy.decision import (
    Decision,
    FinishReason,
    Prefix,
    Repair,
    RepairCaps,
    RepairKind,
    UnrepairableWindow,
    accepted_prefix,
    decide,
    needs_checkpoint,
    settle,
)

EOG = 99

# ---------------------------------------------------------------------------------
# Reference model of the runtime state.


class IllegalRepair(AssertionError):
    """The repair asked the reference runtime for something the real one can't do."""


@dataclass
class ReferenceState:
    """The model state as the list of tokens it has consumed, position by position.

    ``recurrent`` states refuse a trim (an SSM state cannot forget a suffix); they can
    roll back in place at most ``rollback_window`` tokens and at most
    ``len(window) - 1`` of the window just decoded (the llama.cpp trap), or restore
    a checkpoint taken before the window.
    """

    tokens: list[int]
    recurrent: bool
    rollback_window: int
    checkpoint: list[int] | None = None
    last_decode: int = 0
    discarded: bool = False

    def decode(self, window: Sequence[int], *, checkpoint: bool) -> None:
        if checkpoint:
            self.checkpoint = list(self.tokens)
        self.tokens.extend(window)
        self.last_decode = len(window)

    def apply(self, repair: Repair) -> None:
        kind = repair.kind
        if kind is RepairKind.RETIRE:
            if repair.remove != 0 or repair.replay:
                raise IllegalRepair("retire removes nothing")
            self.checkpoint = None
        elif kind is RepairKind.TRIM:
            if self.recurrent:
                raise IllegalRepair("a recurrent state cannot be trimmed")
            if repair.keep_to > len(self.tokens) - 1:
                raise IllegalRepair("trim removes nothing")
            del self.tokens[repair.keep_to :]
        elif kind is RepairKind.ROLLBACK_IN_PLACE:
            if not self.recurrent:
                raise IllegalRepair("in-place rollback is for recurrent state")
            if not 1 <= repair.remove <= self.rollback_window:
                raise IllegalRepair("rollback beyond the runtime's window")
            if repair.remove > self.last_decode - 1:
                raise IllegalRepair("llama.cpp trap: at most len(window) - 1 tokens")
            del self.tokens[len(self.tokens) - repair.remove :]
        elif kind is RepairKind.RESTORE_AND_REPLAY:
            if self.checkpoint is None:
                raise IllegalRepair("restore without a checkpoint")
            self.tokens = [*self.checkpoint, *repair.replay]
            self.checkpoint = None
        elif kind is RepairKind.DISCARD:
            self.discarded = True
            self.tokens = []
        else:  # pragma: no cover
            raise AssertionError(kind)
        if not self.discarded and len(self.tokens) != repair.keep_to:
            raise IllegalRepair(f"{kind}: state length {len(self.tokens)} != keep_to")


# ---------------------------------------------------------------------------------
# Scenarios and the closed-form oracle.


@dataclass
class Scenario:
    history: list[int]
    last: int
    draft: list[int]
    predictions: list[int]
    remaining: int
    eog: frozenset[int]
    caps: RepairCaps
    cancelled_at: int | None = None
    stop_indices: frozenset[int] = frozenset()
    stop_tokens: frozenset[int] = frozenset()
    calls: list[tuple[int, int]] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.draft)

    @property
    def base(self) -> int:
        return len(self.history)

    def text_of(self, token: int) -> str:
        self.calls.append((len(self.calls), token))
        return "t"

    def push(self, text: str) -> StopResult:
        j, token = self.calls[-1]
        return StopResult(text, stopped=j in self.stop_indices or token in self.stop_tokens)

    def run(self, caps: RepairCaps | None = None) -> Decision:
        """The engine's judgement: the accepted prefix, the stop cut, the settlement."""
        self.calls.clear()
        prefix = accepted_prefix(draft=self.draft, predictions=self.predictions,
                                 remaining=self.remaining, eog=self.eog,
                                 cancelled_at=self.cancelled_at)
        texts, stop_at = cut_at_stop(prefix.candidates, self.eog, self.text_of, self)
        assert len(texts) == len(self.calls)
        return settle(prefix, last=self.last, base=self.base, draft=self.draft,
                      caps=self.caps if caps is None else caps, stop_at=stop_at)


def leading_matches(draft: Sequence[int], predictions: Sequence[int]) -> int:
    return next(
        (i for i, (d, p) in enumerate(zip(draft, predictions, strict=False)) if d != p),
        min(len(draft), len(predictions)),
    )


@dataclass(frozen=True)
class Expected:
    candidates: tuple[int, ...]
    n: int
    finish: FinishReason | None


def oracle(s: Scenario) -> Expected:
    """Closed form: n is the tightest of the limits; finish is the one that binds."""
    a = leading_matches(s.draft, s.predictions)
    candidates = (*s.draft[:a], s.predictions[a])
    inf = len(candidates) + 10
    cancel = inf if s.cancelled_at is None else s.cancelled_at
    # First candidate that ends the request once committed (EOG before stop).
    ends = [
        j
        for j, t in enumerate(candidates)
        if t in s.eog or j in s.stop_indices or t in s.stop_tokens
    ]
    e = ends[0] if ends else inf
    n = min(len(candidates), cancel, s.remaining, e + 1)
    finish: FinishReason | None
    if e + 1 <= min(cancel, s.remaining):
        finish = FinishReason.EOG if candidates[e] in s.eog else FinishReason.STOP
    elif s.remaining <= a and s.remaining < cancel:
        finish = FinishReason.LENGTH
    elif cancel <= a:  # the walk reaches the cancellation index
        finish = FinishReason.CANCELLED
    else:
        finish = None
    return Expected(candidates, n, finish)


def expected_repair_kind(k: int, n: int, caps: RepairCaps, finished: bool) -> RepairKind | None:
    """None means UnrepairableWindow."""
    r = k + 1 - n
    if r == 0:
        return RepairKind.RETIRE
    if not caps.recurrent:
        return RepairKind.TRIM
    if 1 <= r <= caps.rollback_window and r <= k:
        return RepairKind.ROLLBACK_IN_PLACE
    if caps.checkpointed:
        return RepairKind.RESTORE_AND_REPLAY
    return RepairKind.DISCARD if finished else None


def check(s: Scenario) -> Decision | None:
    """Run one scenario and check every property; None when it (rightly) raised."""
    exp = oracle(s)
    try:
        d = s.run()
    except UnrepairableWindow:
        # Only legal when the request continues and no repair exists.
        d = s.run(RepairCaps(s.caps.recurrent, s.caps.rollback_window, checkpointed=True))
        assert d.finish is None
        assert expected_repair_kind(s.k, len(d.committed), s.caps, finished=False) is None
        return None

    n = len(d.committed)
    k = s.k
    # The walk.
    assert d.committed == exp.candidates[:n], "committed is a prefix of the candidates"
    assert n == exp.n
    assert d.finish is exp.finish
    assert d.matched == leading_matches(s.draft, s.predictions)
    assert d.accepted == min(n, d.matched) <= k
    assert d.verified_rows == k + 1 and d.draft_len == k
    if s.cancelled_at is not None:
        if s.cancelled_at <= d.matched:
            assert d.finish is not None, "a reached cancel always finishes the request"
        assert n <= s.cancelled_at
    assert n <= s.remaining
    if d.finish is None:
        assert n == d.matched + 1, "a continuing request commits every candidate"
    # The stop cut: once per committed non-EOG token, in order, never for others.
    assert s.calls == [(j, t) for j, t in enumerate(d.committed) if t not in s.eog]
    # EOG can only be the final committed token.
    assert all(t not in s.eog for t in d.committed[:-1])

    # The repair.
    rep = d.repair
    assert rep.remove == k + 1 - n
    assert rep.keep_to == s.base + n
    assert (rep.kind is RepairKind.RETIRE) == (n == k + 1)
    assert rep.kind is expected_repair_kind(k, n, s.caps, d.finish is not None)
    if rep.kind is RepairKind.RESTORE_AND_REPLAY:
        assert rep.replay == ((s.last, *d.committed[:-1]) if n else ())
        assert len(rep.replay) == n
    else:
        assert rep.replay == ()
    if rep.kind is RepairKind.DISCARD:
        assert d.finish is not None

    # Rejected drafts leave no trace: apply the repair to the reference state.
    state = ReferenceState(list(s.history), s.caps.recurrent, s.caps.rollback_window)
    state.decode([s.last, *s.draft], checkpoint=s.caps.checkpointed)
    state.apply(rep)
    if not state.discarded:
        assert state.tokens == [*s.history, s.last, *d.committed][:-1]
    return d


# ---------------------------------------------------------------------------------
# Property tests.


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    k = draw(st.integers(0, 6))
    tokens = st.integers(0, 4) | st.just(EOG)
    full = draw(st.lists(tokens, min_size=k + 1, max_size=k + 1))
    agree = draw(st.integers(0, k))
    draft = full[:agree] + draw(st.lists(tokens, min_size=k - agree, max_size=k - agree))
    a = leading_matches(draft, full)
    # Seeded sampling may stop drawing rows after the first mismatch.
    predictions = full[: draw(st.integers(a + 1, k + 1))]
    history = draw(st.lists(st.integers(100, 200), max_size=6))
    return Scenario(
        history=history,
        last=draw(tokens),
        draft=draft,
        predictions=predictions,
        remaining=draw(st.integers(0, k + 2)),
        eog=draw(st.sampled_from([frozenset(), frozenset({EOG}), frozenset({EOG, 3})])),
        caps=RepairCaps(
            recurrent=draw(st.booleans()),
            rollback_window=draw(st.integers(0, k + 2)),
            checkpointed=draw(st.booleans()),
        ),
        cancelled_at=draw(st.none() | st.integers(0, k + 2)),
        stop_indices=draw(st.frozensets(st.integers(0, k), max_size=2)),
        stop_tokens=draw(st.frozensets(st.integers(0, 4), max_size=1)),
    )


@settings(max_examples=600, deadline=None)
@given(scenarios())
def test_decide_properties(s: Scenario) -> None:
    check(s)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_needs_checkpoint_is_sufficient(s: Scenario) -> None:
    """If needs_checkpoint says no, no outcome of that window can be unrepairable."""
    caps = RepairCaps(s.caps.recurrent, s.caps.rollback_window, checkpointed=False)
    if needs_checkpoint(s.k, caps):
        return
    d = s.run(caps)  # must not raise
    assert d.repair.kind is not RepairKind.RESTORE_AND_REPLAY
    if d.finish is None:
        assert d.repair.kind is not RepairKind.DISCARD


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_checkpointed_never_raises(s: Scenario) -> None:
    caps = RepairCaps(s.caps.recurrent, s.caps.rollback_window, checkpointed=True)
    d = s.run(caps)
    assert d.repair.kind is not RepairKind.DISCARD


# ---------------------------------------------------------------------------------
# Exhaustive small windows.


def _scenario(
    k: int,
    a: int,
    *,
    remaining: int = 100,
    cancelled_at: int | None = None,
    eog_at: int | None = None,
    stop_at: int | None = None,
    caps: RepairCaps | None = None,
) -> Scenario:
    """A window of k drafts whose first a are accepted (a == k: bonus token)."""
    predictions = [10 + i for i in range(k + 1)]
    draft = predictions[:a] + [50 + i for i in range(a, k)]
    if eog_at is not None:
        if eog_at < a:
            draft[eog_at] = EOG
        predictions[eog_at] = EOG
    return Scenario(
        history=[100, 101, 102],
        last=7,
        draft=draft,
        predictions=predictions,
        remaining=remaining,
        eog=frozenset({EOG}),
        caps=caps if caps is not None else RepairCaps(recurrent=False),
        cancelled_at=cancelled_at,
        stop_indices=frozenset() if stop_at is None else frozenset({stop_at}),
    )


def test_walk_exhaustive_small_windows() -> None:
    count = 0
    for k in range(5):
        for a in range(k + 1):
            for cancel, remaining, eog_at, stop_at in itertools.product(
                [None, *range(k + 3)], range(k + 3), [None, *range(a + 1)], [None, *range(a + 1)]
            ):
                s = _scenario(
                    k, a, remaining=remaining, cancelled_at=cancel, eog_at=eog_at, stop_at=stop_at
                )
                assert leading_matches(s.draft, s.predictions) == a
                check(s)
                count += 1
    assert count == 8486  # every combination ran


def _outcome(k: int, n: int, *, finished: bool, caps: RepairCaps) -> Scenario:
    """A scenario committing exactly n tokens, finishing or not."""
    if not finished:
        assert n >= 1
        return _scenario(k, n - 1, caps=caps)
    if n == k + 1:
        return _scenario(k, k, eog_at=k, caps=caps)  # bonus token is EOG
    return _scenario(k, k, remaining=n, caps=caps)  # budget runs out after n


def test_repair_exhaustive_grid() -> None:
    """Every (k, n, caps, finished) combination, through the reference state."""
    seen: set[RepairKind] = set()
    for k in range(6):
        for n, finished, recurrent, window, checkpointed in itertools.product(
            range(k + 2), [False, True], [False, True], range(k + 3), [False, True]
        ):
            if n == 0 and not finished:
                continue  # nothing committed only happens when the request ends
            caps = RepairCaps(recurrent, window, checkpointed)
            s = _outcome(k, n, finished=finished, caps=caps)
            want = expected_repair_kind(k, n, caps, finished)
            if want is None:
                with pytest.raises(UnrepairableWindow):
                    s.run()
                assert needs_checkpoint(k, caps), "unrepairable only where a checkpoint was due"
                continue
            d = check(s)
            assert d is not None and len(d.committed) == n
            assert (d.finish is not None) == finished
            seen.add(d.repair.kind)
    assert seen == set(RepairKind)


@pytest.mark.parametrize(("k", "a"), [(k, a) for k in range(6) for a in range(k + 1)])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_cancellation_at_every_index(k: int, a: int, checkpointed: bool) -> None:
    for cancel in range(k + 2):
        for recurrent, window in itertools.product([False, True], range(k + 2)):
            caps = RepairCaps(recurrent, window, checkpointed)
            s = _scenario(k, a, cancelled_at=cancel, caps=caps)
            d = check(s)
            if cancel > a:
                # The walk ends before the index: the request goes on to a later window.
                assert d is None or (d.finish is None and len(d.committed) == a + 1)
                continue
            assert d is not None, "a cancelled request is never unrepairable"
            assert d.finish is FinishReason.CANCELLED
            assert len(d.committed) == cancel
            if cancel == 0:
                assert d.committed == ()
                assert d.repair.kind is not RepairKind.RETIRE
                assert d.repair.kind is not RepairKind.ROLLBACK_IN_PLACE  # r = k + 1
                assert d.repair.remove == k + 1
                assert d.repair.keep_to == s.base


def test_needs_checkpoint_is_tight() -> None:
    """Where needs_checkpoint says yes, a plain correction at row 0 is unrepairable."""
    for k, window in itertools.product(range(6), range(7)):
        caps = RepairCaps(recurrent=True, rollback_window=window)
        s = _scenario(k, 0, caps=caps)  # n = 1, r = k, request continues
        if needs_checkpoint(k, caps):
            with pytest.raises(UnrepairableWindow):
                s.run()
        else:
            check(s)
    assert not any(needs_checkpoint(k, RepairCaps(recurrent=False)) for k in range(10))


# ---------------------------------------------------------------------------------
# Named situations.


def test_zero_length_window_does_nothing() -> None:
    for recurrent in (False, True):
        caps = RepairCaps(recurrent=recurrent, rollback_window=0)
        assert not needs_checkpoint(0, caps)
        d = decide(last=5, base=8, draft=[], predictions=[6], remaining=3, eog=set(), caps=caps)
        assert d.committed == (6,)
        assert d.accepted == 0 and d.matched == 0 and d.finish is None
        assert d.repair == Repair(RepairKind.RETIRE, keep_to=9, remove=0)


def test_zero_length_window_cancelled_recurrent() -> None:
    kwargs: dict[str, Any] = dict(last=5, base=8, draft=[], predictions=[6], remaining=3)
    d = decide(**kwargs, eog=set(), caps=RepairCaps(True, 4), cancelled_at=0)
    assert d.committed == () and d.finish is FinishReason.CANCELLED
    assert d.repair == Repair(RepairKind.DISCARD, keep_to=8, remove=1)
    d = decide(**kwargs, eog=set(), caps=RepairCaps(True, 4, True), cancelled_at=0)
    assert d.repair == Repair(RepairKind.RESTORE_AND_REPLAY, keep_to=8, remove=1, replay=())
    d = decide(**kwargs, eog=set(), caps=RepairCaps(False), cancelled_at=0)
    assert d.repair == Repair(RepairKind.TRIM, keep_to=8, remove=1)


def test_full_acceptance_commits_bonus_and_retires() -> None:
    d = decide(
        last=1, base=10, draft=[2, 3, 4], predictions=[2, 3, 4, 5], remaining=10,
        eog={EOG}, caps=RepairCaps(True, 0),
    )
    assert d.committed == (2, 3, 4, 5) and d.accepted == 3 and d.finish is None
    assert d.repair == Repair(RepairKind.RETIRE, keep_to=14, remove=0)


def test_correction_trims_rejected_rows() -> None:
    d = decide(
        last=1, base=10, draft=[2, 3, 4], predictions=[2, 9, 4, 5], remaining=10,
        eog={EOG}, caps=RepairCaps(False),
    )
    assert d.committed == (2, 9) and d.accepted == 1 and d.matched == 1
    # KV holds last@10, 2@11, 3@12, 4@13; keep last and 2, drop the rejected 3 and 4.
    assert d.repair == Repair(RepairKind.TRIM, keep_to=12, remove=2)


def test_drafted_eog_stops_the_commit_there() -> None:
    d = decide(
        last=1, base=0, draft=[2, EOG, 4, 5], predictions=[2, EOG, 4, 5, 6], remaining=10,
        eog={EOG}, caps=RepairCaps(False),
    )
    assert d.matched == 4
    assert d.committed == (2, EOG) and d.accepted == 2
    assert d.finish is FinishReason.EOG
    assert d.repair == Repair(RepairKind.TRIM, keep_to=2, remove=3)


def test_eog_as_correction_is_committed() -> None:
    d = decide(
        last=1, base=0, draft=[2, 3], predictions=[2, EOG], remaining=10,
        eog={EOG}, caps=RepairCaps(True, 2),
    )
    assert d.committed == (2, EOG) and d.finish is FinishReason.EOG
    assert d.repair == Repair(RepairKind.ROLLBACK_IN_PLACE, keep_to=2, remove=1)


def test_max_tokens_inside_window() -> None:
    d = decide(
        last=1, base=4, draft=[2, 3, 4, 5], predictions=[2, 3, 4, 5, 6], remaining=2,
        eog=set(), caps=RepairCaps(False),
    )
    assert d.committed == (2, 3) and d.finish is FinishReason.LENGTH
    assert d.accepted == 2 and d.matched == 4
    assert d.repair == Repair(RepairKind.TRIM, keep_to=6, remove=3)


def test_remaining_zero_commits_nothing() -> None:
    d = decide(
        last=1, base=4, draft=[2], predictions=[2, 3], remaining=0, eog=set(),
        caps=RepairCaps(False),
    )
    assert d.committed == () and d.finish is FinishReason.LENGTH
    assert d.repair == Repair(RepairKind.TRIM, keep_to=4, remove=2)


def test_stop_string_mid_window() -> None:
    d = decide(
        last=1, base=0, draft=[2, 3, 4], predictions=[2, 3, 4, 5], remaining=10, eog=set(),
        caps=RepairCaps(True, 3), stop_at=1,
    )
    assert d.committed == (2, 3) and d.finish is FinishReason.STOP
    assert d.repair == Repair(RepairKind.ROLLBACK_IN_PLACE, keep_to=2, remove=2)


def test_eog_wins_over_stop() -> None:
    d = decide(
        last=1, base=0, draft=[EOG], predictions=[EOG, 5], remaining=10, eog={EOG},
        caps=RepairCaps(False), stop_at=0,
    )
    assert d.committed == (EOG,) and d.finish is FinishReason.EOG


def test_a_stop_past_the_walk_is_no_cut() -> None:
    d = decide(
        last=1, base=0, draft=[2, 3, 4], predictions=[2, 3, 4, 5], remaining=2, eog=set(),
        caps=RepairCaps(False), stop_at=3,
    )
    assert d.committed == (2, 3) and d.finish is FinishReason.LENGTH


def test_settle_refuses_a_cut_it_cannot_make() -> None:
    prefix = Prefix(candidates=(2, EOG), matched=1, finish=FinishReason.EOG)
    for bad in (-1, 1, 2):
        with pytest.raises(ValueError, match="stop_at"):
            settle(prefix, last=1, base=0, draft=[2], caps=RepairCaps(False), stop_at=bad)
    d = settle(prefix, last=1, base=0, draft=[2], caps=RepairCaps(False), stop_at=0)
    assert d.committed == (2,) and d.finish is FinishReason.STOP


def test_cancel_wins_over_length_at_same_index() -> None:
    d = decide(
        last=1, base=0, draft=[2, 3], predictions=[2, 3, 4], remaining=1, eog=set(),
        caps=RepairCaps(False), cancelled_at=1,
    )
    assert d.committed == (2,) and d.finish is FinishReason.CANCELLED


def test_cancel_past_the_window_waits_for_a_later_window() -> None:
    d = decide(
        last=1, base=0, draft=[2, 3], predictions=[2, 3, 4], remaining=10, eog=set(),
        caps=RepairCaps(False), cancelled_at=3,
    )
    assert d.committed == (2, 3, 4) and d.finish is None
    assert d.repair.kind is RepairKind.RETIRE
    d = decide(
        last=1, base=0, draft=[2, 3], predictions=[2, 3, 4], remaining=10, eog=set(),
        caps=RepairCaps(False), cancelled_at=2,
    )
    assert d.committed == (2, 3) and d.finish is FinishReason.CANCELLED
    assert d.repair.kind is RepairKind.TRIM and d.repair.keep_to == 2


def test_rollback_trap_and_window() -> None:
    # k = 3, nothing committed: r = 4 = len(window), beyond the trap even with a
    # generous rollback window.
    caps = RepairCaps(recurrent=True, rollback_window=8, checkpointed=True)
    d = decide(
        last=1, base=5, draft=[2, 3, 4], predictions=[2, 3, 4, 5], remaining=10,
        eog=set(), caps=caps, cancelled_at=0,
    )
    assert d.repair == Repair(RepairKind.RESTORE_AND_REPLAY, keep_to=5, remove=4, replay=())
    # k = 3, one committed (correction at row 0): r = 3 > window 2.
    caps = RepairCaps(recurrent=True, rollback_window=2, checkpointed=True)
    assert needs_checkpoint(3, caps)
    d = decide(
        last=1, base=5, draft=[2, 3, 4], predictions=[9], remaining=10, eog=set(), caps=caps
    )
    assert d.committed == (9,)
    assert d.repair == Repair(RepairKind.RESTORE_AND_REPLAY, keep_to=6, remove=3, replay=(1,))
    with pytest.raises(UnrepairableWindow):
        decide(
            last=1, base=5, draft=[2, 3, 4], predictions=[9], remaining=10, eog=set(),
            caps=RepairCaps(recurrent=True, rollback_window=2),
        )
    # Two committed: r = 2 fits the window and the trap.
    d = decide(
        last=1, base=5, draft=[2, 3, 4], predictions=[2, 9], remaining=10, eog=set(), caps=caps
    )
    assert d.repair == Repair(RepairKind.ROLLBACK_IN_PLACE, keep_to=7, remove=2)


def test_replay_is_last_then_committed_drafts() -> None:
    caps = RepairCaps(recurrent=True, rollback_window=0, checkpointed=True)
    d = decide(
        last=1, base=5, draft=[2, 3, 4, 5], predictions=[2, 3, 9], remaining=10, eog=set(),
        caps=caps,
    )
    assert d.committed == (2, 3, 9)
    assert d.repair == Repair(RepairKind.RESTORE_AND_REPLAY, keep_to=8, remove=2, replay=(1, 2, 3))


# ---------------------------------------------------------------------------------
# Validation.


def _call(**overrides: object) -> Decision:
    kwargs: dict[str, Any] = dict(
        last=1, base=0, draft=[2, 3], predictions=[2, 3, 4], remaining=10, eog=set(),
        caps=RepairCaps(False),
    )
    kwargs.update(overrides)
    return decide(**kwargs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"predictions": []}, "empty"),
        ({"predictions": [2, 3, 4, 5]}, "4 predictions"),
        ({"predictions": [2, 3]}, "row 2"),
        ({"predictions": [2]}, "row 1"),
        ({"base": -1}, "base"),
        ({"remaining": -1}, "remaining"),
        ({"cancelled_at": -1}, "cancelled_at"),
    ],
)
def test_invalid_inputs(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _call(**overrides)


def test_missing_prediction_is_fine_when_not_reached() -> None:
    # Row 2 is absent, but the budget ends the walk before it is needed.
    d = _call(predictions=[2, 3], remaining=2)
    assert d.committed == (2, 3) and d.finish is FinishReason.LENGTH
    d = _call(predictions=[2, 3], cancelled_at=1)
    assert d.committed == (2,) and d.finish is FinishReason.CANCELLED


def test_caps_and_needs_checkpoint_validation() -> None:
    with pytest.raises(ValueError, match="rollback_window"):
        RepairCaps(recurrent=True, rollback_window=-1)
    with pytest.raises(ValueError, match="draft length"):
        needs_checkpoint(-1, RepairCaps(recurrent=True))


def test_decision_is_frozen() -> None:
    d = _call()
    with pytest.raises(AttributeError):
        d.finish = FinishReason.STOP  # type: ignore[misc]

