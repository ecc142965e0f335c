"""Several hybrid (recurrent) sequences verified in shared forwards and repaired stay
exactly what each would be alone.

Why: llama.cpp runs one forward as micro-batches, and a later micro-batch can move an
earlier sequence's state cell without its rollback snapshots (meshd.native.batching), so
an in-place rollback after a badly shared forward restores a stale state. Sessions are
grouped into forwards by ``forward_groups``; these tests drive the real runtime through
random windows, rollbacks, checkpoints and session churn (sequence ids reused, cells
reordered) and check every verified row against the synthetic model's designed rule.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import attrs
import numpy as np
import pytest

from meshd.native.batching import forward_groups
from meshd.native.context import ContextConfig, TargetContext
from meshd.native.model import Model
from meshd.native.session import SequenceSession, verify_many
from meshd.policy.decision import Decision, RepairCaps, RepairKind, decide, needs_checkpoint
from meshd.testing import testmodels

K = 6
SLOTS = 4


@pytest.fixture(scope="module")
def qwen35() -> Iterator[Model]:
    model = Model.load(testmodels.test_model_path("qwen35", acceptance=1.0))
    yield model
    model.close()


def make_context(model: Model, *, rollback: bool = True, mtp: bool = False,
                 slots: int = SLOTS) -> TargetContext:
    return TargetContext(model, ContextConfig(
        n_ctx_seq=512, n_seq_max=slots, draft_max=K, use_mtp=mtp, n_threads=1,
        in_place_rollback=rollback))


# ---------------------------------------------------------------------- the grouping


def test_recurrent_windows_group_by_rows_and_consecutive_sequences() -> None:
    windows = [(0, 4), (1, 1), (2, 4), (3, 4), (5, 1), (4, 1)]
    groups = forward_groups(windows, recurrent=True, n_batch=512)
    assert [[windows[i] for i in g] for g in groups] == [
        [(0, 4)], [(2, 4), (3, 4)], [(1, 1)], [(4, 1), (5, 1)]]
    assert forward_groups(windows, recurrent=False, n_batch=512) == [[0, 1, 2, 3, 5, 4]]
    # Every group fits n_batch rows.
    assert forward_groups([(0, 3), (1, 3), (2, 3)], recurrent=True, n_batch=6) == [[0, 1], [2]]
    assert forward_groups([(0, 3), (1, 3), (2, 3)], recurrent=False, n_batch=7) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="longer than n_batch"):
        forward_groups([(0, 9)], recurrent=True, n_batch=8)


def test_verify_many_refuses_windows_llama_cpp_would_split(qwen35: Model) -> None:
    ctx = make_context(qwen35, slots=2)
    try:
        with SequenceSession.open(ctx) as a, SequenceSession.open(ctx) as b:
            a.prefill([testmodels.BOS_ID, *b"one"])
            b.prefill([testmodels.BOS_ID, *b"two"])
            with pytest.raises(ValueError, match="cannot share one forward"):
                verify_many([(a, [65, 66]), (b, [67])])
            assert a.n_past == b.n_past == 4  # nothing ran
            # Given out of order, the rows still go in sequence order; logits come back
            # in the order given.
            lb, la = verify_many([(b, [67]), (a, [65])])
            assert la.shape == lb.shape == (1, ctx.n_vocab)
    finally:
        ctx.close()


def test_sessions_take_the_lowest_free_sequence_id(qwen35: Model) -> None:
    """So that concurrent sessions sit on consecutive ids, which hybrid forwards need."""
    ctx = make_context(qwen35)
    try:
        sessions = [SequenceSession.open(ctx) for _ in range(3)]
        assert [s.seq_id for s in sessions] == [0, 1, 2]
        sessions[0].close()
        sessions[2].close()
        again = SequenceSession.open(ctx)
        assert again.seq_id == 0
        again.close()
        sessions[1].close()
    finally:
        ctx.close()


# ---------------------------------------------------------------------- the smallest case


@pytest.mark.parametrize("prefill_order", list(itertools.permutations(range(3))))
def test_a_window_before_a_micro_batch_that_moves_its_cell(
        qwen35: Model, prefill_order: tuple[int, ...]) -> None:
    """Sequences 0, 1, 2 whose state cells follow the prefill order; sequence 0 verifies
    3 rows and 1, 2 one row each, then 0 rolls back. As one forward, llama.cpp runs
    ``[0]`` then ``[1, 2]``, and for the prefill orders (1, 0, 2) and (2, 0, 1) the second
    micro-batch moves sequence 0's cell, so its rollback read another cell's snapshots
    (logits off by 0.5 to 10). Grouped, every sequence's next logits equal a fresh one's."""
    ctx = make_context(qwen35, slots=4)
    prompts = [[testmodels.BOS_ID, *p] for p in (b"first one", b"second", b"third prompt")]
    refs = [testmodels.reference_continuation(p, 8) for p in prompts]
    try:
        sessions = [SequenceSession.open(ctx) for _ in prompts]
        for i in prefill_order:
            sessions[i].prefill(prompts[i])
        windows = [[*refs[0][:2], refs[0][2] ^ 1], refs[1][:1], refs[2][:1]]
        groups = forward_groups(
            [(s.seq_id, len(w)) for s, w in zip(sessions, windows, strict=True)],
            recurrent=True, n_batch=ctx.config.n_batch)
        assert len(groups) == 2
        for group in groups:
            rows = verify_many([(sessions[i], windows[i]) for i in group])
            for i, lg in zip(group, rows, strict=True):
                assert [int(t) for t in lg.argmax(axis=1)][:2] == refs[i][1:1 + min(2, len(lg))]
            if 0 in group:
                sessions[0].rollback_in_place(sessions[0].n_past - 1)
        nexts = [refs[0][2], refs[1][1], refs[2][1]]
        got = [s.decode(t) for s, t in zip(sessions, nexts, strict=True)]
        histories = [prompts[0] + refs[0][:3], prompts[1] + refs[1][:2],
                     prompts[2] + refs[2][:2]]
        for s in sessions:
            s.close()
        for lg, history in zip(got, histories, strict=True):
            with SequenceSession.open(ctx) as fresh:
                np.testing.assert_allclose(lg, fresh.prefill(history), atol=1e-3)
    finally:
        ctx.close()


# ---------------------------------------------------------------------- random search


@attrs.define
class Stream:
    """One session following the designed rule: ``ref[:committed]`` is in its state."""

    session: SequenceSession
    ref: list[int]
    committed: int = 1


def _open(ctx: TargetContext, rng: random.Random, mtp: bool) -> Stream:
    s = SequenceSession.open(ctx, mtp=mtp)
    prompt = [testmodels.BOS_ID, *(rng.choice(b"abcdefghij klmnop") for _ in range(
        rng.randint(1, 12)))]
    ref = testmodels.reference_continuation(prompt, 400)
    assert int(s.prefill(prompt).argmax()) == ref[0]
    return Stream(s, ref)


def _apply(s: SequenceSession, decision: Decision) -> None:
    """Apply a greedy decision's repair, as the engine does."""
    kind, repair = decision.repair.kind, decision.repair
    if kind is RepairKind.ROLLBACK_IN_PLACE:
        s.rollback_in_place(repair.keep_to)
    elif kind is RepairKind.RESTORE_AND_REPLAY:
        s.restore_and_replay(repair.keep_to, repair.replay)
    else:
        assert kind is RepairKind.RETIRE
        s.retire()


