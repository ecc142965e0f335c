"""Adaptive draft length for one proposer: how many drafts this step should verify.

:class:`AdaptiveK` combines the objective of :mod:`meshd.policy.costs` (``choose_k``)
with acceptance estimates and probing (:mod:`meshd.policy.acceptance`). It is the
engine's per-request controller for proposers that do not choose their own length; the
composite proposer and prompt lookup apply the same objective themselves, per child or
per match.
"""

from __future__ import annotations

from .acceptance import PROBE_BUDGET, AcceptanceTracker, Explorer, probe_interval_floor
from .costs import DEFAULT_MARGIN, CostCurve, RepairCost, choose_k, ratios

#: Run lengths (drafted tokens accepted in a row) where each streak bucket starts.
STREAK_BUCKETS = (1, 4, 16)

#: Where the per-position acceptance right after a fully accepted window starts (see
#: :class:`AdaptiveK`): optimistic, so a copy run found by a probe is used at once.
STREAK_PRIOR = 0.9

#: Steps between two tries of a longer window (see :meth:`AdaptiveK.next_k`) ...
LONGER_EVERY = 8
#: ... whose expected speedup is within this share of the chosen length's ...
LONGER_SLACK = 0.05
#: ... and whose last position rests on fewer verified drafts than this.
EXPLORED = 2.0


