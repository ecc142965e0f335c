"""Prompt lookup replayed over a known text: what each rule drafts, gets accepted and
pays is arithmetic on the text and the cost curve, so it is exact and repeatable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.bench.replay import foresight, hindsight, main, replay_ngram, replay_simple
from meshd.plugins.match_stats import SharedMatchStats
from meshd.policy.costs import CostCurve

#: Extra rows cheap, as on a CPU with a Q8_0 model (costs in decodes, by rows).
CHEAP = CostCurve.from_row_costs({2: 1.3, 9: 2.0, 17: 2.4, 33: 3.0})


def test_a_copied_text_is_drafted_and_the_replay_repeats_exactly() -> None:
    prompt = list(range(1000, 1200))
    text = prompt[20:140]  # the answer copies a stretch of the prompt
    first = replay_ngram(prompt, text, CHEAP)
    assert first == replay_ngram(prompt, text, CHEAP)  # no clock, no noise
    assert first.speedup > 2.0 and first.accepted > 80
    simple = replay_simple(prompt, text, CHEAP)
    assert simple.verifies > 0  # drafts once 12 tokens match
    assert foresight(prompt, text, CHEAP) >= first.speedup


def test_text_that_never_repeats_costs_what_plain_decoding_costs() -> None:
    prompt = list(range(1000, 1100))
    text = list(range(5000, 5100))
    for replay in (replay_ngram(prompt, text, CHEAP, shared=SharedMatchStats()),
                   replay_simple(prompt, text, CHEAP)):
        assert replay.drafted == 0 and replay.speedup == pytest.approx(1.0)
        assert replay.limit is None  # no acceptance was measured
    assert foresight(prompt, text, CHEAP) == pytest.approx(1.0)


def test_hindsight_drafts_a_copy_as_far_as_foresight_and_nothing_that_never_holds(
) -> None:
    """A text that copies the prompt from its first token: every match holds to the end,
    so the best length per match-length class is the longest window that pays, as with
    foresight. Where only part of each match holds, drafting that part pays. A text
    whose every match is followed by something new: no length pays, so hindsight drafts
    nothing and costs what plain decoding costs."""
    prompt = list(range(1000, 1200))
    copy = prompt[20:140]
    assert hindsight(prompt, copy, CHEAP) == pytest.approx(foresight(prompt, copy, CHEAP))
    assert hindsight(prompt, copy, CHEAP) > replay_simple(prompt, copy, CHEAP).speedup
    # "1 2" recurs, each time followed by a token never seen before.
    prompt = [1, 2, 3]
    fresh = [t for i in range(40) for t in (1, 2, 100 + i)]
    assert foresight(prompt, fresh, CHEAP) > 1.0  # "1 2" itself is predictable ...
    assert hindsight(prompt, fresh, CHEAP) > 1.0  # ... and a draft at "... 1" of "2" pays
    never = [t for i in range(40) for t in (7, 200 + i)]  # "7" followed by a new token
    assert hindsight([7, 9], never, CHEAP) == pytest.approx(1.0)
    assert hindsight(list(range(1000, 1100)), list(range(5000, 5100)), CHEAP) == 1.0


def test_a_rejected_draft_is_paid_for() -> None:
    """A draft that fails at its first token costs its rows and commits one token."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
              11, 12]
    text = [99, 98]  # after the prompt's 12-token repeat, the text goes elsewhere
    got = replay_simple(prompt[:-1], [prompt[-1], *text], CHEAP, m=4)
    # A draft of the one token there is room for (13), rejected: c(1) for one token;
    # then the last token, decoded plainly: 1.
    assert (got.drafted, got.accepted, got.verifies) == (1, 0, 1)
    assert got.speedup == pytest.approx(2 / (CHEAP.cost(1) + 1.0))
    # Its acceptance (0 at the first position) is worth no window: the limit is plain
    # decoding, which the rule fell short of by that one rejected row.
    assert got.limit == pytest.approx(1.0)


def test_the_limit_prices_the_measured_acceptance_at_the_best_fixed_window() -> None:
    """Drafts of up to 4 that always hold once the text has repeated the prompt's
    5-token cycle far enough for 3 tokens to match: the limit is the best window of at
    most 4 drafts at acceptance 1, and the steps that drafted nothing stay plain
    decodes."""
    cycle = [501, 502, 503, 504, 505]
    prompt = [7, *cycle]
    text = [*cycle] * 8
    got = replay_simple(prompt, text, CHEAP, n=3, m=4)
    assert got.accepted == got.drafted > 0
    plain = len(text) - 1 - got.accepted - got.verifies
    assert plain > 0  # the first steps find no 3-token match
    k = max(range(5), key=lambda j: ((j + 1) / CHEAP.cost(j), -j))
    drafting = (k + 1) / CHEAP.cost(k)
    spec = len(text) - 1 - plain
    assert got.limit == pytest.approx((len(text) - 1) / (plain + spec / drafting))


def test_the_replay_command_prints_and_writes_its_table(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        ) -> None:
    out = tmp_path / "replay.json"
    assert main(["-m", "smollm2-q4_1", "-w", "json-reformat", "--tokens", "24", "--reps", "1",
                 "--cost-reps", "1", "--draft-max", "8", "--ctx", "1024",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "json-reformat" in printed and "seer" in printed and "reach" in printed
    assert "hind" in printed
    (report,) = json.loads(out.read_text())
    (row,) = report["workloads"]
    assert row["workload"] == "json-reformat" and row["copies"] is True
    assert row["tokens"] == 24 and row["meshd"]["speedup"] >= 1.0
    assert row["hindsight"] >= 1.0
