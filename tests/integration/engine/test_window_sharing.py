"""Concurrent requests share one forward per step, and output does not change: windows
get one length for the group, shorter ones are padded with filler, and MTP drafts for
all of them come from one head forward per position.

Why it matters: llama.cpp computes windows together (one micro-batch) only when they
have equal rows, so requests choosing their own lengths would each pay a pass of their
own; on a hybrid model the split even decides whether rollbacks stay exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from meshd.daemon.engine import window_sharing
from meshd.daemon.engine.forwards import ForwardTiming
from meshd.daemon.engine.generation import Generation, step_many
from meshd.daemon.engine.sampling import GREEDY, SamplingParams
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native.session import SequenceSession
from meshd.policy.costs import CostCurve
from meshd.policy.shared_window import Member, SharedPlan
from meshd.testing import testmodels
from tests.integration.helpers.daemon import reference

SLOTS = 4
#: A 1B hybrid model's curve measured on a CPU (Q8_0, 2 threads): cheap up to 8 rows,
#: then every row costs its compute.
CURVE = CostCurve.from_row_costs({2: 1.89, 4: 2.42, 8: 2.79, 16: 4.08, 32: 6.70, 64: 12.0})

SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)
#: (prompt, max_tokens, sampling, proposer); prompts are made from the model's own text
#: (see ``_prompts``): copies that prompt lookup can draft from, and one without.
REQUESTS = [
    (0, 60, GREEDY, "ngram"),
    (5, 52, SamplingParams(temperature=1.1, top_k=20, top_p=0.9, seed=12345), "mtp"),
    (None, 57, GREEDY, "off"),  # rides along with filler rows
    (11, 49, SEEDED, "auto"),
]


@pytest.fixture(scope="module", params=["qwen35", "mimo2"])
def runtime(request: pytest.FixtureRequest) -> Iterator[ModelRuntime]:
    """A hybrid model (qwen35) and an attention-only one (mimo2), both with MTP heads:
    llama.cpp computes equal windows on consecutive sequences as one micro-batch for
    both (per-sequence state and KV)."""
    path = str(testmodels.test_model_path(request.param, acceptance=0.9))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=SLOTS,
                                    draft_max=6, calibrate=False, threads=1,
                                    adaptive_rollback=False))  # the references decode plainly
    rt.curve = CURVE
    yield rt
    assert rt.idle_slots == SLOTS
    rt.close()


def _prompts(rt: ModelRuntime) -> list[list[int]]:
    """Prompt ids: the model's own continuation of "x" followed by a few of its tokens
    again (the model carries on from there, so the text repeats the prompt), or plain."""
    x = rt.tokenize_prompt("x", chat=False)
    text = reference(rt, x, max_tokens=60)[0]
    return [x + text[:50] + text[start:start + 3] if start is not None
            else rt.tokenize_prompt("hello world, hello", chat=False)
            for start, _, _, _ in REQUESTS]


def _generations(rt: ModelRuntime, prompts: list[list[int]]) -> list[Generation]:
    """The requests, drafting on every step they may (the tiny model's head costs as
    much as its body, so the adaptive gate would soon drop it)."""
    return [rt.generation(prompt, max_tokens=max_tokens, sampling=sampling,
                          proposer=proposer, adaptive=False)
            for prompt, (_, max_tokens, sampling, proposer) in zip(prompts, REQUESTS,
                                                                 strict=True)]


def _run_together(gens: list[Generation]) -> list[int]:
    """Step all to the end; the number of verify forwards of each step while all four run."""
    for g in gens:
        g.start()
    forwards_per_step: list[int] = []
    live = list(gens)
    while live:
        seen: list[ForwardTiming] = []
        step_many(live, on_forward=seen.append)
        if len(live) == len(gens):
            forwards_per_step.append(len(seen))
        live = [g for g in live if not g.done]
    return forwards_per_step


def _always_draft(members: Sequence[Member], _row_cost: Callable[[int], float], *,
                  max_length: int, margin: float = 1.0) -> SharedPlan:
    """A plan that drafts 3 per request whatever the economics (which on this tiny
    model, whose drafting costs more than its forwards, say not to)."""
    length = min(3, max_length)
    return SharedPlan(length, tuple(min(length, m.cap) if m.acceptance is not None else 0
                                    for m in members))


@pytest.mark.parametrize("economics", ["measured", "always-draft"])
def test_concurrent_requests_share_one_forward_and_keep_their_tokens(
        runtime: ModelRuntime, economics: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if economics == "always-draft":
        monkeypatch.setattr(window_sharing, "plan_shared", _always_draft)
    prompts = _prompts(runtime)
    alone = [reference(runtime, p, max_tokens=n, sampling=sp)[0]
             for p, (_, n, sp, _) in zip(prompts, REQUESTS, strict=True)]
    gens = _generations(runtime, prompts)
    try:
        forwards = _run_together(gens)
        assert [list(g.committed) for g in gens] == alone
        assert len(forwards) >= 5 and all(n == 1 for n in forwards)
        assert gens[2].stats.drafted == 0  # filler rows are not drafts
        if economics == "always-draft":
            assert all(g.stats.drafted > 0 for g in (gens[0], gens[1], gens[3]))
            assert gens[0].stats.accepted > 0 and gens[3].stats.accepted > 0
        # A drafted window never exceeds what a recurrent state can undo in place.
        assert all(len(g.stats.drafted_per_position) <= g.session.rollback_window
                   for g in gens if g.session.recurrent)
    finally:
        for g in gens:
            g.close()


def test_group_forwards_stay_out_of_a_lone_requests_curve(
        runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost model hears how many sequences each forward carried, so a group's
    dearer forwards price groups and never the windows of a request alone."""
    costs = runtime.costs
    assert costs is not None
    prompts = _prompts(runtime)
    heard: list[tuple[int, int]] = []
    record = costs.record

    def spy(rows: int, seconds: float, *, sequences: int = 1) -> None:
        heard.append((rows, sequences))
        record(rows, seconds, sequences=sequences)

    monkeypatch.setattr(costs, "record", spy)
    gens = _generations(runtime, prompts)
    try:
        forwards = _run_together(gens)
    finally:
        for g in gens:
            g.close()
    together = heard[:len(forwards)]
    assert together and all(sequences == len(gens) for _, sequences in together)
    assert all(rows % len(gens) == 0 for rows, _ in together)  # equal windows


