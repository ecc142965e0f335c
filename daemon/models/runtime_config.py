"""What loading one model means: its file, context shape, speculation and plugins.

Why a record of its own: the configuration (``meshd serve``'s files and flags), the
command line of ``meshd generate`` and the bench all say it, and the runtime and its parts
(loading, proposers, calibration) read it; none of them needs the others.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from meshd.native.context import DEFAULT_DRAFT_MAX
from meshd.plugins.config import PluginConfig
from meshd.plugins.history import DEFAULT_HISTORY_TOKENS

__all__ = ["RuntimeConfig"]


@attrs.frozen
class RuntimeConfig:
    """One model as the runtime loads it (defaults: the embedded model, one slot)."""

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
