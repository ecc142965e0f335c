"""What the target context, its sessions and its MTP companion share: the row of a
forward, the logits array type and the context's sizing.

Why a module of its own: :mod:`.context`, :mod:`.session` and :mod:`.mtp` all need these,
and keeping them here lets those three import each other in one direction only (session
-> context -> mtp -> here), with no import hidden inside a function to break a circle.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from .llama import ATTN_TILED, lc

FloatArray = npt.NDArray[np.float32]


#: The longest draft meshd verifies by default. Long windows pay only for drafts that
#: are nearly always right (prompt lookup while the output copies the input), but there
#: they pay most, as a long window costs far less per row than a short one (docs/
#: benchmarks.md gives measured costs). The cost model chooses shorter windows
#: wherever acceptance does not carry the long ones.
DEFAULT_DRAFT_MAX = 32

#: The deepest in-place rollback of a recurrent state (``n_rs_seq``): each step of depth
#: keeps one more copy of every recurrent layer's state per sequence.
ROLLBACK_MAX = 8

#: The attention kernel every forward of a CPU context takes, whatever its width:
#: llama.cpp's tiled prefill kernel, where each row's result is its own whatever shares
#: its tile (meshd's patch computes only a tile's rows, so a one-row decode pays for one).
ATTN_KERNEL = ATTN_TILED

#: The K-cache types a context can be given ("auto": :func:`resolve_cache_type_k`).
CACHE_TYPES_K = ("auto", "f16", "bf16")
#: ggml.h's numbers of the resolved K-cache types (GGML_TYPE_F16, GGML_TYPE_BF16).
GGML_TYPES = {"f16": 1, "bf16": 30}


def _check_cache_type_k(requested: str) -> None:
    if requested not in CACHE_TYPES_K:
        raise ValueError(f"unknown K-cache type {requested!r}; one of "
                         f"{', '.join(CACHE_TYPES_K)}")


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
    _check_cache_type_k(requested)
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


@attrs.frozen
class ContextConfig:
    """How to size the shared context.

    ``n_ctx_seq`` is the context length of each sequence (its KV is private to it: the
    non-unified layout keeps a decode's attention over its own cells only), ``n_seq_max``
    the number of concurrent sessions, ``draft_max`` the longest verify window minus one
    (up to :data:`ROLLBACK_MAX` of it sets ``n_rs_seq``, the in-place rollback depth of
    recurrent models; longer windows on them take a checkpoint).
    """

    n_ctx_seq: int = 4096
    n_seq_max: int = 1
    n_batch: int = 512
    draft_max: int = DEFAULT_DRAFT_MAX
    n_threads: int | None = None
    use_mtp: bool = True
    #: Let recurrent models roll back in place (``n_rs_seq``); off forces checkpoints.
    in_place_rollback: bool = True
    #: The K cache's type, one of :data:`CACHE_TYPES_K` (the context resolves "auto").
    cache_type_k: str = "auto"
    #: Pin the attention kernel (:data:`ATTN_KERNEL`) where the runtime can; off leaves
    #: llama.cpp's choice by a forward's width.
    pin_attention: bool = True

    def __attrs_post_init__(self) -> None:
        if self.n_ctx_seq < 16 or self.n_seq_max < 1 or self.draft_max < 0:
            raise ValueError(f"invalid context config {self}")
        _check_cache_type_k(self.cache_type_k)
        if self.n_batch < self.draft_max + 1:
            raise ValueError("n_batch must hold a whole verify window (draft_max + 1 rows)")


@attrs.define
class Row:
    """One entry of a forward: token at position for sequence, with or without output."""

    token: int
    pos: int
    seq_id: int
    output: bool


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
