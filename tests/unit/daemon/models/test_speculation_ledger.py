"""The speculation ledger: what one request's end teaches the next ones (without
llama.cpp: the statistics are what a finished generation reports)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from meshd.daemon.models.speculation_ledger import HeadPrices, SpeculationLedger
from meshd.policy.costs import CostCurve
from meshd.policy.gate import Refusal
from meshd.policy.rollback_depth import RollbackDepth

CHEAP = CostCurve([1.0 + 0.1 * k for k in range(5)])


def ended(ledger: SpeculationLedger, *, accepted: list[int], drafted: list[int],
          dropped: bool = False, followed_head: bool = True,
          prices: HeadPrices | None = None, forced: tuple[int, int] = (0, 0),
          held_plain: int = 0) -> None:
    refusals = {Refusal.MTP_HEAD_DROPPED: 1} if dropped else {}
    if held_plain:
        refusals[Refusal.SHARED_PLAN] = held_plain
    stats: Any = SimpleNamespace(
        accepted_per_position=accepted, drafted_per_position=drafted, refusals=refusals,
        emitted=64, accepted=accepted[0] if accepted else 0,
        forced_accepted=forced[0], forced_drafted=forced[1])
    ledger.ended(stats, followed_head=followed_head, prices=prices)


def prices(overhead: float) -> HeadPrices:
    mtp: Any = SimpleNamespace(overhead=overhead, draft_cost=0.1)
    return HeadPrices(mtp, CHEAP, rollback_window=0, recurrent=False, decode_seconds=None)


def test_only_requests_that_followed_the_head_pool_its_acceptance() -> None:
    ledger = SpeculationLedger(rollback=None)
    ended(ledger, accepted=[30, 20], drafted=[40, 30], followed_head=False)
    assert ledger.mtp_acceptance.drafted == 0
    ended(ledger, accepted=[30, 20], drafted=[40, 30])
    assert ledger.mtp_acceptance.drafted == 70
    assert ledger.mtp_acceptance.conditional() == [0.75, 20 / 30 / 0.75]


def test_the_head_pays_until_measured_and_then_as_its_acceptance_says() -> None:
    ledger = SpeculationLedger(rollback=None)
    assert ledger.head_pays(None)  # not measured: try it
    assert ledger.head_pays(prices(0.05))  # nothing pooled: the bound at acceptance 1
    ended(ledger, accepted=[0, 0, 0, 0], drafted=[64, 0, 0, 0])
    assert not ledger.head_pays(prices(0.05))  # every draft missed
    good = SpeculationLedger(rollback=None)
    ended(good, accepted=[64, 64, 64, 64], drafted=[64, 64, 64, 64])
    assert good.head_pays(prices(0.05))
    assert not good.head_pays(prices(5.0))  # a head dearer than anything it saves


def test_a_dropped_head_is_skipped_by_the_next_requests() -> None:
    ledger = SpeculationLedger(rollback=None)
    assert ledger.head_choice.due
    ended(ledger, accepted=[0], drafted=[16], dropped=True)
    assert not ledger.head_choice.due


def test_quiet_requests_drop_the_snapshots_and_a_speculating_one_wants_them_back() -> None:
    ledger = SpeculationLedger(rollback=RollbackDepth(4, quiet_requests=2))
    rollback = ledger.rollback
    assert rollback is not None
    for _ in range(2):
        ended(ledger, accepted=[], drafted=[], followed_head=False)
    assert rollback.wanted == 0 and not ledger.snapshots_wanted_back
    rollback.switched(0, decode_s=None)
    ended(ledger, accepted=[60], drafted=[64], followed_head=False)
    assert rollback.wanted == 4 and ledger.snapshots_wanted_back


def test_forced_drafts_acceptance_is_pooled_for_the_next_constrained_requests() -> None:
    ledger = SpeculationLedger(rollback=None)
    assert ledger.forced_acceptance.prior() is None  # the engine's FORCED_PRIOR, then
    ended(ledger, accepted=[], drafted=[], followed_head=False, forced=(10, 20))
    assert ledger.forced_acceptance.prior() is None  # too little evidence yet
    ended(ledger, accepted=[], drafted=[], followed_head=False, forced=(30, 60))
    prior = ledger.forced_acceptance.prior()
    assert prior is not None and 0.45 < prior < 0.55  # a tokenizer that splits otherwise


def test_a_head_dropped_in_company_is_held_against_it_even_where_it_pays_alone() -> None:
    """Without snapshots, a request whose own drafts were right 60 times in 64 dropped
    the head: alone, that is want of snapshots (they come back and the head stays due).
    The same request held plain by the forwards it shared learned that the head does
    not pay in company: the next requests go without it and the snapshots stay off."""
    for company, due in ((0, True), (40, False)):
        ledger = SpeculationLedger(rollback=RollbackDepth(4))
        rollback = ledger.rollback
        assert rollback is not None
        rollback.not_expected()
        rollback.switched(0, decode_s=None)
        ended(ledger, accepted=[60, 55], drafted=[64, 60], dropped=True,
              prices=prices(0.05), held_plain=company)
        assert ledger.head_choice.due is due
        assert ledger.snapshots_wanted_back is due
