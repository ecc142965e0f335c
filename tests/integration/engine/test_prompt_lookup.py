"""Prompt lookup on the real small model: where the output does not copy, drafting costs
(next to) no verify rows; where it copies a long span, the windows grow long; either way
the tokens are plain decoding's.

The machine's economics are pinned to a measured CPU cost curve (SmolLM2 Q4_1 on the
project's 2-core machine: a second row costs most of a decode), so what is asserted
is the proposer's behaviour on that machine, not this one's timing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from meshd.daemon.engine.generation import Generation
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.plugins.registry import default_registry
from meshd.policy.costs import CostCurve, CostModel

#: Relative cost of verifying k drafts (k + 1 rows), SmolLM2 Q4_1 on a 2-core CPU.
CPU = CostCurve.from_row_costs({2: 1.74, 9: 4.9, 17: 8.5, 33: 16.0})


class PinnedCosts(CostModel):
    """The cost model of a machine with curve :data:`CPU`: measured forwards do not
    move it (they would make the test depend on this machine's load)."""

    def record(self, rows: int, seconds: float, *, sequences: int = 1) -> None:
        pass


@pytest.fixture(scope="module")
def rt() -> Iterator[ModelRuntime]:
    runtime = ModelRuntime(
        RuntimeConfig(n_ctx_seq=2048, n_seq_max=1, draft_max=CPU.max_k, calibrate=False,
                      prefix_cache_tokens=0),
        registry=default_registry(),
    )
    runtime.costs = PinnedCosts(CPU.costs)
    yield runtime
    runtime.close()


def generate(rt: ModelRuntime, text: str, proposer: str, max_tokens: int) -> Generation:
    prompt = rt.tokenize_prompt(rt.render_chat([{"role": "user", "content": text}]),
                                chat=True)
    gen = rt.generation(prompt, max_tokens=max_tokens, proposer=proposer)
    for _ in rt.run(gen):
        pass
    return gen


def wasted_rows(gen: Generation) -> int:
    """Verify rows spent on draft tokens that were not accepted."""
    return gen.stats.drafted - gen.stats.accepted


def longest_window(gen: Generation) -> int:
    per_position: Sequence[int] = gen.stats.drafted_per_position
    return max((i + 1 for i, n in enumerate(per_position) if n), default=0)


@pytest.mark.slow
def test_on_a_prompt_the_output_does_not_copy_drafting_wastes_almost_nothing(
        rt: ModelRuntime) -> None:
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    plain = generate(rt, text, "off", 96)
    gen = generate(rt, text, "ngram", 96)
    assert gen.committed == plain.committed
    # Nothing here is worth a verify row on this machine; no probe is spent either (the
    # shadow drafts measure acceptance for free).
    assert wasted_rows(gen) <= 3, gen.stats.as_dict()


@pytest.mark.slow
def test_a_long_copied_span_is_drafted_in_long_windows(rt: ModelRuntime) -> None:
    passage = ("The committee met on the third of March to review the harbour budget. "
               "It agreed to repair the north pier before the summer, to hire two more "
               "pilots for the night shift, and to publish the tide tables for the whole "
               "year in the town hall and on the council's website by the end of April.")
    text = f"Repeat the following passage exactly, word for word:\n\n{passage}"
    plain = generate(rt, text, "off", 80)
    gen = generate(rt, text, "ngram", 80)
    assert gen.committed == plain.committed
    assert longest_window(gen) >= 16, gen.stats.as_dict()
    assert gen.stats.accepted >= 40 and wasted_rows(gen) <= gen.stats.accepted // 4
