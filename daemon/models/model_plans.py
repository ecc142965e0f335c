"""The configured models as the daemon loads them: one ``ModelPlan`` per model spec.

Why apart from :mod:`meshd.daemon.config.model_specs`: a spec is what the configuration
says (keys, where they came from; nothing opened, so ``meshd config check`` lists it); a
plan is what the model set serves: a ``RuntimeConfig`` (the spec's keys with the
daemon-wide settings every model shares: slots, speculation, plugins) and what residency
needs (its file's size, keep-alive, aliases). ``serve`` builds them at start and again on
SIGHUP. Config may not import the models layer, so the step from one to the other is here.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from meshd.clients.argtypes import duration_seconds, size_bytes
from meshd.daemon.config import options as opt
from meshd.daemon.config.model_specs import ModelSpec, model_specs
from meshd.daemon.config.settings import Config, ConfigError, Loaded
from meshd.daemon.models.model_set import ModelPlan
from meshd.daemon.models.runtime_config import RuntimeConfig
from meshd.native.default_model import default_model_path

__all__ = ["model_plans", "residency"]


def model_plans(loaded: Loaded, default_proposer: str) -> list[ModelPlan]:
    """Every configured model, the default first (``default_proposer``: the checked
    ``[speculation] proposer``, which a model without its own takes). Raises
    ConfigError naming the model's table or flag."""
    c = loaded.config
    plans = [_plan(spec, c, loaded, default_proposer) for spec in model_specs(loaded)]
    limit = residency(c)["memory_limit"]
    for plan in plans:
        if limit is not None and plan.size_bytes > limit:
            raise ConfigError(f"model {plan.name!r} ({plan.size_bytes} bytes) is larger than "
                              f"serve.memory_limit ({limit} bytes): it could never load")
    return plans


def _plan(spec: ModelSpec, c: Config, loaded: Loaded, default_proposer: str) -> ModelPlan:
    m = spec.model
    proposer = default_proposer
    if spec.proposer != c.speculation.proposer:  # its own: checked here
        try:
            proposer = opt.proposer_name(spec.proposer)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{spec.source}: proposer: {exc}") from None
    config = RuntimeConfig(
        model_path=m.path, n_ctx_seq=m.ctx, n_seq_max=c.serve.slots,
        draft_max=c.speculation.draft_max, threads=m.threads,
        calibrate=not c.speculation.fixed_k, default_proposer=proposer,
        in_place_rollback=c.speculation.rollback_snapshots != "never",
        adaptive_rollback=c.speculation.rollback_snapshots == "auto",
        allowed_drafts=tuple(m.draft_models), rpc_workers=m.rpc,
        tensor_split=m.tensor_split, gpu_layers=m.gpu_layers,
        prefix_cache_tokens=c.serve.prefix_cache_tokens, cache_type_k=m.cache_type_k,
        chat_template_file=m.chat_template_file, chat_template=m.chat_template,
        reasoning=m.reasoning,
        history_tokens=c.speculation.history_tokens,
        history_shared=c.speculation.history_shared,
        history_prompts=c.speculation.history_prompts,
        plugins=loaded.plugins,
    )
    path = m.path or str(default_model_path())
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise ConfigError(f"{spec.source}: {path}: {exc.strerror or exc}") from None
    return ModelPlan(spec.name, config, keep_alive_s=spec.keep_alive_s, size_bytes=size,
                     aliases=m.aliases, tags=m.tags)


def residency(c: Config) -> dict[str, Any]:
    """The ModelSet's limits from ``[serve]``: keep_alive_s, max_loaded, memory_limit."""
    s = c.serve
    return {"keep_alive_s": duration_seconds(s.keep_alive), "max_loaded": s.max_loaded,
            "memory_limit": size_bytes(s.memory_limit) if s.memory_limit else None}
