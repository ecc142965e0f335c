"""Measure what a verify window costs on this model and machine (the cost curve).

Why measure: on a CPU a batch of k rows can cost nearly k single decodes (Q4_1), or
much less (Q8_0, F16); speculation only pays where the tokens it commits outweigh
that cost. The adaptive draft length decides per step from this curve, so it must come
from the model actually loaded, on the machine actually running it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence

import attrs

from .context import TargetContext
from .session import SequenceSession

#: Tokens of context the calibration forwards run after (a short prompt's worth).
CALIBRATION_CONTEXT = 64


def measure_row_costs(
    context: TargetContext, k_max: int, *, reps: int = 5,
    context_tokens: int = CALIBRATION_CONTEXT, baseline: TargetContext | None = None,
) -> list[float]:
    """Relative cost of a forward of k+1 rows vs 1 row, for k = 0..k_max (see
    :func:`measure_row_costs_timed`)."""
    return measure_row_costs_timed(context, k_max, reps=reps, context_tokens=context_tokens,
                                   baseline=baseline)[0]


def measure_row_costs_timed(
    context: TargetContext, k_max: int, *, reps: int = 5,
    context_tokens: int = CALIBRATION_CONTEXT, baseline: TargetContext | None = None,
) -> tuple[list[float], float]:
    """Relative cost of a forward of k+1 rows vs 1 row, for k = 0..k_max, and the unit's
    wall time in seconds.

    Arms are interleaved (1, 2, ..., k_max+1, 1, 2, ...) and medians taken, so machine
    noise hits every size alike. Uses one temporary session slot.

    Without ``baseline`` the unit is a one-row forward on ``context`` itself (``c[0] ==
    1``): what the adaptive draft length compares on the context it decodes on. With
    ``baseline`` (the same model without in-place rollback) the unit is a one-row forward
    there, timed in the same interleaved rounds: a recurrent context that can roll back
    in place stores per-token state snapshots on every forward, one-row ones included,
    which decoding without speculation never pays. Against that unit ``c[0]`` is what
    the snapshots cost a plain decode and every window's cost includes them, so a limit
    computed from it is the best any speculation on this context can do against plain
    decoding.
    """
    n_vocab = context.n_vocab
    filler = [(7 * i + 3) % n_vocab for i in range(context_tokens)]
    times: dict[int, list[float]] = {n: [] for n in range(1, k_max + 2)}
    unit_times: list[float] = []
    with contextlib.ExitStack() as stack:
        session = stack.enter_context(SequenceSession.open(context))
        session.prefill(filler)
        base_pos = session.n_past
        plain = None
        if baseline is not None:
            plain = stack.enter_context(SequenceSession.open(baseline))
            plain.prefill(filler)
        for _ in range(reps):
            if plain is not None:
                unit_times.append(_time_window(plain, filler[:1], len(filler)))
            for n in times:
                times[n].append(_time_window(session, filler[:n], base_pos))
    base = statistics.median(unit_times if unit_times else times[1])
    return [statistics.median(times[n]) / base for n in range(1, k_max + 2)], base


def _time_window(session: SequenceSession, window: list[int], base_pos: int) -> float:
    """Seconds one forward of ``window`` takes; the session is put back at ``base_pos``."""
    if session.recurrent:
        session.checkpoint()
    t0 = time.perf_counter()
    session.verify(window)
    elapsed = time.perf_counter() - t0
    if session.recurrent:
        session.restore_and_replay(base_pos, ())
    else:
        session.trim(base_pos)
    return elapsed


@attrs.frozen
class MtpCosts:
    """What following and using the MTP head costs, relative to the target's decode.

    ``overhead``: the catch-up MTP forward that follows every target forward, as a
    fraction of that forward; ``draft_cost``: one drafted token, in target decodes.
    """

    overhead: float
    draft_cost: float


def measure_mtp_costs(context: TargetContext, *, steps: int = 15, draft_len: int = 4,
                      context_tokens: int = CALIBRATION_CONTEXT) -> MtpCosts | None:
    """Measure the MTP head's costs on this model and machine (None: no head).

    Why: a head is worth following only if what its drafts save beats what catching it
    up costs on every forward; on a small model the head can cost as much as the body.
    Each quantity is a median of per-step ratios (catch-up vs body within one forward;
    a drafted token vs the neighbouring decode), so a step slowed down by other load on
    the machine shifts both sides of its ratio and not the result.
    """
    samples = mtp_cost_samples(context, steps=steps, draft_len=draft_len,
                               context_tokens=context_tokens)
    if samples is None:
        return None
    overheads, draft_costs = samples
    return MtpCosts(overhead=statistics.median(overheads),
                    draft_cost=statistics.median(draft_costs))


def mtp_cost_samples(context: TargetContext, *, steps: int = 15, draft_len: int = 4,
                     context_tokens: int = CALIBRATION_CONTEXT,
                     ) -> tuple[list[float], list[float]] | None:
    """The per-step ratios :func:`measure_mtp_costs` takes the medians of: each step's
    catch-up overhead and drafted-token cost (None: no head, or nothing measurable).
    Uses one temporary session slot; a few of these make the daemon's calibration in
    idle moments (:mod:`meshd.policy.calibration`)."""
    if context.mtp is None:
        return None
    n_vocab = context.n_vocab
    filler = [(7 * i + 3) % n_vocab for i in range(context_tokens + steps + 2)]
    overheads: list[float] = []
    draft_costs: list[float] = []
    with SequenceSession.open(context, mtp=True) as session:
        session.prefill(filler[:context_tokens])
        for t in filler[context_tokens:context_tokens + 2]:  # warm-up
            session.decode(t)
        c = session.counters
        for t in filler[context_tokens + 2:]:
            fwd0, mtp0 = c.decode_ms, c.mtp_ms
            session.decode(t)
            mtp_ms = c.mtp_ms - mtp0
            body_ms = (c.decode_ms - fwd0) - mtp_ms
            if body_ms <= 0 or session.mtp is None:
                return None
            t0 = time.perf_counter()
            tokens, _ = session.mtp.draft(t, session.n_past, draft_len)
            fed_ms = session.note_head_feed() * 1e3  # the head fed what it decoded
            draft_ms = (time.perf_counter() - t0) * 1e3 - fed_ms
            overheads.append((mtp_ms + fed_ms) / body_ms)
            if tokens:
                draft_costs.append(draft_ms / len(tokens) / body_ms)
    if not overheads or not draft_costs:
        return None
    return overheads, draft_costs


class CalibrationBench:
    """A session kept for timing forwards across the pieces of a calibration run in
    idle moments (:mod:`meshd.policy.calibration`): prefilled once with filler, each
    timed forward trimmed off again. Holds one sequence slot until :meth:`close` (the
    daemon closes it before any other work runs on the model)."""

    def __init__(self, context: TargetContext, *,
                 context_tokens: int = CALIBRATION_CONTEXT) -> None:
        self.context = context
        self._filler = [(7 * i + 3) % context.n_vocab for i in range(context_tokens)]
        self._session: SequenceSession | None = None
        self._base = 0

    @property
    def holds_slot(self) -> bool:
        return self._session is not None

    def time(self, rows: Sequence[int], *, budget_s: float | None = None,
             ) -> tuple[list[tuple[int, float]], bool]:
        """Each forward of ``rows[i]`` rows timed, in order, and whether the run was cut
        short (the forwards so far took longer than ``budget_s``). Opens and prefills
        the session first if needed (raises ``CapacityError`` without a free slot)."""
        if self._session is None:
            session = SequenceSession.open(self.context)
            try:
                session.prefill(self._filler)
            except BaseException:
                session.close()
                raise
            self._session, self._base = session, session.n_past
        session = self._session
        out: list[tuple[int, float]] = []
        spent = 0.0
        for n in rows:
            window = (self._filler * (n // len(self._filler) + 1))[:n]
            elapsed = _time_window(session, window, self._base)
            out.append((n, elapsed))
            spent += elapsed
            if budget_s is not None and spent > budget_s:
                return out, True
        return out, False

    def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()
