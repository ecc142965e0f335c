"""One window length for the requests that share a forward.

Why: llama.cpp computes the windows of one forward together (one micro-batch) only when
they have the same number of rows and consecutive sequence ids (see
:mod:`meshd.native.batching`), so concurrent requests that each choose their own draft
length split a step into several passes over the weights. And the length that pays
changes with company: a request's own cost curve prices a window as if it ran alone, but
a forward that already carries other requests' rows is past the cheap part of the curve.
So the shared length is the one that maximises the tokens the group expects to commit
per unit of the forward's cost (:func:`plan_shared`), counting how often each proposer
has drafts at all. Members that do not draft ride along with filler rows, cheaper than a
pass of their own; filler is exact, since verification commits a token only where the
target itself would have produced it, and only real drafts count as acceptance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs

from .costs import DEFAULT_MARGIN, prefix_expected

#: Weight of an old window in :class:`RunningAcceptance` (about the last 10 count).
ACCEPTANCE_DECAY = 0.9
#: Pseudo-windows behind a prior acceptance.
PRIOR_WEIGHT = 2.0
#: The acceptance assumed for a request with no evidence and no prior.
DEFAULT_PRIOR = 0.5
#: How close to the best return a shorter shared window may stay and be chosen. A
#: longer one's extra rows are paid for sure, its extra tokens only expected, from the
#: positions measured least, so a tie goes to the shorter window.
LONGER_MARGIN = 1.02
#: Lengths in a row that do not beat the best before the search stops (a step's plan
#: is computed on every step: a fraction of a millisecond is a percent of a small
#: model's forward).
GIVE_UP_AFTER = 4


@attrs.define
class RunningAcceptance:
    """A request's draft acceptance per window position, from its recent windows.

    Position ``i``'s rate is conditional: of the windows whose drafts were right up to
    ``i``, the share whose draft ``i`` was right too. Per position, because a draft made
    from drafts gets worse with depth (one rate over all positions overestimates the
    deep ones); a position seldom reached leans on the one before it. Decayed, so a
    request whose text changes character is followed within about ten windows.
    """

    prior: float = DEFAULT_PRIOR
    successes: list[float] = attrs.field(factory=list)
    trials: list[float] = attrs.field(factory=list)
    #: Decayed share of the steps the proposer was asked for drafts and gave some (prompt
    #: lookup has none where nothing matches; a head always has).
    offer_rate: float = 1.0

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"prior acceptance {self.prior} outside [0, 1]")

    def observe(self, drafted: int, matched: int) -> None:
        """One verified window: ``drafted`` real drafts, the first ``matched`` right."""
        if drafted <= 0:
            return
        if not 0 <= matched <= drafted:
            raise ValueError(f"matched={matched} of drafted={drafted}")
        while len(self.trials) < drafted:
            self.trials.append(0.0)
            self.successes.append(0.0)
        for i in range(len(self.trials)):
            self.trials[i] *= ACCEPTANCE_DECAY
            self.successes[i] *= ACCEPTANCE_DECAY
        for i in range(min(matched + 1, drafted)):  # positions reached
            self.trials[i] += 1.0
            if i < matched:
                self.successes[i] += 1.0

    def asked(self, offered: bool) -> None:
        """The proposer was asked for drafts this step and gave some (or none)."""
        self.offer_rate = self.offer_rate * ACCEPTANCE_DECAY + (
            (1.0 - ACCEPTANCE_DECAY) if offered else 0.0)

    def rates(self, k: int) -> list[float]:
        """Conditional acceptance of positions ``0 .. k-1``."""
        out: list[float] = []
        lean = self.prior
        for i in range(k):
            if i < len(self.trials):
                lean = (self.successes[i] + PRIOR_WEIGHT * lean) / (self.trials[i] + PRIOR_WEIGHT)
            out.append(lean)
        return out


@attrs.frozen
class Member:
    """One request in a shared forward.

    ``acceptance``: its conditional acceptance per window position, at least ``cap`` of
    them (None: it does not draft this step and rides with filler rows); ``cap``: the
    most real drafts it may verify (budget, context room, its ``draft_max``);
    ``draft_cost``: one drafted token, in single-row decodes.
    """

    acceptance: tuple[float, ...] | None
    cap: int = 0
    draft_cost: float = 0.0
    #: How often it has drafts when asked (its expected tokens are scaled by it).
    offer_rate: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.cap < 0 or self.draft_cost < 0.0 or not 0.0 <= self.offer_rate <= 1.0:
            raise ValueError(f"invalid member {self}")
        if self.acceptance is not None:
            if len(self.acceptance) < self.cap:
                raise ValueError(f"{len(self.acceptance)} acceptances for cap {self.cap}")
            if not all(0.0 <= a <= 1.0 for a in self.acceptance):
                raise ValueError(f"acceptance {self.acceptance} outside [0, 1]")


@attrs.frozen
class SharedPlan:
    """A step's shared window: every member verifies ``length + 1`` rows, of which the
    first ``drafts[i]`` after its last token are member ``i``'s real drafts (the rest
    filler)."""

    length: int
    drafts: tuple[int, ...]


def plan_at(members: Sequence[Member], length: int,
            row_cost: Callable[[int], float]) -> tuple[float, SharedPlan]:
    """The best plan at window ``length`` and its expected tokens per unit of cost.

    Every member's rows are paid anyway (the forward carries ``length + 1`` rows each);
    what a member's real drafts add is their tokens against their drafting cost. So
    members draft in order of what their drafts return per cost, each while that beats
    the group's ratio so far (the rule that maximises a ratio of sums); a member whose
    head costs as much as a decode does not hold back the others."""
    n = len(members)
    tokens = float(n)
    cost = row_cost(n * (length + 1))
    gains: list[tuple[float, float, int, int]] = []  # (tokens, cost, member, drafts)
    for i, m in enumerate(members):
        real = 0 if m.acceptance is None else min(length, m.cap)
        if real > 0:
            gains.append((m.offer_rate * (prefix_expected(m.acceptance or (), real)[-1] - 1.0),
                          real * m.draft_cost, i, real))
    drafts = [0] * n
    for extra, spend, i, real in sorted(
            gains, key=lambda g: g[0] / g[1] if g[1] > 0.0 else math.inf, reverse=True):
        if extra <= 0.0 or (spend > 0.0 and extra / spend <= tokens / cost):
            break
        tokens += extra
        cost += spend
        drafts[i] = real
    return tokens / cost, SharedPlan(length if any(drafts) else 0, tuple(drafts))


def plan_shared(members: Sequence[Member], row_cost: Callable[[int], float], *,
                max_length: int, margin: float = DEFAULT_MARGIN) -> SharedPlan:
    """The window length (and who drafts) that pays best for the whole group.

    ``row_cost(rows)`` is a forward of ``rows`` rows relative to a one-row decode.
    Plain shared decoding (length 0) unless some length beats it by ``margin``; of the
    lengths that do, the shortest within :data:`LONGER_MARGIN` of the best. Never longer than
    any drafting member's ``cap`` can use nor than ``max_length`` (the longest window
    every member can undo in place).
    """
    n = len(members)
    top = min(max_length, max((m.cap for m in members if m.acceptance is not None),
                              default=0))
    plain = SharedPlan(0, (0,) * n)
    if top <= 0 or n == 0:
        return plain
    floor = (n / row_cost(n)) * margin
    plans: list[tuple[float, SharedPlan]] = []
    best = 0.0
    behind = 0
    for length in range(1, top + 1):
        r, plan = plan_at(members, length, row_cost)
        if plan.length > 0 and r > floor:
            behind = 0 if r > best else behind + 1
            best = max(best, r)
            plans.append((r, plan))
        else:
            behind += 1
        if behind >= GIVE_UP_AFTER:
            break  # past the peak (or no peak): longer windows only cost more rows
    if not plans:
        return plain
    return next(plan for r, plan in plans if r * LONGER_MARGIN >= best)
