"""A hybrid model drops its rollback snapshots while requests do not speculate and gets
them back when one does, with output unchanged either way.

Why: llama.cpp writes the in-place rollback snapshots of every recurrent layer on every
forward, plain decodes included, so a model that keeps them runs slower than plain
decoding when nothing is drafted (the runtime rebuilds its context between requests)."""

from __future__ import annotations

from meshd.daemon.engine import Generation
from meshd.daemon.runtime import ModelRuntime, RuntimeConfig
from meshd.native import testmodels
from meshd.policy.rollback_depth import QUIET_REQUESTS


def _serve(rt: ModelRuntime, prompt: list[int], proposer: str) -> Generation:
    gen = rt.generation(prompt, max_tokens=40, proposer=proposer)
    for _ in gen.run():
        pass
    return gen


def test_snapshots_follow_speculation_and_tokens_do_not_change() -> None:
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=2,
                                    draft_max=4, calibrate=False, threads=1))
    try:
        full = rt.context.rollback_window
        assert full == 4
        prompt = rt.tokenize_prompt("snapshots come and go", chat=False)
        reference = _serve(rt, prompt, "off").committed
        for _ in range(QUIET_REQUESTS - 1):
            assert _serve(rt, prompt, "off").committed == reference
        assert rt.context.rollback_window == full  # switched only between requests
        plain = _serve(rt, prompt, "off")  # opens on the rebuilt context
        assert rt.context.rollback_window == 0
        assert plain.committed == reference
        drafted = _serve(rt, prompt, "mtp")  # checkpoints and replays: still exact
        assert drafted.committed == reference
        assert drafted.stats.accepted >= 0.1 * len(drafted.committed)
        assert drafted.stats.session.checkpoints > 0  # every window needs one
        assert drafted.stats.session.rollbacks_in_place == 0
        again = _serve(rt, prompt, "mtp")  # the snapshots are back
        assert rt.context.rollback_window == full
        assert again.committed == reference
        assert again.stats.drafted > 0
        assert again.stats.session.checkpoints == 0  # windows within the snapshots
    finally:
        rt.close()
    assert rt.rollback is not None


def test_fixed_depth_when_adaptation_is_off() -> None:
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=1,
                                    draft_max=4, calibrate=False, threads=1,
                                    adaptive_rollback=False))
    try:
        prompt = rt.tokenize_prompt("snapshots stay", chat=False)
        for _ in range(QUIET_REQUESTS + 1):
            _serve(rt, prompt, "off")
        assert rt.context.rollback_window == 4 and rt.rollback is None
    finally:
        rt.close()
