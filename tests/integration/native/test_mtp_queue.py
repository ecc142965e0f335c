"""The MTP head is fed lazily: what the target decodes waits in the session's queue until
the next draft (or until the queue is full), and a verify window's rejected rows are
dropped from it before they cost anything.

What a user sees: the same drafts whenever the head is fed, and a request that is not
drafting no longer pays an MTP forward for every target forward.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from meshd.native.context import ContextConfig, TargetContext
from meshd.native.model import Model
from meshd.native.mtp import QUEUE_ROWS
from meshd.native.session import SequenceSession
from meshd.testing import testmodels

K = 3


@pytest.fixture(scope="module", params=["qwen35", "mimo2"])
def context(request: pytest.FixtureRequest) -> Iterator[TargetContext]:
    model = Model.load(testmodels.test_model_path(request.param, acceptance=0.9))
    ctx = TargetContext(model, ContextConfig(n_ctx_seq=256, n_seq_max=2, draft_max=K,
                                             use_mtp=True, n_threads=1))
    yield ctx
    ctx.close()
    model.close()


def _prompt(ctx: TargetContext) -> list[int]:
    tok = ctx.model.tokenizer
    return [testmodels.BOS_ID, *tok.tokenize("the queue waits for a draft", add_special=False)]


def _drafts_along(ctx: TargetContext, steps: int, *, every_step: bool) -> list[int]:
    """Greedy-decode ``steps`` tokens after the prompt; draft ``K`` tokens after each one
    (``every_step``) or only after the last; return the last drafts."""
    with SequenceSession.open(ctx, mtp=True) as s:
        assert s.mtp is not None
        last = int(np.argmax(s.prefill(_prompt(ctx))[-1]))
        drafts: list[int] = []
        for i in range(steps):
            if every_step or i == steps - 1:
                drafts, _ = s.mtp.draft(last, s.n_past, K)
            last = int(np.argmax(s.decode(last)[-1]))
        return drafts


def test_drafts_do_not_depend_on_when_the_head_is_fed(context: TargetContext) -> None:
    steps = QUEUE_ROWS + 5  # past one full queue
    eager = _drafts_along(context, steps, every_step=True)
    lazy = _drafts_along(context, steps, every_step=False)
    assert len(eager) == K
    assert lazy == eager


def test_a_session_that_does_not_draft_feeds_the_head_once_per_full_queue(
        context: TargetContext) -> None:
    assert context.mtp is not None
    with SequenceSession.open(context, mtp=True) as s:
        assert s.mtp is not None
        last = int(np.argmax(s.prefill(_prompt(context))[-1]))
        before = context.mtp.forwards
        for _ in range(2 * QUEUE_ROWS):
            last = int(np.argmax(s.decode(last)[-1]))
        assert context.mtp.forwards - before == 2  # one per QUEUE_ROWS decodes, not 64
        before = context.mtp.forwards
        s.mtp.draft(last, s.n_past, K)
        assert context.mtp.forwards - before == 1 + K  # the queue, then one per draft
        # That feeding is timed apart from the drafting, and counted once.
        assert s.note_head_feed() > 0.0
        assert s.note_head_feed() == 0.0


def test_rejected_rows_leave_the_queue_with_the_repair(context: TargetContext) -> None:
    with SequenceSession.open(context, mtp=True) as s:
        assert s.mtp is not None
        last = int(np.argmax(s.prefill(_prompt(context))[-1]))
        drafts, _ = s.mtp.draft(last, s.n_past, K)
        start = s.n_past
        s.verify([last, *drafts])
        assert [pos for _, pos, _ in s.mtp.queue][-K - 1:] == list(range(start, start + K + 1))
        if s.recurrent:  # only `last` kept
            s.rollback_in_place(start + 1)
        else:
            s.trim(start + 1)
        assert max(pos for _, pos, _ in s.mtp.queue) == start
