"""Prefix cache: reusing a finished session's KV never changes the output."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshd.daemon.runtime import ModelRuntime, RuntimeConfig
from meshd.native import testmodels


def make(kind: str, cache: bool) -> ModelRuntime:
    return ModelRuntime(RuntimeConfig(
        model_path=str(testmodels.test_model_path(kind, acceptance=0.9)), n_ctx_seq=512,
        n_seq_max=2, draft_max=4, calibrate=False, prefix_cache_tokens=None if cache else 0,
    ))


@pytest.fixture(params=["llama", "qwen35"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[ModelRuntime, ModelRuntime]]:
    cached, plain = make(request.param, True), make(request.param, False)
    yield cached, plain
    for rt in (cached, plain):
        assert rt.idle_slots == 2
        rt.close()


def run(rt: ModelRuntime, prompt: list[int], proposer: str = "off") -> list[int]:
    gen = rt.generation(prompt, max_tokens=40, proposer=proposer, adaptive=False)
    for _ in gen.run():
        pass
    return gen.committed


def test_conversation_turns_reuse_the_history(pair: tuple[ModelRuntime, ModelRuntime]) -> None:
    cached, plain = pair
    tok = cached.model.tokenizer
    turn1 = [testmodels.BOS_ID, *tok.tokenize("first turn of a conversation", add_special=False)]
    proposer = "mtp" if cached.model.info.has_mtp else "ngram"
    out1 = run(cached, turn1, proposer)
    assert out1 == run(plain, turn1, proposer)
    # The next turn resends everything so far, plus more.
    turn2 = [*turn1, *out1, *tok.tokenize(" and the second turn", add_special=False)]
    out2 = run(cached, turn2, proposer)
    assert out2 == run(plain, turn2, proposer)
    stats = cached.prefix_cache.stats
    assert stats.hits == 1 and stats.reused_tokens >= len(turn1) + len(out1) - 1
    assert plain.prefix_cache.stats.hits == 0


def test_shared_system_prompt_is_trimmed_and_reused() -> None:
    rt, plain = make("llama", True), make("llama", False)
    try:
        tok = rt.model.tokenizer
        system = [testmodels.BOS_ID, *tok.tokenize("a long shared system prompt " * 3,
                                                   add_special=False)]
        a = [*system, *tok.tokenize("question a", add_special=False)]
        b = [*system, *tok.tokenize("question b", add_special=False)]
        run(rt, a)
        assert run(rt, b) == run(plain, b)
        assert rt.prefix_cache.stats.hits == 1
        assert rt.prefix_cache.stats.reused_tokens >= len(system)
    finally:
        rt.close()
        plain.close()


def test_eviction_keeps_slots_available() -> None:
    rt = make("llama", True)
    try:
        tok = rt.model.tokenizer
        for i in range(5):
            text = f"{'vwxyz'[i]} distinct prompt " * 2  # differs from the 2nd token on
            run(rt, [testmodels.BOS_ID, *tok.tokenize(text, add_special=False)])
        assert len(rt.prefix_cache) <= 2
        assert rt.prefix_cache.stats.evictions >= 3
        assert rt.idle_slots == 2
    finally:
        rt.close()
