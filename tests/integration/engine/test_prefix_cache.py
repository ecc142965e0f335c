"""Prefix cache: reusing a finished session's KV never changes the output."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.testing import testmodels


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
    for _ in rt.run(gen):
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


def test_interleaved_chats_each_reuse_their_own_history() -> None:
    """Two chats that open with one system prompt, their turns interleaved (what a
    server with two users sees): each later turn reuses its own chat's history, not
    just the system prompt (the first chat's session is copied up to the system prompt
    for the second, not taken over), and the text is the text without the cache."""
    rt, plain = make("llama", True), make("llama", False)
    try:
        tok = rt.model.tokenizer
        system = [testmodels.BOS_ID, *tok.tokenize("a long shared system prompt " * 3,
                                                   add_special=False)]
        chats = {name: [*system, *tok.tokenize(f"chat {name} asks", add_special=False)]
                 for name in "ab"}
        held = {name: 0 for name in chats}  # what the chat's last turn left in its KV
        for turn in range(2):
            for name, prompt in chats.items():
                before = rt.prefix_cache.stats.reused_tokens
                out = run(rt, prompt)
                assert out == run(plain, prompt), (name, turn)
                reused = rt.prefix_cache.stats.reused_tokens - before
                if turn == 0:
                    assert reused >= len(system) if name == "b" else reused == 0
                else:  # this chat's last prompt and answer (its last token never decoded)
                    assert reused >= held[name] - 1, (name, reused, held[name])
                held[name] = len(prompt) + len(out)
                prompt += [*out, *tok.tokenize(" and then", add_special=False)]
        assert rt.prefix_cache.stats.branches == 1
        assert rt.idle_slots == 2
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


def _mtp_forwards(rt: ModelRuntime) -> int:
    assert rt.context.mtp is not None
    return rt.context.mtp.forwards


@pytest.mark.parametrize("kind", ["qwen35", "mimo2"])
def test_only_requests_drafting_with_the_mtp_head_pay_for_it(kind: str) -> None:
    """Catching the MTP head up costs an MTP forward per target forward: a request whose
    proposer does not draft with it (off, ngram) must not run it, and gets the same
    tokens as one that does."""
    rt = make(kind, False)
    try:
        prompt = [testmodels.BOS_ID, *rt.model.tokenizer.tokenize("lazy head", add_special=False)]
        outputs = {}
        for proposer in ("off", "ngram", "mtp"):
            before = _mtp_forwards(rt)
            outputs[proposer] = run(rt, prompt, proposer)
            ran = _mtp_forwards(rt) - before
            assert (ran > 0) == (proposer == "mtp"), (proposer, ran)
        assert outputs["off"] == outputs["ngram"] == outputs["mtp"]
        assert outputs["off"] == testmodels.reference_continuation(prompt, 40)
    finally:
        rt.close()


def test_mtp_requests_reuse_only_sessions_that_followed_the_head() -> None:
    """The head cannot catch up on history it did not see: a session cached by a request
    without MTP is no use to one with MTP; the other way round it is (the session stops
    following the head), and the output never changes."""
    cached, plain = make("mimo2", True), make("mimo2", False)
    try:
        tok = cached.model.tokenizer
        turn1 = [testmodels.BOS_ID, *tok.tokenize("first turn of a talk", add_special=False)]
        out1 = run(cached, turn1, "off")
        turn2 = [*turn1, *out1, *tok.tokenize(" then more", add_special=False)]
        out2 = run(cached, turn2, "mtp")
        assert cached.prefix_cache.stats.hits == 0  # the off session could not serve it
        assert out2 == run(plain, turn2, "mtp")
        turn3 = [*turn2, *out2, *tok.tokenize(" and more", add_special=False)]
        before = _mtp_forwards(cached)
        out3 = run(cached, turn3, "off")
        assert cached.prefix_cache.stats.hits == 1  # the MTP session served the off one
        assert _mtp_forwards(cached) == before
        assert out3 == run(plain, turn3, "off")
    finally:
        for rt in (cached, plain):
            assert rt.idle_slots == 2
            rt.close()
