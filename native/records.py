"""The plain records of the native layer that other layers name: a forward's row, the
logits array type, the context's sizing, a model's facts, a session's counters, and the
tokenizer's refusal. No llama.cpp here.

Why a module of its own: the daemon's engine, requests and front ends name these at
import time, and tests of those layers run against a fake runtime (``meshd.testing``)
without llama.cpp; the modules that make them (``primitives``, ``context``, ``model``,
``session``, ``tokenizer``) re-export them, so either import works.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["CACHE_TYPES_K", "DEFAULT_DRAFT_MAX", "ROLLBACK_MAX", "ContextConfig", "FloatArray",
           "ModelInfo", "Row", "SessionCounters", "TooManyTokens", "check_cache_type_k"]

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

#: The K-cache types a context can be given ("auto": ``primitives.resolve_cache_type_k``).
CACHE_TYPES_K = ("auto", "f16", "bf16")


def check_cache_type_k(requested: str) -> None:
    """Refuse a K-cache type outside :data:`CACHE_TYPES_K` (ValueError)."""
    if requested not in CACHE_TYPES_K:
        raise ValueError(f"unknown K-cache type {requested!r}; one of "
                         f"{', '.join(CACHE_TYPES_K)}")


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
    #: Pin the attention kernel (``primitives.ATTN_KERNEL``) where the runtime can; off
    #: leaves llama.cpp's choice by a forward's width.
    pin_attention: bool = True

    def __attrs_post_init__(self) -> None:
        if self.n_ctx_seq < 16 or self.n_seq_max < 1 or self.draft_max < 0:
            raise ValueError(f"invalid context config {self}")
        check_cache_type_k(self.cache_type_k)
        if self.n_batch < self.draft_max + 1:
            raise ValueError("n_batch must hold a whole verify window (draft_max + 1 rows)")


@attrs.define
class Row:
    """One entry of a forward: token at position for sequence, with or without output."""

    token: int
    pos: int
    seq_id: int
    output: bool


@attrs.frozen
class ModelInfo:
    """Static facts about a model, as reported to clients and used by the engine."""

    path: str
    architecture: str
    description: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_layer_nextn: int
    n_params: int
    size_bytes: int
    is_recurrent: bool
    is_hybrid: bool
    eog_tokens: frozenset[int]
    bos_token: int | None
    eos_token: int | None
    has_chat_template: bool

    @property
    def has_mtp(self) -> bool:
        return self.n_layer_nextn >= 1

    @property
    def has_recurrent_state(self) -> bool:
        """Recurrent or hybrid: rejected drafts cannot be removed by a KV trim alone."""
        return self.is_recurrent or self.is_hybrid


@attrs.define
class SessionCounters:
    """What one session has cost over its whole life (prefix-cache reuses included).

    A request's own figures are the difference between two snapshots (``since``).
    ``decode_ms`` is single-row forwards, ``verify_ms`` forwards over a drafted window
    (``[last, d0..]``, two rows or more), ``prefill_ms`` the prompt.
    """

    target_forwards: int = 0
    prefill_forwards: int = 0
    rows_verified: int = 0
    prefill_tokens: int = 0
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoint_ms: float = 0.0
    rollbacks_in_place: int = 0
    trims: int = 0
    restores: int = 0
    replayed_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    verify_ms: float = 0.0
    #: Time inside those forwards spent catching the MTP head up (part of the above).
    mtp_ms: float = 0.0
    #: Prompt tokens copied from another sequence instead of prefilled (share_prefix).
    shared_prefix_tokens: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return attrs.asdict(self)

    def snapshot(self) -> SessionCounters:
        """A copy, to subtract later with :meth:`since`."""
        return attrs.evolve(self)

    def since(self, base: SessionCounters) -> SessionCounters:
        """What was counted after ``base`` was taken (field by field)."""
        return SessionCounters(**{
            f.name: getattr(self, f.name) - getattr(base, f.name)
            for f in attrs.fields(SessionCounters)
        })

    def note_window(self, n_rows: int, ms: float) -> None:
        """Count one decode (1 row) or verify (a drafted window) forward's time."""
        if n_rows > 1:
            self.rows_verified += n_rows
            self.verify_ms += ms
        else:
            self.decode_ms += ms


class TooManyTokens(ValueError):
    """A text tokenizes to more tokens than the caller would take (none were kept)."""

    def __init__(self, n_tokens: int, limit: int) -> None:
        super().__init__(f"the text is {n_tokens} tokens, above the limit of {limit}")
        self.n_tokens = n_tokens
        self.limit = limit