class AdaptiveK:
    """Per-session draft-length controller for a single proposer.

    Each step: ``k = next_k()``; if ``k > 0`` ask the proposer for up to ``k`` tokens;
    after verification call ``observe(proposed, accepted, censored)``. Combines
    :func:`choose_k`, :class:`AcceptanceTracker` estimates and an :class:`Explorer`.
    (The composite proposer applies the same policy internally, per child.)

    Acceptance is tracked apart by state, because copying comes in runs: right after a
    window whose every draft was accepted (``streak``; the text is most likely still
    being copied, so long drafts pay) and otherwise (after a rejection, an empty
    proposal or a plain step). One pooled estimate would average a run's near-certain
    acceptance with the misses around it and choose a length that suits neither. Streaks
    are told apart by how long they have lasted (1-3, 4-15, 16+ accepted drafts in a
    row): deep in a copy run acceptance is near 1 and the longest windows pay. The
    streak estimates start optimistic (:data:`STREAK_PRIOR`): the first fully accepted
    probe is followed by a long window, so a copy region is exploited at once; where
    streaks do not last (text that copies a word here and there), a few failed long
    windows teach the streak tracker so and it stops trying.
    """

    def __init__(
        self,
        curve: CostCurve,
        tracker: AcceptanceTracker | None = None,
        *,
        k_max: int | None = None,
        margin: float = DEFAULT_MARGIN,
        draft_cost: float = 0.0,
        explorer: Explorer | None = None,
        streaks: bool = True,
        probe_budget: float = PROBE_BUDGET,
    ) -> None:
        self.curve = curve
        #: Acceptance outside a streak (after a rejection, an empty proposal, a plain step).
        self.tracker = tracker if tracker is not None else AcceptanceTracker()
        #: Acceptance right after fully accepted windows, one tracker per run length
        #: bucket (:data:`STREAK_BUCKETS`): the longer the output has been copying, the
        #: likelier it goes on, and the longer the window that pays.
        self.streak_trackers = [
            AcceptanceTracker(prior=STREAK_PRIOR, prior_weight=self.tracker.prior_weight,
                              decay=self.tracker.decay,
                              max_positions=self.tracker.max_positions)
            for _ in STREAK_BUCKETS
        ]
        #: Expected probe cost allowed per step, in decodes (``inf``: no floor).
        self.probe_budget = probe_budget
        #: Whether streaks are tracked apart (off: one pooled estimate).
        self.streaks = streaks
        #: Drafted tokens accepted in a row, up to the end of the last step (0 after a
        #: rejection, an empty proposal or a plain step).
        self.run = 0
        self._planned: AcceptanceTracker = self.tracker
        self.k_max = curve.max_k if k_max is None else min(k_max, curve.max_k)
        self.margin = margin
        self.draft_cost = draft_cost
        #: What windows beyond a recurrent model's in-place rollback cost (None: free).
        self.repair: RepairCost | None = None
        self.explorer = explorer if explorer is not None else Explorer()
        self.probing = False
        self._since_longer = 0

    def acceptances(self) -> tuple[float, ...]:
        """The estimates this step decides from (streak or not), positions 0..k_max-1."""
        n = max(1, self.k_max)
        return self.current_tracker().acceptances(n)

    @property
    def streak(self) -> bool:
        """Whether the last step verified a window and accepted every draft of it."""
        return self.run > 0

    def current_tracker(self) -> AcceptanceTracker:
        """The tracker for the present state (no streak, or the run length's bucket)."""
        if self.run <= 0:
            return self.tracker
        bucket = sum(1 for start in STREAK_BUCKETS if self.run >= start) - 1
        return self.streak_trackers[bucket]

    def next_k(self, limit: int | None = None) -> int:
        """The draft length for this step (> 0 when it is a probe, 0 for plain decode),
        at most ``limit`` (this step's reach: tokens left, the proposer's longest draft).

        Why the limit goes into the choice and is not applied to it: the best length
        within reach is not the best overall cut down (a 32-draft choice cut to 8 may
        cost a block of rows more than the 7 that were best within 8)."""
        self._planned = self.current_tracker()
        k_max = self.k_max if limit is None else max(0, min(limit, self.k_max))
        k = choose_k(self.curve, self.acceptances(), k_max, margin=self.margin,
                     draft_cost=self.draft_cost, repair=self.repair)
        if k > 0:
            self.probing = False
            self.explorer.speculated()
            return self._longer(k, k_max)
        # A probe costs c(1) - 1 plus its drafting and saves a decode when it hits:
        # keep its expected cost under PROBE_BUDGET of a decode per step on average.
        if k_max >= 1:
            hit = self.tracker.acceptances(1)[0]
            probe_cost = self.curve.cost(1) - 1.0 + self.draft_cost - hit
            self.explorer.min_interval = probe_interval_floor(probe_cost, self.probe_budget)
        if k_max >= 1 and self.explorer.idle_step():
            self.explorer.probed()
            self.probing = True
            return 1
        self.probing = False
        self.run = 0  # a plain step verifies nothing: whatever ran is over
        return 0

    def _longer(self, k: int, k_max: int) -> int:
        """``k``, or now and then a longer window whose positions beyond ``k`` were
        never verified, where it is expected to do nearly as well.

        Why: positions never drafted are estimated from the ones before them, and short
        windows never verify them, so an estimate that starts low stays there: a model's
        head whose first draft is right 85% of the time and its next ones 95% drafts 1
        token a step for good where 3 pay more. One window in :data:`LONGER_EVERY`, of a
        length expected within :data:`LONGER_SLACK` of the best, costs next to nothing.
        """
        self._since_longer += 1
        if self._since_longer < LONGER_EVERY or k >= k_max:
            return k
        tracker = self.current_tracker()
        rs = ratios(self.curve, self.acceptances(), k_max, draft_cost=self.draft_cost,
                    repair=self.repair)
        for j in range(k + 1, len(rs)):
            if rs[j] >= rs[k] * (1.0 - LONGER_SLACK) and tracker.evidence(j - 1) < EXPLORED:
                self._since_longer = 0
                return j
        return k

    def observe(self, proposed: int, accepted: int, *, censored: bool = False) -> None:
        """Feed back one step's verification (``proposed = 0``: nothing was verified)."""
        self._planned.update(proposed, accepted, censored=censored)
        if self.streaks and proposed > 0 and accepted == proposed:
            self.run += accepted
        else:
            self.run = 0
        if self.probing:
            if proposed > 0:
                self.explorer.probe_result(accepted)
            else:
                self.explorer.rearm()  # the proposer had nothing: probe next step
            self.probing = False
