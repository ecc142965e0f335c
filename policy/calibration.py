"""Measuring the verify-cost curve in small pieces, from quiet measurements only.

Why: the cost curve (what a forward of ``k + 1`` rows costs against one decode) decides
every speculative step, and measuring it takes every size's forwards several times:
18 s for SmolLM2 on a quiet 2-core machine, 445 s beside one busy process, whose
measurements are wrong anyway (a one-row forward slowed 30-fold by a descheduled thread
makes wide forwards look cheap). A daemon that measured before it served was not ready
for minutes, and a start-up check run under load threw a good cached curve away.

So the curve is measured by a plan that hands out :class:`Piece` s of a few forwards
each; the caller runs them when the model's compute thread has nothing else to do and
hands back what they :class:`Timed` and the :class:`~meshd.policy.load.Load` they ran
under. Until it is done the runtime prices speculation with the cached curve, else
:func:`meshd.policy.costs.conservative_prior` (which never speculates).

1. The MTP head's costs, if the model has one (:data:`MTP_STEPS` steps a piece).
2. A cached curve: its first sizes are checked (:data:`SPOT_REPS` quiet rounds of
   1 .. :data:`SPOT_K` + 1 rows) and it is kept where they agree
   (:func:`~meshd.policy.costs.spot_agrees`), measured again where they do not.
3. No cached curve (or one that disagreed): every size until :data:`REPS` of its quiet
   ratios agree (a repeat that disagrees asks for more, up to 3 x :data:`REPS`).

Each piece interleaves one-row forwards with wider ones and takes every wider one's
ratio against the same piece's one-row forwards, so a slow drift between pieces cancels.
It holds about :data:`PIECE_S` of work (estimated from what the sizes cost so far), so a
request that arrives waits at most that long. A piece that ran with company
(:func:`~meshd.policy.load.busy`), or ran past :data:`CUT_FACTOR` times its estimate and
was cut short, is dropped and the plan waits (:data:`RETRY_FIRST_S`, doubling up to
:data:`RETRY_MAX_S`) before the next one: a curve measured under load is never cached.

With ``wait_for_quiet`` off (``meshd generate``, benchmarks: a run that cannot wait) a
busy piece is run again at once a few times (:data:`SYNC_RETRIES`); if the company
stays, the calibration stops there: a start-up check keeps the cached curve, and a
measurement leaves the cached curve or the prior in place for that run (nothing
measured under load is used or cached). The MTP head's ratios hold up under load (a
slowed step slows both sides of each ratio) and always count there.

Sans-I/O: times are handed in, nothing is read.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence

import attrs

from .costs import SPOT_K, SPOT_SLACK, SPOT_TOLERANCE, is_plausible, spot_agrees, within_rows
from .load import Load, busy

__all__ = ["CUT_FACTOR", "MTP_STEPS", "PIECE_S", "REPS", "RETRY_FIRST_S", "RETRY_MAX_S",
           "SPOT_MIN_S", "SPOT_REPS", "Calibration", "Outcome", "Phase", "Piece", "Timed"]

#: Quiet ratios each size needs (their median is its cost).
REPS = 5
#: Rounds of the start-up check of a cached curve.
SPOT_REPS = 3
#: A one-row forward shorter than this (a tiny model) is timed by the scheduler's noise
#: more than by its work: its cached curve is kept without the check.
SPOT_MIN_S = 0.002
#: The work one piece holds, in seconds of estimated forwards.
PIECE_S = 0.15
#: A piece running longer than this many times its estimate (and :data:`CUT_MIN_S`) is
#: cut short and counts as busy: a descheduled thread makes a forward 10-50 times slower.
CUT_FACTOR = 4.0
CUT_MIN_S = 0.05
#: The first wait after a busy piece, and the longest (doubling between them).
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
#: The MTP head's steps: per piece while waiting for quiet, and in all.
MTP_STEPS = 5
MTP_TOTAL_STEPS = 15
#: Without ``wait_for_quiet``, a busy piece is run again this many times in a row before
#: it is counted (and the curve not cached).
SYNC_RETRIES = 3
#: Times a whole quiet measurement may come out implausible before it is given up.
MAX_RESTARTS = 2
#: Ratios kept per size at most (a size whose repeats keep disagreeing takes the median).
MAX_SAMPLES_FACTOR = 3


class Phase(enum.StrEnum):
    MTP = "mtp"
    CHECK = "check"
    CURVE = "curve"
    DONE = "done"


@attrs.frozen
class Piece:
    """A few forwards to time: ``rows`` in order (1: a one-row forward), or ``steps``
    decode-and-draft steps of the MTP head. Cut short past ``budget_s`` (None: never)."""

    phase: Phase
    rows: tuple[int, ...] = ()
    steps: int = 0
    budget_s: float | None = None


@attrs.frozen
class Timed:
    """What a piece measured: each forward's rows and seconds (``cut``: stopped past its
    budget), or the MTP head's per-step ratios (``failed``: no head to measure)."""

    times: tuple[tuple[int, float], ...] = ()
    cut: bool = False
    overheads: tuple[float, ...] = ()
    draft_costs: tuple[float, ...] = ()
    failed: bool = False


