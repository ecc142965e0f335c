"""What speculation learns across one model's requests, kept in one place.

Why: a request ends with facts that later requests decide from: the MTP head's
acceptance (pooled, what ``auto`` judges the head by), how the requests that followed
the head ended (:class:`~meshd.policy.head_choice.HeadChoice`), the rollback snapshots'
evidence (:class:`~meshd.policy.rollback_depth.RollbackDepth`), prompt lookup's
acceptance by match length, and the earlier answers history lookup drafts from
(:class:`~meshd.plugins.history.HistoryStore`, in memory only, bounded, by owner).
The runtime hands every ended generation here (``ModelRuntime.release``) and reads
the ledger when it plans the next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from meshd.plugins.history import HistoryStore
from meshd.plugins.match_stats import SharedMatchStats
from meshd.policy.acceptance import PooledAcceptance
from meshd.policy.costs import CostCurve, RepairCost
from meshd.policy.gate import Refusal, mtp_head_pays
from meshd.policy.head_choice import HeadChoice
from meshd.policy.rollback_depth import OWN_EVIDENCE_DRAFTS, RequestOutcome, RollbackDepth

if TYPE_CHECKING:  # types only: the ledger itself runs no llama.cpp (a fast-tier test)
    from meshd.daemon.engine.generation_stats import GenerationStats
    from meshd.native.calibrate import MtpCosts

__all__ = ["HeadPrices", "SpeculationLedger"]


@attrs.frozen
class HeadPrices:
    """What the MTP head costs on the model's context now (what judging it needs)."""

    mtp: MtpCosts
    curve: CostCurve
    #: The context's in-place rollback depth now.
    rollback_window: int
    #: The model keeps recurrent state (a window beyond the rollback depth is replayed).
    recurrent: bool
    #: A one-row forward's measured time (None: not enough samples yet).
    decode_seconds: float | None


class SpeculationLedger:
    """One model's speculation evidence across requests."""

    def __init__(self, rollback: RollbackDepth | None, *,
                 history: HistoryStore | None = None) -> None:
        #: The head's acceptance over the requests that drafted with it (``auto``).
        self.mtp_acceptance = PooledAcceptance()
        #: How the requests that followed the head ended (``auto`` skips a dropped head).
        self.head_choice = HeadChoice()
        #: The rollback snapshots' depth, kept only while speculation uses them (None:
        #: fixed, as configured: no recurrent state, or adaptation off).
        self.rollback = rollback
        #: Prompt lookup's acceptance by match length (it sets draft lengths only; every
        #: draft is verified, so output cannot change).
        self.ngram_stats = SharedMatchStats()
        #: The acceptance of the tokens a constraint forces, drafted (the tokenizer may
        #: prefer another split), over the constrained requests that drafted them.
        self.forced_acceptance = PooledAcceptance()
        #: Earlier answers, by owner, that history lookup drafts from (capacity 0: off).
        self.history = history if history is not None else HistoryStore(0)
        #: History drafts' acceptance by match length (lengths only, as ``ngram_stats``).
        self.history_stats = SharedMatchStats()

    def head_pays(self, prices: HeadPrices | None,
                  acceptances: Sequence[Sequence[float]] | None = None) -> bool:
        """Whether the head pays at ``acceptances`` (default: the pooled ones), judged
        where the rollback snapshots are kept (the depth an adaptive context returns to
        when speculation uses it), their cost per forward counted against the head.
        True until the head is measured (``prices`` None)."""
        if prices is None:
            return True
        if acceptances is None:
            acceptances = self.mtp_acceptance.estimates()
        overhead, depth = prices.mtp.overhead, prices.rollback_window
        if self.rollback is not None:
            depth = self.rollback.full
            overhead += self.rollback.snapshot_overhead(prices.decode_seconds)
        return mtp_head_pays(prices.curve, overhead=overhead, draft_cost=prices.mtp.draft_cost,
                             k_max=prices.curve.max_k, acceptances=acceptances,
                             repair=RepairCost(depth) if prices.recurrent else None)

    def ended(self, stats: GenerationStats, *, followed_head: bool,
              prices: HeadPrices | None) -> None:
        """A request ended: its forced drafts' acceptance pooled, the head's (if it
        followed the head), how it ended, and the rollback depth's evidence."""
        dropped = Refusal.MTP_HEAD_DROPPED in stats.refusals
        pays_with_snapshots = False
        self.forced_acceptance.add([stats.forced_accepted], [stats.forced_drafted])
        if followed_head:
            self.mtp_acceptance.add(stats.accepted_per_position, stats.drafted_per_position)
            # Its acceptance says what the head is worth alone; a request whose company
            # kept it from drafting learned what the head is worth in company.
            pays_with_snapshots = (Refusal.SHARED_PLAN not in stats.refusals
                                   and self._pays_with_snapshots(stats, prices))
            # A head dropped only for want of snapshots is not held against it.
            self.head_choice.ended(dropped=dropped and not pays_with_snapshots)
        if self.rollback is not None:
            self.rollback.ended(RequestOutcome(
                tokens=stats.emitted, accepted=stats.accepted, dropped_head=dropped,
                head_pays_with_snapshots=pays_with_snapshots))

    def _pays_with_snapshots(self, stats: GenerationStats, prices: HeadPrices | None) -> bool:
        """Whether a request that followed the head without rollback snapshots measured
        an acceptance at which the head would pay with them."""
        rollback = self.rollback
        if rollback is None or rollback.depth != 0 or prices is None:
            return False
        own = PooledAcceptance(min_drafts=OWN_EVIDENCE_DRAFTS)
        own.add(stats.accepted_per_position, stats.drafted_per_position)
        estimates = own.estimates()
        return bool(estimates) and self.head_pays(prices, estimates)

    @property
    def snapshots_wanted_back(self) -> bool:
        """The rollback snapshots were dropped and are wanted back (rebuilt when idle)."""
        return self.rollback is not None and self.rollback.wanted > self.rollback.depth
