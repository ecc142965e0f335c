"""The engine's one step path (verify, commit, repair) against the fake runtime of
``meshd.testing``: the real Generation and SequenceSession on a toy model whose next
token is a known function of the context, so every expectation is exact."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from meshd.daemon.engine.generation import Generation, SpeculationSettings, step_many
from meshd.daemon.engine.sampling import GREEDY, SamplingParams
from meshd.native.errors import RuntimeStateError, SessionUnusable
from meshd.native.records import ContextConfig
from meshd.plugins.base import Capabilities, Outcome, Proposal, ProposalRequest
from meshd.policy.decision import FinishReason
from meshd.testing.fake_runtime import EOS, STORY, FakeContext, ToyModel, story_rule

PROMPT = "Once upon"
#: What greedy decoding of the toy model says after PROMPT.
ANSWER = STORY[len(PROMPT):]
SEEDED = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, seed=11)


class ScriptedProposer:
    """Drafts the toy model's own continuation, wrong from position ``wrong_at`` of each
    draft on (None: never wrong); records what it was told."""

    name = "scripted"

    def __init__(self, wrong_at: int | None = None, max_len: int = 8) -> None:
        self.capabilities = Capabilities(max_len=max_len)
        self.wrong_at = wrong_at
        self.outcomes: list[Outcome] = []
        self.drafts: list[tuple[int, ...]] = []

    def propose(self, request: ProposalRequest) -> Proposal | None:
        tokens, draft = list(request.tokens), []
        for i in range(request.max_len):
            token = story_rule(tokens)
            if self.wrong_at is not None and i >= self.wrong_at:
                token = (token + 1) % 256  # never the favourite
            draft.append(token)
            tokens.append(token)
        self.drafts.append(tuple(draft))
        return Proposal(tuple(draft))

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def close(self) -> None:
        pass


def generation(model: ToyModel, context: FakeContext, *, prompt: str = PROMPT,
               max_tokens: int = 200, sampling: SamplingParams = GREEDY,
               stop: Sequence[str] = (), proposer: ScriptedProposer | None = None,
               draft_max: int = 8) -> Generation:
    tokens = model.tokenizer.tokenize(prompt)
    return Generation(session=model.open_session(context, reserve=len(tokens)),
                      info=model.info, tokenizer=model.as_tokenizer(), prompt=tokens,
                      max_tokens=max_tokens, sampling=sampling, stop=stop,
                      proposer=proposer,
                      settings=SpeculationSettings(draft_max=draft_max, adaptive=False))


def run(model: ToyModel, context: FakeContext, **kwargs: object) -> tuple[str, FinishReason]:
    gen = generation(model, context, **kwargs)  # type: ignore[arg-type]
    text = "".join(event.text for event in gen.events())
    assert gen.finish is not None
    gen.close()
    return text, gen.finish


@pytest.fixture
def model() -> ToyModel:
    return ToyModel()


@pytest.fixture
def context(model: ToyModel) -> FakeContext:
    return model.context()


def test_greedy_decoding_follows_the_model(model: ToyModel, context: FakeContext) -> None:
    assert run(model, context) == (ANSWER, FinishReason.EOG)


def test_a_window_commits_the_drafts_up_to_the_first_mismatch_and_the_target_token(
        model: ToyModel, context: FakeContext) -> None:
    proposer = ScriptedProposer(wrong_at=3, max_len=6)
    gen = generation(model, context, proposer=proposer, draft_max=6)
    gen.start()
    before = list(gen.tokens)
    events = gen.step()
    draft = proposer.drafts[-1]
    committed = [t for e in events for t in e.tokens]
    target = story_rule(before + list(draft[:3]))
    assert committed == [*draft[:3], target] and target != draft[3]
    assert proposer.outcomes[-1] == Outcome(6, 3, tuple(committed))
    # The rejected rows left the sequence: it holds exactly what was committed.
    assert context.tokens(gen.session.seq_id) == gen.tokens[:gen.session.n_past]
    assert gen.session.n_past == len(gen.tokens) - 1  # the last token is not decoded yet
    gen.close()
    assert gen.stats.session.trims == 1 and gen.stats.accepted == 3


def test_a_right_draft_is_committed_whole_with_the_next_token(
        model: ToyModel, context: FakeContext) -> None:
    proposer = ScriptedProposer(max_len=4)
    gen = generation(model, context, proposer=proposer, draft_max=4)
    gen.start()
    committed = [t for e in gen.step() for t in e.tokens]
    assert committed[:4] == list(proposer.drafts[-1]) and len(committed) == 5
    assert gen.session.counters.target_forwards == 2  # the prompt, one verify window


@pytest.mark.parametrize("recurrent,in_place", [(False, True), (True, True), (True, False)],
                         ids=["attention", "rollback", "restore-replay"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("wrong_at", [None, 0, 1, 5])
def test_speculation_never_changes_the_output(recurrent: bool, in_place: bool,
                                              sampling: SamplingParams,
                                              wrong_at: int | None) -> None:
    model = ToyModel(recurrent=recurrent)
    config = ContextConfig(n_ctx_seq=512, n_seq_max=2, draft_max=8,
                           in_place_rollback=in_place)
    plain = run(model, model.context(config), sampling=sampling, max_tokens=80)
    context = model.context(config)
    proposer = ScriptedProposer(wrong_at=wrong_at)
    assert run(model, context, sampling=sampling, max_tokens=80, proposer=proposer) == plain
    assert proposer.outcomes  # it did speculate


def test_seeded_sampling_depends_on_the_seed(model: ToyModel, context: FakeContext) -> None:
    first = run(model, context, sampling=SEEDED, max_tokens=40)
    again = run(model, context, sampling=SEEDED, max_tokens=40)
    other = run(model, context, sampling=SamplingParams(temperature=1.5, top_k=0, top_p=1.0,
                                                        seed=12), max_tokens=40)
    assert first == again and first != other


@pytest.mark.parametrize("proposer", [None, ScriptedProposer()], ids=["plain", "drafts"])
def test_a_stop_string_ends_the_text_before_it(model: ToyModel, context: FakeContext,
                                               proposer: ScriptedProposer | None) -> None:
    text, finish = run(model, context, stop=["fox"], proposer=proposer)
    assert (text, finish) == (ANSWER[:ANSWER.index("fox")], FinishReason.STOP)


@pytest.mark.parametrize("proposer", [None, ScriptedProposer()], ids=["plain", "drafts"])
def test_max_tokens_bounds_the_answer(model: ToyModel, context: FakeContext,
                                      proposer: ScriptedProposer | None) -> None:
    gen = generation(model, context, max_tokens=7, proposer=proposer)
    text = "".join(e.text for e in gen.events())
    assert (text, gen.finish, len(gen.committed)) == (ANSWER[:7], FinishReason.LENGTH, 7)


def test_the_context_end_is_a_length_finish(model: ToyModel) -> None:
    context = model.context(ContextConfig(n_ctx_seq=16, n_seq_max=1, n_batch=16, draft_max=4))
    text, finish = run(model, context)
    assert finish is FinishReason.LENGTH and text == ANSWER[:16 - 10 + 1]


def test_the_end_of_generation_token_is_committed_not_shown(model: ToyModel,
                                                            context: FakeContext) -> None:
    gen = generation(model, context)
    list(gen.events())
    assert gen.committed[-1] == EOS and gen.text == ANSWER


def test_cancel_stops_at_the_next_step(model: ToyModel, context: FakeContext) -> None:
    gen = generation(model, context)
    gen.start()
    gen.step()
    gen.cancel()
    gen.step()
    assert gen.finish is FinishReason.CANCELLED and len(gen.committed) == 2


def test_cancel_at_a_count_cuts_a_window(model: ToyModel, context: FakeContext) -> None:
    gen = generation(model, context, proposer=ScriptedProposer())
    gen.start()
    gen.cancel(at_emitted=4)
    gen.step()
    assert gen.finish is FinishReason.CANCELLED and len(gen.committed) == 4
    assert context.tokens(gen.session.seq_id) == gen.tokens[:gen.session.n_past]


def test_requests_stepped_together_share_each_forward(model: ToyModel,
                                                      context: FakeContext) -> None:
    alone = [run(model, model.context(), prompt=p)[0] for p in (PROMPT, "a small")]
    gens = [generation(model, context, prompt=p, proposer=ScriptedProposer(wrong_at=2))
            for p in (PROMPT, "a small")]
    for gen in gens:
        gen.start()
    shared = 0
    while not all(g.done for g in gens):
        before = len(context.forwards)
        outcomes = step_many([g for g in gens if not g.done])
        assert not any(isinstance(o, Exception) for o in outcomes)
        rows = context.forwards[before:]
        shared += len({r.seq_id for r in rows[0]}) == 2 if rows else 0
    assert [g.text for g in gens] == alone and shared > 0


def test_a_failed_forward_fails_the_request_and_its_session(model: ToyModel,
                                                            context: FakeContext) -> None:
    gen = generation(model, context)
    gen.start()
    context.faults.fail_forwards = 1
    with pytest.raises(RuntimeStateError):
        gen.step()
    assert not gen.session.usable
    with pytest.raises(SessionUnusable):
        gen.session.decode(1)


def test_a_forced_rule_gives_the_answer_a_test_asks_for() -> None:
    """The fake is configurable: a rule that always says EOS ends at once."""
    model = ToyModel(rule=lambda tokens: EOS)
    assert run(model, model.context()) == ("", FinishReason.EOG)
