"""Rejected drafts leave no trace: every repair path against a fresh context.

For each synthetic architecture (attention-only llama, hybrid recurrent qwen35 with in-place
rollback, the same with checkpoints only, attention-only mimo2) a verify window with every
accepted count 0..k is repaired, and the next-token logits must equal those of a fresh
session fed only the accepted history.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from meshd.native.context import ContextConfig, TargetContext
from meshd.native.errors import RollbackRefused
from meshd.native.model import Model
from meshd.native.session import SequenceSession, verify_many
from meshd.policy.decision import RepairCaps, RepairKind, decide, needs_checkpoint
from meshd.testing import testmodels

K = 4
VARIANTS = ["llama", "qwen35", "qwen35-ckpt", "mimo2"]


@pytest.fixture(scope="module", params=VARIANTS)
def ctx(request: pytest.FixtureRequest) -> Iterator[TargetContext]:
    arch, _, variant = str(request.param).partition("-")
    model = Model.load(testmodels.test_model_path(arch, acceptance=1.0))
    context = TargetContext(model, ContextConfig(
        n_ctx_seq=512, n_seq_max=3, draft_max=K, in_place_rollback=variant != "ckpt"))
    yield context
    assert context.free_slots == 3
    context.close()
    model.close()


def prompt() -> list[int]:
    return [testmodels.BOS_ID, *b"the history matters"]


def reference(n: int) -> list[int]:
    return testmodels.reference_continuation(prompt(), n)


def repair_window(s: SequenceSession, last: int, draft: list[int]) -> tuple[RepairKind, int]:
    """Verify [last, *draft], decide greedily, apply the repair; returns kind and n."""
    caps0 = RepairCaps(s.recurrent, s.rollback_window, False)
    if needs_checkpoint(len(draft), caps0):
        s.checkpoint()
    base = s.n_past
    rows = s.verify([last, *draft])
    preds = [int(i) for i in rows.argmax(axis=1)]
    d = decide(last=last, base=base, draft=draft, predictions=preds, remaining=1000,
               eog=set(), caps=RepairCaps(s.recurrent, s.rollback_window, s.has_checkpoint))
    kind = d.repair.kind
    if kind is RepairKind.RETIRE:
        s.retire()
    elif kind is RepairKind.TRIM:
        s.trim(d.repair.keep_to)
    elif kind is RepairKind.ROLLBACK_IN_PLACE:
        s.rollback_in_place(d.repair.keep_to)
    else:
        assert kind is RepairKind.RESTORE_AND_REPLAY
        s.restore_and_replay(d.repair.keep_to, d.repair.replay)
    return kind, len(d.committed)


@pytest.mark.parametrize("accepted", range(K + 1))
def test_repair_leaves_no_trace(ctx: TargetContext, accepted: int) -> None:
    ref = reference(K + 8)
    # Window [ref1, d0..d3]: `accepted` right drafts (ref2...), then wrong ones.
    draft = ref[2:2 + accepted] + [(t + 7) % 256 for t in ref[2 + accepted:2 + K]]
    with SequenceSession.open(ctx) as s, SequenceSession.open(ctx) as fresh:
        assert int(s.prefill(prompt()).argmax()) == ref[0]
        assert int(s.decode(ref[0]).argmax()) == ref[1]  # a serial decode first
        kind, n = repair_window(s, ref[1], draft)
        assert n == accepted + 1
        committed = ref[: 2 + accepted + 1]  # ..., last accepted draft, correction/bonus
        assert s.n_past == len(prompt()) + len(committed) - 1
        got = s.decode(committed[-1])
        fresh.prefill([*prompt(), *committed[:-1]])
        want = fresh.decode(committed[-1])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert int(got.argmax()) == ref[len(committed)]
    if accepted == K:
        assert kind is RepairKind.RETIRE
    elif not ctx.recurrent:
        assert kind is RepairKind.TRIM
    elif ctx.rollback_window:
        assert kind is RepairKind.ROLLBACK_IN_PLACE
    else:
        assert kind is RepairKind.RESTORE_AND_REPLAY


def test_stale_rollback_is_refused(ctx: TargetContext) -> None:
    if not ctx.recurrent or not ctx.rollback_window:
        pytest.skip("only recurrent models with in-place rollback have the trap")
    ref = reference(6)
    with SequenceSession.open(ctx) as s:
        s.prefill(prompt())
        s.decode(ref[0])
        s.decode(ref[1])
        # Two single-token decodes: rolling back 2 tokens would restore a stale state
        # (llama.cpp's seq_rm returns True anyway). We refuse.
        with pytest.raises(RollbackRefused):
            s.rollback_in_place(s.n_past - 2)
        s.verify([ref[2], ref[3], ref[4]])
        # Right after a 3-row window, up to 2 tokens roll back ...
        s.rollback_in_place(s.n_past - 2)
        # ... once: a second rollback before the next forward is refused too.
        with pytest.raises(RollbackRefused):
            s.rollback_in_place(s.n_past - 1)
        assert s.usable


def test_two_sessions_in_one_forward(ctx: TargetContext) -> None:
    ref = reference(6)
    other = [testmodels.BOS_ID, *b"another prompt entirely"]
    ref2 = testmodels.reference_continuation(other, 6)
    with SequenceSession.open(ctx) as a, SequenceSession.open(ctx) as b:
        a.prefill(prompt())
        b.prefill(other)
        la, lb = verify_many([(a, ref[:4]), (b, ref2[:4])])
    assert [int(i) for i in la.argmax(axis=1)] == ref[1:5]
    assert [int(i) for i in lb.argmax(axis=1)] == ref2[1:5]


def test_mtp_drafts_match_a_fresh_mtp_context(ctx: TargetContext) -> None:
    if ctx.mtp is None:
        pytest.skip("no MTP head")
    ref = reference(K + 12)
    with SequenceSession.open(ctx) as s:
        s.prefill(prompt())
        s.decode(ref[0])
        assert s.mtp is not None
        # A window with 2 of 4 drafts right, repaired; then draft from the repaired state.
        draft = [ref[2], ref[3], 99, 98]
        _, n = repair_window(s, ref[1], draft)
        committed = [ref[0], ref[1], ref[2], ref[3]][: 1 + n]
        got = s.mtp.draft(committed[-1], s.n_past, K, probs=True)
        plain = s.mtp.draft(committed[-1], s.n_past, K)
    with SequenceSession.open(ctx) as fresh:
        fresh.prefill([*prompt(), *committed[:-1]])
        assert fresh.mtp is not None
        want = fresh.mtp.draft(committed[-1], fresh.n_past, K, probs=True)
    assert got[0] == want[0] == plain[0]
    assert plain[1] == [] and len(got[1]) == K and all(0.0 < p <= 1.0 for p in got[1])
    np.testing.assert_allclose(got[1], want[1], atol=1e-4)
    assert got[0] == testmodels.reference_draft(
        [*prompt(), *committed], K, acceptance=1.0)


def test_sessions_without_the_head_share_a_context_with_one_following_it(
        ctx: TargetContext) -> None:
    """The target outputs the head's hidden rows only for forwards that include a
    session following the head; forwards without one (alone, between the follower's
    own) leave the follower's drafts exactly those of a fresh context."""
    if ctx.mtp is None:
        pytest.skip("no MTP head")
    ref = reference(K + 12)
    with SequenceSession.open(ctx, mtp=False) as bystander, SequenceSession.open(ctx) as s:
        assert bystander.mtp is None and s.mtp is not None
        bystander.prefill(prompt())
        s.prefill(prompt())
        got_bystander = [int(bystander.decode(ref[0]).argmax())]
        s.decode(ref[0])
        got_bystander.append(int(bystander.decode(ref[1]).argmax()))
        la, lb = verify_many([(bystander, [ref[2], ref[3]]), (s, [ref[1], ref[2]])])
        s.retire()
        got_bystander.append(int(la[0].argmax()))
        got_bystander.append(int(la[1].argmax()))
        assert [int(i) for i in lb.argmax(axis=1)] == ref[2:4]
        got = s.mtp.draft(ref[3], s.n_past, K)
    assert got_bystander == ref[1:5]
    with SequenceSession.open(ctx) as fresh:
        fresh.prefill([*prompt(), *ref[:3]])
        assert fresh.mtp is not None
        want = fresh.mtp.draft(ref[3], fresh.n_past, K)
    assert got == want
    assert got[0] == testmodels.reference_draft([*prompt(), *ref[:4]], K, acceptance=1.0)
