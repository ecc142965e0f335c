"""One loaded model ready to serve: model, shared context, proposers, cost curve.

Why a separate object: ``meshd generate`` (one request, in-process) and ``meshd serve``
(many requests over a socket) must produce token-for-token the same output, so both build
their generations here and nowhere else.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from meshd.daemon.engine.constraint import GrammarState, compile_grammar
from meshd.daemon.engine.generation import Ending, Generation, SpeculationSettings, TokenEvent
from meshd.daemon.engine.prefix_cache import PrefixCache
from meshd.daemon.engine.request_errors import PromptTooLong, RequestError, too_long_message
from meshd.daemon.engine.sampling import GREEDY, SamplingParams
from meshd.daemon.engine.schema_checks import nesting_problem
from meshd.daemon.engine.window import MtpHead
from meshd.daemon.models.calibration import CostCalibration
from meshd.daemon.models.speculation_ledger import HeadPrices, SpeculationLedger
from meshd.daemon.models.thread_tuning import ThreadTuning
from meshd.daemon.models.timed_steps import (
    Events,
    Notes,
    ProgressFactory,
    StepProgress,
    slow_step,
    timed,
)
from meshd.daemon.prompts.call_schema import closed_objects
from meshd.daemon.prompts.chat_template import (
    ChatTemplateError,
    ModelChat,
    fallback_template,
    template_source,
)
from meshd.native.calibrate import MtpCosts
from meshd.native.context import DEFAULT_DRAFT_MAX, ContextConfig, TargetContext
from meshd.native.default_model import default_model_path
from meshd.native.draft import DraftModel
from meshd.native.errors import ModelLoadError
from meshd.native.grammar_vocab import GrammarVocab
from meshd.native.model import Model
from meshd.native.rpc import parse_endpoint
from meshd.native.rpc_workers import RemoteWorkers
from meshd.native.session import SequenceSession
from meshd.plugins.base import ModelDescription, Proposer, ProposerEnv
from meshd.plugins.config import PluginConfig
from meshd.plugins.guard import PluginGuards
from meshd.plugins.history import DEFAULT_HISTORY_TOKENS, HistoryStore, HistoryView
from meshd.plugins.registry import Registry, default_registry
from meshd.plugins.remote_plugin_set import PluginHosts
from meshd.plugins.resources import Need, Resources
from meshd.policy.costs import CostCurve, CostModel
from meshd.policy.rollback_depth import RollbackDepth

#: The owner of in-process generations (``meshd generate``, the bench): the process's
#: own user; the daemon passes each request's peer instead.
LOCAL_OWNER = "local"


@attrs.frozen
class RuntimeConfig:
    model_path: str | None = None
    n_ctx_seq: int = 4096
    n_seq_max: int = 1
    n_batch: int = 512
    draft_max: int = DEFAULT_DRAFT_MAX
    threads: int | None = None
    calibrate: bool = True
    default_proposer: str = "auto"
    in_place_rollback: bool = True
    #: Drop a recurrent model's rollback snapshots (they slow every forward) while its
    #: requests do not use speculation, and bring them back when they would pay
    #: (:mod:`meshd.policy.rollback_depth`); off: keep them whenever in_place_rollback.
    adaptive_rollback: bool = True
    #: Keep finished sessions for prompts that share their prefix (0 disables).
    prefix_cache_tokens: int | None = None
    #: The draft models ``draft:PATH`` may name (None: any readable file, for in-process
    #: use by the local user; the daemon passes its ``--draft-model`` list, so a socket
    #: client cannot make it load an arbitrary file).
    allowed_drafts: tuple[str, ...] | None = None
    #: ``[speculation.plugins.NAME]`` tables: options, enabling, host rules.
    plugins: Mapping[str, PluginConfig] = attrs.field(factory=dict)
    #: Layers offloaded to accelerators (and workers); None or -1: all there are. A
    #: CPU-only build without workers has no device to offload to and runs them here.
    gpu_layers: int | None = None
    #: Remote workers (``HOST:PORT``, llama.cpp RPC servers) the layers are split across.
    rpc_workers: tuple[str, ...] = ()
    #: Weights of the layer split over the devices (workers, then local accelerators).
    tensor_split: tuple[float, ...] = ()
    #: The attention K cache's type (``ContextConfig.cache_type_k``).
    cache_type_k: str = "auto"
    #: A Jinja chat template file used instead of the GGUF's own.
    chat_template_file: str | None = None
    #: A chat template given inline: a built-in format's name or Jinja source.
    chat_template: str | None = None
    #: Whether reasoning models think: auto | on | off (``--reasoning``).
    reasoning: str = "auto"
    #: Tokens of earlier answers history lookup keeps (0: none; ``[speculation]
    #: history_tokens``), in memory only, the oldest evicted.
    history_tokens: int = DEFAULT_HISTORY_TOKENS
    #: Every owner's requests draft from every owner's answers (default: own only).
    history_shared: bool = False
    #: Keep the prompt with each answer (default: the committed output only).
    history_prompts: bool = False


class ModelRuntime:
    """A model loaded once, shared by every request on it."""

    def __init__(self, config: RuntimeConfig = RuntimeConfig(),
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
        path = Path(config.model_path) if config.model_path else default_model_path()
        self.path = path
        #: The workers the layers are split across (None: everything is local).
        self.remote: RemoteWorkers | None = None
        if config.rpc_workers:
            self.remote = RemoteWorkers(
                [parse_endpoint(w) for w in config.rpc_workers],
                tensor_split=config.tensor_split)
        try:
            self.model, self.context = self._load()
            self._loaded = True
        except BaseException:
            if self.remote is not None:
                self.remote.close()
            raise
        ctx_config = self.context.config
        #: llguidance's view of the vocabulary, for requests with a constraint.
        self.grammar_vocab = GrammarVocab(self.model)
        self.registry = registry if registry is not None else default_registry()
        info = self.model.info
        #: Out-of-process plugins from the config (spawned now, or accepted on connect).
        self.plugins = PluginHosts(config.plugins.values(), model=self.description,
                                   eog=sorted(info.eog_tokens), tokenizer=self.model.tokenizer)
        if self.plugins:
            self.registry = self.registry.copy()
            self.plugins.register_into(self.registry)
        #: Third-party in-process proposers: each on a worker thread, under its deadline.
        self.guards = PluginGuards({
            name: config.plugins.get(name, PluginConfig(name)).deadline_ms / 1e3
            for name in self.registry.names() if self.registry.isolatable(name)})
        if self.guards:
            self.registry = self.registry.copy()
            self.registry.guards = self.guards
        cache_tokens = config.prefix_cache_tokens
        if cache_tokens is None:
            cache_tokens = ctx_config.n_ctx_seq * ctx_config.n_seq_max
        self.prefix_cache = PrefixCache(
            self.context, max_entries=ctx_config.n_seq_max if cache_tokens else 0,
            max_tokens=cache_tokens,
        )
        self._chat = ModelChat(self.model, config.reasoning)
        self._drafts: dict[str, DraftModel] = {}
        self.costs: CostModel | None = None
        #: The MTP head's measured costs (None: no head, or not calibrated).
        self.mtp_costs: MtpCosts | None = None
        full = self.context.rollback_window
        #: What speculation learns across requests (the rollback depth adapts only on a
        #: recurrent model with snapshots, and when configured to).
        self.ledger = SpeculationLedger(
            RollbackDepth(full) if config.adaptive_rollback and full > 0 else None,
            history=HistoryStore(config.history_tokens, shared=config.history_shared))
        #: The owner of each running generation whose answer history keeps (history:
        #: :meth:`finish` adds its output to :attr:`SpeculationLedger.history`).
        self._history_owners: weakref.WeakKeyDictionary[Generation, str] = (
            weakref.WeakKeyDictionary())
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
        self.plugins.start()

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

    def _note(self, event: str, message: str) -> None:
        if self._notes is not None:
            self._notes(event, message)

    def _step(self, what: str, kind: str, *, display: bool = True,
              **fields: object) -> StepProgress:
        return slow_step(what, kind, progress=self._progress if display else None,
                         events=self._events, **fields)

    def _load(self, *, announce: bool = True) -> tuple[Model, TargetContext]:
        """Load the model (placing layers on the workers, if any) and its context."""
        config = self.config
        placement = self.remote.connect() if self.remote is not None else None
        bar = self._step(f"loading {self.path.name}", "model_load" if announce
                         else "model_reload", display=announce, path=str(self.path))
        model = Model.load(self.path, on_progress=bar.update, placement=placement,
                           n_gpu_layers=-1 if config.gpu_layers is None else config.gpu_layers,
                           chat_template=template_source(config.chat_template,
                                                         config.chat_template_file))
        bar.done()
        #: Which template a model whose file has none is served with (``tool_use``, a
        #: built-in format's name, ``chatml``: ``chat_template.fallback_template``);
        #: None for the file's own or a configured one. Plain prompts stay raw then.
        self.chat_template_fallback: str | None = None
        if model.chat_template is None:  # (none in the file, none given): llama-server's
            source, which = fallback_template(model)
            self.chat_template_fallback = which
            model.chat_template = source
            model.info = attrs.evolve(model.info, has_chat_template=True)
            if announce and self._events is not None:
                self._events("chat_template_fallback", template=which,
                             architecture=model.info.architecture, path=str(self.path))
        try:
            n_ctx_train = model.info.n_ctx_train
            if announce and n_ctx_train and config.n_ctx_seq > n_ctx_train:
                self._note("ctx_capped", f"--ctx {config.n_ctx_seq} is more than the model "
                           f"was trained for; using its training context of {n_ctx_train}")
            ctx_config = ContextConfig(
                n_ctx_seq=min(config.n_ctx_seq, n_ctx_train or config.n_ctx_seq),
                n_seq_max=config.n_seq_max, n_batch=config.n_batch,
                draft_max=config.draft_max, n_threads=config.threads,
                in_place_rollback=config.in_place_rollback,
                cache_type_k=config.cache_type_k,
            )
            with timed("context_build", self._events, n_ctx_seq=ctx_config.n_ctx_seq,
                       n_seq_max=ctx_config.n_seq_max):
                context = TargetContext(model, ctx_config)
            return model, context
        except BaseException:
            model.close()
            raise

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
        self.model, self.context = self._load(announce=False)
        self.grammar_vocab = GrammarVocab(self.model)
        self.prefix_cache.context = self.context
        self._loaded = True
        return True

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
        owner = self._history_owners.pop(gen, None)
        if decoded and owner is not None and gen.committed:
            self.history_view(owner).remember(gen.prompt, gen.committed)
        self.release(gen.close(keep_session=True), decoded=decoded)

    def history_view(self, owner: str) -> HistoryView:
        """The model's history as ``owner`` may see it."""
        return HistoryView(self.ledger.history, owner, prompts=self.config.history_prompts,
                           stats=self.ledger.history_stats)

    def run(self, gen: Generation) -> Iterator[TokenEvent]:
        """``gen`` to its end, in-process (``meshd generate``, the bench, tests): its
        events as tokens are committed, then :meth:`finish`."""
        try:
            yield from gen.events()
        finally:
            self.finish(gen)

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
    def curve(self) -> CostCurve | None:
        """The current verify-cost curve (None: not calibrated, speculation is fixed-k)."""
        return self.costs.curve() if self.costs is not None else None

    @curve.setter
    def curve(self, value: CostCurve | None) -> None:
        self.costs = CostModel(value) if value is not None else None
        self._listen(self.costs)

    @property
    def idle_slots(self) -> int:
        """Slots a new request can get: free ones plus cached sessions (evictable) and
        the one the calibration holds between its pieces (given back before any call)."""
        held = int(self.calibration is not None and self.calibration.holds_slot)
        return self.context.free_slots + len(self.prefix_cache) + held

    def close(self) -> None:
        if self.calibration is not None:
            self.calibration.close()
        self.plugins.close()
        self.guards.close()
        self.prefix_cache.clear()
        for draft in self._drafts.values():
            draft.close()
        self._drafts.clear()
        self.context.close()
        self.model.close()
        if self.remote is not None:
            self.remote.close()

    def draft_model(self, path: str) -> DraftModel:
        """The draft model at ``path``, loaded once and shared by every request."""
        key = str(Path(path).resolve())
        allowed = self.config.allowed_drafts
        if allowed is not None and key not in {str(Path(p).resolve()) for p in allowed}:
            offered = ", ".join(allowed) if allowed else "none (meshd serve --draft-model PATH)"
            raise RequestError(f"draft model {path} is not one this daemon serves; "
                               f"allowed: {offered}")
        if key not in self._drafts:
            cfg = self.context.config
            try:
                with timed("draft_model_load", self._events, path=key):
                    self._drafts[key] = DraftModel(
                        key, target=self.model, n_ctx_seq=cfg.n_ctx_seq,
                        n_seq_max=cfg.n_seq_max, n_threads=cfg.n_threads,
                    )
            except ModelLoadError as exc:
                raise RequestError(str(exc)) from exc
        return self._drafts[key]

    def __enter__(self) -> ModelRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ prompts

    def compile_constraint(self, kind: str, value: object) -> str:
        """A request's constraint as llguidance's grammar, checked against this model's
        vocabulary (ConstraintError quotes llguidance). A JSON schema's objects that
        list their properties and say nothing of others take those only, as llama-server
        reads them and as a call's arguments are held (:func:`closed_objects`). Blocking;
        not on the event loop."""
        if kind == "json_schema" and isinstance(value, Mapping) \
                and nesting_problem(value) is None:  # (else compile_grammar says so)
            value = closed_objects(value)
        return compile_grammar(kind, value, self.grammar_vocab.tokenizer())

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """Render chat messages with the model's template (``chat_template.ModelChat``:
        ``add_generation_prompt``, ``tools``, ``variables``)."""
        try:
            return self._chat.render(messages, **options)
        except ChatTemplateError as exc:
            raise RequestError(str(exc)) from exc

    def prompt_too_long(self, n_prompt: int) -> PromptTooLong:
        """The error for a prompt of ``n_prompt`` tokens over the context."""
        n_ctx = self.context.config.n_ctx_seq
        return PromptTooLong(too_long_message(n_prompt, n_ctx, self.model.info.n_ctx_train),
                             n_prompt=n_prompt, n_ctx=n_ctx)

    def tokenize_prompt(self, text: str, *, chat: bool, limit: int | None = None) -> list[int]:
        return self.model.tokenizer.tokenize(text, add_special=not chat, parse_special=chat,
                                             max_tokens=limit)

    # ------------------------------------------------------------------ generations

    def unavailable_proposers(self) -> dict[str, str]:
        """Installed proposers that cannot serve this model, with the reason for each."""
        out: dict[str, str] = {}
        if "mtp" in self.registry and self.context.mtp is None:
            out["mtp"] = "the model has no MTP head"
        if "draft" in self.registry and self.config.allowed_drafts == ():
            out["draft"] = "no draft model (start meshd serve with --draft-model PATH)"
        if "history" in self.registry and not self.ledger.history.enabled:
            out["history"] = "no history is kept ([speculation] history_tokens = 0)"
        for name, why in self.registry.errors.items():
            out[name] = f"the plugin failed to load: {why}"
        for name, host in self.plugins.hosts.items():
            if host.start_error is not None and host.link is None:
                host.current()  # tried again once its backoff has passed
                out[name] = f"the plugin failed to start: {host.start_error}"
        return out

    def plugin_counters(self) -> dict[str, int]:
        """``plugin.NAME.*`` for every plugin, out-of-process and isolated in-process."""
        return {**self.plugins.counters(), **self.guards.counters()}

    def usable_proposers(self) -> list[str]:
        """What a request may name besides ``off``: ``auto``, every installed proposer
        that can serve this model, and ``draft:PATH`` for each allowed draft model."""
        bad = self.unavailable_proposers()
        names = ["auto"]
        for name in self.registry.names():
            if name in bad:
                continue
            if name == "draft" and self.config.allowed_drafts:
                names += [f"draft:{p}" for p in self.config.allowed_drafts]
            else:
                names.append(name)
        return names

    def proposer_problem(self, name: str | None) -> str | None:
        """Why a request's proposer cannot be used here (None: it can, or it is a
        ``draft:PATH`` whose path is checked when it is loaded)."""
        name = name or self.config.default_proposer
        if name == "off":
            return None
        base = name.partition(":")[0]
        bad = self.unavailable_proposers()
        available = ", ".join(["off", *self.usable_proposers()])
        if base in bad:
            return f"proposer {name!r} cannot serve this model: {bad[base]} " \
                   f"(available: {available})"
        if base != "auto" and base not in self.registry:
            return f"unknown proposer {name!r} (available: {available})"
        return None

    def resolve_proposer(self, name: str | None) -> str | None:
        """The registry name for a request's proposer ("draft:PATH" is "draft")."""
        name = name or self.config.default_proposer
        if name == "off":
            return None
        if name == "auto":
            return ("mtp" if self._auto_may_follow_head() and self.ledger.head_choice.due
                    else "ngram")
        return name.partition(":")[0]

    def _auto_may_follow_head(self) -> bool:
        if self.mtp_costs is None and self.calibrating:
            return False  # not measured yet: following it may cost more than it saves
        return self.model.info.has_mtp and self.mtp_head_pays

    def make_proposer(self, name: str | None, options: Mapping[str, object] | None = None,
                      prompt: Sequence[int] = (), *, adaptive: bool = True,
                      owner: str | None = None,
                      ) -> tuple[Proposer | None, MtpHead | None]:
        """The request's proposer and, on a model with an MTP head, the (unbound) head
        it was given; the caller binds the head to the session if the proposer needs it.
        The factory gets its config table's options overlaid with the request's, and the
        resources it declared (``NAME:ARG``: ARG is the draft model's path); with
        ``adaptive`` off, proposers that choose their own length get no live cost curve.
        ``owner`` (None: unknown) is whose earlier answers history lookup may draft from."""
        resolved = self.resolve_proposer(name)
        if resolved is None:
            return None, None
        problem = self.proposer_problem(name)
        if problem is not None:
            raise RequestError(problem)
        config = self.config.plugins.get(resolved)
        if config is not None and not config.enabled:
            raise RequestError(f"proposer {resolved!r} is disabled in the configuration")
        opts: dict[str, object] = dict(config.options) if config is not None else {}
        opts.update(options or {})
        head = MtpHead() if self.context.mtp is not None else None
        env = ProposerEnv(
            vocab_size=self.model.info.n_vocab, eog_tokens=self.model.info.eog_tokens,
            mtp=head, options=opts, model=self.description,
            resources=self._resources(resolved, (name or "").partition(":")[2], opts,
                                      prompt, config, adaptive=adaptive, owner=owner),
        )
        try:
            return self.registry.create(resolved, env), head
        except Exception as exc:
            raise RequestError(str(exc)) from exc

    def _resources(self, name: str, arg: str, options: Mapping[str, object],
                   prompt: Sequence[int], config: PluginConfig | None, *,
                   adaptive: bool = True, owner: str | None = None) -> Resources:
        """Exactly the resources the factory declared (prompt text only if allowed)."""
        needs = self.registry.needs(name)
        draft = None
        if Need.DRAFT_MODEL in needs:
            path = arg or options.get("draft_model")
            if not isinstance(path, str) or not path:
                raise RequestError(f"the {name} proposer needs a draft model: '{name}:PATH'")
            draft = self.draft_model(path)
        text = None
        if Need.PROMPT_TEXT in needs and config is not None and config.allow_prompt_text:
            text = self.model.tokenizer.detokenize(prompt, special=True)
        return Resources(
            draft_model=draft,
            tokenizer=self.model.tokenizer if Need.TOKENIZER in needs else None,
            prompt_text=text,
            cost_curve=self.curve if Need.COST_CURVE in needs else None,
            registry=self.registry if Need.REGISTRY in needs else None,
            cost_curve_now=(lambda: self.curve) if (
                Need.LIVE_COST_CURVE in needs and adaptive and self.curve is not None) else None,
            match_stats=self.ledger.ngram_stats if Need.MATCH_STATS in needs else None,
            history=(self.history_view(owner) if Need.HISTORY in needs and owner is not None
                     and self.ledger.history.enabled and self.registry.built_in(name)
                     else None),
        )

    @property
    def description(self) -> ModelDescription:
        """The target model as proposers see it."""
        info = self.model.info
        return ModelDescription(
            name=Path(info.path).name, n_vocab=info.n_vocab, n_ctx_train=info.n_ctx_train,
            has_mtp=info.has_mtp, bos_token=info.bos_token, eos_token=info.eos_token,
        )

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
        resolved = self.resolve_proposer(proposer)
        state = None if grammar is None else GrammarState(
            self.grammar_vocab.tokenizer(), grammar, n_vocab=self.model.info.n_vocab,
            eog=self.model.info.eog_tokens)
        prop, head = self.make_proposer(proposer, proposer_options, prompt,
                                        adaptive=adaptive, owner=owner)
        if (proposer or self.config.default_proposer) == "auto" and self._auto_may_follow_head():
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
            if owner is not None and self.ledger.history.enabled:
                self._history_owners[gen] = owner
            return gen
        except Exception:
            if prop is not None:
                prop.close()
            session.close()
            raise
