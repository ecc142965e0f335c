"""Concurrent requests: one window length for the group, so ONE forward.

llama.cpp computes the windows of a forward as one micro-batch only when they have equal
rows and consecutive sequence ids; every further micro-batch is another pass over the
weights, and on a hybrid model the split also decides exactness
(:mod:`meshd.native.batching`). And a request alone prices its window as if the forward
were its own, while a forward carrying other requests' rows is past the cheap part of
the curve. So the engine's step (:func:`meshd.daemon.engine.generation.step_many`) gets one length
chosen for the group (:func:`meshd.policy.shared_window.plan_shared`), caps every
request's drafts at it, and pads shorter windows with filler. Padding is allowed only
where it cannot change output, and that is checked here: every request's sampling is
exactly verifiable (greedy or seeded), a recurrent session's padded window can be undone
in place, and the context has room. A request stepping alone is padded the same way
where a wider forward costs less (:func:`pad_alone`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import attrs

from meshd.daemon.engine.sampling import Sampler
from meshd.daemon.engine.window import MtpHead, Window
from meshd.native.session import SequenceSession
from meshd.policy.costs import CostModel
from meshd.policy.decision import RepairCaps, needs_checkpoint
from meshd.policy.gate import StepGate
from meshd.policy.shared_window import Member, RunningAcceptance, plan_shared


class Sharer(Protocol):
    """What a request sharing a forward shows here (a
    :class:`~meshd.daemon.engine.generation.Generation`)."""

    session: SequenceSession
    costs: CostModel | None
    sampler: Sampler
    mtp_head: MtpHead | None
    last: int
    acceptance: RunningAcceptance
    shared_idle: int
    gate: StepGate

    def draft_cap(self) -> int: ...


#: Shared steps without drafts after which the group drafts one token each, so that
#: acceptance that improved (or a pessimistic prior) is noticed: at most one step in
#: this many pays for a probe.
PROBE_EVERY = 16


def shared_caps(generations: Sequence[Sharer]) -> list[int] | None:
    """How many drafts each request may make this step so that the group's windows,
    padded to one length with filler, are ONE llama.cpp micro-batch (none at all for
    recurrent sessions that cannot roll a row back in place); or None where requests
    decide alone (one request, no cost model yet, sampling that cannot be verified,
    sequence ids llama.cpp would not compute together)."""
    if len(generations) < 2:
        return None
    first = generations[0]
    if first.costs is None or not _consecutive(generations):
        return None
    if not all(g.sampler.params.exact_verifiable for g in generations):
        return None
    members = []
    for g in generations:
        cap = g.draft_cap()
        members.append(Member(tuple(g.acceptance.rates(cap)) if cap > 0 else None, cap,
                              g.gate.draft_cost(), g.acceptance.offer_rate))
    if first.session.context.recurrent:
        longest = min(g.session.rollback_window for g in generations)
        if longest < 1:
            # No in-place rollback: a drafting request's window needs a checkpoint and a
            # forward of its own, which the others wait for. In company, nobody drafts.
            return [0] * len(generations)
    else:  # attention-only KV drops any suffix exactly
        longest = max(m.cap for m in members)
    costs, n = first.costs, len(generations)
    plan = plan_shared(members, lambda rows: costs.row_cost(rows, n), max_length=longest)
    able = [g for g, m in zip(generations, members, strict=True) if m.cap > 0]
    if plan.length > 0 or not able:
        for g in able:
            g.shared_idle = 0
        if plan.length > 0 and not costs.company.may_draft(n):
            return [0] * n  # drafting in company measurably earned less than plain steps
        return list(plan.drafts)
    # Nobody drafts: now and then all draft one token (their rows are paid alike), as
    # acceptance is only learned from drafts.
    for g in able:
        g.shared_idle += 1
    if min(g.shared_idle for g in able) < PROBE_EVERY:
        return list(plan.drafts)
    for g in able:
        g.shared_idle = 0
    if not costs.company.may_draft(n):
        return list(plan.drafts)
    return [min(1, m.cap) for m in members]


def observe_shared(generations: Sequence[Sharer], caps: list[int] | None,
                   outcomes: Sequence[object], seconds: float) -> None:
    """A step of requests that shared a plan ended (``outcomes``: each one's events or
    exception): its tokens and wall time go to the company check
    (:class:`~meshd.policy.company.CompanyCheck`), as a drafting or a plain step."""
    costs = generations[0].costs if generations else None
    if caps is None or costs is None:
        return
    tokens = sum(len(ev.tokens) for out in outcomes if isinstance(out, list) for ev in out)
    costs.company.observe(len(generations), drafted=any(caps), tokens=tokens,
                          seconds=seconds)


def pad_windows(generations: Sequence[Sharer], windows: list[Window],
                caps: list[int] | None) -> list[Window]:
    """``windows`` (one per generation, in order), the shorter ones padded with filler
    to the longest draft, when the group shares a length this step (``caps`` not None)
    and every padded window fits; otherwise unchanged."""
    if caps is None or len(windows) < 2:
        return windows
    length = max(len(w.draft) for w in windows)  # within the caps: plan() held to them
    if length == 0:
        return windows
    if not all(_fits(g.session, length) for g in generations):
        return windows
    return [w if len(w.draft) == length else
            padded(w, length) for w in windows]


def _fits(s: SequenceSession, length: int) -> bool:
    """Whether a window of ``length`` drafts (filler included) has room in ``s``'s
    context and is undone in place: no checkpoint held or needed for it."""
    return (s.n_past + length + 1 <= s.context.config.n_ctx_seq and not s.has_checkpoint
            and not needs_checkpoint(length, RepairCaps(s.recurrent, s.rollback_window)))


def pad_alone(generation: Sharer, window: Window) -> Window:
    """A request stepping alone: ``window`` padded with filler to the length its cost
    curve priced it at, where a wider forward costs less (whole blocks of rows for the
    matrix kernels: :meth:`meshd.policy.costs.CostCurve.sanitized`). The filler rows
    are free guesses. Padded only where it is exact and cheap to undo, as for shared
    windows: verifiable sampling, within the request's draft cap (tokens left, context
    room), and on a recurrent model within the in-place rollback with no checkpoint."""
    k = len(window.draft)
    costs = generation.costs
    if k == 0 or costs is None or not generation.sampler.params.exact_verifiable:
        return window
    length = min(costs.curve().padded_length(k), generation.draft_cap())
    if length <= k or not _fits(generation.session, length):
        return window
    return padded(window, length)


def padded(window: Window, length: int) -> Window:
    """``window`` with filler drafts up to ``length``: its last token repeated (text that
    repeats itself then still commits them)."""
    fill = window.draft[-1] if window.draft else window.last
    draft = (*window.draft, *([fill] * (length - len(window.draft))))
    return attrs.evolve(window, draft=draft, real=len(window.draft))


def draft_ahead(generations: Sequence[Sharer], caps: list[int]) -> None:
    """Draft for every request that drafts from its MTP head at once, its cap each,
    one MTP forward per position for all of them; each head hands its drafts to its
    proposer when asked (:class:`MtpHead`).

    Only heads their proposer used at its last proposal draft ahead (a composite that
    chose prompt lookup would waste them); a head's time is its share of the forwards.
    """
    ahead = []
    for g, cap in zip(generations, caps, strict=True):
        head = g.mtp_head
        session = head.session if head is not None else None
        if head is None or not head.in_use or session is None or session.mtp is None:
            continue
        if cap > 0 and not session.mtp.stale:
            ahead.append((g, head, session.mtp, cap))
    if len(ahead) < 2:
        return  # one head drafts as fast on its own, when its proposer asks
    t0 = time.perf_counter()
    owner = ahead[0][2].owner
    tokens, _ = owner.draft_many([(mtp, g.last, g.session.n_past, k)
                                  for g, _, mtp, k in ahead])
    share = (time.perf_counter() - t0) / len(ahead)
    for (g, head, _, _), drafts in zip(ahead, tokens, strict=True):
        head.set_ahead(g.last, g.session.n_past, drafts, share)


def _consecutive(generations: Sequence[Sharer]) -> bool:
    """Whether the sessions' sequence ids form one run (llama.cpp's condition for
    computing equal windows together)."""
    ids = sorted(g.session.seq_id for g in generations)
    return ids == list(range(ids[0], ids[0] + len(ids)))
