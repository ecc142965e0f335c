"""Prompts prefilled together: the same logits as alone, in fewer forwards where exact."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from meshd.native.context import ContextConfig, TargetContext
from meshd.native.model import Model
from meshd.native.session import SequenceSession, prefill_many
from meshd.testing import testmodels


@pytest.fixture(scope="module", params=["llama", "mimo2", "qwen35"])
def ctx(request: pytest.FixtureRequest) -> Iterator[TargetContext]:
    model = Model.load(testmodels.test_model_path(str(request.param), acceptance=1.0))
    # n_batch 64: the longest prompt below spans two forwards.
    context = TargetContext(model, ContextConfig(n_ctx_seq=256, n_seq_max=3, n_batch=64))
    yield context
    assert context.free_slots == 3
    context.close()
    model.close()


PROMPTS = [
    [testmodels.BOS_ID, *b"the history matters"],
    [testmodels.BOS_ID, *b"a much longer prompt that needs more than one forward " * 2],
    [testmodels.BOS_ID, *b"ab"],
]


def test_prompts_prefilled_together_give_what_each_gives_alone(ctx: TargetContext) -> None:
    alone = []
    for p in PROMPTS:
        with SequenceSession.open(ctx, reserve=len(p) + 8) as s:
            alone.append(s.prefill(p))
    sessions = [SequenceSession.open(ctx, reserve=len(p) + 8) for p in PROMPTS]
    try:
        before = ctx.forward_id
        together = prefill_many(list(zip(sessions, PROMPTS, strict=True)))
        forwards = ctx.forward_id - before
        for got, want in zip(together, alone, strict=True):
            np.testing.assert_array_equal(got, want)
        rows = sum(len(p) for p in PROMPTS)
        if ctx.recurrent:  # each prompt alone: a micro-batch may move another's state
            assert forwards == sum(-(-len(p) // 64) for p in PROMPTS)
        else:
            assert forwards == -(-rows // 64)
        for s, p in zip(sessions, PROMPTS, strict=True):
            assert s.n_past == len(p) and s.counters.prefill_tokens == len(p)
            # the next decode continues each sequence where its own prompt ended
            assert int(np.argmax(s.decode(int(np.argmax(together[sessions.index(s)]))))) \
                == testmodels.reference_continuation(p, 2)[1]
    finally:
        for s in sessions:
            s.close()


def test_an_empty_prompt_is_refused_before_any_forward(ctx: TargetContext) -> None:
    sessions = [SequenceSession.open(ctx, reserve=32) for _ in range(2)]
    try:
        before = ctx.forward_id
        with pytest.raises(ValueError, match="at least one token"):
            prefill_many([(sessions[0], PROMPTS[0]), (sessions[1], [])])
        assert ctx.forward_id == before
        assert all(s.n_past == 0 for s in sessions)
    finally:
        for s in sessions:
            s.close()


def test_a_copied_prefix_continues_as_its_own_prefill_would(ctx: TargetContext) -> None:
    """A sequence that copies a prefix another holds (and prefills only the rest) gives
    the logits its own whole prefill gives; a recurrent state, or a session following
    an MTP head, cannot copy one and is refused before anything changes."""
    prompt = PROMPTS[1]
    with SequenceSession.open(ctx, reserve=len(prompt) + 8, mtp=False) as s:
        alone = s.prefill(prompt)
    with SequenceSession.open(ctx, reserve=len(prompt) + 8, mtp=False) as donor, \
            SequenceSession.open(ctx, reserve=len(prompt) + 8, mtp=False) as borrower:
        donor.prefill([*prompt[:-5], *b"other"])  # holds the prefix, then goes elsewhere
        if ctx.recurrent:
            with pytest.raises(ValueError, match="attention-only"):
                borrower.share_prefix(donor, len(prompt) - 5)
            assert borrower.n_past == 0
            return
        borrower.share_prefix(donor, len(prompt) - 5)
        assert borrower.n_past == len(prompt) - 5
        np.testing.assert_array_equal(borrower.prefill(prompt[-5:]), alone)
        assert borrower.counters.prefill_tokens == 5
        assert borrower.counters.shared_prefix_tokens == len(prompt) - 5
        with pytest.raises(ValueError, match="cannot share"):
            borrower.share_prefix(donor, donor.n_past + 1)
