"""One loaded model ready to serve: model, shared context, proposers, cost curve.

Why a separate object: ``meshd generate`` (one request, in-process) and ``meshd serve``
(many requests over a socket) must produce token-for-token the same output, so both build
their generations here and nowhere else. Its parts each do one job: loading
(:mod:`.model_loading`), the proposers (:mod:`.proposer_set`), prompts
(:mod:`.model_prompts`), what speculation learned (:mod:`.speculation_ledger`), whose
answers history keeps (:mod:`.answer_owners`), the costs (:mod:`.calibration`,
:mod:`.thread_tuning`); this object opens generations and takes back what ended ones
leave.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from meshd.daemon.engine.constraint import GrammarState
from meshd.daemon.engine.generation import Ending, Generation, SpeculationSettings, TokenEvent
from meshd.daemon.engine.prefix_cache import PrefixCache
from meshd.daemon.engine.request_errors import PromptTooLong, RequestError
from meshd.daemon.engine.sampling import GREEDY, SamplingParams
from meshd.daemon.engine.window import MtpHead
from meshd.daemon.models.answer_owners import AnswerOwners
from meshd.daemon.models.calibration import CostCalibration
from meshd.daemon.models.model_loading import load_model, remote_workers
from meshd.daemon.models.model_prompts import ModelPrompts
from meshd.daemon.models.proposer_set import ProposerSet, describe
from meshd.daemon.models.runtime_config import RuntimeConfig
from meshd.daemon.models.speculation_ledger import HeadPrices, SpeculationLedger
from meshd.daemon.models.thread_tuning import ThreadTuning
from meshd.daemon.models.timed_steps import (
    Events,
    Notes,
    ProgressFactory,
    StepProgress,
    slow_step,
)
from meshd.native.calibrate import MtpCosts
from meshd.native.default_model import default_model_path
from meshd.native.draft import DraftModel
from meshd.native.grammar_vocab import GrammarVocab
from meshd.native.session import SequenceSession
from meshd.plugins.base import ModelDescription, Proposer
from meshd.plugins.guard import PluginGuards
from meshd.plugins.history import HistoryStore, HistoryView
from meshd.plugins.registry import Registry
from meshd.plugins.remote_plugin_set import PluginHosts
from meshd.policy.costs import CostCurve, CostModel
from meshd.policy.rollback_depth import RollbackDepth

__all__ = ["LOCAL_OWNER", "ModelRuntime", "RuntimeConfig"]

#: The owner of in-process generations (``meshd generate``, the bench): the process's
#: own user; the daemon passes each request's peer instead.
LOCAL_OWNER = "local"
#: The runtime of ``ModelRuntime()``: the embedded model, one slot.
_DEFAULT = RuntimeConfig()


class ModelRuntime:
    """A model loaded once, shared by every request on it."""

    def __init__(self, config: RuntimeConfig = _DEFAULT,
                 registry: Registry | None = None, *, notes: Notes | None = None,
                 progress: ProgressFactory | None = None, events: Events | None = None,
                 calibrate_now: bool = True,
                 ) -> None:
        """``calibrate_now``: measure (or check) the cost curve before returning; off
        (``meshd serve``), :meth:`idle_work` measures it in the compute thread's idle moments."""
        self.config = config
        self._notes = notes
        self._progress = progress
        #: Slow steps' start and end, with durations (the daemon logs them).
        self._events = events
        self.path = Path(config.model_path) if config.model_path else default_model_path()
        #: The workers the layers are split across (None: everything is local).
        self.remote = remote_workers(config)
        try:
            self._load(announce=True)
        except BaseException:
            if self.remote is not None:
                self.remote.close()
            raise
        ctx_config = self.context.config
        #: The proposers requests may use, and what they run in (plugins, draft models).
        self.proposers = ProposerSet(self, registry, events=events)
        cache_tokens = config.prefix_cache_tokens
        if cache_tokens is None:
            cache_tokens = ctx_config.n_ctx_seq * ctx_config.n_seq_max
        self.prefix_cache = PrefixCache(
            self.context, max_entries=ctx_config.n_seq_max if cache_tokens else 0,
            max_tokens=cache_tokens,
        )
        self.costs: CostModel | None = None
        #: The MTP head's measured costs (None: no head, or not calibrated).
        self.mtp_costs: MtpCosts | None = None
        full = self.context.rollback_window
        #: What speculation learns across requests (the rollback depth adapts only on a
        #: recurrent model with snapshots, and when configured to).
        self.ledger = SpeculationLedger(
            RollbackDepth(full) if config.adaptive_rollback and full > 0 else None,
            history=HistoryStore(config.history_tokens, shared=config.history_shared))
        #: The owner of each running generation whose answer history keeps.
        self.answers = AnswerOwners(self.ledger.history, self.ledger.history_stats,
                                    prompts=config.history_prompts)
        #: Fewer threads while other processes use the CPUs (None: one thread, or the
        #: layers run elsewhere); it hears every forward the cost model records.
        self.threads = ThreadTuning.for_runtime(self, events=events)
        #: The cost calibration (finished here, or left to :meth:`idle_work`).
        self.calibration: CostCalibration | None = None
        if config.calibrate and config.draft_max > 0:
            try:
                self.calibration = calibration = CostCalibration(
                    self, wait_for_quiet=not calibrate_now, note=self._note,
                    step=lambda what, kind: self._step(what, kind), events=events)
                if calibrate_now:
                    calibration.run_to_end()
                # Until measured in idle moments: the cached curve, or the conservative prior.
                self.costs = CostModel(calibration.costs_now())
                self._listen(self.costs)
            except BaseException:
                self.close()
                raise
        if self.ledger.rollback is not None and config.default_proposer == "off":
            self.ledger.rollback.not_expected()
            self.apply_rollback_depth()
        self.proposers.start()

    # ------------------------------------------------------------------ loading

    def _load(self, *, announce: bool) -> None:
        """Load the model and its context (:func:`load_model`) and its prompt tools."""
        loaded = load_model(self.config, self.path, self.remote, announce=announce,
                            progress=self._progress, events=self._events, notes=self._notes)
        self.model, self.context = loaded.model, loaded.context
        #: The template a GGUF without one is served with (``LoadedModel``).
        self.chat_template_fallback = loaded.chat_template_fallback
        self.prompts = ModelPrompts(self.model, self.config.reasoning)
        self._loaded = True

    @property
    def degraded(self) -> bool:
        """A remote worker was lost: forwards fail until :meth:`reload` succeeds."""
        return self.remote is not None and (self.remote.degraded or not self._loaded)

    def reload(self) -> bool:
        """Load the model again after a lost worker is back; False (nothing changed)
        while a session still uses the old context. Call on the model's worker thread."""
        if self.remote is None:
            return False
        self.prefix_cache.clear()
        if self.context.sessions:
            return False
        self._loaded = False
        self.context.close()
        self.model.close()
        self._load(announce=False)
        self.prefix_cache.context = self.context
        return True

    def _note(self, event: str, message: str) -> None:
        if self._notes is not None:
            self._notes(event, message)

    def _step(self, what: str, kind: str) -> StepProgress:
        return slow_step(what, kind, progress=self._progress, events=self._events)

    def close(self) -> None:
        if self.calibration is not None:
            self.calibration.close()
        self.prefix_cache.clear()
        self.proposers.close()
        self.context.close()
        self.model.close()
        if self.remote is not None:
            self.remote.close()

    def __enter__(self) -> ModelRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ costs

    def idle_work(self) -> CostCalibration | None:
        """What the compute thread should run in its idle moments (None: nothing)."""
        return self.calibration if self.calibrating else None

    @property
    def calibrating(self) -> bool:
        """Whether the cost calibration is still to finish (in idle moments)."""
        return self.calibration is not None and not self.calibration.finished

    def _listen(self, costs: CostModel | None) -> None:
        if costs is not None and self.threads is not None:
            costs.listener = self.threads.forward

    @property
    def curve(self) -> CostCurve | None:
        """The current verify-cost curve (None: not calibrated, speculation is fixed-k)."""
        return self.costs.curve() if self.costs is not None else None

    @curve.setter
    def curve(self, value: CostCurve | None) -> None:
        self.costs = CostModel(value) if value is not None else None
        self._listen(self.costs)

    @property
    def head_prices(self) -> HeadPrices | None:
        """What the MTP head costs on this context now (None: not measured)."""
        m, curve = self.mtp_costs, self.curve
        if m is None or curve is None:
            return None
        return HeadPrices(m, curve, self.context.rollback_window, self.context.recurrent,
                          self.costs.decode_seconds() if self.costs is not None else None)

    @property
    def mtp_head_pays(self) -> bool:
        """Whether the MTP head can pay at the pooled acceptance (True until measured)."""
        return self.ledger.head_pays(self.head_prices)

    def apply_rollback_depth(self) -> None:
        """Rebuild the context at the rollback depth the evidence asks for, once no
        request is running on it (cached sessions are dropped: they live in it). Runs
        on the model's compute thread: the scheduler's step before it admits requests,
        and (in-process) as a generation is made."""
        rollback, old = self.ledger.rollback, self.context
        if rollback is None or rollback.wanted == rollback.depth:
            return
        if len(old.sessions) > len(self.prefix_cache):
            return  # a request is running: switch between requests
        decode_s = self.costs.decode_seconds() if self.costs is not None else None
        self.prefix_cache.clear()
        self.context = old.rebuilt(in_place_rollback=rollback.wanted > 0)
        self.prefix_cache.context = self.context
        rollback.switched(self.context.rollback_window, decode_s=decode_s)
        if self.costs is not None:
            self.costs.forget()  # forwards cost differently now
        self._note("rollback_depth_failed" if rollback.stuck else "rollback_depth",
                   rollback.describe())

    @property
    def idle_slots(self) -> int:
        """Slots a new request can get: free ones plus cached sessions (evictable) and
        the one the calibration holds between its pieces (given back before any call)."""
        held = int(self.calibration is not None and self.calibration.holds_slot)
        return self.context.free_slots + len(self.prefix_cache) + held

    # ------------------------------------------------------------------ prompts

    @property
    def grammar_vocab(self) -> GrammarVocab:
        """llguidance's view of the vocabulary, for requests with a constraint."""
        return self.prompts.grammar_vocab

    def compile_constraint(self, kind: str, value: object) -> str:
        """A request's constraint as llguidance's grammar (:class:`ModelPrompts`)."""
        return self.prompts.compile_constraint(kind, value)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """Render chat messages with the model's template (:class:`ModelPrompts`)."""
        return self.prompts.render_chat(messages, **options)

    def prompt_too_long(self, n_prompt: int) -> PromptTooLong:
        """The error for a prompt of ``n_prompt`` tokens over the context."""
        return self.prompts.prompt_too_long(n_prompt, self.context.config.n_ctx_seq)

    def tokenize_prompt(self, text: str, *, chat: bool, limit: int | None = None) -> list[int]:
        return self.prompts.tokenize(text, chat=chat, limit=limit)

    # ------------------------------------------------------------------ proposers

    @property
    def registry(self) -> Registry:
        """The installed proposers (with the configured plugins)."""
        return self.proposers.registry

    @registry.setter
    def registry(self, value: Registry) -> None:
        self.proposers.registry = value

    @property
    def plugins(self) -> PluginHosts:
        return self.proposers.plugins

    @property
    def guards(self) -> PluginGuards:
        return self.proposers.guards

    @property
    def _drafts(self) -> dict[str, DraftModel]:
        """The loaded draft models (the thread tuning sets their threads too)."""
        return self.proposers.drafts.loaded

    @property
    def description(self) -> ModelDescription:
        """The target model as proposers see it."""
        return describe(self.model)

    def draft_model(self, path: str) -> DraftModel:
        """The draft model at ``path``, loaded once and shared by every request."""
        return self.proposers.draft_model(path)

    def unavailable_proposers(self) -> dict[str, str]:
        """Installed proposers that cannot serve this model, with the reason for each."""
        return self.proposers.unavailable()

    def plugin_counters(self) -> dict[str, int]:
        """``plugin.NAME.*`` for every plugin, out-of-process and isolated in-process."""
        return self.proposers.plugin_counters()

    def usable_proposers(self) -> list[str]:
        """What a request may name besides ``off`` (:meth:`ProposerSet.usable`)."""
        return self.proposers.usable()

    def proposer_problem(self, name: str | None) -> str | None:
        """Why a request's proposer cannot be used here (None: it can)."""
        return self.proposers.problem(name)

    def resolve_proposer(self, name: str | None, *, owner_known: bool = True) -> str | None:
        """The registry name for a request's proposer (:meth:`ProposerSet.resolve`)."""
        return self.proposers.resolve(name, owner_known=owner_known)

    def make_proposer(self, name: str | None, options: Mapping[str, object] | None = None,
                      prompt: Sequence[int] = (), *, adaptive: bool = True,
                      owner: str | None = None,
                      ) -> tuple[Proposer | None, MtpHead | None]:
        """The request's proposer and the (unbound) MTP head (:meth:`ProposerSet.make`)."""
        return self.proposers.make(name, options, prompt, adaptive=adaptive, owner=owner)

    # ------------------------------------------------------------------ generations

    def history_view(self, owner: str) -> HistoryView:
        """The model's history as ``owner`` may see it."""
        return self.answers.view(owner)

    def release(self, ending: Ending | None, *, decoded: bool = True) -> None:
        """An ended generation handed back (:meth:`Generation.close` with
        ``keep_session``): what it learned goes to the ledger (where it ``decoded``), its
        session to the prefix cache."""
        if ending is None:
            return
        if decoded:
            self.ledger.ended(ending.stats, followed_head=ending.followed_head,
                              prices=self.head_prices)
        self.prefix_cache.store(ending.session, ending.tokens)

    def finish(self, gen: Generation, *, decoded: bool = True) -> None:
        """Close ``gen`` and release what it leaves (:meth:`release`); what it decoded
        joins its owner's history."""
        self.answers.finished(gen, decoded=decoded)
        self.release(gen.close(keep_session=True), decoded=decoded)

    def run(self, gen: Generation) -> Iterator[TokenEvent]:
        """``gen`` to its end, in-process (``meshd generate``, the bench, tests): its
        events as tokens are committed, then :meth:`finish`."""
        try:
            yield from gen.events()
        finally:
            self.finish(gen)

    def generation(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        sampling: SamplingParams = GREEDY,
        stop: Sequence[str] = (),
        proposer: str | None = None,
        draft_max: int | None = None,
        adaptive: bool = True,
        proposer_options: Mapping[str, object] | None = None,
        grammar: str | None = None,
        logprobs: int | None = None,
        owner: str | None = LOCAL_OWNER,
    ) -> Generation:
        """A ready-to-start generation on a fresh session (closed when it finishes).
        ``grammar``: llguidance's grammar text from :meth:`compile_constraint`.
        ``owner``: who asked (``uid:N``, ``key:HASH``...): history lookup drafts from
        that owner's earlier answers and keeps this one's (None: neither; in-process
        callers, ``meshd generate`` and the bench, are this process's own user)."""
        if not prompt:
            raise RequestError("the prompt is empty")
        need = len(prompt) + 1
        if need > self.context.config.n_ctx_seq:
            raise self.prompt_too_long(len(prompt))
        k = self.config.draft_max if draft_max is None else min(draft_max, self.config.draft_max)
        self.apply_rollback_depth()  # before anything binds to the context
        resolved = self.resolve_proposer(proposer, owner_known=owner is not None)
        state = None if grammar is None else GrammarState(
            self.grammar_vocab.tokenizer(), grammar, n_vocab=self.model.info.n_vocab,
            eog=self.model.info.eog_tokens)
        prop, head = self.make_proposer(proposer, proposer_options, prompt,
                                        adaptive=adaptive, owner=owner)
        if ((proposer or self.config.default_proposer) == "auto"
                and self.proposers.auto_may_follow_head()):
            if self.ledger.head_choice.due:
                self.ledger.head_choice.following()
            else:  # served without a head that earlier requests dropped
                self.ledger.head_choice.skip()
        if k == 0 and prop is not None:
            prop.close()
            prop = None
        # Only a session whose proposer drafts with the MTP head follows it: catching the
        # head up costs an MTP forward after every target forward.
        follow_mtp = head is not None and prop is not None and prop.capabilities.needs_mtp_head
        try:
            hit = self.prefix_cache.lookup(
                prompt, need_mtp=follow_mtp,
                branch=(None if follow_mtp or self.context.free_slots == 0 else
                        lambda: SequenceSession.open(self.context, reserve=need, mtp=False)))
            if hit is not None:
                session = hit[0]
            else:
                if self.context.free_slots == 0:
                    self.prefix_cache.evict_one()
                session = SequenceSession.open(self.context, reserve=need, mtp=follow_mtp)
        except BaseException:
            if prop is not None:
                prop.close()
            raise
        try:
            if follow_mtp and head is not None:
                head.bind(session)
            else:
                session.detach_mtp()
                head = None
            gen = Generation(
                session=session, info=self.model.info, tokenizer=self.model.tokenizer,
                prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop=stop,
                proposer=prop, costs=self.costs,
                settings=SpeculationSettings(
                    draft_max=k,
                    adaptive=adaptive and not (prop and prop.capabilities.decides_length),
                    prior_acceptance=self.ledger.mtp_acceptance.prior() if follow_mtp else None,
                    forced_prior=self.ledger.forced_acceptance.prior(),
                ),
                mtp_head=head, grammar=state, logprobs=logprobs,
            )
            gen.proposer_name = resolved
            self.answers.started(gen, owner)
            return gen
        except Exception:
            if prop is not None:
                prop.close()
            session.close()
            raise
