"""The target context: one llama.cpp context shared by many sequence sessions.

Why shared: the daemon puts the decode steps and verify windows of many requests into ONE
forward (``forward``); each request is a sequence (``seq_id``) of the same context.
Sequence slots are pooled and handed back on every exit path.

Thread discipline (enforced, not just documented): llama.cpp contexts are not thread
safe, so every call that touches this context or its MTP companion takes ``self.lock``.
Callers run these blocking calls on worker threads (the daemon uses
``anyio.to_thread.run_sync`` with a limiter of one per model); the lock makes a mistake
there serialize instead of corrupt memory.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import attrs
import numpy as np

from .cpus import usable_cpus
from .errors import CapacityError, NativeError, RuntimeStateError
from .llama import attn_kernel_pinnable, float_rows, lc, lcx, set_attn_kernel
from .model import Model
from .mtp import MtpContext
from .primitives import (
    ATTN_KERNEL,
    FloatArray,
    Row,
    context_params,
    resolve_cache_type_k,
    rounds_rows_alike,
)
from .primitives import CACHE_TYPES_K as CACHE_TYPES_K
from .primitives import DEFAULT_DRAFT_MAX as DEFAULT_DRAFT_MAX
from .primitives import ROLLBACK_MAX as ROLLBACK_MAX
from .primitives import ContextConfig as ContextConfig


class SlotHolder(Protocol):
    """What holds a sequence slot (a session): the context closes it when it closes."""

    def close(self) -> None: ...


Holder = TypeVar("Holder", bound=SlotHolder)

DEFAULT_CONFIG = ContextConfig()


def _default_threads() -> int:
    return usable_cpus()


class TargetContext:
    """The shared llama.cpp context of one model, plus its MTP companion when available."""

    def __init__(self, model: Model, config: ContextConfig = DEFAULT_CONFIG) -> None:
        self.model = model
        all_on_cpu = model.gpu_layers == 0
        pinnable = config.pin_attention and attn_kernel_pinnable()
        config = attrs.evolve(config, cache_type_k=resolve_cache_type_k(
            config.cache_type_k, all_on_cpu=all_on_cpu, pinnable=pinnable))
        #: The configuration as made: ``cache_type_k`` is the type it resolved to.
        self.config = config
        #: Whether every forward rounds a row alike (:func:`rounds_rows_alike`).
        self.exact = rounds_rows_alike(config.cache_type_k, all_on_cpu=all_on_cpu,
                                       pinnable=pinnable)
        self.lock = threading.RLock()
        info = model.info
        if config.n_ctx_seq > info.n_ctx_train > 0:
            raise CapacityError(
                f"n_ctx_seq={config.n_ctx_seq} exceeds the model's training context "
                f"{info.n_ctx_train}"
            )
        threads = config.n_threads or _default_threads()
        params = context_params(config, threads)
        params.n_rs_seq = (
            min(config.draft_max, ROLLBACK_MAX)
            if info.has_recurrent_state and config.in_place_rollback else 0
        )
        ctx = lc.llama_init_from_model(model.handle, params)
        if not ctx:
            raise CapacityError(
                f"llama.cpp could not create a context of {params.n_ctx} tokens "
                f"({config.n_seq_max} sequences); lower n_ctx_seq or n_seq_max"
            )
        self._ctx = ctx
        if all_on_cpu and pinnable:  # on accelerators llama.cpp's own kernels stand
            set_attn_kernel(ctx, ATTN_KERNEL)
        self.n_vocab = info.n_vocab
        self.n_embd = lc.llama_model_n_embd_out(model.handle)
        self.memory = lc.llama_get_memory(ctx)
        # Read back what llama.cpp actually enabled: it clamps n_rs_seq to 0 silently
        # for architectures without rollback support.
        self.rollback_window = int(lc.llama_n_rs_seq(ctx)) if info.has_recurrent_state else 0
        self.recurrent = info.has_recurrent_state
        self._batch = lc.llama_batch_init(config.n_batch, 0, 1)
        self._free_slots = list(range(config.n_seq_max))
        #: The open sessions by sequence id (see :meth:`open_slot`).
        self.sessions: dict[int, SlotHolder] = {}
        self.forward_id = 0
        #: Seconds the last forward spent catching the MTP head up (0 without one).
        self.last_mtp_s = 0.0
        self.mtp: MtpContext | None = None
        self._closed = False
        #: Whether the target's forwards output the hidden rows the MTP head reads
        #: (switched per forward by :meth:`_hidden_rows_for`).
        self._nextn_on = False
        if config.use_mtp and info.has_mtp:
            self.mtp = MtpContext(model, config, threads, self.lock)

    # ------------------------------------------------------------------ lifecycle

    @property
    def ctx(self) -> Any:
        if self._closed:
            raise NativeError("the context has been closed")
        return self._ctx

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            for session in list(self.sessions.values()):
                session.close()
            if self.mtp is not None:
                self.mtp.close()
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            self._closed = True

    def rebuilt(self, *, in_place_rollback: bool) -> TargetContext:
        """This context closed and a new one made like it, with or without the in-place
        rollback's snapshots (llama.cpp fixes them when a context is created). Every
        session must be closed first. Where llama.cpp cannot make the new one (memory),
        the old settings are made again: the caller reads ``rollback_window`` for what
        it got."""
        if self.sessions:
            raise RuntimeStateError("a context with open sessions cannot be rebuilt")
        config = attrs.evolve(self.config, in_place_rollback=in_place_rollback)
        self.close()
        try:
            return TargetContext(self.model, config)
        except CapacityError:
            return TargetContext(self.model, self.config)

    def __enter__(self) -> TargetContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def open_slot(self, open_on: Callable[[int], Holder], *, reserve: int = 0) -> Holder:
        """Take a free sequence slot and register what ``open_on(seq_id)`` opens on it
        (a session, see ``SequenceSession.open``); the context closes it when it closes.
        ``reserve`` = tokens it will need."""
        with self.lock:
            if reserve > self.config.n_ctx_seq:
                raise CapacityError(
                    f"request needs {reserve} tokens of context but each session has "
                    f"{self.config.n_ctx_seq}"
                )
            if not self._free_slots:
                raise CapacityError(
                    f"all {self.config.n_seq_max} session slots are in use"
                )
            # The lowest free id: sessions on consecutive sequence ids can share a
            # hybrid model's forward (see meshd.native.batching).
            seq_id = min(self._free_slots)
            self._free_slots.remove(seq_id)
            try:
                holder = open_on(seq_id)
            except BaseException:
                self._free_slots.append(seq_id)
                raise
            self.sessions[seq_id] = holder
            return holder

    def release_slot(self, seq_id: int) -> None:
        """Clear a sequence everywhere and put its slot back in the pool."""
        with self.lock:
            if self.sessions.pop(seq_id, None) is None:
                return
            if not self._closed:
                lc.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
                if self.mtp is not None:
                    self.mtp.clear(seq_id)
            self._free_slots.append(seq_id)

    # ------------------------------------------------------------------ forward

    def forward(self, rows: Sequence[Row]) -> tuple[FloatArray, FloatArray | None]:
        """Decode ``rows`` in ONE llama.cpp forward (chunking is the caller's job).

        Returns the logits of the output rows, in row order (a copy), and the target's
        hidden rows for every input row when an MTP companion needs them (a copy).
        The MTP companion is caught up before returning.
        """
        n = len(rows)
        if n == 0:
            raise ValueError("empty forward")
        if n > self.config.n_batch:
            raise ValueError(f"forward of {n} rows exceeds n_batch={self.config.n_batch}")
        with self.lock:
            b = self._batch
            n_out = 0
            for i, r in enumerate(rows):
                b.token[i] = r.token
                b.pos[i] = r.pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = r.seq_id
                b.logits[i] = r.output
                n_out += r.output
            b.n_tokens = n
            follow = self._hidden_rows_for(rows)
            self.model.check_devices()
            rc = lc.llama_decode(self.ctx, b)
            self.forward_id += 1
            if rc != 0:
                seqs = sorted({r.seq_id for r in rows})
                raise RuntimeStateError(
                    f"llama_decode failed with code {rc} for sequences {seqs}",
                    seq_id=seqs[0] if len(seqs) == 1 else None,
                    positions=(min(r.pos for r in rows), max(r.pos for r in rows) + 1),
                )
            logits = (
                float_rows(lc.llama_get_logits(self.ctx), n_out, self.n_vocab).copy()
                if n_out
                else np.empty((0, self.n_vocab), dtype=np.float32)
            )
            hidden: FloatArray | None = None
            self.last_mtp_s = 0.0
            if follow and self.mtp is not None:
                t0 = time.perf_counter()
                ptr = lcx.llama_get_embeddings_nextn(self.ctx)
                hidden = float_rows(ptr, n, self.n_embd).copy()
                self.mtp.catch_up(rows, hidden)
                self.last_mtp_s = time.perf_counter() - t0
            # A remote worker lost during the forward: its rows are garbage (see rpc_relay).
            # Checked once the computation is over (llama_decode may return before).
            if self.model.placement is not None:
                lc.llama_synchronize(self.ctx)
            self.model.check_devices()
            return logits, hidden

    def _hidden_rows_for(self, rows: Sequence[Row]) -> bool:
        """Whether this forward must output the hidden rows of every input row (some of
        ``rows`` belong to a sequence following the MTP head), switching llama.cpp's
        output of them on or off to match.

        Why per forward: with that output on, every forward copies a hidden row per
        input row and the last layer runs on every row of a prefill instead of the
        output rows only. A context whose sessions decode without the head (speculation
        off, prompt lookup) then pays nothing for the head. llama.cpp's graph reuse
        compares this setting, so switching it is safe.
        """
        follow = self.mtp is not None and self.mtp.follows_any(rows)
        if follow != self._nextn_on:
            lcx.llama_set_embeddings_nextn(self.ctx, follow, False)
            self._nextn_on = follow
        return follow

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        with self.lock:
            return bool(lc.llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def holds_from_start(self, seq_id: int) -> bool:
        """Whether the sequence still holds its first position: a sliding-window cache
        may have dropped old positions, and then no prefix of it is whole."""
        with self.lock:
            return int(lc.llama_memory_seq_pos_min(self.memory, seq_id)) <= 0

    def seq_state_save(self, seq_id: int) -> tuple[ctypes.Array[ctypes.c_uint8], int, int]:
        """A copy of the recurrent part of the sequence's state (PARTIAL_ONLY), for a
        checkpoint: the buffer, the bytes llama.cpp said the state has and the bytes it
        wrote (an empty state or a short copy is a failure the caller reports)."""
        flags = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        with self.lock:
            size = int(lc.llama_state_seq_get_size_ext(self.ctx, seq_id, flags))
            buf = (ctypes.c_uint8 * max(size, 1))()
            written = int(lc.llama_state_seq_get_data_ext(self.ctx, buf, size, seq_id, flags))
        return buf, size, written

    def seq_state_load(self, seq_id: int, data: ctypes.Array[ctypes.c_uint8]) -> int:
        """Put a copy made by :meth:`seq_state_save` back; the bytes read (0: failed)."""
        flags = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        with self.lock:
            return int(lc.llama_state_seq_set_data_ext(self.ctx, data, len(data), seq_id,
                                                       flags))

    def seq_state_bytes(self, seq_id: int) -> int:
        """Bytes of the sequence's whole KV + recurrent state (as llama.cpp would save it)."""
        with self.lock:
            return int(lc.llama_state_seq_get_size_ext(self.ctx, seq_id, 0))

    def seq_cp_whole(self, src: int, dst: int) -> None:
        """Make ``dst`` a copy of the whole of ``src``. Sequences have streams of their
        own (a non-unified KV), and llama.cpp copies between streams only whole: the
        cells at once, the buffers at the next forward (before it writes anything)."""
        with self.lock:
            lc.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
