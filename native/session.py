"""A sequence session: one request's sequence in the shared target context.

The session knows positions and states, never requests: it offers prefill, decode,
verify and the repair primitives the speculation state machine chooses between:

* ``trim(keep_to)`` - drop the attention KV suffix (``seq_rm``; attention-only models);
* ``rollback_in_place(keep_to)`` - recurrent/hybrid models with ``n_rs_seq > 0``: llama.cpp
  keeps per-token snapshots of the last decode, so ``seq_rm`` rolls back in O(1). It is
  only exact right after the window's forward, by at most ``rows - 1`` tokens, once: we
  refuse anything else (llama.cpp would "succeed" and restore a stale state);
* ``checkpoint()`` before a verify + ``restore_and_replay(keep_to, replay)`` - save the
  recurrent part of the sequence's state (PARTIAL_ONLY), put it back, drop the attention
  suffix, and re-decode the accepted tokens;
* ``retire()`` - every verified row was committed: free the checkpoint, nothing to undo.

Every primitive checks llama.cpp's return value; a failure raises ``RuntimeStateError``
naming the sequence and positions and marks the session unusable.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .batching import forward_groups
from .errors import CapacityError, RollbackRefused, RuntimeStateError, SessionUnusable
from .prefill_chunks import prefill_forward_rows, prefill_merges_chunks
from .records import FloatArray, Row
from .records import SessionCounters as SessionCounters

if TYPE_CHECKING:
    from .context import TargetContext
    from .mtp import MtpSession


@attrs.define
class _Checkpoint:
    data: Any  # the context's copy of the state (``TargetContext.seq_state_save``)
    n_past: int


class SequenceSession:
    """One sequence of a ``TargetContext``. Not thread-safe by itself: the context lock is.

    Opened with :meth:`open`, which takes a free sequence slot of the context."""

    @classmethod
    def open(cls, context: TargetContext, *, reserve: int = 0,
             mtp: bool = True) -> SequenceSession:
        """A new session on a free sequence slot of ``context``; ``reserve`` = tokens it
        will need; ``mtp``: follow the MTP head (if the model has one) so it can draft."""
        return context.open_slot(lambda seq_id: cls(context, seq_id, mtp=mtp),
                                 reserve=reserve)

    def __init__(self, context: TargetContext, seq_id: int, *, mtp: bool = True) -> None:
        self.context = context
        self.seq_id = seq_id
        self.n_past = 0  # tokens in the KV / state; the next position to write
        self.counters = SessionCounters()
        self._checkpoint: _Checkpoint | None = None
        self._last_forward_id = -1
        self._last_rows = 0
        self._rolled_back = False
        self._unusable: str | None = None
        self._closed = False
        #: The MTP companion's view of this sequence, when the session follows the MTP
        #: head (only a session whose proposer drafts with it should: catching the head
        #: up costs an MTP forward after every target forward).
        self.mtp: MtpSession | None = (
            context.mtp.session(seq_id) if mtp and context.mtp is not None else None
        )

    def detach_mtp(self) -> None:
        """Stop following the MTP head (its state for this sequence is dropped; a
        session cannot start following it again, the head would lack the history)."""
        if self.mtp is None:
            return
        with self.context.lock:
            if self.context.mtp is not None:
                self.context.mtp.clear(self.seq_id)
            self.mtp = None

    # ------------------------------------------------------------------ state

    @property
    def recurrent(self) -> bool:
        return self.context.recurrent

    @property
    def rollback_window(self) -> int:
        return self.context.rollback_window

    @property
    def has_checkpoint(self) -> bool:
        return self._checkpoint is not None

    @property
    def checkpoint_held_bytes(self) -> int:
        """Bytes of the state checkpoint held now (0 between verify windows)."""
        ckpt = self._checkpoint
        return len(ckpt.data) if ckpt is not None else 0

    @property
    def usable(self) -> bool:
        return self._unusable is None and not self._closed

    def _check(self) -> None:
        if self._closed:
            raise SessionUnusable("session is closed", seq_id=self.seq_id)
        if self._unusable is not None:
            raise SessionUnusable(f"session unusable: {self._unusable}", seq_id=self.seq_id)

    def _fail(self, message: str, positions: tuple[int, int] | None = None) -> RuntimeStateError:
        self._unusable = message
        return RuntimeStateError(message, seq_id=self.seq_id, positions=positions)

    def close(self) -> None:
        """Hand the sequence slot back (idempotent; safe on every exit path)."""
        if self._closed:
            return
        self._closed = True
        self._checkpoint = None
        self.context.release_slot(self.seq_id)

    def __enter__(self) -> SequenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ forwards

    def _ensure_room(self, n: int) -> None:
        if self.n_past + n > self.context.config.n_ctx_seq:
            raise CapacityError(
                f"sequence {self.seq_id} would grow to {self.n_past + n} tokens, over its "
                f"context of {self.context.config.n_ctx_seq}"
            )

    def _rows(self, tokens: Sequence[int], outputs: Iterable[bool]) -> list[Row]:
        n_vocab = self.context.n_vocab
        rows = []
        for i, (tok, out) in enumerate(zip(tokens, outputs, strict=True)):
            if not 0 <= tok < n_vocab:
                raise ValueError(f"token id {tok} outside the vocabulary [0, {n_vocab})")
            rows.append(Row(tok, self.n_past + i, self.seq_id, out))
        return rows

    def _note_forward(self, n_rows: int) -> None:
        self._last_forward_id = self.context.forward_id
        self._last_rows = n_rows
        self._rolled_back = False
        self.n_past += n_rows
        self.counters.target_forwards += 1
        if self.mtp is not None:
            self.counters.mtp_ms += self.context.last_mtp_s * 1e3

    def note_head_feed(self) -> float:
        """Count the MTP head's feeding before this session's last drafts
        (:meth:`~meshd.native.mtp.MtpSession.take_fed_s`) as its upkeep, with the verify
        forwards it precedes (``mtp_ms`` and ``verify_ms``); returns its seconds, for the
        caller to take out of the drafting time."""
        if self.mtp is None:
            return 0.0
        fed = self.mtp.take_fed_s()
        self.counters.verify_ms += fed * 1e3
        self.counters.mtp_ms += fed * 1e3
        return fed

    def prefill(self, tokens: Sequence[int]) -> FloatArray:
        """Decode a prompt in forwards of :func:`~.prefill_chunks.prefill_forward_rows`
        (whole chunks, see :func:`prefill_parts`); returns the last row's logits."""
        self._check()
        if not tokens:
            raise ValueError("prefill needs at least one token")
        self._ensure_room(len(tokens))
        t0 = time.perf_counter()
        chunk = prefill_forward_rows(self.context)
        logits: FloatArray | None = None
        with self.context.lock:
            for start in range(0, len(tokens), chunk):
                part = tokens[start:start + chunk]
                last = start + len(part) == len(tokens)
                rows = self._rows(part, [False] * (len(part) - 1) + [last])
                try:
                    out, _ = self.context.forward(rows)
                except RuntimeStateError as exc:
                    raise self._fail(str(exc), (self.n_past, self.n_past + len(part))) from exc
                self._note_forward(len(part))
                self.counters.prefill_forwards += 1
                if last:
                    logits = out[0]
        self.counters.prefill_tokens += len(tokens)
        self.counters.prefill_ms += (time.perf_counter() - t0) * 1e3
        assert logits is not None
        return logits

    def decode(self, token: int) -> FloatArray:
        """Decode one token; returns its logits row (a copy)."""
        logits, ms = self._window([token])
        self.counters.note_window(1, ms)
        row: FloatArray = logits[0]
        return row

    def verify(self, tokens: Sequence[int]) -> FloatArray:
        """One batched forward over ``[last, d0..dk-1]``, every row an output.

        Returns the logits rows (k+1, n_vocab). Row i predicts the token after
        ``tokens[i]``. The window stays in the state until ``retire``/a repair.
        """
        logits, ms = self._window(tokens)
        self.counters.note_window(len(tokens), ms)
        return logits

    def _window(self, tokens: Sequence[int]) -> tuple[FloatArray, float]:
        t0 = time.perf_counter()
        rows = self.window_rows(tokens)
        try:
            logits, _ = self.context.forward(rows)
        except RuntimeStateError as exc:
            raise self.window_failed(exc, len(tokens)) from exc
        self._note_forward(len(tokens))
        return logits, (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ batched windows
    # A window may share its forward with other sessions' (``verify_many``): these are
    # the session's side of it, before and after that forward.

    def window_rows(self, tokens: Sequence[int]) -> list[Row]:
        """The rows of a verify window (or decode step) over ``tokens``, every row an
        output, at this session's next positions. Checks the session is usable and has
        room; changes nothing."""
        self._check()
        self._ensure_room(len(tokens))
        return self._rows(tokens, [True] * len(tokens))

    def window_failed(self, exc: RuntimeStateError, n_rows: int) -> RuntimeStateError:
        """The forward holding this session's window of ``n_rows`` failed: the session is
        unusable from now on; returns the error naming its sequence and positions."""
        return self._fail(str(exc), (self.n_past, self.n_past + n_rows))

    def window_done(self, n_rows: int, ms: float) -> None:
        """The forward holding this session's window of ``n_rows`` ran (``ms`` long): the
        rows are in the state (until ``retire`` or a repair) and counted."""
        self._note_forward(n_rows)
        self.counters.note_window(n_rows, ms)

    def share_prefix(self, donor: SequenceSession, n: int) -> None:
        """Hold the first ``n`` tokens ``donor`` holds, copied from it instead of
        prefilled (what this session held before is dropped). Attention-only states
        only: a position's KV depends on the tokens up to it alone, so any prefix of
        another sequence is exact; a recurrent state is one value per sequence."""
        self._check()
        donor._check()
        if self.recurrent or self.mtp is not None or donor.mtp is not None \
                or donor.context is not self.context:
            # (a forward that feeds an MTP head is another graph: its rows may round
            # differently, so only sessions without one trade prefixes)
            raise ValueError("only attention-only sessions without an MTP head, on one "
                             "context, can share a prefix")
        if donor is self or not 0 < n <= donor.n_past \
                or not self.context.holds_from_start(donor.seq_id):
            raise ValueError(f"cannot share {n} of the {donor.n_past} tokens sequence "
                             f"{donor.seq_id} holds (from its first position)")
        self.context.seq_cp_whole(donor.seq_id, self.seq_id)
        if n < donor.n_past and not self.context.seq_rm(self.seq_id, n, -1):
            raise self._fail("llama_memory_seq_rm refused to cut a shared prefix", (n, -1))
        self.n_past = n
        self._checkpoint = None
        self._last_rows = 0
        self._rolled_back = True  # nothing to roll back: no forward of its own yet
        self.counters.shared_prefix_tokens += n

    # ------------------------------------------------------------------ repair

    def checkpoint(self) -> int:
        """Save the recurrent part of this sequence's state before a verify; returns bytes."""
        self._check()
        t0 = time.perf_counter()
        buf, size, written = self.context.seq_state_save(self.seq_id)
        if size == 0 or written != size:
            raise self._fail(f"state checkpoint failed ({written} of {size} bytes)")
        self._checkpoint = _Checkpoint(buf, self.n_past)
        self.counters.checkpoints += 1
        self.counters.checkpoint_bytes += size
        self.counters.checkpoint_ms += (time.perf_counter() - t0) * 1e3
        return int(size)

    def retire(self) -> None:
        """Every verified row was committed: drop the checkpoint, keep the state."""
        self._checkpoint = None

    def trim(self, keep_to: int) -> None:
        """Drop KV entries at positions >= ``keep_to`` (attention-only state)."""
        self._check()
        if not 0 <= keep_to <= self.n_past:
            raise ValueError(f"trim to {keep_to} outside [0, {self.n_past}]")
        if keep_to == self.n_past:
            self._checkpoint = None
            return
        if self.recurrent:
            raise self._fail(
                "a KV trim cannot undo a recurrent state; use rollback or restore",
                (keep_to, self.n_past),
            )
        if not self.context.seq_rm(self.seq_id, keep_to, -1):
            raise self._fail("llama_memory_seq_rm refused a suffix trim", (keep_to, self.n_past))
        self._after_cut(keep_to)
        self.counters.trims += 1

    def can_rollback_in_place(self, keep_to: int) -> bool:
        """True iff an in-place rollback to ``keep_to`` is exact right now."""
        r = self.n_past - keep_to
        return (
            self.recurrent
            and self.rollback_window > 0
            and not self._rolled_back
            and self._last_forward_id == self.context.forward_id
            and 1 <= r <= min(self.rollback_window, self._last_rows - 1)
        )

    def rollback_in_place(self, keep_to: int) -> None:
        """Roll a recurrent/hybrid state back to ``keep_to`` using llama.cpp's snapshots."""
        self._check()
        if not self.can_rollback_in_place(keep_to):
            raise RollbackRefused(
                "in-place rollback refused: only right after the window's forward, by at "
                f"most min(n_rs_seq={self.rollback_window}, rows-1={self._last_rows - 1}) "
                "tokens, once",
                seq_id=self.seq_id, positions=(keep_to, self.n_past),
            )
        if not self.context.seq_rm(self.seq_id, keep_to, -1):
            raise self._fail("llama.cpp refused the in-place rollback", (keep_to, self.n_past))
        self._rolled_back = True
        self._after_cut(keep_to)
        self.counters.rollbacks_in_place += 1

    def restore_and_replay(self, keep_to: int, replay: Sequence[int]) -> None:
        """Put the pre-verify checkpoint back, drop the suffix, re-decode ``replay``."""
        self._check()
        ckpt = self._checkpoint
        if ckpt is None:
            raise self._fail("restore requested without a checkpoint", (keep_to, self.n_past))
        if keep_to != ckpt.n_past + len(replay):
            raise ValueError(
                f"replay of {len(replay)} tokens from {ckpt.n_past} does not reach {keep_to}"
            )
        with self.context.lock:
            n = self.context.seq_state_load(self.seq_id, ckpt.data)
            if n == 0:
                raise self._fail("llama_state_seq_set_data_ext failed", (ckpt.n_past, self.n_past))
            if not self.context.seq_rm(self.seq_id, ckpt.n_past, -1):
                raise self._fail("could not drop the attention suffix after restore",
                                 (ckpt.n_past, self.n_past))
            self._checkpoint = None
            self._after_cut(ckpt.n_past)
            if replay:
                rows = self._rows(replay, [False] * len(replay))
                try:
                    self.context.forward(rows)
                except RuntimeStateError as exc:
                    raise self._fail(str(exc), (self.n_past, keep_to)) from exc
                self._note_forward(len(replay))
                self._rolled_back = True  # a replay is no verify window to roll back
        self.counters.restores += 1
        self.counters.replayed_tokens += len(replay)

    def discard(self) -> None:
        """Forget the whole sequence (used when a finished request cannot be repaired)."""
        self.context.seq_rm(self.seq_id, -1, -1)
        if self.mtp is not None:
            self.mtp.trim(0, None)
        self.n_past = 0
        self._checkpoint = None
        self._unusable = "discarded"

    def _after_cut(self, keep_to: int) -> None:
        kept = self._kept_rows_from_window(keep_to)
        self.n_past = keep_to
        if self.mtp is not None:
            self.mtp.trim(keep_to, kept)

    def _kept_rows_from_window(self, keep_to: int) -> int | None:
        """How many rows of the last window survive (for the MTP's pending hidden state)."""
        start = self.n_past - self._last_rows
        kept = keep_to - start
        return kept if 0 <= kept <= self._last_rows else None

    # ------------------------------------------------------------------ memory

    def state_bytes(self) -> int:
        """Bytes of this sequence's KV + recurrent state (as llama.cpp would save them)."""
        return self.context.seq_state_bytes(self.seq_id)

    def checkpoint_bytes(self) -> int:
        return len(self._checkpoint.data) if self._checkpoint is not None else 0


def verify_many(items: Sequence[tuple[SequenceSession, Sequence[int]]]) -> list[FloatArray]:
    """Verify windows (or single decode steps) of several sessions in ONE forward.

    Returns each session's logits rows, in the order given. Each session must be
    repaired (or retired) before the next forward that includes it. On a recurrent
    (hybrid) state only windows that llama.cpp runs as one micro-batch may share a
    forward (:func:`~.batching.forward_groups` says which; anything else raises
    ``ValueError``): other layouts lose a sequence's rollback snapshots.
    """
    if not items:
        return []
    ctx = items[0][0].context
    if any(s.context is not ctx for s, _ in items):
        raise ValueError("verify_many needs sessions of one context")
    if len({s.seq_id for s, _ in items}) != len(items):
        raise ValueError("a session may appear once per forward")
    groups = forward_groups([(s.seq_id, len(tokens)) for s, tokens in items],
                            recurrent=ctx.recurrent, n_batch=ctx.config.n_batch)
    if len(groups) != 1:
        raise ValueError(
            f"windows of {[(s.seq_id, len(t)) for s, t in items]} (sequence, rows) cannot "
            "share one forward safely; verify them as forward_groups splits them")
    (order,) = groups
    t0 = time.perf_counter()
    rows: list[Row] = []
    for i in order:
        session, tokens = items[i]
        rows += session.window_rows(tokens)
    with ctx.lock:
        try:
            logits, _ = ctx.forward(rows)
        except RuntimeStateError as exc:
            for session, tokens in items:
                session.window_failed(exc, len(tokens))
            raise
        out: list[FloatArray] = [logits[:0]] * len(items)
        start = 0
        dt = (time.perf_counter() - t0) * 1e3
        for i in order:
            session, tokens = items[i]
            out[i] = logits[start:start + len(tokens)]
            start += len(tokens)
            session.window_done(len(tokens), dt)
    return out


def prefill_parts(items: Sequence[tuple[SequenceSession, Sequence[int], bool]],
                  ) -> list[FloatArray | None]:
    """ONE forward over the next prompt tokens of one session or, where chunks merge
    (:mod:`.prefill_chunks`), several: ``items`` are ``(session, tokens, last)``, ``last``
    when ``tokens`` end its prompt; returns the logits of the last row of each one with
    ``last`` (else None). A failed forward makes every session in it unusable."""
    ctx = items[0][0].context
    if len({s.seq_id for s, _, _ in items}) != len(items) \
            or any(s.context is not ctx for s, _, _ in items) \
            or (len(items) > 1 and not prefill_merges_chunks(ctx)):
        raise ValueError("prefill_parts: distinct sessions of one context (merging chunks)")
    rows: list[Row] = []
    for session, tokens, last in items:
        session._check()
        if not tokens:
            raise ValueError("prefill needs at least one token")
        session._ensure_room(len(tokens))
        rows += session._rows(tokens, [False] * (len(tokens) - 1) + [last])
    t0 = time.perf_counter()
    with ctx.lock:
        try:
            logits, _ = ctx.forward(rows)
        except RuntimeStateError as exc:
            for session, tokens, _ in items:
                session._fail(str(exc), (session.n_past, session.n_past + len(tokens)))
            raise
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        outputs = iter(logits)  # a row of each item with ``last``, in order
        out: list[FloatArray | None] = [next(outputs) if last else None for *_, last in items]
        for session, tokens, _ in items:  # the time shared by each one's rows
            session._note_forward(len(tokens))
            session.counters.prefill_forwards += 1
            session.counters.prefill_tokens += len(tokens)
            session.counters.prefill_ms += elapsed_ms * len(tokens) / len(rows)
    return out


def prefill_many(items: Sequence[tuple[SequenceSession, Sequence[int]]]) -> list[FloatArray]:
    """Prefill several sessions' prompts together, ``n_batch`` rows a forward; returns
    each one's last-row logits, in the order given.

    Why: requests admitted together then get their first tokens together and decode
    side by side from there (llama-server batches prompts the same way), and one forward
    over several short prompts reads the weights once. Only on attention-only contexts,
    where every row's result is its own whatever shares its forward (with the default K
    cache, see :mod:`.primitives`); a recurrent state's micro-batches may move another
    sequence's state, so there each session prefills on its own.
    """
    if not items:
        return []
    for session, tokens in items:  # nothing runs unless every prompt can
        session._check()
        if not tokens:
            raise ValueError("prefill needs at least one token")
        session._ensure_room(len(tokens))
    ctx = items[0][0].context
    if len(items) == 1 or ctx.recurrent or any(s.context is not ctx for s, _ in items):
        return [session.prefill(tokens) for session, tokens in items]
    if len({s.seq_id for s, _ in items}) != len(items):
        raise ValueError("a session may appear once in a prefill")
    planned: list[tuple[int, Row]] = []
    for k, (session, tokens) in enumerate(items):
        outputs = [False] * (len(tokens) - 1) + [True]
        planned += [(k, row) for row in session._rows(tokens, outputs)]
    out: list[FloatArray | None] = [None] * len(items)
    t0 = time.perf_counter()
    chunk = ctx.config.n_batch
    with ctx.lock:
        for start in range(0, len(planned), chunk):
            part = planned[start:start + chunk]
            try:
                logits, _ = ctx.forward([row for _, row in part])
            except RuntimeStateError as exc:
                for session, _ in items:  # partly prefilled, or behind a failed forward
                    session._fail(str(exc))
                raise
            rows_of: dict[int, int] = {}
            j = 0
            for k, row in part:
                rows_of[k] = rows_of.get(k, 0) + 1
                if row.output:
                    out[k] = logits[j]
                    j += 1
            for k, n in rows_of.items():
                session = items[k][0]
                session._note_forward(n)
                session.counters.prefill_forwards += 1
    total = len(planned)
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    for session, tokens in items:  # the shared time, by each one's share of the rows
        session.counters.prefill_tokens += len(tokens)
        session.counters.prefill_ms += elapsed_ms * len(tokens) / total
    assert all(row is not None for row in out)
    return [row for row in out if row is not None]
