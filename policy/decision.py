"""The speculation decision: verify, commit, repair. Sans-I/O, in the style of h11.

Each step the engine's last committed token, ``last``, is not yet in the model's state
(it would sit at position ``base``). One target forward over ``[last, d_0 .. d_{k-1}]``
yields the target's own next token after each row, ``p_0 .. p_k``. Two pure steps turn
those facts into a :class:`Decision` (the tokens committed, why the request finished, if
it did, and how to repair the state): :func:`accepted_prefix` walks the candidates up to
a cancel, the budget or an end-of-generation token; the engine then cuts that prefix at
the first completed stop string (its text assembly, the one impure part), and
:func:`settle` decides the commit and the repair given that cut. :func:`decide` is the
two with a known cut. Pure, so every rule is tested exhaustively.

The invariant is the repair rule: after ``n`` commits the state keeps exactly the first
``n`` of the window's ``k + 1`` entries. Keeping any rejected row would make the model
condition every later token on text the user never saw; hence retire the window iff
every verified row was committed.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence, Set

from attrs import field, frozen

__all__ = [
    "Decision",
    "FinishReason",
    "Prefix",
    "Repair",
    "RepairCaps",
    "RepairKind",
    "UnrepairableWindow",
    "accepted_prefix",
    "decide",
    "needs_checkpoint",
    "settle",
]


class FinishReason(enum.StrEnum):
    """Why a generation ended: the decision's verdict, and the wire's ``finish_reason``
    (:mod:`meshd.protocol` takes this enum from here). The decision gives only the first
    four; the daemon adds ``shutdown`` and ``error``."""

    STOP = "stop"
    """A stop string completed on the committed token (that token is committed; the
    matched string is not emitted)."""
    LENGTH = "length"
    """The request's token budget (``max_tokens`` or the context) ran out before the next
    candidate."""
    EOG = "eog"
    """The target produced an end-of-generation token (committed; the engine decides
    whether its text is shown)."""
    CANCELLED = "cancelled"
    """The client went away or asked to stop (a ``cancel`` for this request)."""
    SHUTDOWN = "shutdown"
    """The daemon is shutting down and its grace period for running requests ran out."""
    ERROR = "error"
    """The generation failed part-way; ``done.error_message`` says why."""


class RepairKind(enum.Enum):
    """How the engine brings the model state back to the committed history."""

    RETIRE = "retire"
    """Every verified row was committed: keep the state, free the pre-verify
    checkpoint (if any), remove nothing."""
    TRIM = "trim"
    """Attention-only KV: drop positions ``>= keep_to`` (``llama_memory_seq_rm``)."""
    ROLLBACK_IN_PLACE = "rollback_in_place"
    """Recurrent (or hybrid) state: roll back the last ``remove`` tokens in place,
    right after the window's decode. The same call drops the attention suffix of a
    hybrid model."""
    RESTORE_AND_REPLAY = "restore_and_replay"
    """Recurrent state that cannot roll back far enough: restore the pre-verify
    checkpoint (state at ``base``, ``last`` not yet fed) and re-decode ``replay``."""
    DISCARD = "discard"
    """The state is unusable and the request is over; drop the sequence."""


@frozen
class RepairCaps:
    """What the sequence session can do to undo a verify window.

    ``recurrent``: the model has recurrent (SSM / linear-attention) state that a KV
    trim cannot undo. ``rollback_window``: how many trailing tokens the runtime can
    roll back in place right after a decode (0 when it cannot). ``checkpointed``: a
    copy of the state from before this window's decode exists.
    """

    recurrent: bool
    rollback_window: int = field(default=0)
    checkpointed: bool = field(default=False)

    @rollback_window.validator
    def _check_window(self, _attribute: object, value: int) -> None:
        if value < 0:
            raise ValueError(f"rollback_window must be >= 0, got {value}")


@frozen
class Repair:
    """One repair instruction.

    ``keep_to`` is always ``base + n`` (the first position to remove, equivalently the
    number of positions the state keeps) and ``remove`` is always ``k + 1 - n``, for
    every kind, so the engine (and its logs) can rely on them; ``replay`` is non-empty
    only for :attr:`RepairKind.RESTORE_AND_REPLAY` with ``n >= 1``.
    """

    kind: RepairKind
    keep_to: int
    remove: int
    replay: tuple[int, ...] = ()


@frozen
class Decision:
    """The outcome of one verify window.

    ``committed``: tokens to append to the committed sequence, in order (a prefix of
    ``d_0 .. d_{a-1}, p_a``). ``accepted``: how many of them are drafted tokens.
    ``matched``: how many leading drafts the target agreed with (``a``), whether or
    not the walk got to commit them; this is the proposer's acceptance statistic.
    ``finish``: why the request ended, or None if it continues. ``repair``: what to do
    to the model state. ``verified_rows``: rows the window wrote (``k + 1``).
    """

    committed: tuple[int, ...]
    accepted: int
    matched: int
    finish: FinishReason | None
    repair: Repair
    verified_rows: int

    @property
    def draft_len(self) -> int:
        """``k``, the number of drafted tokens in the window."""
        return self.verified_rows - 1


class UnrepairableWindow(RuntimeError):
    """A recurrent state cannot be repaired and the request has not finished.

    The engine must never reach this: :func:`needs_checkpoint` tells it, before the
    decode, when to snapshot the state so that every non-finishing outcome is
    repairable. Raising (instead of returning DISCARD) keeps a live request from
    silently continuing on a state that still holds rejected drafts.
    """


@frozen
class Prefix:
    """What a verified window commits unless a stop string ends it sooner.

    ``candidates``: ``d_0 .. d_{a-1}, p_a`` up to the first that the request may not
    commit (cancel, budget) or through the first end-of-generation token. ``matched``:
    ``a``, the leading drafts the target agreed with. ``finish``: the walk's own end
    (CANCELLED, LENGTH or EOG), or None.
    """

    candidates: tuple[int, ...]
    matched: int
    finish: FinishReason | None


def needs_checkpoint(k: int, caps: RepairCaps) -> bool:
    """Must the engine snapshot the state before decoding a window of ``k`` drafts?

    Non-cancelled outcomes remove ``r = k + 1 - n`` rows with ``1 <= n <= k + 1``, so
    ``0 <= r <= k``. An in-place rollback handles ``1 <= r <= min(rollback_window, k)``
    (llama.cpp can roll back at most ``len(window) - 1`` tokens right after the
    window's decode), so every such outcome is repairable without a checkpoint iff
    ``k <= rollback_window``. Attention-only KV can always trim, and ``k == 0`` (a
    plain decode step) removes nothing unless it commits nothing, which only a
    finish (cancel or exhausted budget) does: then the state may simply be discarded.

    ``caps.checkpointed`` is ignored: this is asked before the checkpoint exists.
    """
    if k < 0:
        raise ValueError(f"draft length must be >= 0, got {k}")
    return caps.recurrent and k > 0 and k > caps.rollback_window


def accepted_prefix(
    *,
    draft: Sequence[int],
    predictions: Sequence[int],
    remaining: int,
    eog: Set[int],
    cancelled_at: int | None = None,
) -> Prefix:
    """Walk the candidates ``d_0 .. d_{a-1}, p_a`` one at a time.

    ``predictions[i]`` is the target's next token after row ``i``; it may be shorter
    than ``k + 1`` (seeded sampling draws row by row and may stop at the first
    mismatch), but it must cover every candidate the walk reaches.

    Before candidate ``j``: if ``cancelled_at`` is set and ``j >= cancelled_at`` the
    request is CANCELLED; if ``j >= remaining`` it is LENGTH; neither takes candidate
    ``j``. A candidate in ``eog`` is taken and ends the walk (EOG).

    ``cancelled_at`` is relative to this window: 0 means "cancelled now" (nothing more
    is committed); a larger index lets the request run until that many tokens of the
    window are committed, so "cancel once N tokens are out" lands exactly on token N
    even when N falls in a later window. A walk that ends before reaching the index
    does not finish the request on its account.
    """
    k = len(draft)
    if remaining < 0:
        raise ValueError(f"remaining must be >= 0, got {remaining}")
    if cancelled_at is not None and cancelled_at < 0:
        raise ValueError(f"cancelled_at must be >= 0, got {cancelled_at}")
    if not predictions:
        raise ValueError("predictions is empty: the window's first row is always verified")
    if len(predictions) > k + 1:
        raise ValueError(
            f"{len(predictions)} predictions for a window of {k + 1} rows (k={k})"
        )

    matched = 0
    for i in range(min(k, len(predictions))):
        if draft[i] != predictions[i]:
            break
        matched += 1

    candidates: list[int] = []
    finish: FinishReason | None = None
    for j in range(matched + 1):
        if cancelled_at is not None and j >= cancelled_at:
            finish = FinishReason.CANCELLED
            break
        if j >= remaining:
            finish = FinishReason.LENGTH
            break
        if j < matched:
            token = draft[j]
        else:
            if len(predictions) <= j:
                raise ValueError(
                    f"the walk needs prediction row {j} (the target's token after "
                    f"{j} accepted drafts) but only {len(predictions)} were given"
                )
            token = predictions[j]
        candidates.append(token)
        if token in eog:
            finish = FinishReason.EOG
            break
    return Prefix(tuple(candidates), matched, finish)


def settle(
    prefix: Prefix,
    *,
    last: int,
    base: int,
    draft: Sequence[int],
    caps: RepairCaps,
    stop_at: int | None = None,
) -> Decision:
    """What the window commits and how to repair the state, given the stop cut.

    ``stop_at``: the first candidate whose commit completes a stop string (never an
    end-of-generation token); it is committed, the rest are not, and the request
    finishes STOP. None: no stop string completed, and the walk's finish stands.

    Raises ValueError on inconsistent inputs and :class:`UnrepairableWindow` when a
    recurrent state cannot be repaired for a request that has not finished.
    """
    if base < 0:
        raise ValueError(f"base must be >= 0, got {base}")
    committed, finish = prefix.candidates, prefix.finish
    if stop_at is not None:
        if not 0 <= stop_at < len(committed) or (
                stop_at == len(committed) - 1 and finish is FinishReason.EOG):
            raise ValueError(f"stop_at {stop_at} is not a candidate that can complete a "
                             f"stop string ({len(committed)} candidates, finish {finish})")
        committed, finish = committed[: stop_at + 1], FinishReason.STOP
    n = len(committed)
    repair = _repair(last=last, base=base, draft=draft, n=n, caps=caps, finish=finish)
    return Decision(
        committed=committed,
        accepted=min(n, prefix.matched),
        matched=prefix.matched,
        finish=finish,
        repair=repair,
        verified_rows=len(draft) + 1,
    )


def decide(
    *,
    last: int,
    base: int,
    draft: Sequence[int],
    predictions: Sequence[int],
    remaining: int,
    eog: Set[int],
    caps: RepairCaps,
    cancelled_at: int | None = None,
    stop_at: int | None = None,
) -> Decision:
    """:func:`accepted_prefix` then :func:`settle`, for a caller that knows which
    candidate would complete a stop string (``stop_at``); a cut the walk does not reach,
    or on an end-of-generation token, is no cut (EOG wins)."""
    prefix = accepted_prefix(draft=draft, predictions=predictions, remaining=remaining,
                             eog=eog, cancelled_at=cancelled_at)
    if stop_at is not None and (stop_at >= len(prefix.candidates)
                                or prefix.candidates[stop_at] in eog):
        stop_at = None
    return settle(prefix, last=last, base=base, draft=draft, caps=caps, stop_at=stop_at)


def _repair(
    *,
    last: int,
    base: int,
    draft: Sequence[int],
    n: int,
    caps: RepairCaps,
    finish: FinishReason | None,
) -> Repair:
    """Pick the cheapest repair that leaves the state holding ``last, d_0 .. d_{n-2}``.

    The window wrote ``k + 1`` rows and ``n`` tokens were committed, so the first ``n``
    rows stay (all committed tokens but the final one are drafts, and the final one is
    the next window's ``last``) and ``r = k + 1 - n`` trailing rows go.
    """
    k = len(draft)
    remove = k + 1 - n
    keep_to = base + n
    if remove == 0:
        return Repair(RepairKind.RETIRE, keep_to, 0)
    if not caps.recurrent:
        return Repair(RepairKind.TRIM, keep_to, remove)
    # llama.cpp trap: an in-place rollback right after a decode may undo at most
    # len(window) - 1 tokens, so r == k + 1 (nothing committed) never rolls back.
    if remove <= caps.rollback_window and remove <= k:
        return Repair(RepairKind.ROLLBACK_IN_PLACE, keep_to, remove)
    if caps.checkpointed:
        replay = (last, *draft[: n - 1]) if n >= 1 else ()
        return Repair(RepairKind.RESTORE_AND_REPLAY, keep_to, remove, replay)
    if finish is None:
        raise UnrepairableWindow(
            f"recurrent state: {remove} of {k + 1} rows to undo, rollback window "
            f"{caps.rollback_window}, no checkpoint, and the request continues "
            "(needs_checkpoint() should have been honoured before the decode)"
        )
    return Repair(RepairKind.DISCARD, keep_to, remove)
