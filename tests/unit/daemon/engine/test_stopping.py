"""Tests for the incremental stop-string matcher (meshd.daemon.engine.stopping)."""

from __future__ import annotations

import gc
import itertools
import time
import tracemalloc
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.daemon.engine.stopping import StopMatcher, StopResult, cut_at_stop
from meshd.policy.decision import FinishReason, RepairCaps, accepted_prefix, settle


def reference(text: str, stops: Sequence[str]) -> tuple[str, int | None]:
    """(emitted text, end index of the stop that fired or None), by brute force.

    The first stop string to complete wins (the shortest prefix of ``text`` that
    contains one); among those completing there, the earliest start (longest) wins.
    """
    for end in range(1, len(text) + 1):
        seen = text[:end]
        starts = [end - len(s) for s in stops if seen.endswith(s)]
        if starts:
            return text[: min(starts)], end
    return text, None


def run(pieces: Sequence[str], stops: Sequence[str]) -> tuple[str, int | None]:
    """Push pieces, checking the streaming invariants; (emitted, stopping piece)."""
    matcher = StopMatcher(stops)
    full = "".join(pieces)
    want, stop_end = reference(full, stops)
    max_prefix = max((len(s) - 1 for s in stops), default=0)
    prefixes = {s[:i] for s in stops for i in range(1, len(s))}
    emitted = ""
    consumed = ""
    for index, piece in enumerate(pieces):
        result = matcher.push(piece)
        before = len(consumed)
        consumed += piece
        emitted += result.text
        # Nothing is ever emitted that later turns out to be (part of) a stop.
        assert want.startswith(emitted)
        if result.stopped:
            # Reported on exactly the piece that completes the stop.
            assert stop_end is not None and before < stop_end <= len(consumed)
            assert emitted == want
            assert matcher.stopped and matcher.held == "" and matcher.flush() == ""
            return emitted, index
        assert stop_end is None or stop_end > len(consumed)
        # Holdback: exactly the longest suffix that could still start a stop.
        held = matcher.held
        assert emitted + held == consumed
        assert held == "" or held in prefixes
        longer = range(len(held) + 1, min(len(consumed), max_prefix) + 1)
        assert not any(consumed[-n:] in prefixes for n in longer)
    assert stop_end is None
    emitted += matcher.flush()
    assert emitted == want == full
    return emitted, None


@st.composite
def split(draw: st.DrawFn, text: str) -> list[str]:
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 3))
    bounds = [0, *sorted(cuts), len(text)]
    return [text[i:j] for i, j in itertools.pairwise(bounds)]


alphabet = st.sampled_from("abcé ")


@settings(max_examples=800, deadline=None)
@given(
    st.text(alphabet, max_size=24).flatmap(lambda t: split(t)),
    st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=4),
)
def test_matches_reference(pieces: list[str], stops: list[str]) -> None:
    run(pieces, stops)


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet, max_size=24).flatmap(lambda t: split(t)),
    st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_present_in_text_always_fires(pieces: list[str], stops: list[str]) -> None:
    """Planting a stop string anywhere (split arbitrarily) makes the matcher stop."""
    planted = [*pieces, *stops[0], "tail"]
    _, index = run(planted, stops)
    assert index is not None


def test_straddles_many_pieces() -> None:
    m = StopMatcher(["</end>"])
    assert m.push("hello <") == StopResult("hello ")
    assert m.held == "<"
    for ch in "/en":
        assert m.push(ch) == StopResult("")
    assert m.held == "</en"
    assert m.push("d> ignored") == StopResult("", stopped=True)
    assert m.stopped


def test_holdback_released_when_diverging() -> None:
    m = StopMatcher(["abc"])
    assert m.push("xab") == StopResult("x")
    assert m.push("x") == StopResult("abx")
    assert m.held == ""


def test_overlapping_prefix_reheld() -> None:
    m = StopMatcher(["aab"])
    assert m.push("a").text == ""
    assert m.push("a").text == ""
    assert m.push("a").text == "a"  # "aa" may still start the stop
    assert m.push("b") == StopResult("", stopped=True)


def test_text_before_stop_in_same_piece() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("abc STOP def") == StopResult("abc ", stopped=True)


def test_first_completed_wins() -> None:
    # "bc" completes before "abcd" could: output "a" (documented streaming rule).
    assert run(["a", "b", "c", "d"], ["abcd", "bc"]) == ("a", 2)
    # "ab" always completes before "abc".
    assert run(["abc"], ["abc", "ab"]) == ("", 0)


def test_same_end_prefers_longest() -> None:
    assert run(["x", "abc"], ["c", "abc"]) == ("x", 1)
    m = StopMatcher(["c", "abc"])
    assert m.push("xabc") == StopResult("x", stopped=True)


