"""What the target context, its sessions and its MTP companion share: the row of a
forward, the logits array type and the context's sizing (plain records, defined in
:mod:`.records` and re-exported here), and the llama.cpp parameters made from them.

Why a module of its own: :mod:`.context`, :mod:`.session` and :mod:`.mtp` all need these,
and keeping them here lets those three import each other in one direction only (session
-> context -> mtp -> here), with no import hidden inside a function to break a circle.
"""

from __future__ import annotations

from typing import Any

from .llama import ATTN_TILED, lc
from .records import CACHE_TYPES_K as CACHE_TYPES_K
from .records import DEFAULT_DRAFT_MAX as DEFAULT_DRAFT_MAX
from .records import ROLLBACK_MAX as ROLLBACK_MAX
from .records import ContextConfig as ContextConfig
from .records import FloatArray as FloatArray
from .records import Row as Row
from .records import check_cache_type_k

#: The attention kernel every forward of a CPU context takes, whatever its width:
#: llama.cpp's tiled prefill kernel, where each row's result is its own whatever shares
#: its tile (meshd's patch computes only a tile's rows, so a one-row decode pays for one).
ATTN_KERNEL = ATTN_TILED

#: ggml.h's numbers of the resolved K-cache types (GGML_TYPE_F16, GGML_TYPE_BF16).
GGML_TYPES = {"f16": 1, "bf16": 30}


def resolve_cache_type_k(requested: str, *, all_on_cpu: bool, pinnable: bool = True) -> str:
    """The K-cache type a context gets: ``requested``, or for "auto" llama.cpp's f16,
    except bf16 on the CPU of a runtime that cannot pin its attention kernel.

    Why: ggml's CPU flash attention has three kernels and picks one by a forward's
    width (one row over 512 KV cells or more: the KV range split across threads; 64
    rows or more: tiled; else each row over the whole range), and they round
    differently. Speculation verifies in wide forwards what plain decoding computes one
    row at a time, so a greedy near-tie could flip and the text leave plain decoding's.
    meshd's runtime patch (``llama_set_attn_kernel``) pins one kernel instead
    (:data:`ATTN_KERNEL`, the fast tiled one) for every forward: prompts, decode steps
    and verify windows of any width, so a row's logits do not depend on what shares its
    forward. Without the patch only a bf16 K cache gives that (both fast kernels take
    f16 or f32 caches only), at 4.5x a long prompt's prefill time (docs/identity.md).
    Accelerators have their own kernels, so where layers are offloaded "auto" keeps
    llama.cpp's default.
    """
    check_cache_type_k(requested)
    if requested != "auto":
        return requested
    return "bf16" if all_on_cpu and not pinnable else "f16"


def rounds_rows_alike(cache_type_k: str, *, all_on_cpu: bool, pinnable: bool = True) -> bool:
    """Whether every forward computes a row's logits the same way, whatever rows are
    batched with it: on the CPU, with the attention kernel pinned (f16) or a bf16 K
    cache (:func:`resolve_cache_type_k` says why). Then speculation's text is plain
    decoding's bit for bit, and a divergence is a bug."""
    if not all_on_cpu:
        return False
    return cache_type_k == "bf16" or (cache_type_k == "f16" and pinnable)


def context_params(config: ContextConfig, threads: int) -> Any:
    """llama.cpp context parameters sized by ``config``.

    One definition for the target context and its MTP companion: the companion must
    hold the same sequences at the same positions, so their sizing may never drift apart.
    ``config.cache_type_k`` must be resolved (:func:`resolve_cache_type_k`).
    """
    if config.cache_type_k not in GGML_TYPES:
        raise ValueError(f"K-cache type {config.cache_type_k!r} is not resolved")
    params = lc.llama_context_default_params()
    params.type_k = GGML_TYPES[config.cache_type_k]
    params.n_ctx = config.n_ctx_seq * config.n_seq_max
    params.n_batch = config.n_batch
    params.n_ubatch = config.n_batch
    params.n_seq_max = config.n_seq_max
    params.n_threads = threads
    params.n_threads_batch = threads
    params.kv_unified = False
    params.no_perf = True
    return params
