"""The model's own multi-token-prediction (MTP, "nextn") head as a draft source.

A second llama.cpp context of type MTP on the same model object. Its entry at position p
is (token x_p, target hidden h_{p-1}) and its logits predict x_{p+1}. So it must see
every token the target decodes (prefill chunks, verify windows, replays) at the same
position, each paired with the previous row's target hidden state; the first row of a
forward pairs with the carried ``pending_h`` (the last target row of the forward before).

Why lazily: those rows wait in the session's queue, and reach the MTP context with the
session's next draft (or once :data:`QUEUE_ROWS` of them wait). A verify window's
rejected rows are then never fed (a repair drops them from the queue), and a session
that is not drafting (speculation turned down, several requests sharing forwards) pays
one wide MTP forward every :data:`QUEUE_ROWS` tokens instead of one per target forward.
The feeding before a draft is a forward of its own, timed apart (``fed_s``): it is the
head's upkeep, paid per step whatever the draft's length, and charged to drafting per
token it would make long drafts look dearer than they are.

Why we keep ``pre_verify_h`` and the window's hidden rows: after a verify with n rows kept
the new ``pending_h`` is the kept window's last row, and when nothing of the window is kept
(restore-and-replay) it is the one from before the window (llama-server loses that one).
Every MTP draft entry is an output: qwen35's MTP graph reads the hidden state before it
drops non-output rows, so masked reads would return wrong rows otherwise.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence

import numpy as np

from .errors import NativeError, RuntimeStateError
from .llama import float_rows, lc, lcx
from .model import Model
from .primitives import ContextConfig, FloatArray, Row, context_params

#: Rows a session's queue holds before they are fed without waiting for a draft: a
#: forward of this many rows costs a few one-row ones, and the queue's hidden rows stay
#: small (this many rows of ``n_embd`` floats).
QUEUE_ROWS = 32


def _embd(row: FloatArray) -> lc.llama_embd:
    return lc.llama_embd(
        row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[0]
    )


class MtpSession:
    """Per-sequence MTP state: the carried hidden rows, and drafting."""

    def __init__(self, owner: MtpContext, seq_id: int) -> None:
        self.owner = owner
        self.seq_id = seq_id
        n = owner.n_embd
        self.pending_h = np.zeros(n, dtype=np.float32)
        self.pre_verify_h = np.zeros(n, dtype=np.float32)
        self.window_h = np.zeros((0, n), dtype=np.float32)
        self.stale = False
        self.drafts = 0
        #: (token, position, the target's hidden row before it) not yet fed to the head.
        self.queue: list[tuple[int, int, FloatArray]] = []
        #: Seconds spent feeding the queue before drafts, not yet taken (see
        #: :meth:`take_fed_s`).
        self.fed_s = 0.0

    def take_fed_s(self) -> float:
        """The feeding time of the drafts since the last call (the head's upkeep: its
        owner counts it with the target's forwards, not with the drafting)."""
        fed, self.fed_s = self.fed_s, 0.0
        return fed

    def trim(self, keep_to: int, kept_rows: int | None) -> None:
        """Follow a target repair: drop MTP KV >= keep_to and pick the carried hidden row."""
        with self.owner.lock:
            lc.llama_memory_seq_rm(self.owner.memory, self.seq_id, keep_to, -1)
        self.queue = [e for e in self.queue if e[1] < keep_to]
        if keep_to == 0:
            self.pending_h = np.zeros_like(self.pending_h)
            self.stale = False
        elif kept_rows is None:
            self.stale = True  # cut outside the last window: the hidden row is unknown
        elif kept_rows == 0:
            self.pending_h = self.pre_verify_h.copy()
        else:
            self.pending_h = self.window_h[kept_rows - 1].copy()

    def draft(self, last: int, pos0: int, k: int, *, probs: bool = False,
              ) -> tuple[list[int], list[float]]:
        """Up to ``k`` greedy drafts after ``last`` (at ``pos0``), and with ``probs`` the
        head's probability of each (else an empty list).

        Why probabilities only on request: each one is a softmax over the whole
        vocabulary (150k entries on real models), host work per drafted token that only
        a probability cut needs; the argmax alone reads the logits in place.
        """
        (tokens,), (chances,) = self.owner.draft_many([(self, last, pos0, k)], probs=probs)
        return tokens, chances


class MtpContext:
    """The MTP companion of a target context (same model, same sequences, sized by the
    same ``config``); ``lock`` is the target context's, held around every call."""

    def __init__(self, model: Model, config: ContextConfig, threads: int,
                 lock: threading.RLock) -> None:
        self.lock = lock
        params = context_params(config, threads)
        params.n_rs_seq = 0
        params.ctx_type = lc.LLAMA_CONTEXT_TYPE_MTP
        ctx = lc.llama_init_from_model(model.handle, params)
        if not ctx:
            raise NativeError("llama.cpp could not create the MTP context")
        self.ctx = ctx
        lcx.llama_set_embeddings_nextn(ctx, True, True)
        self.memory = lc.llama_get_memory(ctx)
        self.batch = lc.llama_batch_ext_init(ctx)
        self.n_embd = int(lc.llama_model_n_embd_out(model.handle))
        self.n_vocab = model.info.n_vocab
        self.n_batch = config.n_batch
        self._sessions: dict[int, MtpSession] = {}
        #: MTP forwards run (catch-ups and draft steps), for tests and stats.
        self.forwards = 0

    def session(self, seq_id: int) -> MtpSession:
        s = MtpSession(self, seq_id)
        self._sessions[seq_id] = s
        return s

    def follows_any(self, rows: Sequence[Row]) -> bool:
        """Whether any of ``rows`` belongs to a sequence that follows the head."""
        sessions = self._sessions
        return bool(sessions) and any(r.seq_id in sessions for r in rows)

    def clear(self, seq_id: int) -> None:
        lc.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        self._sessions.pop(seq_id, None)

    def close(self) -> None:
        lc.llama_batch_ext_free(self.batch)
        lc.llama_free(self.ctx)

    def draft_many(self, items: Sequence[tuple[MtpSession, int, int, int]], *,
                   probs: bool = False) -> tuple[list[list[int]], list[list[float]]]:
        """Greedy drafts for several sequences at once: ``items`` are ``(session, last,
        pos0, k)``; returns each item's tokens and, with ``probs``, the head's
        probability of each (else empty lists).

        One MTP forward per draft position carries every sequence still drafting (as
        llama.cpp's own server drafts for its slots), instead of one forward per
        sequence and position: the head's weights and the vocabulary's output matrix
        are read once per position for all of them. A stale session drafts nothing.
        """
        tokens: list[list[int]] = [[] for _ in items]
        chances: list[list[float]] = [[] for _ in items]
        live = [i for i, (sess, _, _, k) in enumerate(items) if k > 0 and not sess.stale]
        if not live:
            return tokens, chances
        if len({items[i][0].seq_id for i in live}) != len(live):
            raise ValueError("one draft per sequence at a time")
        h = {i: items[i][0].pending_h for i in live}
        tok = {i: items[i][1] for i in live}
        batch = self.batch
        with self.lock:
            fed = [items[i][0] for i in live if items[i][0].queue]
            if fed:
                t0 = time.perf_counter()
                self._feed(fed)
                share = (time.perf_counter() - t0) / len(fed)
                for sess in fed:
                    sess.fed_s += share
            try:
                for step in range(max(items[i][3] for i in live)):
                    rows = [i for i in live if items[i][3] > step]
                    lc.llama_batch_ext_clear(batch)
                    at: dict[int, int] = {}
                    for i in rows:
                        sess, _, pos0, _ = items[i]
                        at[i] = self._add(sess.seq_id, tok[i], pos0 + step, h[i], output=True)
                    rc = lc.llama_process(self.ctx, lc.LLAMA_PROCESS_TYPE_DECODE, batch)
                    self.forwards += 1
                    if rc != 0:
                        first = items[rows[0]]
                        raise RuntimeStateError(
                            f"MTP draft decode failed ({rc})", seq_id=first[0].seq_id,
                            positions=(first[2] + step, first[2] + step + 1),
                        )
                    for i in rows:
                        logits = float_rows(lc.llama_get_logits_ith(self.ctx, at[i]), 1,
                                            self.n_vocab)[0]
                        d = int(logits.argmax())
                        if probs:
                            chances[i].append(float(1.0 / np.exp(logits - logits[d]).sum()))
                        tokens[i].append(d)
                        h[i] = float_rows(lcx.llama_get_embeddings_nextn_ith(self.ctx, at[i]),
                                          1, self.n_embd)[0].copy()
                        tok[i] = d
            finally:
                for i in live:
                    sess, _, pos0, _ = items[i]
                    lc.llama_memory_seq_rm(self.memory, sess.seq_id, pos0, -1)
        for i in live:
            items[i][0].drafts += 1
        return tokens, chances

    def catch_up(self, rows: Sequence[Row], hidden: FloatArray) -> None:
        """Queue what the target just decoded for the head (each row with the target's
        hidden row before it), feeding the sessions whose queue is full."""
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for k, r in enumerate(rows):
            sess = self._sessions.get(r.seq_id)
            if sess is None:
                continue
            beg = first.setdefault(r.seq_id, k)
            last[r.seq_id] = k
            sess.queue.append((r.token, r.pos, sess.pending_h if k == beg else hidden[k - 1]))
        full = []
        for seq_id, beg in first.items():
            sess = self._sessions[seq_id]
            end = last[seq_id]
            sess.pre_verify_h = sess.pending_h
            sess.window_h = hidden[beg:end + 1]
            sess.pending_h = hidden[end].copy()
            if len(sess.queue) >= QUEUE_ROWS:
                full.append(sess)
        if full:
            with self.lock:
                self._feed(full)

    def _feed(self, sessions: Sequence[MtpSession]) -> None:
        """Feed the queued rows of ``sessions`` to the head (no outputs), in forwards of
        at most ``n_batch`` rows; the lock is held."""
        entries = [(sess.seq_id, e) for sess in sessions for e in sess.queue]
        for sess in sessions:
            sess.queue = []
        batch = self.batch
        for at in range(0, len(entries), self.n_batch):
            lc.llama_batch_ext_clear(batch)
            for seq_id, (token, pos, h) in entries[at:at + self.n_batch]:
                self._add(seq_id, token, pos, h, output=False)
            rc = lc.llama_process(self.ctx, lc.LLAMA_PROCESS_TYPE_DECODE, batch)
            self.forwards += 1
            if rc != 0:
                raise RuntimeStateError(f"MTP catch-up decode failed ({rc})")

    def _add(self, seq_id: int, token: int, pos: int, h: FloatArray, *, output: bool) -> int:
        """Append one entry (token at ``pos``, paired with hidden row ``h``) to the batch."""
        batch = self.batch
        idx = lc.llama_batch_ext_add_token(batch, seq_id, token)
        if idx < 0:
            raise NativeError(f"MTP batch rejected token {token} ({idx})")
        lc.llama_batch_ext_set_pos(batch, idx, (lc.llama_pos * 1)(pos))
        if not lc.llama_batch_ext_set_embd_token(batch, idx, _embd(np.ascontiguousarray(h))):
            raise NativeError("MTP batch rejected a hidden row")
        if output:
            lc.llama_batch_ext_set_output_logits(batch, idx, True)
        return int(idx)
