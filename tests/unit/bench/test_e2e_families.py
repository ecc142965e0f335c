"""``meshd bench-e2e`` on a family of requests (agent loops, SQL...): each repetition asks
several of the family's questions one after another, and its decode rate is the rounds'
tokens over their decode spans, not over the wall time between them."""

from __future__ import annotations

from meshd.bench.e2e import Run
from meshd.bench.stream_client import RequestRecord, StreamResult
from meshd.bench.workloads import Workload

FAMILY = Workload(name="fam", description="", messages=(("user", "Q: {variant}"),),
                  variants=tuple(f"question {i}" for i in range(8)), warm_up=3)


def _record(tag: str, sent: float, first: float, last: float, tokens: int) -> RequestRecord:
    return RequestRecord(0, tag, sent, StreamResult(text="x", t_first=first, t_last=last,
                                                    completion_tokens=tokens))


def test_a_family_run_is_timed_over_its_rounds_decode_spans() -> None:
    # two rounds, 1 s of decoding each, 5 s of prefill and idle between them
    run = Run("meshd", 0, (_record("[1.1.1]", 0.0, 0.5, 1.5, 11),
                           _record("[1.1.2]", 4.0, 6.5, 7.5, 21)), None, rounds=2)
    assert run.decode_tok_s == 15.0
    one = Run("meshd", 0, (_record("[1.1]", 0.0, 0.5, 1.5, 11),))
    assert one.decode_tok_s == 10.0


def test_a_failed_round_fails_the_run() -> None:
    failed = RequestRecord(0, "[1.1.2]", 0.0, StreamResult(error="boom"))
    run = Run("meshd", 0, (_record("[1.1.1]", 0.0, 0.5, 1.5, 11), failed), None, rounds=2)
    assert run.decode_tok_s is None


def test_consecutive_measured_requests_ask_different_questions_never_a_warm_up_one() -> None:
    def question(w: Workload) -> str:
        return w.messages[0][1]

    warm = {question(FAMILY.for_tag(t)) for t in FAMILY.warm_up_tags()}
    measured = [question(FAMILY.for_tag(f"[1.1.{i + 1}]", i)) for i in range(5)]
    assert len(set(measured)) == 5
    assert not warm & set(measured)
    # the same place in the run asks the same question whatever the tag
    assert question(FAMILY.for_tag("[2.1.1]", 3)) == measured[3]
