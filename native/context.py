"""The target context: one llama.cpp context shared by many runtime sessions.

Why shared: the daemon puts the decode steps and verify windows of many requests into ONE
forward (``forward_many``); each request is a sequence (``seq_id``) of the same context.
Sequence slots are pooled and handed back on every exit path.

Thread discipline (enforced, not just documented): llama.cpp contexts are not thread
safe, so every call that touches this context or its MTP companion takes ``self.lock``.
Callers run these blocking calls on worker threads (the daemon uses
``anyio.to_thread.run_sync`` with a limiter of one per model); the lock makes a mistake
there serialize instead of corrupt memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

from .cpus import usable_cpus
from .errors import CapacityError, NativeError, RuntimeStateError
from .llama import float_rows, lc, lcx
from .model import Model

if TYPE_CHECKING:
    from .mtp import MtpContext
    from .session import RuntimeSession

FloatArray = npt.NDArray[np.float32]


#: The longest draft meshd verifies by default. Long windows pay only for drafts that
#: are nearly always right (prompt lookup while the output copies the input), but there
#: they pay most: on SmolLM2 Q8_0 here 9 rows cost 3.9 decodes, 17 rows 5.2, 33 rows
#: about 6-8.5 (Q4_1: 17 rows 8.5, 33 rows about 15). The cost model chooses shorter
#: windows wherever acceptance does not carry the long ones.
DEFAULT_DRAFT_MAX = 32

#: The deepest in-place rollback of a recurrent state (``n_rs_seq``): each step of depth
#: keeps one more copy of every recurrent layer's state per sequence.
ROLLBACK_MAX = 8


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

    def __attrs_post_init__(self) -> None:
        if self.n_ctx_seq < 16 or self.n_seq_max < 1 or self.draft_max < 0:
            raise ValueError(f"invalid context config {self}")
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
    """
    params = lc.llama_context_default_params()
    params.n_ctx = config.n_ctx_seq * config.n_seq_max
    params.n_batch = config.n_batch
    params.n_ubatch = config.n_batch
    params.n_seq_max = config.n_seq_max
    params.n_threads = threads
    params.n_threads_batch = threads
    params.kv_unified = False
    params.no_perf = True
    return params


def _default_threads() -> int:
    return usable_cpus()


class TargetContext:
    """The shared llama.cpp context of one model, plus its MTP companion when available."""

    def __init__(self, model: Model, config: ContextConfig = ContextConfig()) -> None:
        self.model = model
        self.config = config
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
        self.n_vocab = info.n_vocab
        self.n_embd = lc.llama_model_n_embd_out(model.handle)
        self.memory = lc.llama_get_memory(ctx)
        # Read back what llama.cpp actually enabled: it clamps n_rs_seq to 0 silently
        # for architectures without rollback support.
        self.rollback_window = int(lc.llama_n_rs_seq(ctx)) if info.has_recurrent_state else 0
        self.recurrent = info.has_recurrent_state
        self._batch = lc.llama_batch_init(config.n_batch, 0, 1)
        self._free_slots = list(range(config.n_seq_max - 1, -1, -1))
        self.sessions: dict[int, RuntimeSession] = {}
        self.forward_id = 0
        #: Seconds the last forward spent catching the MTP head up (0 without one).
        self.last_mtp_s = 0.0
        self.mtp: MtpContext | None = None
        self._closed = False
        if config.use_mtp and info.has_mtp:
            from .mtp import MtpContext

            lcx.llama_set_embeddings_nextn(ctx, True, False)
            self.mtp = MtpContext(self, threads)

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

    def __enter__(self) -> TargetContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def open_session(self, *, reserve: int = 0, mtp: bool = True) -> RuntimeSession:
        """A new session on a free sequence slot; ``reserve`` = tokens it will need;
        ``mtp``: follow the MTP head (if the model has one) so it can draft."""
        from .session import RuntimeSession

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
            seq_id = self._free_slots.pop()
            session = RuntimeSession(self, seq_id, mtp=mtp)
            self.sessions[seq_id] = session
            return session

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
            if self.mtp is not None and self.mtp.follows_any(rows):
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

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        with self.lock:
            return bool(lc.llama_memory_seq_rm(self.memory, seq_id, p0, p1))