@attrs.frozen
class Outcome:
    """What the calibration settled on.

    ``costs``: the curve to use (None: none measured; keep the prior); ``cache``:
    whether to keep it for later runs; ``mtp``: the MTP head's (overhead, draft cost),
    None where not measured."""

    costs: tuple[float, ...] | None
    cache: bool
    mtp: tuple[float, float] | None


class Calibration:
    """The plan of one model's calibration: which piece next, what the pieces gave."""

    def __init__(self, k_max: int, cached: Sequence[float] | None = None, *,
                 has_mtp: bool = False, wait_for_quiet: bool = True, reps: int = REPS,
                 ) -> None:
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        self.k_max = k_max
        self.wait_for_quiet = wait_for_quiet
        self.reps = reps
        good = cached is not None and len(cached) == k_max + 1 and is_plausible(cached)
        #: The cached curve being checked or kept (None: none usable).
        self.cached: tuple[float, ...] | None = tuple(cached) if good and cached else None
        self.phase = Phase.MTP if has_mtp else self._after_mtp()
        #: A one-row forward's wall time, from quiet pieces (None: not yet measured).
        self.unit_s: float | None = None
        self._units: list[float] = []
        self._ratios: dict[int, list[float]] = {}
        self._overheads: list[float] = []
        self._draft_costs: list[float] = []
        self._mtp: tuple[float, float] | None = None
        self._costs: tuple[float, ...] | None = self.cached
        self._cache = False
        #: A busy piece was counted (only without ``wait_for_quiet``): nothing is cached.
        self.tainted = False
        self.restarts = 0
        self._busy_streak = 0
        self._retry_s = 0.0
        #: No piece before this time (a busy piece asked for a wait).
        self.not_before = -math.inf
        self.pieces = 0
        self.busy_pieces = 0
        #: Things to tell the user: (event, message), taken by the caller.
        self.notes: list[tuple[str, str]] = []

    def _after_mtp(self) -> Phase:
        return Phase.CHECK if self.cached is not None else Phase.CURVE

    # ------------------------------------------------------------------ state

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def measuring_curve(self) -> bool:
        """Whether the curve itself is being measured (not checked)."""
        return self.phase is Phase.CURVE

    def outcome(self) -> Outcome:
        return Outcome(self._costs, self._cache, self._mtp)

    def wait_s(self, now: float) -> float:
        """Seconds until the next piece may run (0: now)."""
        return max(0.0, self.not_before - now)

    def progress(self) -> float:
        """Share of the curve's samples collected (1 once done)."""
        if self.done:
            return 1.0
        if self.phase is not Phase.CURVE:
            return 0.0
        need = self.reps * self.k_max
        have = sum(min(self.reps, len(self._ratios.get(r, ()))) for r in self._sizes())
        return have / need

    # ------------------------------------------------------------------ pieces

    def next_piece(self) -> Piece | None:
        """The next piece to run (None: done)."""
        if self.phase is Phase.DONE:
            return None
        if self.phase is Phase.MTP:
            steps = MTP_STEPS if self.wait_for_quiet else MTP_TOTAL_STEPS
            return Piece(Phase.MTP, steps=steps)
        if self.phase is Phase.CHECK:
            need = {r: SPOT_REPS for r in range(2, min(SPOT_K, self.k_max) + 2)}
        else:
            need = {r: self._wanted(r) for r in self._sizes()}
        missing = [r for r, n in need.items() if len(self._ratios.get(r, ())) < n]
        if not missing:  # complete already (ratios kept from the check)
            self._advance()
            return self.next_piece()
        missing.sort(key=lambda r: (len(self._ratios.get(r, ())), r))
        return self._plan(self.phase, missing, need)

    def _sizes(self) -> range:
        return range(2, self.k_max + 2)

    def _estimate(self, rows: int) -> float:
        """A forward of ``rows`` rows in seconds: its median ratio so far, else ``rows``
        one-row forwards (dear on purpose: a piece is never longer than meant)."""
        unit = self.unit_s or 0.0
        seen = self._ratios.get(rows)
        return unit * (statistics.median(seen) if seen else rows)

    def _plan(self, phase: Phase, missing: list[int], need: dict[int, int]) -> Piece:
        if self.unit_s is None:  # the first piece: one size, to learn the unit
            return Piece(phase, rows=(1, missing[0], 1))
        unit = self.unit_s
        sizes: list[int] = []
        cost = unit
        for r in missing:
            if sizes and cost + self._estimate(r) > PIECE_S:
                break
            sizes.append(r)
            cost += self._estimate(r)
        most = max(need[r] - len(self._ratios.get(r, ())) for r in sizes)
        rounds = max(1, min(most, math.floor(PIECE_S / cost)))
        rows = (*((1, *sizes) * rounds), 1)
        total = cost * rounds + unit
        budget = max(CUT_FACTOR * total, CUT_MIN_S) if self.wait_for_quiet else None
        return Piece(phase, rows=rows, budget_s=budget)

    def _wanted(self, rows: int) -> int:
        """Ratios ``rows`` needs: :attr:`reps`, more while its repeats disagree."""
        seen = self._ratios.get(rows, [])
        if len(seen) < self.reps or not self.wait_for_quiet:
            return self.reps
        cap = MAX_SAMPLES_FACTOR * self.reps
        if len(seen) >= cap or _agree(seen) >= self.reps:
            return len(seen)
        return len(seen) + 1

    # ------------------------------------------------------------------ results

    def company(self, now: float) -> None:
        """Other processes were seen busy just before a piece (while the model was idle):
        the piece is not run, and this counts as a busy piece (a wait, or without waiting
        one of the tries before giving up)."""
        self.busy_pieces += 1
        if self.wait_for_quiet:
            self._back_off(now)
            return
        self._busy_streak += 1
        if self._busy_streak > SYNC_RETRIES:
            self._give_up()

    def feed(self, piece: Piece, timed: Timed, load: Load | None, now: float) -> None:
        """What ``piece`` measured under ``load`` (None: not judged, as for layers run on
        an accelerator or remote workers), at ``now``."""
        if piece.phase is not self.phase:
            return  # a piece planned before the phase changed
        self.pieces += 1
        shared = timed.cut or (load is not None and busy(load))
        if shared:
            self.busy_pieces += 1
            if self.wait_for_quiet:
                self._back_off(now)
                return
            if piece.phase is not Phase.MTP:  # the head's ratios hold up under load
                self._busy_streak += 1
                if self._busy_streak <= SYNC_RETRIES:
                    return  # run again at once: the company may have been a moment's
                self._give_up()
                return
        self._busy_streak = 0
        self._retry_s = 0.0
        self.not_before = now
        if piece.phase is Phase.MTP:
            self._feed_mtp(timed)
        else:
            self._feed_rows(timed)
        self._advance()

    def _give_up(self) -> None:
        """Without waiting for quiet, the machine stayed busy: nothing measured now is
        worth using (a descheduled thread makes a one-row forward 30 times slower, so
        wide ones look nearly free), so the cached curve stays, else the prior."""
        self.tainted = True
        if self.phase is Phase.CURVE:
            self.notes.append((
                "calibration_skipped", "other processes are using the CPUs, so the verify "
                "cost cannot be measured now (it would come out wrong): this run "
                + ("keeps the cached curve" if self.cached is not None else
                   "decodes without drafts") + "; the next start measures it again"))
        self.phase = Phase.DONE

    def _back_off(self, now: float) -> None:
        self._retry_s = min(RETRY_MAX_S, max(RETRY_FIRST_S, self._retry_s * 2))
        self.not_before = now + self._retry_s

    def _feed_mtp(self, timed: Timed) -> None:
        if timed.failed:
            self._overheads.clear()
            self.phase = self._after_mtp()
            return
        self._overheads.extend(timed.overheads)
        self._draft_costs.extend(timed.draft_costs)

    def _feed_rows(self, timed: Timed) -> None:
        units = [t for rows, t in timed.times if rows == 1 and t > 0]
        if not units:
            return
        unit = statistics.median(units)
        self._units = [*self._units[-8:], unit]
        self.unit_s = statistics.median(self._units)
        for rows, t in timed.times:
            if rows > 1 and t > 0:
                self._ratios.setdefault(rows, []).append(t / unit)

    def _advance(self) -> None:
        if self.phase is Phase.MTP:
            if len(self._overheads) >= MTP_TOTAL_STEPS or (
                    not self.wait_for_quiet and self._overheads):
                if self._draft_costs:
                    self._mtp = (statistics.median(self._overheads),
                                 statistics.median(self._draft_costs))
                self.phase = self._after_mtp()
            return
        if self.phase is Phase.CHECK:
            self._advance_check()
        elif self.phase is Phase.CURVE:
            self._advance_curve()

    def _advance_check(self) -> None:
        sizes = range(2, min(SPOT_K, self.k_max) + 2)
        if any(len(self._ratios.get(r, ())) < SPOT_REPS for r in sizes):
            return
        assert self.cached is not None
        spot = [1.0, *(statistics.median(self._ratios[r]) for r in sizes)]
        unit = self.unit_s or 0.0
        if unit < SPOT_MIN_S or self.tainted or spot_agrees(self.cached, spot):
            self.phase = Phase.DONE  # kept as cached (a busy check cannot judge it)
            # written again only to keep the head's quiet measurement beside it
            self._cache = self._mtp is not None and not self.tainted
            return
        self.notes.append((
            "recalibrating", "measuring the verify cost again: the cached curve "
            f"({_first(self.cached, len(spot))}) disagrees with what these forwards cost "
            f"now ({_first(spot, len(spot))}); it was probably measured while other work "
            "ran"))
        self.phase = Phase.CURVE  # the check's ratios count towards the curve

    def _advance_curve(self) -> None:
        if any(len(self._ratios.get(r, ())) < self._wanted(r) for r in self._sizes()):
            return
        costs = (1.0, *(statistics.median(self._ratios[r]) for r in self._sizes()))
        if is_plausible(costs):
            self._costs, self._cache = costs, not self.tainted
            self.phase = Phase.DONE
            return
        self.restarts += 1
        if self.restarts <= (MAX_RESTARTS if self.wait_for_quiet else 1):
            # Measured again from scratch (without waiting for quiet: once, longer).
            self._ratios.clear()
            if not self.wait_for_quiet:
                self.reps = max(self.reps, 9)
            return
        # Still implausible: used capped at each size's rows, never cached; the online
        # cost model corrects it from real forwards. A cached curve stays where there is one.
        if self.cached is None:
            self._costs = tuple(within_rows(costs))
        self.phase = Phase.DONE


def _agree(ratios: Sequence[float]) -> int:
    """How many of a size's ratios agree with their median (the start-up check's
    tolerance: a share of the extra cost, plus a slack)."""
    med = statistics.median(ratios)
    tolerance = SPOT_TOLERANCE * max(0.0, med - 1.0) + SPOT_SLACK
    return sum(1 for r in ratios if abs(r - med) <= tolerance)


def _first(costs: Sequence[float], n: int) -> str:
    """``c(1)=1.39, c(2)=2.03``: a curve's first sizes, for a note."""
    return ", ".join(f"c({k})={c:.2f}" for k, c in enumerate(costs[:n]) if k)