def test_unseeded_sampling_keeps_its_own_forwards(runtime: ModelRuntime) -> None:
    """Filler is exact only where a draft is verified exactly; a request sampling without
    a seed is never padded, and the others still keep their tokens."""
    prompts = _prompts(runtime)[:3]
    greedy = [reference(runtime, p, max_tokens=n)[0]
              for p, (_, n, _, _) in zip(prompts, REQUESTS, strict=False)]
    gens = [runtime.generation(p, max_tokens=n, proposer=proposer, adaptive=False)
            for p, (_, n, _, proposer) in zip(prompts, REQUESTS, strict=False)]
    gens.append(runtime.generation(runtime.tokenize_prompt("x", chat=False), max_tokens=40,
                                  sampling=SamplingParams(temperature=0.9), proposer="mtp"))
    try:
        _run_together(gens)
        assert [list(g.committed) for g in gens[:3]] == greedy
        assert len(gens[3].committed) == 40
        assert gens[3].stats.drafted == 0
    finally:
        for g in gens:
            g.close()


def test_one_head_forward_drafts_for_several_sequences(runtime: ModelRuntime) -> None:
    """``draft_many`` gives each sequence the drafts it gets on its own."""
    ctx = runtime.context
    prompts = _prompts(runtime)
    runtime.prefix_cache.clear()  # finished requests' sessions hold slots
    sessions = [SequenceSession.open(ctx, mtp=True) for _ in prompts]
    try:
        lasts = []
        for s, p in zip(sessions, prompts, strict=True):
            logits = s.prefill(p)
            lasts.append(int(logits.argmax()))
        own = []
        for s, last in zip(sessions, lasts, strict=True):
            assert s.mtp is not None
            own.append(s.mtp.draft(last, s.n_past, 5)[0])
        mtps = [s.mtp for s in sessions]
        assert all(m is not None for m in mtps)
        owner = ctx.mtp
        assert owner is not None
        together, _ = owner.draft_many(
            [(m, last, s.n_past, k) for m, last, s, k
             in zip(mtps, lasts, sessions, (5, 5, 3, 0), strict=True) if m is not None])
        assert together == [own[0], own[1], own[2][:3], []]
        assert all(len(d) == 5 for d in own)
    finally:
        for s in sessions:
            s.close()