def run_random(ctx: TargetContext, seed: int, *, steps: int = 30, mtp: bool = False) -> None:
    """Random windows (0..K drafts, a random number of them right), random session churn;
    each step's windows verified in ``forward_groups`` forwards, each forward's repairs
    (restore-and-replay last) before the next one. Every row that predicts a committed
    token must predict the designed one."""
    rng = random.Random(seed)
    streams = [_open(ctx, rng, mtp) for _ in range(ctx.config.n_seq_max)]
    try:
        for step in range(steps):
            if rng.random() < 0.15:
                streams.pop(rng.randrange(len(streams))).session.close()
                streams.append(_open(ctx, rng, mtp))
            rng.shuffle(streams)
            windows = []
            for st in streams:
                c, k = st.committed, rng.choice([0, 0, 1, 2, 3, 4, 5, 6])
                right = rng.randint(0, k)
                draft = st.ref[c:c + right] + [t ^ 1 for t in st.ref[c + right:c + k]]
                windows.append([st.ref[c - 1], *draft])
                caps = RepairCaps(True, st.session.rollback_window, False)
                if needs_checkpoint(k, caps):
                    st.session.checkpoint()
            for group in forward_groups(
                    [(st.session.seq_id, len(w)) for st, w in zip(streams, windows, strict=True)],
                    recurrent=True, n_batch=ctx.config.n_batch):
                bases = [streams[i].session.n_past for i in group]
                rows = verify_many([(streams[i].session, windows[i]) for i in group])
                decided = []
                for i, lg, base in zip(group, rows, bases, strict=True):
                    st, s = streams[i], streams[i].session
                    preds = [int(t) for t in lg.argmax(axis=1)]
                    d = decide(last=windows[i][0], base=base, draft=windows[i][1:],
                               predictions=preds, remaining=1000, eog=set(),
                               caps=RepairCaps(True, s.rollback_window, s.has_checkpoint))
                    n = len(d.committed)
                    assert list(d.committed) == st.ref[st.committed:st.committed + n], (
                        f"seed {seed} step {step} sequence {s.seq_id}")
                    st.committed += n
                    decided.append((s, d))
                # Restore-and-replay decodes: after the in-place rollbacks, as the engine.
                decided.sort(key=lambda t: t[1].repair.kind is RepairKind.RESTORE_AND_REPLAY)
                for s, d in decided:
                    _apply(s, d)
    finally:
        for st in streams:
            st.session.close()


@pytest.mark.parametrize("variant", ["rollback", "checkpoint", "rollback-mtp"])
def test_shared_forwards_equal_each_sequence_alone(qwen35: Model, variant: str) -> None:
    ctx = make_context(qwen35, rollback=variant != "checkpoint", mtp=variant.endswith("mtp"))
    try:
        for seed in range(40):
            run_random(ctx, seed, mtp=variant.endswith("mtp"))
        assert ctx.free_slots == SLOTS
    finally:
        ctx.close()
