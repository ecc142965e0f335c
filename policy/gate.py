"""The step gate: may this decode step speculate, and with how many drafts?

One call per step (:meth:`StepGate.verdict`) answers from facts the engine hands over
(:class:`StepFacts`) and from what the gate has learned (acceptance, drafting cost), with
a :class:`Verdict`: a draft length, why speculation was refused (if it was) and whether
to stop following the MTP head. The engine applies it; nothing here touches the model.
The checks, first refusal wins: exact verification needs greedy or seeded sampling; the
budget must allow a draft; an MTP head that cannot pay for its catch-up is dropped; then
the cost model (:class:`~meshd.policy.draft_length.AdaptiveK`) chooses the length, 0 when
none beats plain decoding. A followed head is paid for on every forward, so the gate
judges it fast: a short window until :data:`HEAD_EVIDENCE_WINDOWS` windows are seen, then
its acceptance, and what following it bought (:class:`HeadValue`), must beat its cost.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from .acceptance import AcceptanceTracker
from .costs import CostCurve, CostModel, RepairCost, speedup_limit
from .draft_length import AdaptiveK
from .realised import RealisedRate

#: Decode-phase forwards before the MTP head's cost is judged (timings settle).
HEAD_CHECK_FORWARDS = 16
#: Drafted tokens verified before the head is judged by its measured acceptance.
HEAD_CHECK_DRAFTS = 16
#: Windows a followed head verifies outside a run of accepted drafts before the cost
#: model alone decides: until then it drafts a short window (:data:`HEAD_EVIDENCE_K`)
#: on every step the cost model would decode plainly. Its catch-up is paid on every
#: forward anyway, so learning quickly what it is worth is cheaper than the slow
#: probing a free proposer gets.
HEAD_EVIDENCE_WINDOWS = 8
#: The window of such an evidence step.
HEAD_EVIDENCE_K = 2
#: Steps a followed head is given before its realised value (:class:`HeadValue`) is judged.
HEAD_VALUE_STEPS = 32
#: Per-step decay of that value's evidence (about the last 50 steps count).
HEAD_VALUE_DECAY = 0.98
#: Forwards between two such judgements.
HEAD_CHECK_EVERY = 8
#: Weight of the newest proposal in the running drafting time per token.
DRAFT_TIME_WEIGHT = 0.2


class Refusal(enum.StrEnum):
    """Why a step decoded plainly although the request has a proposer (the keys of
    the request statistics' ``refusals``)."""

    UNSEEDED_SAMPLING = "unseeded_sampling"
    BUDGET = "budget"
    MTP_HEAD_DROPPED = "mtp_head_dropped"
    COST_MODEL = "cost_model"
    #: Counted by the engine: the plan of a forward shared with other requests kept the
    #: step plain (:mod:`meshd.policy.shared_window`).
    SHARED_PLAN = "shared_plan"
    #: Counted by the engine, not the gate: the proposer was asked and had no draft.
    PROPOSER_EMPTY = "proposer_empty"


@attrs.frozen
class HeadLoad:
    """What following the MTP head has cost since decoding began (prefill excluded)."""

    forwards: int
    """Target forwards."""
    forward_ms: float
    """Their time, the head's catch-up included."""
    head_ms: float
    """The head's catch-up forwards alone."""
    drafted: int
    """Drafted tokens verified."""


@attrs.define
class HeadValue(RealisedRate):
    """What following the MTP head has bought lately: tokens committed against what they
    cost in plain decodes (each window by the cost curve, the head's catch-up on every
    forward, the drafting), decayed so that a head which stopped paying shows it within
    tens of steps. A ratio under 1: decoding plainly without the head would be faster.

    Why a realised ledger and not the acceptance estimates alone: what the head is worth
    depends on the lengths the cost model actually chooses from them (a head right three
    times in four may draft now and then and still not earn its catch-up back)."""

    decay: float = HEAD_VALUE_DECAY


@attrs.frozen
class StepFacts:
    """What the engine knows before a step."""

    exact_verifiable: bool
    """Greedy or seeded sampling (otherwise a draft cannot be verified exactly)."""
    k_max: int
    """The most drafts the request allows now: ``draft_max``, the tokens left after the
    target's own one, and the context's room."""
    head: HeadLoad | None = None
    """Set while the request follows an MTP head."""
    repair: RepairCost | None = None
    """What windows longer than the in-place rollback cost (recurrent models only)."""


@attrs.frozen
class Verdict:
    """One step's gate: ``k`` drafts (0: decode plainly)."""

    k: int
    refusal: Refusal | None = None
    drop_head: bool = False
    """Stop following the MTP head (and decode the rest of the request plainly)."""


def mtp_head_pays(curve: CostCurve, *, overhead: float, draft_cost: float, k_max: int,
                  acceptances: Sequence[Sequence[float]] = (),
                  repair: RepairCost | None = None) -> bool:
    """Whether following an MTP head can beat plain decoding without it.

    ``overhead``: the head's catch-up time per target forward, as a fraction of it (paid
    on plain steps too); ``draft_cost``: one drafted token, in decodes. Speculation must
    beat ``1 + overhead``. With no ``acceptances`` only the bound at acceptance 1 is
    judged; with them (one estimate per state), the best of them must beat it too.
    """
    target = 1.0 + overhead
    if speedup_limit(curve, 1.0, k_max=k_max, draft_cost=draft_cost,
                     repair=repair)[1] < target:
        return False
    if not acceptances:
        return True
    return max(speedup_limit(curve, acc, k_max=k_max, draft_cost=draft_cost,
                             repair=repair)[1]
               for acc in acceptances) >= target


class StepGate:
    """One request's speculation policy: the gate, and what it learns between steps.

    ``adaptive`` is None when the draft length is not the gate's to choose (no cost
    model, or a proposer that chooses its own length): then every step the budget
    allows drafts ``k_max``. Times are handed in (:meth:`drafted`), never read here.
    """

    def __init__(self, costs: CostModel | None, *, draft_max: int, adaptive: bool,
                 prior: float | None = None, streaks: bool = True) -> None:
        self.costs = costs
        self.adaptive: AdaptiveK | None = None
        if adaptive and costs is not None:
            # ``prior``: the acceptance other requests measured for this proposer, where
            # known; it replaces the generic prior, so drafting starts at once where it
            # paid for them (and the request's own evidence takes over within a few steps).
            # ``streaks``: see AdaptiveK; off for a model's own head, whose drafts do not
            # come in copy runs (a fully accepted window says little about the next).
            tracker = AcceptanceTracker(prior=prior) if prior is not None else None
            self.adaptive = AdaptiveK(costs.curve(), tracker, k_max=draft_max,
                                      streaks=streaks)
        #: Running wall time of drafting one token, in seconds (None before a draft).
        self.draft_s_per_token: float | None = None
        self._next_head_check = 0
        #: What following the MTP head has bought (while the request follows one).
        self.head_value = HeadValue()
        #: The head's catch-up per target forward, as a fraction of it (measured).
        self._head_overhead = 0.0
        self._following = False

    def verdict(self, facts: StepFacts) -> Verdict:
        """This step's draft length, refusal and head verdict (see the module docstring).

        Not a pure function: choosing a length advances the controller's probing
        schedule, so call it once per step."""
        if not facts.exact_verifiable:
            return Verdict(0, Refusal.UNSEEDED_SAMPLING)
        if facts.k_max <= 0:
            return Verdict(0, Refusal.BUDGET)
        adaptive = self.adaptive
        if adaptive is None:
            return Verdict(facts.k_max)
        if self.costs is not None:
            adaptive.curve = self.costs.curve()
            draft_cost = self.draft_cost()
            if draft_cost > 0.0:
                # Drafting is not free (an MTP head or draft model runs forwards):
                # the cost model charges each drafted token what it measurably costs.
                adaptive.draft_cost = draft_cost
        adaptive.repair = facts.repair
        head = facts.head
        self._following = head is not None
        if head is not None:
            if head.forward_ms > head.head_ms > 0.0:
                self._head_overhead = head.head_ms / (head.forward_ms - head.head_ms)
            value = self.head_value
            if ((value.steps >= HEAD_VALUE_STEPS and value.ratio < 1.0)
                    or self._head_cannot_pay(adaptive, head)):
                return self._drop_head()
        k = adaptive.next_k(facts.k_max)
        if head is not None and k == 0:
            if adaptive.tracker.updates < HEAD_EVIDENCE_WINDOWS:
                k = min(HEAD_EVIDENCE_K, facts.k_max)  # gather evidence on the head
            else:
                self.held_plain()
        return Verdict(k, Refusal.COST_MODEL if k == 0 else None)

    def held_plain(self) -> None:
        """A step decoded plainly while the head is followed (the cost model said so,
        or a shared forward's plan kept it plain): it paid the head's catch-up for one
        token. One rule for both, so a head that company never lets draft is dropped as
        one the cost model never lets draft."""
        if self._following:
            self.head_value.add(1, 1.0 + self._head_overhead)

    def _drop_head(self) -> Verdict:
        self.adaptive = None
        return Verdict(0, Refusal.MTP_HEAD_DROPPED, drop_head=True)

    def draft_cost(self) -> float:
        """One drafted token lately, in single-row decodes (0 until both are measured)."""
        decode_s = self.costs.decode_seconds() if self.costs is not None else None
        per_token = self.draft_s_per_token
        return per_token / decode_s if decode_s and per_token is not None else 0.0

    def drafted(self, seconds: float, tokens: int) -> None:
        """A proposal of ``tokens`` tokens took ``seconds`` (an empty one counts as one)."""
        per_token = seconds / max(1, tokens)
        prev = self.draft_s_per_token
        self.draft_s_per_token = per_token if prev is None else (
            (1 - DRAFT_TIME_WEIGHT) * prev + DRAFT_TIME_WEIGHT * per_token)

    def verified(self, proposed: int, matched: int) -> None:
        """Feed back one step's window (``proposed = 0``: the proposer had nothing)."""
        adaptive = self.adaptive
        if adaptive is None:
            return
        adaptive.observe(proposed, matched)
        if self._following:
            window = adaptive.curve.cost(min(proposed, adaptive.curve.max_k))
            self.head_value.add(matched + 1, window * (1.0 + self._head_overhead)
                                + adaptive.draft_cost * proposed)

    def _head_cannot_pay(self, adaptive: AdaptiveK, head: HeadLoad) -> bool:
        """Whether following the MTP head costs more than its drafts can save.

        Following the head is not free: every target forward is followed by an MTP
        forward to catch it up (``o``, measured as a fraction of the target's forward
        time), plain steps included. Speculation must therefore beat ``1 + o`` (plain
        decoding without the head), not 1. The head is dropped when even drafts that are
        always right could not (on a model whose head costs as much as its body), or,
        once enough drafts were verified, when the measured acceptance cannot.
        """
        if self.draft_s_per_token is None:
            return False
        if head.forwards < max(HEAD_CHECK_FORWARDS, self._next_head_check):
            return False
        self._next_head_check = head.forwards + HEAD_CHECK_EVERY  # not on every step
        if head.forward_ms <= head.head_ms:  # the head took all the time: it cannot pay
            return True
        overhead = head.head_ms / (head.forward_ms - head.head_ms)
        measured: list[Sequence[float]] = []
        if head.drafted >= HEAD_CHECK_DRAFTS:
            trackers = [adaptive.tracker, *(t for t in adaptive.streak_trackers if t.updates)]
            measured = [t.acceptances(adaptive.k_max) for t in trackers]
        return not mtp_head_pays(adaptive.curve, overhead=overhead,
                                 draft_cost=adaptive.draft_cost, k_max=adaptive.k_max,
                                 acceptances=measured, repair=adaptive.repair)