def test_empty_stop_list_holds_nothing() -> None:
    m = StopMatcher([])
    assert m.push("abc") == StopResult("abc")
    assert m.held == "" and m.flush() == ""


def test_flush_releases_held_text() -> None:
    m = StopMatcher(["###"])
    assert m.push("done #") == StopResult("done ")
    assert m.push("#") == StopResult("")
    assert m.flush() == "##"
    assert m.flush() == ""


def test_empty_pieces_and_unicode() -> None:
    m = StopMatcher(["éé"])
    assert m.push("") == StopResult("")
    assert m.push("café") == StopResult("caf")
    assert m.push("") == StopResult("")
    assert m.push("é!") == StopResult("", stopped=True)


def test_duplicates_collapse() -> None:
    assert StopMatcher(["a", "b", "a"]).stops == ("a", "b")


def test_invalid() -> None:
    with pytest.raises(ValueError, match="empty stop"):
        StopMatcher(["ok", ""])
    with pytest.raises(TypeError):
        StopMatcher("abc")
    m = StopMatcher(["x"])
    assert m.push("ax").stopped
    with pytest.raises(RuntimeError):
        m.push("more")


def test_the_stop_cut_over_a_windows_prefix() -> None:
    """The engine's wiring: the matcher completes the stop on the right token, and the
    window commits through it and no further."""
    vocab = {1: "The", 2: " end", 3: "<", 4: "/s", 5: ">", 6: " more"}
    prefix = accepted_prefix(draft=[2, 3, 4, 5, 6], predictions=[2, 3, 4, 5, 6, 6],
                             remaining=10, eog=set())
    texts, stop_at = cut_at_stop(prefix.candidates, set(), vocab.__getitem__,
                                 StopMatcher(["</s>"]))
    d = settle(prefix, last=1, base=0, draft=[2, 3, 4, 5, 6], caps=RepairCaps(False),
               stop_at=stop_at)
    assert d.committed == (2, 3, 4, 5)
    assert d.finish is FinishReason.STOP
    assert "".join(texts) == " end"


def test_the_stop_cut_never_pushes_an_end_of_generation_token() -> None:
    pushed: list[int] = []

    def text_of(token: int) -> str:
        pushed.append(token)
        return "x"

    texts, stop_at = cut_at_stop((7, 8, 9), {9}, text_of, StopMatcher(["y"]))
    assert (pushed, texts, stop_at) == ([7, 8], ["x", "x"], None)


def _long_stop(n: int) -> str:
    """A stop whose prefixes overlap themselves: held back in full, never completed by
    a run of ``a`` (KMP's worst case: every character falls back along the table)."""
    return "a" * (n - 1) + "b"


def _peak_bytes(n: int) -> int:
    """Peak memory allocated while building a matcher for an ``n``-character stop and
    pushing ``n`` characters that keep all of it held back."""
    gc.collect()
    tracemalloc.start()
    try:
        matcher = StopMatcher([_long_stop(n)])
        for _ in range(n):
            matcher.push("a")
        assert len(matcher.held) == n - 1
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_linear_in_the_stop_length() -> None:
    """Every prefix of a stop in a set is n**2/2 characters (a 30,000-character stop
    took 453 MB); the matcher must take memory proportional to the stop."""
    n = 3_000
    small, large = _peak_bytes(n), _peak_bytes(4 * n)
    assert large < 6 * small, (small, large)  # linear: ~4x; quadratic: ~16x
    assert large < 64 * 4 * n, large  # a few machine words per character


def _push_seconds(n: int) -> float:
    """CPU time to push ``2n`` one-character pieces through an ``n``-character stop
    (the best of five, against noise from other processes: a fresh clone's CI run once
    measured 8.3x for 4x the length with three)."""
    best = float("inf")
    for _ in range(5):
        matcher = StopMatcher([_long_stop(n)])
        gc.disable()
        try:
            start = time.process_time()
            for _ in range(2 * n):
                matcher.push("a")
            best = min(best, time.process_time() - start)
        finally:
            gc.enable()
    return best


def test_time_is_linear_in_the_stop_length() -> None:
    """Each push costs amortized constant time per stop, however long the stop and the
    held-back text: 4x the stop and the text take about 4x the time, not 16x."""
    n = 5_000
    small, large = _push_seconds(n), _push_seconds(4 * n)
    assert large < 8 * small, (small, large)


def test_a_long_overlapping_stop_straddles_pieces() -> None:
    """KMP's fall-backs: text that nearly matches, again and again, before it does."""
    stop = "ab" * 300 + "c"
    text = "ab" * 700 + "c" + "tail"
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    emitted, index = run(pieces, [stop, "abc" * 50])
    assert emitted == "ab" * 400 and index is not None
