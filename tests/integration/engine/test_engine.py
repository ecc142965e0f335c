"""The merge gate: speculation never changes the token stream, for every proposer.

Runs the real engine on the real llama.cpp runtime: synthetic models (attention-only
llama, hybrid recurrent qwen35 with an MTP head, attention-only mimo2 with an MTP head)
whose logits have clear margins, so identity with ``--proposer off`` must be exact, and the
quantized SmolLM2 on fixed prompts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.bench.workloads import load_workloads
from meshd.daemon.engine.generation import Generation
from meshd.daemon.engine.sampling import SamplingParams
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native import draft as native_draft
from meshd.native.calibrate import MtpCosts
from meshd.native.context import DEFAULT_DRAFT_MAX, ROLLBACK_MAX
from meshd.plugins.base import Capabilities, Outcome, Proposal, ProposalRequest, ProposerEnv
from meshd.plugins.registry import Registry, default_registry
from meshd.policy.costs import CostCurve
from meshd.policy.decision import FinishReason
from meshd.testing import testmodels

# "qwen35-ckpt": the hybrid model with in-place rollback off, so every rejected draft is
# repaired by restoring a checkpoint and replaying the accepted tokens.
SYNTHETIC = ["llama", "qwen35", "qwen35-ckpt", "mimo2"]
PROPOSERS = {"llama": ["ngram", "composite"], "qwen35": ["mtp", "ngram", "composite"],
             "qwen35-ckpt": ["mtp", "ngram"], "mimo2": ["mtp", "ngram", "composite"]}
# The synthetic models rarely repeat a bigram (by design), so let n-gram lookup match
# single tokens: its drafts are then often wrong, which exercises every repair path.
OPTIONS: dict[str, dict[str, object]] = {
    "ngram": {"min_n": 1},
    "composite": {"ngram": {"min_n": 1}},
}
_runtimes: dict[tuple[str, float], ModelRuntime] = {}


#: Longer than the in-place rollback depth, so recurrent models also take checkpoints.
K_MAX = DEFAULT_DRAFT_MAX
assert K_MAX > ROLLBACK_MAX

def runtime(kind: str, acceptance: float = 0.9) -> ModelRuntime:
    key = (kind, acceptance)
    if key not in _runtimes:
        arch, _, variant = kind.partition("-")
        path = None if arch == "smollm2" else str(
            testmodels.test_model_path(arch, acceptance=acceptance))
        _runtimes[key] = ModelRuntime(
            RuntimeConfig(model_path=path, n_ctx_seq=1024, n_seq_max=2, draft_max=K_MAX,
                          calibrate=False, in_place_rollback=variant != "ckpt"),
            registry=default_registry(),
        )
        # A cheap-verify cost curve (like F32/F16 models) so the composite speculates.
        _runtimes[key].curve = CostCurve.sanitized([1.0 + 0.15 * k for k in range(K_MAX + 1)])
    return _runtimes[key]


@pytest.fixture(scope="module", autouse=True)
def _close_runtimes() -> Iterator[None]:
    yield
    for rt in _runtimes.values():
        assert rt.idle_slots == rt.context.config.n_seq_max, "leaked session slot"
        rt.close()
    _runtimes.clear()


def generate(
    rt: ModelRuntime, prompt: Sequence[int], *, proposer: str = "off", k: int = 0,
    max_tokens: int = 64, sampling: SamplingParams | None = None, stop: Sequence[str] = (),
    cancel_at: int | None = None,
) -> Generation:
    gen = rt.generation(prompt, max_tokens=max_tokens, sampling=sampling or SamplingParams(),
                        stop=stop, proposer=proposer, draft_max=k, adaptive=False,
                        proposer_options=OPTIONS.get(proposer))
    if cancel_at is not None:
        gen.cancel(at_emitted=cancel_at)
    for _ in rt.run(gen):
        pass
    assert rt.idle_slots == rt.context.config.n_seq_max
    return gen


def prompt_for(rt: ModelRuntime, text: str) -> list[int]:
    return rt.model.tokenizer.tokenize(text, add_special=True)


texts = st.text(alphabet="abcdefghij klmnop\n", min_size=1, max_size=40)


@pytest.mark.parametrize("kind", SYNTHETIC)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=texts, k=st.integers(1, K_MAX), max_tokens=st.integers(1, 120), data=st.data())
def test_identity_greedy(
    kind: str, text: str, k: int, max_tokens: int, data: st.DataObject
) -> None:
    rt = runtime(kind)
    prompt = prompt_for(rt, text)
    ref = generate(rt, prompt, max_tokens=max_tokens)
    proposer = data.draw(st.sampled_from(PROPOSERS[kind]), label="proposer")
    got = generate(rt, prompt, proposer=proposer, k=k, max_tokens=max_tokens)
    assert got.committed == ref.committed
    assert got.finish == ref.finish
    assert got.text == ref.text


@pytest.mark.parametrize("kind", SYNTHETIC)
@pytest.mark.parametrize("k", [1, 3, 8, K_MAX])  # K_MAX > ROLLBACK_MAX: checkpoints
def test_identity_every_proposer(kind: str, k: int) -> None:
    rt = runtime(kind)
    prompt = prompt_for(rt, "abc abc abc def")
    ref = generate(rt, prompt, max_tokens=100)
    assert len(ref.committed) > 10
    for proposer in PROPOSERS[kind]:
        got = generate(rt, prompt, proposer=proposer, k=k, max_tokens=100)
        assert got.committed == ref.committed, proposer
        assert got.stats.verify_calls > 0, f"{proposer} never speculated: the test is void"


@pytest.mark.parametrize("kind", SYNTHETIC)
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, K_MAX), temp=st.floats(0.3, 1.5))
def test_identity_seeded_sampling(kind: str, seed: int, k: int, temp: float) -> None:
    rt = runtime(kind)
    prompt = prompt_for(rt, "sampled text")
    sp = SamplingParams(temperature=temp, seed=seed, top_k=40, top_p=0.95)
    ref = generate(rt, prompt, max_tokens=80, sampling=sp)
    for proposer in PROPOSERS[kind]:
        got = generate(rt, prompt, proposer=proposer, k=k, max_tokens=80, sampling=sp)
        assert got.committed == ref.committed, proposer


def test_unseeded_sampling_is_not_speculated() -> None:
    rt = runtime("llama")
    gen = generate(rt, prompt_for(rt, "abc"), proposer="ngram", k=4, max_tokens=30,
                   sampling=SamplingParams(temperature=0.8))
    assert gen.stats.verify_calls == 0
    assert gen.stats.refusals.get("unseeded_sampling", 0) >= 1


@pytest.mark.parametrize("kind", SYNTHETIC)
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(cancel_at=st.integers(0, 60), k=st.integers(1, K_MAX))
def test_cancellation_point(kind: str, cancel_at: int, k: int) -> None:
    rt = runtime(kind)
    prompt = prompt_for(rt, "cancel me please")
    ref = generate(rt, prompt, max_tokens=60)
    got = generate(rt, prompt, proposer=PROPOSERS[kind][0], k=k, max_tokens=60,
                   cancel_at=cancel_at)
    assert got.committed == ref.committed[:cancel_at]
    if cancel_at < len(ref.committed):
        assert got.finish is FinishReason.CANCELLED
    # A cut commit never retires the window: the state holds exactly the committed
    # history (minus the last token, not yet decoded), or was discarded.
    assert got.session.n_past in (0, len(prompt) + len(got.committed) - 1)


def test_mtp_forwards_at_full_acceptance() -> None:
    """qwen35 at acceptance 1.0, k=3: about one target forward per 4 tokens."""
    rt = runtime("qwen35", acceptance=1.0)
    n = 120
    gen = generate(rt, prompt_for(rt, "full acceptance"), proposer="mtp", k=3, max_tokens=n)
    assert len(gen.committed) == n
    decode_forwards = gen.stats.session.target_forwards - gen.stats.session.prefill_forwards
    assert decode_forwards <= math.ceil(n / 4) + 1
    assert gen.stats.accepted >= 0.9 * gen.stats.drafted


@pytest.mark.parametrize("kind", ["qwen35", "qwen35-ckpt"])
def test_mtp_zero_acceptance_commits_one_token_per_step(kind: str) -> None:
    rt = runtime(kind, acceptance=0.0)
    prompt = prompt_for(rt, "zero acceptance")
    ref = generate(rt, prompt, max_tokens=80)
    gen = generate(rt, prompt, proposer="mtp", k=3, max_tokens=80)
    assert gen.committed == ref.committed
    st = gen.stats
    assert st.accepted == 0 and st.verify_calls > 20
    # Every window committed exactly one token: one decode forward per token.
    c = st.session
    assert c.target_forwards - c.prefill_forwards - c.restores == len(gen.committed) - 1
    # ... and every rejected window was undone, in place or from a checkpoint.
    if kind == "qwen35":
        assert st.session.rollbacks_in_place == st.verify_calls and st.session.checkpoints == 0
    else:
        assert st.session.restores == st.verify_calls == st.session.checkpoints


def test_max_tokens_inside_a_window() -> None:
    rt = runtime("qwen35", acceptance=1.0)
    prompt = prompt_for(rt, "budget")
    ref = generate(rt, prompt, max_tokens=50)
    for n in (1, 2, 5, 7, 13):
        gen = generate(rt, prompt, proposer="mtp", k=8, max_tokens=n)
        assert gen.committed == ref.committed[:n]
        assert gen.finish is FinishReason.LENGTH


def test_stop_string_inside_window() -> None:
    rt = runtime("llama")
    prompt = prompt_for(rt, "stop")
    ref = generate(rt, prompt, max_tokens=80)
    stop = ref.text[20:23]
    assert stop and stop in ref.text
    got = generate(rt, prompt, proposer="ngram", k=8, max_tokens=80, stop=[stop])
    assert got.finish is FinishReason.STOP
    assert got.text == ref.text[: ref.text.index(stop)]
    assert got.committed == ref.committed[: len(got.committed)]


# --------------------------------------------------------------------------- faults


class FaultyProposer:
    name = "faulty"

    def __init__(self, mode: str, vocab: int) -> None:
        self.mode = mode
        self.vocab = vocab
        self.capabilities = Capabilities(max_len=8)

    def propose(self, request: ProposalRequest) -> Proposal | None:
        if self.mode == "raises":
            raise RuntimeError("boom")
        if self.mode == "out_of_vocab":
            return Proposal((self.vocab + 5, 1))
        if self.mode == "too_long":
            return Proposal(tuple([1] * (request.max_len + 5)))
        return None

    def observe(self, outcome: Outcome) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("mode", "fault"), [
    ("raises", "error"), ("out_of_vocab", "invalid_token"), ("too_long", "too_long"),
    ("empty", None),
])
def test_proposer_faults_do_not_change_output(mode: str, fault: str | None) -> None:
    base = runtime("llama")
    reg = Registry()
    reg.register("faulty", lambda env: FaultyProposer(mode, env.vocab_size))
    rt = base
    old = rt.registry
    rt.registry = reg
    try:
        prompt = prompt_for(rt, "faults")
        ref = generate(rt, prompt, max_tokens=40)
        got = generate(rt, prompt, proposer="faulty", k=4, max_tokens=40)
    finally:
        rt.registry = old
    assert got.committed == ref.committed
    if fault is None:
        assert got.stats.refusals.get("proposer_empty", 0) > 0
    else:
        assert got.stats.proposer_faults.get(fault, 0) > 0


def test_unknown_proposer_is_a_clear_error() -> None:
    rt = runtime("llama")
    with pytest.raises(ValueError, match="unknown proposer 'nope'"):
        rt.generation(prompt_for(rt, "x"), max_tokens=4, proposer="nope")
    assert rt.idle_slots == rt.context.config.n_seq_max


def test_mtp_on_model_without_head_is_a_clear_error() -> None:
    rt = runtime("llama")
    with pytest.raises(ValueError, match="no MTP head"):
        rt.generation(prompt_for(rt, "x"), max_tokens=4, proposer="mtp")


# --------------------------------------------------------------------------- SmolLM2

SMOL_PROMPTS = [
    "Rewrite this code with type hints:\ndef add(a, b):\n    return a + b\n",
    '{"name": "x", "items": [1, 2, 3]} Reformat this JSON with indentation:',
]


@pytest.mark.parametrize("text", SMOL_PROMPTS)
def test_identity_on_quantized_smollm2(text: str) -> None:
    rt = runtime("smollm2")
    prompt = prompt_for(rt, text)
    ref = generate(rt, prompt, max_tokens=60)
    for k in (2, 5):
        got = generate(rt, prompt, proposer="ngram", k=k, max_tokens=60)
        assert got.committed == ref.committed


@pytest.mark.parametrize("workload", ["csv-to-markdown", "quote-passage"])
def test_identity_on_smollm2_past_256_tokens(workload: str) -> None:
    """Prompts of 400 tokens (real copy work, where prompt lookup drafts long windows):
    speculation keeps plain decoding's text with the default cache, where one-token
    decodes and verify windows run the same attention kernel; with an f16 K cache
    these texts leave plain decoding's within the first ten tokens (docs/identity.md,
    Identity and its limits)."""
    (wl,) = load_workloads([workload])
    rt = runtime("smollm2")
    prompt = prompt_for(rt, rt.render_chat([{"role": r, "content": c} for r, c in wl.messages]))
    assert len(prompt) > 300
    ref = generate(rt, prompt, max_tokens=48)
    for k in (4, K_MAX):
        got = generate(rt, prompt, proposer="ngram", k=k, max_tokens=48)
        assert got.stats.drafted > 0
        assert got.committed == ref.committed, k


def test_a_prefix_cache_hit_keeps_the_text() -> None:
    """A request whose prompt extends an earlier one's (its KV reused from the cache,
    only the rest prefilled, in a batch of a few rows) gives the greedy text of a
    fresh prefill, past 256 tokens too."""
    (wl,) = load_workloads(["quote-passage"])
    cached, fresh = (ModelRuntime(RuntimeConfig(n_ctx_seq=1024, calibrate=False,
                                                prefix_cache_tokens=tokens))
                     for tokens in (None, 0))
    try:
        text = cached.render_chat([{"role": r, "content": c} for r, c in wl.messages])
        prompt = prompt_for(cached, text)
        first = generate(cached, prompt, max_tokens=24)
        longer = prompt + list(first.committed)[:5]
        again = generate(cached, longer, max_tokens=24)
        assert again.stats.reused_prompt_tokens > 300
        assert again.committed == generate(fresh, longer, max_tokens=24).committed
    finally:
        cached.close()
        fresh.close()


def test_env_is_passed_to_factories() -> None:
    seen: list[ProposerEnv] = []

    def factory(env: ProposerEnv) -> FaultyProposer:
        seen.append(env)
        return FaultyProposer("empty", env.vocab_size)

    rt = runtime("qwen35")
    reg = Registry()
    reg.register("spy", factory)
    old, rt.registry = rt.registry, reg
    try:
        generate(rt, prompt_for(rt, "x"), proposer="spy", k=2, max_tokens=3)
    finally:
        rt.registry = old
    assert seen and seen[0].mtp is not None and seen[0].vocab_size == rt.model.info.n_vocab


# --------------------------------------------------------------------------- draft model


@pytest.mark.parametrize("kind", ["qwen35", "qwen35-ckpt", "mimo2"])
@pytest.mark.parametrize("k", [2, 5])
def test_draft_model_identity(kind: str, k: int) -> None:
    """A synthetic llama (same vocabulary, same rule) drafts for the other models."""
    rt = runtime(kind)
    draft = f"draft:{testmodels.test_model_path('llama')}"
    prompt = prompt_for(rt, "drafted by a smaller model")
    ref = generate(rt, prompt, max_tokens=90)
    got = generate(rt, prompt, proposer=draft, k=k, max_tokens=90)
    assert got.committed == ref.committed
    assert got.stats.verify_calls > 0
    assert got.stats.accepted >= 0.9 * got.stats.drafted  # the same rule: near-total


def test_a_long_prompt_reaches_the_draft_model_a_slice_per_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft model's copy of a long prompt is prefilled a slice per proposal, so no
    step (and no other request's next token) waits for the whole prompt on the draft
    model: the first proposals offer nothing while it catches up, then it drafts, and the
    text is plain decoding's."""
    monkeypatch.setattr(native_draft, "CATCH_UP_S", 0.0)  # one chunk a step, any CPU
    slices: list[tuple[int, bool]] = []
    real = native_draft.DraftSequence.draft

    def spy(self: native_draft.DraftSequence, tokens: Sequence[int], k: int,
            **kw: bool) -> tuple[list[int], list[float]]:
        before = self.session.counters.prefill_tokens
        out = real(self, tokens, k, **kw)
        slices.append((self.session.counters.prefill_tokens - before, bool(out[0])))
        return out

    monkeypatch.setattr(native_draft.DraftSequence, "draft", spy)
    rt = runtime("mimo2")
    prompt = prompt_for(rt, " ".join(f"item {i} of the list" for i in range(400)))[:700]
    ref = generate(rt, prompt, max_tokens=40)
    got = generate(rt, prompt, proposer=f"draft:{testmodels.test_model_path('llama')}",
                   k=4, max_tokens=40)
    assert got.committed == ref.committed
    assert max(n for n, _ in slices) <= native_draft.PREFILL_CHUNK < len(prompt)
    catching_up = [d for _, d in slices[:len(prompt) // native_draft.PREFILL_CHUNK]]
    assert not any(catching_up), slices
    assert any(d for _, d in slices) and got.stats.accepted > 0


def test_draft_model_errors_are_clear() -> None:
    rt = runtime("llama")
    prompt = prompt_for(rt, "x")
    smol = runtime("smollm2").model.info.path
    with pytest.raises(ValueError, match=r"differs from the target|tokens, the target has"):
        rt.generation(prompt, max_tokens=4, proposer=f"draft:{smol}")
    with pytest.raises(ValueError, match="not found"):
        rt.generation(prompt, max_tokens=4, proposer="draft:/nonexistent/model.gguf")
    with pytest.raises(ValueError, match="attention-only"):
        rt.generation(prompt, max_tokens=4,
                      proposer=f"draft:{testmodels.test_model_path('qwen35', acceptance=0.9)}")
    with pytest.raises(ValueError, match="draft:PATH"):
        rt.generation(prompt, max_tokens=4, proposer="draft")
    assert rt.idle_slots == rt.context.config.n_seq_max


@pytest.mark.parametrize("kind", ["qwen35", "mimo2"])
def test_an_mtp_head_that_cannot_pay_is_dropped(kind: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every verified row costs a full decode (a Q4_1-like cost curve, set by hand:
    timings on a shared machine are no test input) nothing can pay for catching the head
    up after every forward, whatever it costs. The engine measures that cost, stops
    following the head and decodes the rest plainly: same tokens, no further MTP
    forwards."""
    path = str(testmodels.test_model_path(kind, acceptance=1.0))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=1,
                                    calibrate=False))
    try:
        assert rt.context.mtp is not None
        prompt = prompt_for(rt, "the head does not pay here")
        ref = generate(rt, prompt, max_tokens=200)
        # The curve stays the hand-set one: measured forwards would replace it (which is
        # the point of measuring, but this test is about the curve given, and on a quiet
        # machine this tiny model's measured 3-row forward costs ~1.1 decodes: the head
        # then pays, and is rightly kept).
        rt.curve = CostCurve([1.0 + k for k in range(K_MAX + 1)])
        assert rt.costs is not None
        monkeypatch.setattr(rt.costs, "record", lambda *args, **kwargs: None)
        gen = rt.generation(prompt, max_tokens=200, proposer="mtp", adaptive=True)
        forwards_at_drop = None
        for _ in rt.run(gen):
            if forwards_at_drop is None and gen.stats.refusals.get("mtp_head_dropped"):
                forwards_at_drop = rt.context.mtp.forwards
        assert gen.committed == ref.committed
        assert gen.stats.refusals.get("mtp_head_dropped") == 1, gen.stats.refusals
        assert forwards_at_drop is not None and rt.context.mtp.forwards == forwards_at_drop
        assert rt.idle_slots == rt.context.config.n_seq_max
    finally:
        rt.close()


@pytest.mark.quiet_machine  # calibrate=True measures the machine
def test_auto_uses_the_head_only_where_it_can_pay() -> None:
    """Calibration measures the head (its catch-up and drafting times, positive numbers
    on any machine); what ``auto`` then means follows from them: prompt lookup where
    even perfect drafts could not pay for the head (the synthetic models, whose head
    costs about as much as their whole forward), MTP where it is cheap. The costs are
    set by hand for the decision, since timings on a shared machine are no test input."""
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=1,
                                    calibrate=True))
    try:
        m = rt.mtp_costs
        assert m is not None and m.overhead > 0 and m.draft_cost > 0, m
        rt.curve = CostCurve.sanitized([1.0 + 0.1 * k for k in range(17)])
        rt.mtp_costs = MtpCosts(overhead=0.9, draft_cost=0.9)
        assert not rt.mtp_head_pays
        assert rt.resolve_proposer("auto") == "composite"  # prompt and history lookup
        assert rt.resolve_proposer("mtp") == "mtp"  # asked for by name, it is still used
        rt.mtp_costs = MtpCosts(overhead=0.05, draft_cost=0.1)
        assert rt.mtp_head_pays and rt.resolve_proposer("auto") == "mtp"
    finally:
        rt.close()


@pytest.mark.quiet_machine  # calibrate=True measures the machine
@pytest.mark.parametrize(("acceptance", "auto"), [(0.0, "composite"), (1.0, "mtp")])
def test_auto_follows_the_heads_acceptance_pooled_over_requests(
        acceptance: float, auto: str) -> None:
    """With a head cheap enough to pay at acceptance 1, ``auto`` drafts with it until
    requests have measured its acceptance; then it keeps the head only where that
    acceptance pays (the costs are set by hand, as above; the acceptance is measured)."""
    path = str(testmodels.test_model_path("qwen35", acceptance=acceptance))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=1,
                                    calibrate=True, draft_max=4))
    try:
        rt.curve = CostCurve.sanitized([1.0 + 0.1 * k for k in range(5)])
        rt.mtp_costs = MtpCosts(overhead=0.05, draft_cost=0.1)
        assert rt.resolve_proposer("auto") == "mtp"
        prompt = prompt_for(rt, "pooled acceptance")
        gen = rt.generation(prompt, max_tokens=64, proposer="mtp", adaptive=False)
        for _ in rt.run(gen):
            pass
        assert gen.stats.drafted >= rt.ledger.mtp_acceptance.min_drafts
        assert rt.resolve_proposer("auto") == auto
        assert rt.resolve_proposer("mtp") == "mtp"
    finally:
        rt.close()


@pytest.mark.quiet_machine  # calibrate=True measures the machine
def test_auto_serves_without_a_head_that_earlier_requests_dropped() -> None:
    """A request that follows a head whose drafts are always wrong drops it (its evidence
    windows all miss); ``auto`` then serves the next requests without the head (no
    catch-up forwards), and follows it again after ``explore_every`` of them, in case
    what the model is asked has changed. Costs set by hand, as above."""
    path = str(testmodels.test_model_path("qwen35", acceptance=0.0))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=1,
                                    calibrate=True, draft_max=4))
    try:
        rt.curve = CostCurve.sanitized([1.0 + 0.1 * k for k in range(5)])
        rt.mtp_costs = MtpCosts(overhead=0.05, draft_cost=0.1)
        prompt = prompt_for(rt, "a head that never pays")

        def serve() -> Generation:
            gen = rt.generation(prompt, max_tokens=48, proposer="auto")
            for _ in rt.run(gen):
                pass
            return gen

        first = serve()
        assert first.proposer_name == "mtp"
        assert first.stats.refusals.get("mtp_head_dropped") == 1
        assert 0 < first.stats.drafted < rt.ledger.mtp_acceptance.min_drafts, first.stats.drafted
        assert first.stats.accepted == 0
        for _ in range(rt.ledger.head_choice.explore_every):
            gen = serve()
            assert gen.proposer_name == "composite" and gen.stats.session.mtp_ms == 0.0
        again = serve()
        assert again.proposer_name == "mtp" and again.stats.session.mtp_ms > 0.0
    finally:
        rt.close()


def test_a_draft_models_probabilities_are_computed_only_on_request() -> None:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=1,
                                    calibrate=False))
    try:
        sequence = rt.draft_model(path).open_sequence()
        try:
            prompt = prompt_for(rt, "the draft and its odds")
            tokens, probs = sequence.draft(prompt, 4)
            again, odds = sequence.draft(prompt, 4, probs=True)
        finally:
            sequence.close()
        assert tokens == again == testmodels.reference_continuation(prompt, 4)
        assert probs == [] and len(odds) == 4 and all(0.0 < p <= 1.0 for p in odds)
    finally:
        rt.close()
