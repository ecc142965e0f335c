"""The proposers one model's requests may use: installed, configured, able to serve it.

Why apart from the runtime: which names a request may give (``auto``, ``off``, an
installed proposer, ``draft:PATH``), why one cannot serve this model, what ``auto``
means now, and the exact resources each factory declared are one decision, made from
the registry, the plugin tables and a few facts of the runtime (:class:`ProposerHost`).
The set also owns what the proposers run in: out-of-process plugin hosts, the deadline
guards of in-process plugins, and the draft models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from meshd.daemon.engine.request_errors import RequestError
from meshd.daemon.engine.window import MtpHead
from meshd.daemon.models.draft_models import DraftModels
from meshd.daemon.models.runtime_config import RuntimeConfig
from meshd.daemon.models.speculation_ledger import SpeculationLedger
from meshd.daemon.models.timed_steps import Events
from meshd.native.calibrate import MtpCosts
from meshd.native.context import TargetContext
from meshd.native.draft import DraftModel
from meshd.native.model import Model
from meshd.plugins.base import ModelDescription, Proposer, ProposerEnv
from meshd.plugins.config import PluginConfig
from meshd.plugins.guard import PluginGuards
from meshd.plugins.history import HistoryView
from meshd.plugins.registry import Registry, default_registry
from meshd.plugins.remote_plugin_set import PluginHosts
from meshd.plugins.resources import Need, Resources
from meshd.policy.costs import CostCurve

__all__ = ["AUTO_SOURCES", "ProposerHost", "ProposerSet", "describe"]

#: What ``auto`` drafts from where it does not follow the MTP head: the request's own
#: prompt and output (prompt lookup) and, where the model keeps a history and the
#: request's owner is known, that owner's earlier answers (history lookup); per step
#: the draft that pays best (a composite of the two). Where earlier answers do not
#: repeat, history offers nothing and the composite drafts as prompt lookup does.
AUTO_SOURCES = ("ngram", "history")


class ProposerHost(Protocol):
    """What the proposer set reads of its runtime
    (:class:`~meshd.daemon.models.runtime.ModelRuntime`)."""

    @property
    def config(self) -> RuntimeConfig: ...

    @property
    def model(self) -> Model: ...

    @property
    def context(self) -> TargetContext: ...

    @property
    def ledger(self) -> SpeculationLedger: ...

    @property
    def calibrating(self) -> bool: ...

    @property
    def mtp_costs(self) -> MtpCosts | None: ...

    @property
    def mtp_head_pays(self) -> bool: ...

    @property
    def curve(self) -> CostCurve | None: ...

    def history_view(self, owner: str) -> HistoryView: ...


def describe(model: Model) -> ModelDescription:
    """The target model as proposers see it."""
    info = model.info
    return ModelDescription(
        name=Path(info.path).name, n_vocab=info.n_vocab, n_ctx_train=info.n_ctx_train,
        has_mtp=info.has_mtp, bos_token=info.bos_token, eos_token=info.eos_token,
    )


class ProposerSet:
    """One model's proposers (see the module docstring)."""

    def __init__(self, host: ProposerHost, registry: Registry | None = None, *,
                 events: Events | None = None) -> None:
        """``registry``: the installed proposers (None: the entry points'); copied
        where the configured plugins add to it."""
        self._host = host
        config = host.config
        self._config = config
        self.registry = registry if registry is not None else default_registry()
        model = host.model
        #: Out-of-process plugins from the config (spawned by :meth:`start`, or accepted
        #: on connect).
        self.plugins = PluginHosts(config.plugins.values(), model=describe(model),
                                   eog=sorted(model.info.eog_tokens), tokenizer=model.tokenizer)
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
        self.drafts = DraftModels(config.allowed_drafts, events=events)

    def start(self) -> None:
        """Spawn the configured out-of-process plugins."""
        self.plugins.start()

    def close(self) -> None:
        self.plugins.close()
        self.guards.close()
        self.drafts.close()

    def draft_model(self, path: str) -> DraftModel:
        """The draft model at ``path``, loaded once and shared by every request."""
        host = self._host
        return self.drafts.get(path, host.model, host.context.config)

    def plugin_counters(self) -> dict[str, int]:
        """``plugin.NAME.*`` for every plugin, out-of-process and isolated in-process."""
        return {**self.plugins.counters(), **self.guards.counters()}

    # ------------------------------------------------------------------ names

    def unavailable(self) -> dict[str, str]:
        """Installed proposers that cannot serve this model, with the reason for each."""
        host = self._host
        out: dict[str, str] = {}
        if "mtp" in self.registry and host.context.mtp is None:
            out["mtp"] = "the model has no MTP head"
        if "draft" in self.registry and self._config.allowed_drafts == ():
            out["draft"] = "no draft model (start meshd serve with --draft-model PATH)"
        if "history" in self.registry and not host.ledger.history.enabled:
            out["history"] = "no history is kept ([speculation] history_tokens = 0)"
        for name, why in self.registry.errors.items():
            out[name] = f"the plugin failed to load: {why}"
        for name, plugin in self.plugins.hosts.items():
            if plugin.start_error is not None and plugin.link is None:
                plugin.current()  # tried again once its backoff has passed
                out[name] = f"the plugin failed to start: {plugin.start_error}"
        return out

    def usable(self) -> list[str]:
        """What a request may name besides ``off``: ``auto``, every installed proposer
        that can serve this model, and ``draft:PATH`` for each allowed draft model."""
        bad = self.unavailable()
        allowed = self._config.allowed_drafts
        names = ["auto"]
        for name in self.registry.names():
            if name in bad:
                continue
            if name == "draft" and allowed:
                names += [f"draft:{p}" for p in allowed]
            else:
                names.append(name)
        return names

    def problem(self, name: str | None) -> str | None:
        """Why a request's proposer cannot be used here (None: it can, or it is a
        ``draft:PATH`` whose path is checked when it is loaded)."""
        name = name or self._config.default_proposer
        if name == "off":
            return None
        base = name.partition(":")[0]
        bad = self.unavailable()
        available = ", ".join(["off", *self.usable()])
        if base in bad:
            return f"proposer {name!r} cannot serve this model: {bad[base]} " \
                   f"(available: {available})"
        if base != "auto" and base not in self.registry:
            return f"unknown proposer {name!r} (available: {available})"
        return None

    def resolve(self, name: str | None, *, owner_known: bool = True) -> str | None:
        """The registry name for a request's proposer ("draft:PATH" is "draft"; "auto"
        the MTP head where it pays, else prompt and history lookup, :data:`AUTO_SOURCES`,
        or prompt lookup alone for a request whose owner is unknown)."""
        name = name or self._config.default_proposer
        if name == "off":
            return None
        if name == "auto":
            if self.auto_may_follow_head() and self._host.ledger.head_choice.due:
                return "mtp"
            return "composite" if owner_known and self._auto_history() else "ngram"
        return name.partition(":")[0]

    def _auto_history(self) -> bool:
        """Whether ``auto`` may draft from earlier answers: a history is kept and both
        the composite and history lookup are installed."""
        return (self._host.ledger.history.enabled and "composite" in self.registry
                and "history" in self.registry)

    def auto_may_follow_head(self) -> bool:
        """Whether ``auto`` may draft with the MTP head: the model has one, it was
        measured (or is not being measured), and it pays."""
        host = self._host
        if host.mtp_costs is None and host.calibrating:
            return False  # not measured yet: following it may cost more than it saves
        return host.model.info.has_mtp and host.mtp_head_pays

    # ------------------------------------------------------------------ making one

    def make(self, name: str | None, options: Mapping[str, object] | None = None,
             prompt: Sequence[int] = (), *, adaptive: bool = True, owner: str | None = None,
             ) -> tuple[Proposer | None, MtpHead | None]:
        """The request's proposer and, on a model with an MTP head, the (unbound) head
        it was given; the caller binds the head to the session if the proposer needs it.
        The factory gets its config table's options overlaid with the request's, and the
        resources it declared (``NAME:ARG``: ARG is the draft model's path); with
        ``adaptive`` off, proposers that choose their own length get no live cost curve.
        ``owner`` (None: unknown) is whose earlier answers history lookup may draft from."""
        resolved = self.resolve(name, owner_known=owner is not None)
        if resolved is None:
            return None, None
        problem = self.problem(name)
        if problem is not None:
            raise RequestError(problem)
        config = self._config.plugins.get(resolved)
        if config is not None and not config.enabled:
            raise RequestError(f"proposer {resolved!r} is disabled in the configuration")
        opts: dict[str, object] = dict(config.options) if config is not None else {}
        if resolved == "composite" and (name or self._config.default_proposer) == "auto":
            opts["proposers"] = list(AUTO_SOURCES)
        opts.update(options or {})
        host = self._host
        head = MtpHead() if host.context.mtp is not None else None
        info = host.model.info
        env = ProposerEnv(
            vocab_size=info.n_vocab, eog_tokens=info.eog_tokens,
            mtp=head, options=opts, model=describe(host.model),
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
        host = self._host
        needs = self.registry.needs(name)
        draft = None
        if Need.DRAFT_MODEL in needs:
            path = arg or options.get("draft_model")
            if not isinstance(path, str) or not path:
                raise RequestError(f"the {name} proposer needs a draft model: '{name}:PATH'")
            draft = self.draft_model(path)
        tokenizer = host.model.tokenizer
        text = None
        if Need.PROMPT_TEXT in needs and config is not None and config.allow_prompt_text:
            text = tokenizer.detokenize(prompt, special=True)
        curve = host.curve
        ledger = host.ledger
        return Resources(
            draft_model=draft,
            tokenizer=tokenizer if Need.TOKENIZER in needs else None,
            prompt_text=text,
            cost_curve=curve if Need.COST_CURVE in needs else None,
            registry=self.registry if Need.REGISTRY in needs else None,
            cost_curve_now=(lambda: host.curve) if (
                Need.LIVE_COST_CURVE in needs and adaptive and curve is not None) else None,
            match_stats=ledger.ngram_stats if Need.MATCH_STATS in needs else None,
            history=(host.history_view(owner) if Need.HISTORY in needs and owner is not None
                     and ledger.history.enabled and self.registry.built_in(name)
                     else None),
        )
