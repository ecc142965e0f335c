"""The generation engine: applies speculation's decisions to one sequence session.

One token's walk: gate -> proposer.propose -> (checkpoint) -> session.verify ->
accepted prefix -> stop cut -> commit/repair decision -> repair -> proposer.observe ->
commit (events out). The gate and the decision live in :mod:`meshd.policy`
(``StepGate.verdict``; ``decision.accepted_prefix`` and ``decision.settle``, with the
stop cut between them, in :meth:`Generation.judge_window`); this is the one place that
applies them. Every proposer goes through the same path, and ``--proposer off`` is that
path with empty drafts, so "identical to plain decoding" is structural.

One decode step has one path: :func:`step_many` plans every generation's window,
verifies them in shared forwards (one for an attention-only model; on a hybrid model one
per group of windows llama.cpp computes together), judges each, then repairs and commits
them (restore-and-replay last) before the next forward; :meth:`Generation.step` is that
path with one generation. The engine is synchronous and does no I/O of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeAlias

import attrs
import numpy as np

from meshd.daemon.engine.cancellation import Cancellation
from meshd.daemon.engine.constraint import GrammarState
from meshd.daemon.engine.forwards import ForwardTiming, forward_groups_of, verify_and_apply
from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.engine.logprobs import TokenLogprob, token_logprob
from meshd.daemon.engine.sampling import GREEDY, FloatArray, Sampler, SamplingParams
from meshd.daemon.engine.stopping import StopMatcher, cut_at_stop
from meshd.daemon.engine.window import Judged, MtpHead, Window
from meshd.daemon.engine.window_sharing import (
    draft_ahead,
    observe_shared,
    pad_alone,
    pad_windows,
    shared_caps,
)
from meshd.native.records import DEFAULT_DRAFT_MAX, ModelInfo
from meshd.native.session import SequenceSession
from meshd.native.utf8 import Utf8Assembler
from meshd.plugins.base import Outcome, ProposalRequest, Proposer
from meshd.plugins.grammar import GrammarProposer
from meshd.plugins.value_copy import COPY_PRIOR, ValueCopyProposer
from meshd.policy.costs import CostModel, RepairCost
from meshd.policy.decision import (
    FinishReason,
    RepairCaps,
    RepairKind,
    accepted_prefix,
    needs_checkpoint,
    settle,
)
from meshd.policy.gate import HeadLoad, Refusal, StepFacts, StepGate
from meshd.policy.shared_window import DEFAULT_PRIOR, RunningAcceptance

if TYPE_CHECKING:
    from meshd.native.tokenizer import Tokenizer

#: How long a proposer may take to answer before its draft counts as late.
PROPOSER_DEADLINE_S = 0.050
#: Acceptance assumed for tokens a grammar forces until the request has measured its
#: own (the target keeps them unless its tokenizer prefers another split).
FORCED_PRIOR = 0.95


@attrs.frozen
class TokenEvent:
    """Committed tokens and the text they released (text may lag behind tokens)."""

    tokens: tuple[int, ...]
    text: str
    #: The tokens' log-probabilities, for a request that asked (``logprobs``).
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class Ending:
    """What a closed generation hands its owner (``ModelRuntime.release``), who then owns
    the still-usable session (to cache or close) with the tokens in it."""

    stats: GenerationStats
    followed_head: bool
    session: SequenceSession
    tokens: tuple[int, ...]


@attrs.frozen
class SpeculationSettings:
    """Per-request speculation: ``draft_max`` bounds k; ``adaptive`` lets cost decide."""

    draft_max: int = DEFAULT_DRAFT_MAX
    adaptive: bool = True
    #: Acceptance the proposer showed in earlier requests (None: the generic prior).
    prior_acceptance: float | None = None
    #: Acceptance of forced-token drafts in earlier requests (None: FORCED_PRIOR).
    forced_prior: float | None = None


class Generation:
    """One request's generation on one sequence session."""

    def __init__(
        self,
        *,
        session: SequenceSession,
        info: ModelInfo,
        tokenizer: Tokenizer,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams = GREEDY,
        stop: Sequence[str] = (),
        proposer: Proposer | None = None,
        costs: CostModel | None = None,
        settings: SpeculationSettings = SpeculationSettings(),
        mtp_head: MtpHead | None = None,
        show_special: bool = False,
        grammar: GrammarState | None = None,
        logprobs: int | None = None,
        cancellation: Cancellation | None = None,
    ) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.session = session
        self.info = info
        self.tokenizer = tokenizer
        self.prompt = list(prompt)
        self.tokens: list[int] = list(prompt)  # prompt + committed (read-only for proposers)
        self.max_tokens = max_tokens
        self.sampler = Sampler(sampling, n_prompt=len(self.prompt), eog=info.eog_tokens)
        self.stopper = StopMatcher(stop)
        self.assembler = Utf8Assembler()
        self.proposer = proposer
        #: The proposer's registry name (what ``auto`` resolved to), where the owner set it.
        self.proposer_name: str | None = None
        #: The source of the last draft proposed (a composite's child, else the proposer).
        self._draft_source = ""
        self.settings = settings
        self.mtp_head = mtp_head
        self._followed_head = mtp_head is not None
        self.show_special = show_special
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.costs = costs
        #: Speculation's policy for this request: one call per step (see _gate).
        self.gate = StepGate(costs, draft_max=settings.draft_max,
                             adaptive=proposer is not None and settings.adaptive,
                             prior=settings.prior_acceptance,
                             streaks=proposer is None
                             or not proposer.capabilities.needs_mtp_head)
        #: Acceptance by window position (a shared window's length is chosen from it).
        self.acceptance = RunningAcceptance(
            prior=settings.prior_acceptance if settings.prior_acceptance is not None
            else DEFAULT_PRIOR)
        #: Shared steps in a row this request could have drafted in and did not.
        self.shared_idle = 0
        #: The request's output constraint: every row is chosen under its mask.
        self.grammar = grammar
        #: Alternatives to report with each token's log-probability (None: not asked).
        self.logprobs = logprobs
        #: Drafts of the forced tokens, with their own gate (they hold far more often).
        self.forced: GrammarProposer | None = None
        self.forced_gate: StepGate | None = None
        #: Copies of the JSON string value being written out of the prompt, gated apart.
        self.copy: ValueCopyProposer | None = None
        self.copy_gate: StepGate | None = None
        if grammar is not None and proposer is not None:
            self.forced = GrammarProposer(grammar.forced)
            self.forced_gate = StepGate(costs, draft_max=settings.draft_max, adaptive=True,
                                        prior=settings.forced_prior or FORCED_PRIOR, streaks=False)
            if grammar.json_document:
                self.copy = ValueCopyProposer(
                    prompt, tokenizer.piece,
                    lambda text: tokenizer.tokenize(text, add_special=False))
                self.copy_gate = StepGate(costs, draft_max=settings.draft_max,
                                          adaptive=True, prior=COPY_PRIOR)
        self.finish: FinishReason | None = None
        self.last = -1
        self.committed: list[int] = []
        self._started = False
        #: (forward ms, MTP catch-up ms, forwards) when decoding began (see _head_load).
        self._decode_base = (0.0, 0.0, 0)
        self._released = False
        #: The request's cancel latch, shared with whoever may cancel it (the scheduler
        #: hands it the request's own when it admits it).
        self.cancellation = cancellation if cancellation is not None else Cancellation()
        self._t0 = time.perf_counter()
        #: The session's counters when this request got it (a prefix-cache hit has some).
        self._counters_base = session.counters.snapshot()
        self._text = ""

    # ------------------------------------------------------------------ control

    def cancel(self, at_emitted: int = 0) -> None:
        """Stop at the next step boundary (or once ``at_emitted`` tokens are committed)."""
        self.cancellation.cancel(at_emitted)

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def checkpoint_held_bytes(self) -> int:
        """State checkpoints this generation's session holds right now."""
        return self.session.checkpoint_held_bytes

    @property
    def text(self) -> str:
        """Text released so far (stop strings and held-back text excluded)."""
        return self._text

    # ------------------------------------------------------------------ steps

    def prompt_suffix(self) -> Sequence[int]:
        """The prompt tokens a prefill must decode: those past what the session already
        holds (a prefix-cache hit holds the rest)."""
        reused = self.session.n_past
        if not 0 <= reused < len(self.prompt):
            raise RuntimeError(f"session holds {reused} tokens of a {len(self.prompt)}-token "
                               "prompt")
        return self.prompt[reused:]

    def start(self) -> list[TokenEvent]:
        """Prefill the prompt and commit the first token (several generations start
        together, sharing what they can, through :mod:`~meshd.daemon.engine.prefill`)."""
        return self.start_with(self.session.prefill(self.begin()))

    def begin(self) -> Sequence[int]:
        """Mark the generation started; the prompt tokens its prefill must decode."""
        if self._started:
            raise RuntimeError("generation already started")
        suffix = self.prompt_suffix()
        self._started = True
        self.stats.reused_prompt_tokens = len(self.prompt) - len(suffix)
        return suffix

    def start_with(self, logits: FloatArray) -> list[TokenEvent]:
        """Commit the first token (a zero-length window) from the last prompt row's
        ``logits``, once the prompt is in the session."""
        c = self.session.counters
        self._decode_base = (c.decode_ms + c.verify_ms, c.mtp_ms, c.target_forwards)
        window = Window(self.prompt[-1], len(self.prompt) - 1, ())
        return self.apply(window, self.judge_window(window, logits[None, :]))

    def step(self) -> list[TokenEvent]:
        """One decode step: :func:`step_many` with this generation alone."""
        (outcome,) = step_many([self])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def events(self) -> Iterator[TokenEvent]:
        """Generate to the end, yielding events as tokens are committed; the owner closes
        (``ModelRuntime.run`` does, handing the session on)."""
        if not self._started:
            yield from self.start()
        while not self.done:
            yield from self.step()

    def close(self, *, keep_session: bool = False) -> Ending | None:
        """Release the proposer and the session; with ``keep_session``, a usable session
        is handed back in an :class:`Ending` instead of closed."""
        if self.proposer is not None:
            try:
                self.proposer.close()
            except Exception:
                self.stats.fault("close_error")
            self.proposer = None
        if self._released:  # the session may serve another request by now
            return None
        self._released = True
        self.stats.wall_ms = (time.perf_counter() - self._t0) * 1e3
        if self.grammar is not None:
            self.stats.grammar_masks = self.grammar.masks
        self.stats.session = self.session.counters.since(self._counters_base)
        if self.session.usable:
            self.stats.state_bytes = self.session.state_bytes()
        if keep_session and self.session.usable:
            return Ending(self.stats, self._followed_head, self.session,
                          tuple(self.tokens[: self.session.n_past]))
        self.session.close()
        return None

    # ------------------------------------------------------------------ plan

    def _gate(self) -> int:
        """How many draft tokens this step may use (0 = plain decode), counting refusals."""
        if self.proposer is None:
            return 0
        # Never price a window longer than the proposer can fill: asked for 32, a head
        # that drafts at most 8 makes a 9-row window, which may cost far more than the
        # 8-row one the gate would have chosen within its reach.
        reach = self.proposer.capabilities.max_len
        verdict = self.gate.verdict(StepFacts(
            exact_verifiable=self.sampler.params.exact_verifiable,
            k_max=min(self._reach(), reach),
            head=self._head_load() if self.mtp_head is not None else None,
            repair=self._repair_cost() if self.session.recurrent else None,
        ))
        if verdict.drop_head:
            self._drop_mtp_head()
        if verdict.refusal is not None:
            self.stats.refuse(verdict.refusal)
        return verdict.k

    def _repair_cost(self) -> RepairCost:
        """What a window beyond the in-place rollback costs this session: its measured
        checkpoint time in decodes (0 until both are measured) and a replay forward."""
        c = self.session.counters
        decode_s = self.costs.decode_seconds() if self.costs is not None else None
        checkpoint = (c.checkpoint_ms / c.checkpoints / 1e3 / decode_s
                      if c.checkpoints and decode_s else 0.0)
        return RepairCost(self.session.rollback_window, checkpoint)

    @property
    def decode_head_ms(self) -> float:
        """Milliseconds of MTP catch-up forwards since the prefill (part of the forward
        time; 0 for a request that does not follow the head)."""
        return self.session.counters.mtp_ms - self._decode_base[1]

    def _head_load(self) -> HeadLoad:
        """What following the MTP head has cost since the prefill."""
        c = self.session.counters
        base_ms, base_mtp_ms, base_forwards = self._decode_base
        return HeadLoad(
            forwards=c.target_forwards - base_forwards,
            forward_ms=c.decode_ms + c.verify_ms - base_ms,
            head_ms=c.mtp_ms - base_mtp_ms,
            drafted=self.stats.drafted,
        )

    def _drop_mtp_head(self) -> None:
        """Decode the rest of the request plainly, without catching the head up."""
        proposer, self.proposer = self.proposer, None
        self.mtp_head = None
        self.session.detach_mtp()
        if proposer is not None:
            try:
                proposer.close()
            except Exception:
                self.stats.fault("close_error")

    def draft_cap(self) -> int:
        """The most drafts this step may verify (0: it cannot speculate now): the
        request's ``draft_max``, the tokens left after the target's own one, the
        context's room; 0 without a proposer or for sampling that cannot be verified."""
        if self.proposer is None or not self.sampler.params.exact_verifiable:
            return 0
        return max(0, self._reach())

    def _reach(self) -> int:
        """``draft_max``, the tokens left after the target's own one, the context's room:
        the longest draft this step could verify (may be negative at the end)."""
        room = self.session.context.config.n_ctx_seq - self.session.n_past - 1
        return min(self.settings.draft_max, self.max_tokens - len(self.committed) - 1, room)

    def plan(self, cap: int | None = None) -> Window:
        """Choose this step's window: ask the proposer for up to k drafts (gated), and
        no more than ``cap`` (the length chosen for a shared forward)."""
        if self.done:
            raise RuntimeError("generation finished")
        draft = self._side_draft(self.forced, self.forced_gate, cap)
        forced = bool(draft)
        copied = False
        if not forced:
            draft = self._side_draft(self.copy, self.copy_gate, cap)
            copied = bool(draft)
        if not forced and not copied:
            wanted = self._gate()
            k = wanted if cap is None else min(wanted, cap)
            if k == 0 < wanted:
                self.stats.refuse(Refusal.SHARED_PLAN)
                if self.mtp_head is not None:
                    self.gate.held_plain()
            if k > 0 and self.proposer is not None:
                draft = self._propose(self.proposer, k)
                if self.grammar is not None and draft:  # no row on a forbidden token
                    keep = self.grammar.valid_prefix(draft)
                    self.stats.grammar_cut += len(draft) - keep
                    draft = draft[:keep]
                self.acceptance.asked(bool(draft))
            if k > 0 and not draft:
                self.gate.verified(0, 0)
        if self.mtp_head is not None:
            self.mtp_head.take_ahead_seconds()  # drafts made ahead are for this step only
        caps = RepairCaps(self.session.recurrent, self.session.rollback_window, False)
        if needs_checkpoint(len(draft), caps):
            self.session.checkpoint()
        return Window(self.last, self.session.n_past, draft, forced=forced, copied=copied)

    def _side_draft(self, side: GrammarProposer | ValueCopyProposer | None,
                    gate: StepGate | None, cap: int | None) -> tuple[int, ...]:
        """A draft from the constraint's side (the tokens it forces, or a JSON value
        copied out of the prompt), each with its own gate: where ``side`` has one and
        its gate says a window pays, cut where the grammar forbids (empty otherwise)."""
        grammar = self.grammar
        if side is None or gate is None or grammar is None or not side.ready(self.tokens):
            return ()
        k_max = self._reach() if cap is None else min(self._reach(), cap)
        k = gate.verdict(StepFacts(
            exact_verifiable=self.sampler.params.exact_verifiable, k_max=k_max,
            repair=self._repair_cost() if self.session.recurrent else None)).k
        draft = self._propose(side, k, gate) if k > 0 else ()
        keep = grammar.valid_prefix(draft)
        self.stats.grammar_cut += len(draft) - keep
        return draft[:keep]

    def _propose(self, proposer: Proposer, k: int, gate: StepGate | None = None,
                 ) -> tuple[int, ...]:
        t0 = time.perf_counter()
        request = ProposalRequest(
            tokens=self.tokens, n_prompt=len(self.prompt), max_len=k,
            deadline=time.monotonic() + PROPOSER_DEADLINE_S,
        )
        head = self.mtp_head
        if head is not None:
            head.last = self.last
            head.in_use = False
        self.stats.proposals += 1
        try:
            proposal = proposer.propose(request)
        except Exception:
            self.stats.fault("error")
            return ()
        finally:
            elapsed = time.perf_counter() - t0
            if head is not None:
                elapsed += head.take_ahead_seconds()
                if head.session is not None:  # the head's upkeep is not drafting
                    elapsed = max(0.0, elapsed - head.session.note_head_feed())
            self.stats.propose_ms += elapsed * 1e3
        (gate or self.gate).drafted(elapsed,
                                    len(proposal.tokens) if proposal is not None else 0)
        if time.monotonic() > request.deadline:
            self.stats.fault("late")
        if proposal is None or not proposal.tokens:
            self.stats.refuse(Refusal.PROPOSER_EMPTY)
            return ()
        tokens = proposal.tokens
        source = getattr(proposal, "source", None)  # (a plugin's Proposal may be older)
        self._draft_source = source if isinstance(source, str) and source else proposer.name
        n_vocab = self.info.n_vocab
        if any(not isinstance(t, int) or not 0 <= t < n_vocab for t in tokens):
            self.stats.fault("invalid_token")
            return ()
        if len(tokens) > k:
            self.stats.fault("too_long")
            tokens = tokens[:k]
        return tuple(tokens)

    # ------------------------------------------------------------------- judge/apply

    def judge_window(self, window: Window, logits: FloatArray) -> Judged:
        """Judge a verified window: the accepted prefix and the commit/repair decision
        (:mod:`meshd.policy.decision`, pure), with the stop cut between them.

        Not pure: matching the rows draws from the sampler's RNG (one draw per row
        reached), and the stop cut pushes each committed token through the UTF-8
        assembler and the stop matcher. Call it exactly once per verified window, in
        order."""
        masks: list[np.ndarray] | None = [] if self.logprobs is not None else None
        t0 = time.perf_counter()
        predictions = self.sampler.match_rows(logits, window.draft, self.tokens,
                                              self.grammar, masks)
        if self.grammar is not None:
            self.stats.grammar_ms += (time.perf_counter() - t0) * 1e3
        caps = RepairCaps(
            self.session.recurrent, self.session.rollback_window, self.session.has_checkpoint
        )
        cancelled_at = self.cancellation.room(len(self.committed))
        prefix = accepted_prefix(
            draft=window.draft, predictions=predictions,
            remaining=self.max_tokens - len(self.committed), eog=self.info.eog_tokens,
            cancelled_at=cancelled_at)
        texts, stop_at = cut_at_stop(prefix.candidates, self.info.eog_tokens,
                                     self._text_of, self.stopper)
        decision = settle(prefix, last=window.last, base=window.base, draft=window.draft,
                          caps=caps, stop_at=stop_at)
        lps = () if self.logprobs is None else tuple(
            token_logprob(logits[j], tok, self.logprobs, masks[j] if masks else None)
            for j, tok in enumerate(decision.committed))
        return Judged(decision, tuple(texts), lps)

    def _text_of(self, token: int) -> str:
        return self.assembler.push(self.tokenizer.piece(token, special=self.show_special))

    def apply(self, window: Window, judged: Judged) -> list[TokenEvent]:
        """Repair the state first, then commit (so an emit failure leaves a clean state)."""
        decision = judged.decision
        repair = decision.repair
        s = self.session
        kind = repair.kind
        if kind is RepairKind.RETIRE:
            s.retire()
        elif kind is RepairKind.TRIM:
            s.trim(repair.keep_to)
        elif kind is RepairKind.ROLLBACK_IN_PLACE:
            s.rollback_in_place(repair.keep_to)
        elif kind is RepairKind.RESTORE_AND_REPLAY:
            s.restore_and_replay(repair.keep_to, repair.replay)
        else:
            s.discard()
        if self.grammar is not None:
            self.grammar.settle(decision.committed)
        k = window.drafted  # filler rows are not the proposer's drafts
        accepted = min(decision.accepted, k)
        if k > 0:
            self.stats.record_verify(k, accepted)
            matched = min(decision.matched, k)
            if window.forced and self.forced_gate is not None:
                self.forced_gate.verified(k, matched)
                self.stats.forced_drafted += k
                self.stats.forced_accepted += accepted
            elif window.copied and self.copy_gate is not None:
                self.copy_gate.verified(k, matched)
                self.stats.copy_drafted += k
                self.stats.copy_accepted += accepted
            else:
                self.gate.verified(k, matched)
                self.acceptance.observe(k, matched)
                self.stats.record_source(self._draft_source, k, accepted)
        if self.proposer is not None and k > 0 and not (window.forced or window.copied):
            try:
                self.proposer.observe(Outcome(k, accepted, decision.committed))
            except Exception:
                self.stats.fault("observe_error")
        # Commit.
        self.tokens.extend(decision.committed)
        self.committed.extend(decision.committed)
        self.stats.emitted = len(self.committed)
        if decision.committed:
            self.last = decision.committed[-1]
        texts, lps = judged.texts, judged.logprobs
        events = [
            TokenEvent((tok,), texts[j] if j < len(texts) else "",
                       (lps[j],) if j < len(lps) else ())
            for j, tok in enumerate(decision.committed)
        ]
        self.finish = decision.finish
        if self.finish is None and (
            len(self.committed) >= self.max_tokens  # the budget ended exactly on a window
            or s.n_past + 1 > s.context.config.n_ctx_seq  # the context is full
        ):
            self.finish = FinishReason.LENGTH
        if self.finish is not None and self.finish is not FinishReason.STOP:
            tail = self.stopper.push(self.assembler.flush()).text
            tail += self.stopper.flush()
            if tail:
                events.append(TokenEvent((), tail))
        for ev in events:
            self._text += ev.text
        return events


