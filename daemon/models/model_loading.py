"""Loading a model and its shared context as a :class:`RuntimeConfig` says.

Why apart from the runtime: the load happens twice in a runtime's life (at start, and
again once a lost RPC worker is back), and it is the one place that turns the configured
shape into native's records (placement, ``ContextConfig``), caps the context at what the
model was trained for and picks a template for a GGUF without one.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from meshd.daemon.models.runtime_config import RuntimeConfig
from meshd.daemon.models.timed_steps import Events, Notes, ProgressFactory, slow_step, timed
from meshd.daemon.prompts.chat_template import fallback_template, template_source
from meshd.native.context import ContextConfig, TargetContext
from meshd.native.model import Model
from meshd.native.rpc import parse_endpoint
from meshd.native.rpc_workers import RemoteWorkers

__all__ = ["LoadedModel", "load_model", "remote_workers"]


@attrs.frozen
class LoadedModel:
    """A model and its context, freshly loaded."""

    model: Model
    context: TargetContext
    chat_template_fallback: str | None
    """Which template a model whose file has none is served with (``tool_use``, a
    built-in format's name, ``chatml``: ``chat_template.fallback_template``); None for
    the file's own or a configured one. Plain prompts stay raw then."""


def remote_workers(config: RuntimeConfig) -> RemoteWorkers | None:
    """The workers the layers are split across (None: everything is local)."""
    if not config.rpc_workers:
        return None
    return RemoteWorkers([parse_endpoint(w) for w in config.rpc_workers],
                         tensor_split=config.tensor_split)


def context_config(config: RuntimeConfig, n_ctx_train: int) -> ContextConfig:
    """The context ``config`` asks for, capped at the model's training context."""
    return ContextConfig(
        n_ctx_seq=min(config.n_ctx_seq, n_ctx_train or config.n_ctx_seq),
        n_seq_max=config.n_seq_max, n_batch=config.n_batch,
        draft_max=config.draft_max, n_threads=config.threads,
        in_place_rollback=config.in_place_rollback,
        cache_type_k=config.cache_type_k,
    )


def load_model(config: RuntimeConfig, path: Path, remote: RemoteWorkers | None, *,
               announce: bool = True, progress: ProgressFactory | None = None,
               events: Events | None = None, notes: Notes | None = None) -> LoadedModel:
    """Load the model (placing layers on the workers, if any) and its context. With
    ``announce`` off (a reload) nothing is drawn, noted or reported but the step itself."""
    placement = remote.connect() if remote is not None else None
    bar = slow_step(f"loading {path.name}", "model_load" if announce else "model_reload",
                    progress=progress if announce else None, events=events, path=str(path))
    model = Model.load(path, on_progress=bar.update, placement=placement,
                       n_gpu_layers=-1 if config.gpu_layers is None else config.gpu_layers,
                       chat_template=template_source(config.chat_template,
                                                     config.chat_template_file))
    bar.done()
    fallback: str | None = None
    if model.chat_template is None:  # (none in the file, none given): llama-server's
        source, fallback = fallback_template(model)
        model.chat_template = source
        model.info = attrs.evolve(model.info, has_chat_template=True)
        if announce and events is not None:
            events("chat_template_fallback", template=fallback,
                   architecture=model.info.architecture, path=str(path))
    try:
        n_ctx_train = model.info.n_ctx_train
        if announce and notes is not None and n_ctx_train and config.n_ctx_seq > n_ctx_train:
            notes("ctx_capped", f"--ctx {config.n_ctx_seq} is more than the model "
                  f"was trained for; using its training context of {n_ctx_train}")
        ctx_config = context_config(config, n_ctx_train)
        with timed("context_build", events, n_ctx_seq=ctx_config.n_ctx_seq,
                   n_seq_max=ctx_config.n_seq_max):
            context = TargetContext(model, ctx_config)
        return LoadedModel(model, context, fallback)
    except BaseException:
        model.close()
        raise
