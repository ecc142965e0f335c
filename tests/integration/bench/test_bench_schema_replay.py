"""Constrained answers replayed: what the grammar forces, what a lookup copies, and what
each costs on a given curve, from a real answer of the default model under a real
llguidance grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.bench.schema_replay import (
    Grammars,
    copiers,
    forced_share,
    grammar_states,
    main,
    replay_answer,
    replay_forced,
    seer,
)
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.policy.costs import CostCurve

#: Extra rows cheap (costs in decodes, by rows), as in the prompt-lookup replay's tests.
CHEAP = CostCurve.from_row_costs({2: 1.3, 9: 2.0, 17: 2.4, 33: 3.0})

#: Most of the answer is the schema's own text: keys, quotes, separators, one enum.
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_reference_number": {"type": "string", "maxLength": 12},
        "preferred_delivery_method": {"enum": ["standard_ground_shipping"]},
        "requested_quantity_in_units": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["customer_reference_number", "preferred_delivery_method",
                 "requested_quantity_in_units"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def rt() -> Iterator[ModelRuntime]:
    with ModelRuntime(RuntimeConfig(n_ctx_seq=1024, threads=2, calibrate=False)) as runtime:
        yield runtime


def _states(rt: ModelRuntime, grammar: str) -> Grammars:
    info = rt.model.info
    return grammar_states(rt.grammar_vocab.tokenizer(), grammar, n_vocab=info.n_vocab,
                          eog=frozenset(info.eog_tokens))


def _answer(rt: ModelRuntime, grammar: str, task: str) -> tuple[list[int], list[int]]:
    prompt = rt.tokenize_prompt(rt.render_chat([{"role": "user", "content": task}]),
                                chat=True)
    gen = rt.generation(prompt, max_tokens=96, proposer="off", grammar=grammar)
    for _ in rt.run(gen):
        pass
    assert gen.finish is not None and gen.finish.value == "eog"
    return prompt, list(gen.committed)


def test_an_answer_the_schema_mostly_dictates_pays_by_its_forced_tokens(
        rt: ModelRuntime) -> None:
    grammar = rt.compile_constraint("json_schema", SCHEMA)
    states = _states(rt, grammar)
    prompt, text = _answer(rt, grammar, "Order AB-7 wants 3 units. Answer as JSON.")
    share = forced_share(prompt, text, states)
    assert 0.5 < share < 1.0  # the keys and the one enum value, not the free values
    forced = replay_forced(prompt, text, CHEAP, states)
    assert forced.drafted > 0 and forced.accepted > len(text) // 2
    assert forced.speedup > 1.5
    got = replay_answer(prompt, text, CHEAP, states)
    assert got == replay_answer(prompt, text, CHEAP, states)  # no clock, no noise
    assert got.forced == forced and got.forced_share == share
    # Foresight drafts the forced runs too, and never a window that does not pay.
    assert got.seer >= forced.speedup * 0.95
    # On a curve where a second row costs as much as a decode, no window pays.
    flat = CostCurve.from_row_costs({2: 2.0, 9: 9.0, 17: 17.0, 33: 33.0})
    assert seer(prompt, text, flat, states) == pytest.approx(1.0)


def test_a_copied_value_is_drafted_by_the_lookup_where_nothing_is_forced(
        rt: ModelRuntime) -> None:
    schema = {"type": "object", "properties": {"quote": {"type": "string", "maxLength": 400}},
              "required": ["quote"], "additionalProperties": False}
    grammar = rt.compile_constraint("json_schema", schema)
    passage = ("The quick brown fox jumps over the lazy dog near the riverbank, while the "
               "old farmer watches from the porch of his wooden house.")
    prompt, text = _answer(rt, grammar, f"Quote this sentence exactly as JSON: {passage}")
    got = replay_answer(prompt, text, CHEAP, _states(rt, grammar),
                        copier=copiers(rt.model.tokenizer, prompt))
    assert got.lookup.accepted > got.forced.accepted  # the copy, on top of the keys
    assert got.lookup.speedup > got.forced.speedup
    # The engine's rule copies the value from its first bytes, before a token n-gram
    # of the quote has matched: more of it drafted and kept than lookup alone.
    assert got.meshd is not None
    assert got.meshd.accepted > got.lookup.accepted
    assert got.meshd.speedup > got.lookup.speedup


def test_the_command_prints_and_writes_its_table(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "schema.json"
    assert main(["-m", "smollm2-q4_1", "-w", "schema-classify", "--tokens", "48",
                 "--cost-reps", "1", "--draft-max", "8", "--ctx", "1024",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "schema-classify" in printed and "geometric mean" in printed
    (report,) = json.loads(out.read_text())
    (row,) = report["workloads"]
    assert row["workload"] == "schema-classify" and 0.0 < row["forced_share"] < 1.0
    assert row["forced"]["speedup"] >= 1.0 and row["seer"] >= 1.0
    assert row["meshd"]["drafted"] >= row["forced"]["drafted"]  # the engine's rule ran


def test_a_workload_without_a_schema_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from meshd.bench.workloads import BenchError

    with pytest.raises(BenchError, match="story"):
        main(["-m", "smollm2-q4_1", "-w", "story", "--tokens", "8", "--cost-reps", "1"])