#: A curve on which 7 rows cost less than 2-6 (as a forward of whole blocks of rows can,
#: measured on 1B Q8_0 models: 8 rows below 5-7): every window is priced at 6 drafts.
BLOCKY = CostCurve.sanitized([1.0, 3.0, 3.2, 3.4, 3.6, 3.8, 2.5])


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_alone_pads_its_window_to_a_cheaper_forward(
        runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch,
        sampling: SamplingParams) -> None:
    """A short window is verified with filler up to the cheaper forward its curve
    priced; the tokens stay plain decoding's (greedy, and seeded sampling), and filler
    is no draft."""
    prompt = _prompts(runtime)[0]
    alone = reference(runtime, prompt, max_tokens=60, sampling=sampling)[0]
    saved = runtime.curve
    runtime.curve = BLOCKY
    gen = runtime.generation(prompt, max_tokens=60, sampling=sampling, proposer="ngram",
                             adaptive=False)
    seen: list[tuple[int, int]] = []  # (rows verified, drafts the request had room for)
    verify = SequenceSession.verify

    def spy(self: SequenceSession, tokens: Sequence[int]) -> object:
        if self is gen.session:
            seen.append((len(tokens), min(6, gen.max_tokens - len(gen.committed) - 1)))
        return verify(self, tokens)

    propose = Generation._propose

    def short(self: Generation, proposer: object, k: int) -> tuple[int, ...]:
        return propose(self, proposer, k)[:2]  # a proposer with less to offer than asked

    monkeypatch.setattr(SequenceSession, "verify", spy)
    monkeypatch.setattr(Generation, "_propose", short)
    try:
        for _ in runtime.run(gen):
            pass
        assert list(gen.committed) == alone
        assert gen.stats.verify_calls > 0 and len(gen.stats.drafted_per_position) <= 2
        # Every drafted window was verified at the padded width.
        windows = [(rows, room) for rows, room in seen if rows > 1]
        assert len(windows) == gen.stats.verify_calls
        assert all(rows == 1 + room for rows, room in windows)
        assert gen.stats.drafted < sum(rows - 1 for rows, _ in windows)
    finally:
        gen.close()
        runtime.curve = saved


def test_without_in_place_rollback_company_decodes_plainly_in_one_forward() -> None:
    """A hybrid model whose context keeps no rollback snapshots: a request's window
    would need a checkpoint and a forward of its own, which every other request would
    wait for. So in company nobody drafts (each step says why: ``shared_plan``), the
    group keeps one forward per step, and the text is what each decodes alone."""
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=SLOTS,
                                    draft_max=6, calibrate=False, threads=1,
                                    in_place_rollback=False, adaptive_rollback=False))
    rt.curve = CURVE
    try:
        assert rt.context.recurrent and rt.context.rollback_window == 0
        prompts = _prompts(rt)
        greedy = [(p, n, proposer) for p, (_, n, _, proposer) in zip(prompts, REQUESTS,
                                                                     strict=True)]
        alone = [reference(rt, p, max_tokens=n)[0] for p, n, _ in greedy]
        gens = [rt.generation(p, max_tokens=n, proposer=proposer, adaptive=False)
                for p, n, proposer in greedy]
        try:
            forwards = _run_together(gens)
            assert [list(g.committed) for g in gens] == alone
            assert len(forwards) >= 5 and all(n == 1 for n in forwards)
            assert all(g.stats.drafted == 0 and g.session.counters.checkpoints == 0
                       for g in gens)
            assert all(g.stats.refusals.get("shared_plan", 0) >= 5
                       for g in gens if g.proposer_name is not None)
        finally:
            for g in gens:
                g.close()
    finally:
        rt.close()


def test_drafting_measured_to_earn_less_in_company_is_held_off(
        runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan says drafting pays (a plan that always drafts), but plain steps of this
    group have been measured far faster (their evidence is seeded: a real machine's
    rates are noise here). After a few drafting steps measure that they earn less, the
    group decodes plainly, each step saying why, and the text stays what each request
    decodes alone."""
    from meshd.policy.company import MIN_STEPS

    monkeypatch.setattr(window_sharing, "plan_shared", _always_draft)
    prompts = _prompts(runtime)
    alone = [reference(runtime, p, max_tokens=n, sampling=sp)[0]
             for p, (_, n, sp, _) in zip(prompts, REQUESTS, strict=True)]
    gens = _generations(runtime, prompts)
    costs = runtime.costs
    assert costs is not None
    costs.company.forget()
    for _ in range(MIN_STEPS):
        costs.company.observe(len(gens), drafted=False, tokens=len(gens), seconds=1e-6)
    try:
        forwards = _run_together(gens)
        assert [list(g.committed) for g in gens] == alone
        assert all(n == 1 for n in forwards)
        assert costs.company.holds >= 1
        # The head and lookup that finds its copy drafted until the group measured it
        # (and a few more windows once requests ended: a smaller group is judged anew).
        drafting = (gens[1], gens[3])
        assert all(0 < g.stats.drafted_per_position[0] <= 2 * MIN_STEPS for g in drafting)
        assert all(g.stats.refusals.get("shared_plan", 0) >= len(forwards) - 2 * MIN_STEPS
                   for g in (gens[0], *drafting))
    finally:
        costs.company.forget()
        for g in gens:
            g.close()