StepOutcome: TypeAlias = list[TokenEvent] | Exception
"""One generation's share of a step: the events it committed, or why it failed."""


def step_many(generations: Sequence[Generation], *,
              on_forward: Callable[[ForwardTiming], None] | None = None,
              max_draft: int | None = None) -> list[StepOutcome]:
    """One decode step for every generation: plan each window, verify them in as few
    forwards as is exact (:func:`forward_groups_of`; one for attention-only models),
    and decide, repair and commit each forward's windows before the next forward.

    A generation that fails (its proposer, its state, the forward) gets its exception
    in its place and the others go on. ``on_forward`` hears the wall time and shape of
    every forward (:class:`ForwardTiming`); the cost model (shared by generations of one
    runtime) records it by rows. Runs where the model's calls may block: a worker thread
    in the daemon.

    A recurrent (hybrid) step may take several forwards: only a forward that llama.cpp
    runs as one micro-batch keeps every in-place rollback exact
    (:mod:`meshd.native.batching`), so concurrent hybrid windows get one shared length
    (:mod:`meshd.daemon.engine.window_sharing`).

    ``max_draft``: no window of this step drafts more (prompts wait for their prefill:
    :func:`~meshd.daemon.engine.step_runs.run_steps`).
    """
    t0 = time.perf_counter()
    out: list[StepOutcome] = [[] for _ in generations]
    planned: list[tuple[int, Generation, Window]] = []
    caps = shared_caps(generations)
    if caps is not None and max_draft is not None:
        caps = [min(c, max_draft) for c in caps]
    if caps is not None and any(caps):
        draft_ahead(generations, caps)
    for i, gen in enumerate(generations):
        try:
            planned.append((i, gen, gen.plan(caps[i] if caps is not None else max_draft)))
        except Exception as exc:
            out[i] = exc
    if len(planned) == len(generations):
        windows = pad_windows(generations, [w for _, _, w in planned], caps)
        if caps is None and len(windows) == 1:
            windows = [pad_alone(generations[0], windows[0])]
        planned = [(i, gen, w) for (i, gen, _), w in zip(planned, windows, strict=True)]
    for group in forward_groups_of([(gen.session, w) for _, gen, w in planned]):
        verify_and_apply([planned[j] for j in group], out, on_forward)
    observe_shared(generations, caps, out, time.perf_counter() - t0)
    return out


