"""What speculation costs and what it buys: the cost curve and the objective.

Why: on a CPU a verify batch of ``k + 1`` rows costs nearly ``k + 1`` decodes at small
``k``, so speculation pays only where the tokens it is expected to commit outweigh that
cost, and both sides move (acceptance with the text and proposer, cost with the model
and machine). So each step decides from a :class:`CostCurve` ``c(k)`` (verifying ``k``
drafts relative to one decode) and per-position acceptance ``acc[i]``
(:class:`~meshd.policy.acceptance.AcceptanceTracker`), by one objective::

    E(k) = 1 + sum_{j=1..k} prod_{i=0..j-1} acc[i]      expected committed tokens
    r(k) = E(k) / (c(k) + k * draft_cost + R(k))        expected speedup over k = 0

with ``R(k)`` the expected repair cost (:class:`RepairCost`). A step speculates only when
some ``k > 0`` beats 1 by a margin, so timing noise does not switch it on. A start-up
calibration is one moment on a noisy machine, so :class:`CostModel` rebuilds the curve
from the recent forwards' medians per size, falling back to the calibration.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from .acceptance import AcceptanceTracker
from .company import CompanyCheck

#: A step speculates only if its expected speedup exceeds this (noise guard).
DEFAULT_MARGIN = 1.02

def _to_floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(x) for x in values)


def _to_ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in values)


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


#: How many rows beyond a window's own a cheaper forward is looked for (see
#: :meth:`CostCurve.sanitized`): past a tile of the matrix kernels' row blocking.
PAD_LOOKAHEAD = 7


def _check_pad(instance: CostCurve, _attribute: object, pad: tuple[int, ...]) -> None:
    if not pad:
        return
    if len(pad) != len(instance.costs) or pad[0] != 0:
        raise ValueError("a padding plan needs one entry per draft length and pad[0] == 0")
    for k, j in enumerate(pad):
        if not k <= j < len(pad):
            raise ValueError(f"pad[{k}] = {j} is not a draft length from {k} to the curve's end")


@attrs.frozen
class CostCurve:
    """Relative cost ``c(k)`` of verifying ``k`` drafts (``k + 1`` rows) vs one decode.

    ``costs[k]`` is ``c(k)`` for ``k = 0 .. max_k``; ``costs[0]`` is 1 and the sequence
    is non-decreasing. Build it from measurements with :meth:`sanitized`,
    :meth:`from_times` or :meth:`from_row_costs`, which repair noisy numbers; the plain
    constructor validates instead of repairing so a hand-written curve with a typo fails.
    Drafts beyond ``max_k`` were never measured, so callers never choose them.

    ``pad`` (empty: none) is the padding plan behind the costs: a window of ``k`` drafts
    is verified as ``pad[k]`` rows-minus-one (the rest filler), where that forward is
    cheaper than ``k + 1`` rows (:meth:`sanitized` says why that happens).
    """

    costs: tuple[float, ...] = attrs.field(converter=_to_floats, validator=_check_costs)
    pad: tuple[int, ...] = attrs.field(default=(), converter=_to_ints, validator=_check_pad)
    #: The measured cost of each size before the repair (empty: ``costs`` were given).
    raw: tuple[float, ...] = attrs.field(default=(), converter=_to_floats)

    @property
    def forward_costs(self) -> tuple[float, ...]:
        """What a forward of ``k + 1`` rows itself costs, unpadded, as measured (for
        rebuilding a curve from it, and for forwards whose rows are not padded)."""
        return self.raw if self.raw else self.costs

    @property
    def max_k(self) -> int:
        """The largest draft length the curve covers."""
        return len(self.costs) - 1

    def cost(self, k: int) -> float:
        """``c(k)``; raises ``ValueError`` beyond :attr:`max_k` (unmeasured is unknown)."""
        if not 0 <= k <= self.max_k:
            raise ValueError(f"k = {k} outside the measured range 0..{self.max_k}")
        return self.costs[k]

    def longest_within(self, cost: float) -> int:
        """The longest draft whose window costs at most ``cost`` one-row decodes (0:
        none does)."""
        k = 0
        while k < self.max_k and self.costs[k + 1] <= cost:
            k += 1
        return k

    def padded_length(self, k: int) -> int:
        """How many drafts-worth of rows a window of ``k`` drafts is priced at: ``k``
        itself unless the plan pads it to a cheaper forward (``k`` beyond the curve:
        ``k``)."""
        return self.pad[k] if 0 <= k < len(self.pad) else k

    @classmethod
    def sanitized(cls, costs: Sequence[float], *, lookahead: int = PAD_LOOKAHEAD,
                  ) -> CostCurve:
        """Repair measured relative costs: ``c(0) = 1``; each window priced at the
        cheapest forward of its rows up to ``lookahead`` more (recorded in ``pad``: its
        filler rows are verified like drafts and commit only where the target itself
        produced them, so padding is exact); then non-decreasing.

        Why padding: the matrix kernels work on blocks of rows, so a forward whose rows
        fill whole blocks can cost less than a narrower one.
        Why non-decreasing: timing noise can make a 2-row batch look cheaper than a
        decode, or 5 rows cheaper than 4 by a hair; a dip of that kind would make the
        optimiser pick that ``k`` for the wrong reason, so each value is raised to the
        running maximum after the padding.
        """
        if not costs:
            raise ValueError("a cost curve needs at least c(0)")
        raw = [1.0]
        for k, c in enumerate(costs[1:], start=1):
            c = float(c)
            if not math.isfinite(c) or c <= 0.0:
                raise ValueError(f"c({k}) = {c} is not a positive finite cost")
            raw.append(c)
        fixed, pad = [1.0], [0]
        for k in range(1, len(raw)):
            j = min(range(k, min(len(raw) - 1, k + max(0, lookahead)) + 1),
                    key=lambda i: (raw[i], i))
            pad.append(j)
            fixed.append(max(raw[j], fixed[-1]))
        return cls(tuple(fixed), tuple(pad) if any(j != k for k, j in enumerate(pad)) else (),
                   tuple(raw))

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
    # Every position given: read it directly (a hot path); else fill in with _acc_at.
    accs = (acc if not isinstance(acc, int | float) and len(acc) >= k
            else [_acc_at(acc, i) for i in range(k)])
    out = [1.0]
    reach = total = 1.0
    for i in range(k):
        reach *= float(accs[i])
        total += reach
        out.append(total)
    return out


def expected_committed(acc: float | Sequence[float], k: int) -> float:
    """Expected tokens committed by verifying ``k`` drafts: ``1 + Σ_j Π_{i<j} acc[i]``.

    ``acc`` is a uniform acceptance rate or per-position conditional rates (a list
    shorter than ``k`` repeats its last value). ``k = 0`` gives 1 (plain decode).
    """
    if k < 0:
        raise ValueError("k must be >= 0")
    return prefix_expected(acc, k)[-1]


@attrs.frozen
class RepairCost:
    """What undoing a window's rejected rows costs on a recurrent (hybrid) model.

    Attention-only models drop rejected rows for free (a KV trim), and so do recurrent
    ones for windows of up to ``rollback_window`` drafts (llama.cpp's in-place
    rollback). A longer window needs a state checkpoint before the forward
    (``checkpoint`` decodes, measured) and, when more rows are rejected than the
    in-place rollback can undo, a restore and a replay forward of the kept rows: the
    window ``[last, d0..dk-1]`` with ``a`` drafts accepted drops ``k - a`` rows (rolled
    back in place up to ``rollback_window``) or else replays ``a + 1`` rows, ``c(a)``.
    Left out, a long window looks far cheaper than it is exactly where acceptance is
    high enough to tempt it.
    """

    rollback_window: int
    checkpoint: float = 0.0

    def expected(self, curve: CostCurve, acc: float | Sequence[float], k: int) -> float:
        """Expected repair cost of a window of ``k`` drafts, in decodes."""
        if k <= self.rollback_window:
            return 0.0
        extra = self.checkpoint
        reach = 1.0
        for a in range(k - self.rollback_window):
            p = _acc_at(acc, a)
            extra += reach * (1.0 - p) * curve.cost(a)
            reach *= p
        return extra


def ratios(
    curve: CostCurve, acc: float | Sequence[float], k_max: int, *, draft_cost: float = 0.0,
    repair: RepairCost | None = None,
) -> list[float]:
    """``[r(0), ..., r(K)]`` with ``K = min(k_max, curve.max_k)``; ``r(0) == 1``.

    ``repair``: what windows longer than a recurrent model's in-place rollback cost on
    top (None: repairs are free, as on attention-only models)."""
    top = max(0, min(k_max, curve.max_k))
    expected = prefix_expected(acc, top)
    return [expected[k] / (curve.costs[k] + k * draft_cost
                           + (repair.expected(curve, acc, k) if repair is not None else 0.0))
            for k in range(top + 1)]


def speedup_limit(
    curve: CostCurve,
    acc: float | Sequence[float] = 1.0,
    *,
    k_max: int | None = None,
    draft_cost: float = 0.0,
    repair: RepairCost | None = None,
) -> tuple[int, float]:
    """The best ``(k, expected speedup)`` for this curve and acceptance, with no margin.

    With ``acc = 1`` this is the physical limit of speculation on the measured machine,
    which benchmarks print next to what they achieved. Ties go to the smaller ``k``.
    """
    rs = ratios(curve, acc, curve.max_k if k_max is None else k_max, draft_cost=draft_cost,
                repair=repair)
    best = max(range(len(rs)), key=lambda k: (rs[k], -k))
    return best, rs[best]


def choose_k(
    curve: CostCurve,
    acc: float | Sequence[float] | AcceptanceTracker,
    k_max: int,
    *,
    margin: float = DEFAULT_MARGIN,
    draft_cost: float = 0.0,
    repair: RepairCost | None = None,
) -> int:
    """Draft length maximising expected committed tokens per unit cost; 0 = plain decode.

    Returns 0 unless the best ``k > 0`` has an expected speedup above ``margin``.
    Monotone: raising any acceptance never lowers the chosen ``k`` (``E(k+1)/E(k)``
    grows with every ``acc[i]``, so the objective has increasing differences in
    ``(k, acc)``), apart from exact float ties.
    """
    if isinstance(acc, AcceptanceTracker):
        acc = acc.acceptances(max(1, k_max))
    k, r = speedup_limit(curve, acc, k_max=k_max, draft_cost=draft_cost, repair=repair)
    return k if k > 0 and r > margin else 0


#: Samples kept per window size; medians over them resist outliers.
WINDOW = 48
#: Fewer samples than this for a size and its calibrated ratio is used.
MIN_SAMPLES = 6
#: The curve is rebuilt after this many new samples (rebuilding each step is wasteful).
REBUILD_EVERY = 8
#: Sizes without samples of their own follow the measured ones up to this many times
#: their calibrated extra cost.
MAX_SHIFT = 2.0


def is_plausible(costs: Sequence[float], *, tolerance: float = 0.85) -> bool:
    """A measured curve looks sane: c(1) > 1, no forward costs much less than one of
    half its rows or fewer, and no size costs far more than that many single decodes.

    Measurements under heavy contention come out non-monotone (a 2-row forward
    "cheaper" than 1 row); such a curve must not be cached. A forward may cost less
    than a slightly narrower one (whole blocks of rows for the matrix kernels), never
    than one of half its rows.
    """
    if len(costs) < 2 or costs[1] <= 1.0:
        return False
    # A batch of k+1 rows never costs much more than k+1 single decodes (a curve that
    # claims so was measured under contention).
    if any(c > 1.5 * (k + 1) for k, c in enumerate(costs)):
        return False
    # Each size against the dearest forward of at most half its rows.
    return all(c >= max(costs[:(k + 1) // 2], default=0.0) * tolerance
               for k, c in enumerate(costs))


#: A cached curve is checked at start on its first sizes (up to this many drafts) ...
SPOT_K = 3
#: ... each size's extra cost (``c - 1``) allowed to differ by this share of the
#: cached one, plus :data:`SPOT_SLACK` decodes, before the curve is measured again.
SPOT_TOLERANCE = 0.5
SPOT_SLACK = 0.1


def spot_agrees(cached: Sequence[float], spot: Sequence[float]) -> bool:
    """Whether a quick measurement of a curve's first sizes (``spot``) agrees with the
    cached curve.

    Why: a calibration measured while other work ran can come out plausible yet wrong
    in its first sizes, the ones every step chooses between (a 2-row forward cached at
    1.19 decodes that costs 1.45 makes a request draft 1 token a step where 3 pay
    more), and a cached curve is used for good; the online cost model does not mend it,
    since a size the curve prices wrongly is seldom run. Measurement noise moves a size
    by a share of its extra cost, so that is what is compared."""
    return all(abs(s - c) <= SPOT_TOLERANCE * (c - 1.0) + SPOT_SLACK
               for c, s in zip(cached[1:], spot[1:], strict=False))


def within_rows(costs: Sequence[float]) -> list[float]:
    """``costs`` with no size dearer than its rows decoded one by one (``c(k) <= k + 1``).

    What the runtime keeps of a calibration measured twice under contention: a batch of
    ``k + 1`` rows never costs more than ``k + 1`` decodes of a quiet machine, and a
    curve claiming so (a forward measured while other work ran) turns off speculation
    that pays. The online model corrects the rest from real forwards."""
    return [min(float(c), k + 1.0) for k, c in enumerate(costs)]


def conservative_prior(k_max: int) -> list[float]:
    """The curve used before one is measured: a window of ``k`` drafts costs ``k + 1``
    decodes, ``c(k) = k + 1``.

    Why this one: it is the only curve that cannot make speculation lose against plain
    decoding on a model and machine nobody measured. Under it ``E(k) / c(k) <= 1`` for
    every acceptance (``E(k) <= k + 1``), so no step beats the margin and every request
    decodes plainly until the calibration, run in idle moments, replaces it; any cheaper
    guess (machine.md's Q4_1 curve, say) would draft where a dearer model or a loaded
    machine makes the window cost more than it commits."""
    if k_max < 0:
        raise ValueError(f"k_max must be >= 0, got {k_max}")
    return [float(k + 1) for k in range(k_max + 1)]


class CostModel:
    """Relative cost of a forward of k+1 rows vs 1 row, for k = 0..max_k, kept current.

    One thread records (the one running the forwards); others may read. Each size's
    samples are an immutable tuple replaced whole on every record, so a reader always
    sees one consistent window without a lock (a racing reader at worst rebuilds the
    curve once more than needed).
    """

    def __init__(self, calibrated: Sequence[float] | CostCurve) -> None:
        if isinstance(calibrated, CostCurve):
            calibrated = calibrated.forward_costs
        self._prior = CostCurve.sanitized(list(calibrated))
        self._samples: dict[int, tuple[float, ...]] = {
            rows: () for rows in range(1, len(calibrated) + 1)
        }
        self._dirty = 0
        self._curve = self._prior
        #: Forwards priced apart from the curve, by (sequences, rows): several requests'
        #: windows in one forward, and one request's wider than the curve.
        self._wide: dict[tuple[int, int], tuple[float, ...]] = {}
        #: What drafting earned in forwards shared by several requests, as measured.
        self.company = CompanyCheck()
        #: Hears every recorded forward, ``(rows, seconds, sequences)``, on the thread
        #: that ran it, right after it (the runtime's thread-count adaptation).
        self.listener: Callable[[int, float, int], None] | None = None

    @property
    def max_k(self) -> int:
        return self._prior.max_k

    @property
    def calibrated(self) -> CostCurve:
        """The curve the recent forwards' medians are laid over (the calibration, or
        the prior until one is measured)."""
        return self._prior

    def recalibrated(self, calibrated: Sequence[float] | CostCurve) -> None:
        """A calibration finished: its curve replaces the one the model started from
        (same sizes); the forwards recorded so far stay, and the next read rebuilds."""
        if isinstance(calibrated, CostCurve):
            calibrated = calibrated.forward_costs
        if len(calibrated) != self._prior.max_k + 1:
            raise ValueError(f"a recalibration needs {self._prior.max_k + 1} sizes, "
                             f"got {len(calibrated)}")
        self._prior = CostCurve.sanitized(list(calibrated))
        self._curve = self._prior
        self._dirty = REBUILD_EVERY

    def record(self, rows: int, seconds: float, *, sequences: int = 1) -> None:
        """One forward of ``rows`` rows of ``sequences`` sequences took ``seconds``.

        Only one sequence's forwards make the curve (what a request alone pays for its
        window). Several sequences' windows in one forward cost more than one
        sequence's of as many rows (llama.cpp's per-sequence work), so they are kept apart and price
        only the forwards they measured (:meth:`row_cost`); counted in the curve, a
        request left alone after concurrent traffic would find its windows too dear."""
        listener = self.listener
        if listener is not None:
            listener(rows, seconds, sequences)
        if rows < 1 or seconds <= 0 or sequences < 1:
            return
        samples = self._samples.get(rows) if sequences == 1 else None
        if samples is None:
            key = (sequences, rows)
            wide = self._wide.get(key, ())
            self._wide[key] = (*wide[-(WINDOW - 1):], seconds)
            return
        self._samples[rows] = (*samples[-(WINDOW - 1):], seconds)
        self._dirty += 1

    def row_cost(self, rows: int, sequences: int = 1) -> float:
        """A forward of ``rows`` rows of ``sequences`` sequences (any number, wider than
        the curve too) relative to a one-row decode: the median of such forwards
        measured (:data:`MIN_SAMPLES` of them), else the curve's measured (unpadded)
        cost up to its end; linear between measured sizes, and past the widest one
        every further row at the average extra cost per row of the widest measured
        forward.

        Why that extrapolation: a forward's extra rows get dearer per row once the batch
        is past the part the weights' reading dominates, but never dearer than their
        average over the measured widths, so a guess errs on the dear side until the
        width is measured."""
        if rows < 1 or sequences < 1:
            raise ValueError(f"rows and sequences must be >= 1, got {rows}, {sequences}")
        curve = self.curve()
        measured = curve.forward_costs  # a group's forward is not padded
        if sequences == 1 and rows <= curve.max_k + 1:
            return measured[rows - 1]
        points = {r: measured[r - 1] for r in range(1, curve.max_k + 2)}
        base = self.decode_seconds()
        seen = {r: statistics.median(s) / base for (q, r), s in list(self._wide.items())
                if q == sequences and len(s) >= MIN_SAMPLES} if base else {}
        if seen:  # past the narrowest of them, the curve (one sequence's) is too cheap
            narrowest = min(seen)
            points = {r: c for r, c in points.items() if r < narrowest} | seen
        if rows in points:
            return points[rows]
        below = max(r for r in points if r < rows)
        above = [r for r in points if r > rows]
        if above:
            hi = min(above)
            c0, c1 = points[below], max(points[hi], points[below])
            return c0 + (c1 - c0) * (rows - below) / (hi - below)
        slope = (points[below] - 1.0) / (below - 1) if below > 1 else 1.0
        return points[below] + slope * (rows - below)

    def forget(self) -> None:
        """Drop every measured forward (the model's forwards changed: a rebuilt context);
        the calibration stands until new samples come."""
        self._samples = {rows: () for rows in self._samples}
        self._wide = {}
        self._dirty = 0
        self._curve = self._prior
        self.company.forget()

    def decode_seconds(self) -> float | None:
        """Wall time of a one-row forward lately: the median of recent one-row forwards,
        or, when speculation runs every step and those are rare, the best-sampled window
        size's median divided by its relative cost. None until enough samples."""
        s = self._samples[1]
        if len(s) >= MIN_SAMPLES:
            return statistics.median(s)
        rows, best = max(self._samples.items(), key=lambda item: len(item[1]))
        if len(best) < MIN_SAMPLES:
            return None
        return statistics.median(best) / self._curve.cost(rows - 1)

    def curve(self) -> CostCurve:
        """The current curve (rebuilt from recent medians every few samples)."""
        if self._dirty < REBUILD_EVERY:
            return self._curve
        self._dirty = 0
        medians = {
            rows: statistics.median(s) for rows, s in list(self._samples.items())
            if len(s) >= MIN_SAMPLES
        }
        base = medians.get(1)
        if base is None:
            return self._curve
        shift = self.extra_shift(base)
        prior = self._prior.forward_costs  # as calibrated: unmeasured sizes follow it
        costs = [
            medians[k + 1] / base if k + 1 in medians
            else 1.0 + (prior[k] - 1.0) * shift
            for k in range(self._prior.max_k + 1)
        ]
        self._curve = CostCurve.sanitized(costs)
        return self._curve

    def extra_shift(self, base: float) -> float:
        """How much more the extra rows of a window cost now than calibrated: the median
        over recent multi-row forwards of ``(t / base - 1) / (c(k) - 1)``, within
        [1, MAX_SHIFT]; 1 until :data:`MIN_SAMPLES` of them were seen.

        Why: the calibration is one short measurement at a small context; real windows
        run at the request's context and the machine's load of the moment, which moves
        every size's cost alike. A size needs :data:`MIN_SAMPLES` forwards of its own
        before its median replaces the calibration, which most sizes never get in a
        request, so without this they would keep the stale cost, and a curve too cheap
        drafts where it loses. Only upward: a curve too dear
        forgoes some gain until the sizes in use are measured, one too cheap loses
        time against plain decoding, so a cheaper cost needs each size's own evidence.
        """
        prior = self._prior.forward_costs
        ratios_seen = [
            (t / base - 1.0) / extra
            for rows, samples in list(self._samples.items()) if rows > 1
            for extra in (prior[rows - 1] - 1.0,) if extra > 0.0
            for t in samples
        ]
        if len(ratios_seen) < MIN_SAMPLES:
            return 1.0
        shift = statistics.median(ratios_seen)
        return min(MAX_SHIFT, max(1.0, shift))
