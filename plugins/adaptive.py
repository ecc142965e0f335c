"""Adaptive draft length: decide, per step, how many draft tokens are worth verifying.

Why this exists: on a CPU a verify batch of ``k + 1`` rows costs nearly ``k + 1`` single
decodes (measured on a 2-core x86 machine: SmolLM2 Q4_1, 2 rows cost 1.75x, 4 rows 3.40x).
Speculation only pays when the tokens it is expected to commit outweigh that cost, and
both sides move: acceptance depends on the text and the proposer, cost on the model's
quantization and the machine. So the decision is made per step from two measured
quantities, never from a fixed ``k``:

* a :class:`CostCurve` ``c(k)``: cost of verifying ``k`` draft tokens (a batch of
  ``k + 1`` rows) relative to one plain decode, so ``c(0) == 1``;
* per-position acceptance estimates ``acc[i]`` from an :class:`AcceptanceTracker`:
  ``P(draft position i accepted | positions 0..i-1 accepted)`` (0-based positions).

The objective (used everywhere in this package, including the composite proposer) is::

    E(k) = 1 + sum_{j=1..k} prod_{i=0..j-1} acc[i]      expected committed tokens
    r(k) = E(k) / (c(k) + k * draft_cost)               tokens per unit of cost

``E(k)`` counts the target's own token (the correction or bonus token the verify batch
always yields) as the leading ``1``; draft token ``j`` (1-based) is committed only when
positions ``0..j-1`` were all accepted, hence the product. Plain decoding is ``k = 0``:
``E = 1``, ``c = 1``, ``r = 1``. ``r(k)`` is therefore directly the expected speedup of
speculating with ``k`` drafts over plain decoding, and a step speculates only when some
``k > 0`` beats 1 by a margin (default 2%) so measurement noise does not switch it on.

Exploration: when ``k = 0`` wins, no proposals are verified, so the acceptance estimates
would never change and a proposer that turned good again would stay off forever.
:class:`Explorer` therefore allows one probe of ``k = 1`` after a fixed number of idle
(plain-decode) steps, a deterministic counter (no randomness, so runs are repeatable).
A probe that commits nothing doubles the interval (up to a cap), one that commits
something resets it; any regular speculation resets it as well. A probe costs
``c(1) - 1`` plus its drafting (a draft model catching up on every token since its last
draft can make that several decodes) and saves a decode when it hits, so the interval
never drops below ``expected probe cost / PROBE_BUDGET``: probes cost at most about 3%
of a decode per step on average, falling to ~0.3% while they keep failing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

#: A step speculates only if its expected speedup exceeds this (noise guard).
DEFAULT_MARGIN = 1.02

#: The most a probe may cost on average per step, in decodes (see :class:`AdaptiveK`).
PROBE_BUDGET = 0.03

#: Run lengths (drafted tokens accepted in a row) where each streak bucket starts.
STREAK_BUCKETS = (1, 4, 16)

#: Where the per-position acceptance right after a fully accepted window starts (see
#: :class:`AdaptiveK`): optimistic, so a copy run found by a probe is used at once.
STREAK_PRIOR = 0.9


def _to_floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(x) for x in values)


def _check_costs(_instance: object, _attribute: object, costs: tuple[float, ...]) -> None:
    if not costs:
        raise ValueError("a cost curve needs at least c(0)")
    if costs[0] != 1.0:
        raise ValueError(f"c(0) must be 1.0 (one plain decode), got {costs[0]}")
    for k, c in enumerate(costs):
        if not math.isfinite(c) or c <= 0.0:
            raise ValueError(f"c({k}) = {c} is not a positive finite cost")
        if k and c < costs[k - 1]:
            raise ValueError(f"cost curve must be non-decreasing: c({k}) = {c} < c({k - 1})")


@attrs.frozen
class CostCurve:
    """Relative cost ``c(k)`` of verifying ``k`` drafts (``k + 1`` rows) vs one decode.

    ``costs[k]`` is ``c(k)`` for ``k = 0 .. max_k``; ``costs[0]`` is 1 and the sequence
    is non-decreasing (a bigger batch never costs less). Build it from measurements with
    :meth:`from_times` or :meth:`from_row_costs`, which repair noisy numbers; the plain
    constructor validates instead of repairing so a hand-written curve with a typo fails.
    Drafts beyond ``max_k`` were never measured, so callers never choose them.
    """

    costs: tuple[float, ...] = attrs.field(converter=_to_floats, validator=_check_costs)

    @property
    def max_k(self) -> int:
        """The largest draft length the curve covers."""
        return len(self.costs) - 1

    def cost(self, k: int) -> float:
        """``c(k)``; raises ``ValueError`` beyond :attr:`max_k` (unmeasured is unknown)."""
        if not 0 <= k <= self.max_k:
            raise ValueError(f"k = {k} outside the measured range 0..{self.max_k}")
        return self.costs[k]

    @classmethod
    def sanitized(cls, costs: Sequence[float]) -> CostCurve:
        """Repair measured relative costs: force ``c(0) = 1``, then make it non-decreasing.

        Timing noise can make a 2-row batch look cheaper than a decode, or 5 rows cheaper
        than 4; physically neither happens, and a dip would make the optimiser pick that
        ``k`` for the wrong reason. Each value is raised to the running maximum.
        """
        if not costs:
            raise ValueError("a cost curve needs at least c(0)")
        fixed = [1.0]
        for k, c in enumerate(costs[1:], start=1):
            c = float(c)
            if not math.isfinite(c) or c <= 0.0:
                raise ValueError(f"c({k}) = {c} is not a positive finite cost")
            fixed.append(max(c, fixed[-1]))
        return cls(tuple(fixed))

    @classmethod
    def from_row_costs(cls, row_costs: Mapping[int, float]) -> CostCurve:
        """From relative costs keyed by **batch rows** (as in machine.md: ``{2: 1.75}``).

        Rows ``r`` map to ``k = r - 1`` drafts. A 1-row entry, if given, is ignored
        (it is the reference, 1 by definition). Row counts that were not measured are
        filled by linear interpolation between their measured neighbours, after the
        points have been made non-decreasing; the curve ends at the largest row count
        measured.
        """
        points = {1: 1.0}
        for rows, c in row_costs.items():
            if rows < 1:
                raise ValueError(f"row count must be >= 1, got {rows}")
            if rows > 1:
                points[rows] = float(c)
        xs = sorted(points)
        ys: list[float] = []
        for x in xs:
            y = points[x]
            if not math.isfinite(y) or y <= 0.0:
                raise ValueError(f"cost for {x} rows = {y} is not a positive finite cost")
            ys.append(max(y, ys[-1]) if ys else 1.0)
        costs = [1.0]
        for seg in range(1, len(xs)):
            x0, x1, y0, y1 = xs[seg - 1], xs[seg], ys[seg - 1], ys[seg]
            for x in range(x0 + 1, x1 + 1):
                costs.append(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
        return cls.sanitized(costs)

    @classmethod
    def from_times(cls, decode_seconds: float, batch_seconds: Mapping[int, float]) -> CostCurve:
        """From raw timings: one single-token decode, and batch wall times keyed by rows."""
        if not math.isfinite(decode_seconds) or decode_seconds <= 0.0:
            raise ValueError(f"decode time must be positive, got {decode_seconds}")
        return cls.from_row_costs({r: t / decode_seconds for r, t in batch_seconds.items()})


def _acc_at(acc: float | Sequence[float], i: int) -> float:
    """Acceptance at 0-based position ``i``; a scalar is uniform, a short list repeats
    its last value (the best guess for positions never measured)."""
    if isinstance(acc, int | float):
        return float(acc)
    if not acc:
        raise ValueError("empty acceptance list")
    return float(acc[i] if i < len(acc) else acc[-1])


def prefix_expected(acc: float | Sequence[float], k: int) -> list[float]:
    """``[E(0), E(1), ..., E(k)]`` in one pass (see the module docstring for ``E``)."""
    out = [1.0]
    reach = 1.0
    for i in range(k):
        reach *= _acc_at(acc, i)
        out.append(out[-1] + reach)
    return out


def expected_committed(acc: float | Sequence[float], k: int) -> float:
    """Expected tokens committed by verifying ``k`` drafts: ``1 + Σ_j Π_{i<j} acc[i]``.

    ``acc`` is a uniform acceptance rate or per-position conditional rates (a list
    shorter than ``k`` repeats its last value). ``k = 0`` gives 1 (plain decode).
    """
    if k < 0:
        raise ValueError("k must be >= 0")
    return prefix_expected(acc, k)[-1]


def ratios(
    curve: CostCurve, acc: float | Sequence[float], k_max: int, *, draft_cost: float = 0.0
) -> list[float]:
    """``[r(0), ..., r(K)]`` with ``K = min(k_max, curve.max_k)``; ``r(0) == 1``."""
    top = max(0, min(k_max, curve.max_k))
    expected = prefix_expected(acc, top)
    return [expected[k] / (curve.costs[k] + k * draft_cost) for k in range(top + 1)]


def speedup_limit(
    curve: CostCurve,
    acc: float | Sequence[float] = 1.0,
    *,
    k_max: int | None = None,
    draft_cost: float = 0.0,
) -> tuple[int, float]:
    """The best ``(k, expected speedup)`` for this curve and acceptance, with no margin.

    With ``acc = 1`` this is the physical limit of speculation on the measured machine
    (e.g. SmolLM2 Q4_1 here: about 1.48x at k = 7), which benchmarks print next to what
    they achieved. Ties go to the smaller ``k``.
    """
    rs = ratios(curve, acc, curve.max_k if k_max is None else k_max, draft_cost=draft_cost)
    best = max(range(len(rs)), key=lambda k: (rs[k], -k))
    return best, rs[best]


def choose_k(
    curve: CostCurve,
    acc: float | Sequence[float] | AcceptanceTracker,
    k_max: int,
    *,
    margin: float = DEFAULT_MARGIN,
    draft_cost: float = 0.0,
) -> int:
    """Draft length maximising expected committed tokens per unit cost; 0 = plain decode.

    Returns 0 unless the best ``k > 0`` has an expected speedup above ``margin``.
    Monotone: raising any acceptance never lowers the chosen ``k`` (``E(k+1)/E(k)``
    grows with every ``acc[i]``, so the objective has increasing differences in
    ``(k, acc)``), apart from exact float ties.
    """
    if isinstance(acc, AcceptanceTracker):
        acc = acc.acceptances(max(1, k_max))
    k, r = speedup_limit(curve, acc, k_max=k_max, draft_cost=draft_cost)
    return k if k > 0 and r > margin else 0


class AcceptanceTracker:
    """Running per-position acceptance: ``P(position i accepted | 0..i-1 accepted)``.

    Counts with exponential decay (old evidence fades; ``decay = 0.98`` remembers about
    50 proposals) and a hierarchical prior: position 0 shrinks toward ``prior``, each
    later position toward the estimate of the position before it. That way, evidence
    from short proposals (probes are one token) carries over to positions never
    verified yet instead of leaving them at a fixed, possibly pessimistic guess.

    Positions at and beyond ``max_positions`` share the last tracked position.
    """

    def __init__(
        self,
        *,
        prior: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.98,
        max_positions: int = 16,
    ) -> None:
        if not 0.0 < prior < 1.0:
            raise ValueError("prior must be in (0, 1)")
        if prior_weight <= 0.0:
            raise ValueError("prior_weight must be positive")
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        if max_positions < 1:
            raise ValueError("max_positions must be >= 1")
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.max_positions = max_positions
        self._trials = [0.0] * max_positions
        self._hits = [0.0] * max_positions
        self.updates = 0

    def update(self, proposed: int, accepted: int, *, censored: bool = False) -> None:
        """Record one verified proposal of ``proposed`` drafts, ``accepted`` of them taken.

        Positions ``< accepted`` count as accepted, position ``accepted`` (if drafted) as
        rejected, later ones were never tested. ``censored`` means the commit was cut
        short (end of generation, token limit) rather than the draft being rejected, so
        the position after the last accepted one is not counted as a rejection.
        A proposal of 0 drafts carries no evidence and is ignored.
        """
        if proposed <= 0:
            return
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted = {accepted} outside 0..{proposed}")
        self.updates += 1
        if self.decay != 1.0:
            self._trials = [t * self.decay for t in self._trials]
            self._hits = [h * self.decay for h in self._hits]
        last = self.max_positions - 1
        for i in range(accepted):
            slot = min(i, last)
            self._trials[slot] += 1.0
            self._hits[slot] += 1.0
        if accepted < proposed and not censored:
            self._trials[min(accepted, last)] += 1.0

    def acceptances(self, n: int | None = None) -> tuple[float, ...]:
        """Estimates for positions ``0 .. n-1`` (default: every tracked position)."""
        n = self.max_positions if n is None else n
        out: list[float] = []
        mean = self.prior
        for i in range(n):
            if i < self.max_positions:
                t, h = self._trials[i], self._hits[i]
                mean = (h + self.prior_weight * mean) / (t + self.prior_weight)
            out.append(mean)
        return tuple(out)

    def acceptance(self, i: int) -> float:
        """The estimate for 0-based position ``i``."""
        return self.acceptances(i + 1)[i]


class Explorer:
    """Deterministic probing schedule for when plain decoding is chosen.

    Call :meth:`idle_step` on each step that does not speculate; it answers True when a
    probe (one draft token) is due. Report a probe's result with :meth:`probe_result`
    and any regular speculation with :meth:`speculated`. ``every = 0`` disables probes.
    """

    def __init__(self, every: int = 16, max_every: int = 256) -> None:
        if every < 0 or (every and max_every < every):
            raise ValueError("need 0 <= every <= max_every")
        self.every = every
        self.max_every = max_every
        self.interval = every
        self.idle = 0
        #: A floor under the interval set by the owner from what a probe costs (a
        #: draft model that must catch up on every token since its last draft makes a
        #: probe cost several decodes, so it may come only that much more rarely).
        self.min_interval = 0

    def idle_step(self) -> bool:
        """Count one plain-decode step; True when a probe is due (stays due until used)."""
        self.idle += 1
        return self.due

    @property
    def due(self) -> bool:
        """Whether the next opportunity should be spent on a probe."""
        return self.every > 0 and self.idle >= max(self.interval, self.min_interval)

    def probed(self) -> None:
        """A probe was issued: restart the idle count."""
        self.idle = 0

    def rearm(self) -> None:
        """A probe was issued but never verified (nothing to draft): make it due again."""
        self.idle = max(self.idle, self.interval)

    def probe_result(self, accepted: int) -> None:
        """A failed probe backs off (interval doubles up to ``max_every``); a hit resets."""
        if accepted > 0:
            self.interval = self.every
        else:
            self.interval = min(self.interval * 2, self.max_every)

    def speculated(self) -> None:
        """Regular speculation happened: the estimates are live again, reset everything."""
        self.idle = 0
        self.interval = self.every


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
        self.explorer = explorer if explorer is not None else Explorer()
        self.probing = False

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

    def next_k(self) -> int:
        """The draft length for this step (> 0 when it is a probe, 0 for plain decode)."""
        self._planned = self.current_tracker()
        k = choose_k(self.curve, self.acceptances(), self.k_max, margin=self.margin,
                     draft_cost=self.draft_cost)
        if k > 0:
            self.probing = False
            self.explorer.speculated()
            return k
        # A probe costs c(1) - 1 plus its drafting and saves a decode when it hits:
        # keep its expected cost under PROBE_BUDGET of a decode per step on average.
        if self.k_max >= 1:
            hit = self.tracker.acceptances(1)[0]
            probe_cost = self.curve.cost(1) - 1.0 + self.draft_cost - hit
            self.explorer.min_interval = max(0, math.ceil(probe_cost / self.probe_budget))
        if self.k_max >= 1 and self.explorer.idle_step():
            self.explorer.probed()
            self.probing = True
            return 1
        self.probing = False
        self.run = 0  # a plain step verifies nothing: whatever ran is over
        return 0

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
