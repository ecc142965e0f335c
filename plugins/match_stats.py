"""Acceptance of prompt-lookup drafts measured by match length.

Why by match length: how far a copied draft is accepted depends above all on how long
the context is that agrees with the earlier occurrence, and position ``i`` of a draft
taken at match length ``L`` is accepted exactly when the next token continues a match of
``L + i``. So one table, ``P(next token continues | match length L)``, gives every
draft's per-position acceptance: ``acc[i] = p(L + i)``. It learns from real drafts
(:meth:`MatchStats.update`) and shadow drafts (:meth:`MatchStats.record`), in decayed
counts per length class shrunk toward a prior whose odds grow with the square of ``L``
(short matches are mostly chance; a long one usually means copying), scaled by the
text's copy factor (:func:`copy_factor`). Nothing about any text is built in.
A :class:`SharedMatchStats` per daemon and model pools what requests measured; the copy
factor stays per request (a copied document must not make the next request draft long).
Sharing changes only draft lengths, never output: every draft is verified.
"""

from __future__ import annotations

import bisect
import math
import threading

#: Where each match-length class starts (a class covers lengths up to the next start).
#: Lengths up to 8 each have their own: short matches are the most frequent, and in
#: tables and code one length may go on where the next never does (a 4-token match
#: that continues must not hide a 5-token one that always fails).
CLASS_STARTS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128)
#: A representative length per class (geometric middle) for the copy-factor fit.
_MIDS = tuple(math.sqrt(a * max(a, b - 1)) for a, b in
              zip(CLASS_STARTS, (*CLASS_STARTS[1:], CLASS_STARTS[-1] * 2), strict=True))

#: Match length at which the prior curve gives even odds (at copy factor 1).
EVEN_LENGTH = 4.0
#: How steeply the prior odds grow with the match length.
PRIOR_POWER = 2.0
#: Weight of the prior curve against a class's own counts, in observations.
PRIOR_WEIGHT = 4.0
#: Weight of ``f = 1`` in the copy-factor fit, in observations.
FACTOR_WEIGHT = 8.0
#: The copy factor stays within [1/FACTOR_LIMIT, FACTOR_LIMIT].
FACTOR_LIMIT = 64.0

#: Per-update decay of the counts (about 100 recent outcomes matter).
DECAY = 0.99
#: Observations per class a new request takes over from the pool.
CARRY = 8.0


def length_class(length: int) -> int:
    """Index of the class of match length ``length`` (lengths < 1 share class 0)."""
    return max(0, bisect.bisect_right(CLASS_STARTS, length) - 1)


def prior_odds(length: float) -> float:
    """Odds of the prior curve at copy factor 1."""
    n = max(0.0, float(length)) / EVEN_LENGTH
    return float(n**PRIOR_POWER)


def prior(length: float, factor: float = 1.0) -> float:
    """The prior curve: probability that a run of ``length`` agreements goes on."""
    odds = factor * prior_odds(length)
    return odds / (odds + 1.0)


def copy_factor(hits: list[float], trials: list[float], start: float = 1.0, *,
                base: float = 1.0) -> float:
    """The ``f`` under which the observed acceptance by class is most likely.

    The model is a logistic one with one free parameter: class ``c`` continues with
    probability ``p_c = f o_c / (f o_c + 1)``, ``o_c`` the curve's odds at the class's
    representative length. ``f = 1`` weighs :data:`FACTOR_WEIGHT` observations (as many
    pseudo-outcomes at even odds, half of them hits). Maximum likelihood, not a mean of
    per-class odds ratios: a class whose every draft held can only raise ``f``, however
    high the curve already puts it (a smoothed odds ratio would read ten hits out of ten
    at length 50 as *below* the curve's 99%, and long copies that held would make short
    matches less trusted). The log-likelihood is concave in ``log f``: a few damped
    Newton steps from ``start`` (the previous fit) reach it. ``base`` scales the curve's
    odds (the curve of a source whose matches say less: ``f`` is relative to it).
    """
    shift = math.log(base)
    theta = min(_THETA_LIMIT, max(-_THETA_LIMIT, math.log(start)))
    for _ in range(32):
        s0 = _sigmoid(theta)
        grad = FACTOR_WEIGHT * (0.5 - s0)
        curv = FACTOR_WEIGHT * s0 * (1.0 - s0)
        for c, t in enumerate(trials):
            if t <= 0.0:
                continue
            p = _sigmoid(theta + shift + _LOG_ODDS[c])
            grad += hits[c] - t * p
            curv += t * p * (1.0 - p)
        step = max(-1.0, min(1.0, grad / curv))
        theta = min(_THETA_LIMIT, max(-_THETA_LIMIT, theta + step))
        if abs(step) < 1e-6:
            break
    return math.exp(theta)


def _sigmoid(x: float) -> float:
    if x >= 0.0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


#: log of the curve's odds at each class's representative length.
_LOG_ODDS = tuple(math.log(prior_odds(m)) for m in _MIDS)
_THETA_LIMIT = math.log(FACTOR_LIMIT)


class SharedMatchStats:
    """Counts pooled across requests (thread-safe; requests run on worker threads)."""

    def __init__(self, *, weight: float = 32.0) -> None:
        #: Pooled evidence is capped at this many observations per class, so the pool
        #: follows what the daemon serves now rather than everything since it started.
        self.weight = weight
        self._hits = [0.0] * len(CLASS_STARTS)
        self._trials = [0.0] * len(CLASS_STARTS)
        self._lock = threading.Lock()

    def snapshot(self, carry: float = CARRY) -> tuple[list[float], list[float]]:
        """The pool's counts scaled to at most ``carry`` observations per class."""
        with self._lock:
            hits, trials = list(self._hits), list(self._trials)
        for c, t in enumerate(trials):
            if t > carry:
                hits[c], trials[c] = hits[c] * carry / t, carry
        return hits, trials

    def merge(self, hits: list[float], trials: list[float]) -> None:
        """Add one request's counts, keeping at most :attr:`weight` per class."""
        with self._lock:
            for c in range(len(CLASS_STARTS)):
                h = self._hits[c] + hits[c]
                t = self._trials[c] + trials[c]
                if t > self.weight:
                    h, t = h * self.weight / t, self.weight
                self._hits[c], self._trials[c] = h, t


class MatchStats:
    """One request's acceptance by match length (see the module docstring)."""

    def __init__(self, shared: SharedMatchStats | None = None, *,
                 prior_factor: float = 1.0) -> None:
        """``prior_factor`` scales the prior curve's odds (below 1: a source whose
        matches are weaker evidence than a request's own text, whose copy factor is
        then fitted relative to that curve)."""
        self.shared = shared
        self.prior_factor = prior_factor
        if shared is not None:
            self._hits, self._trials = shared.snapshot()
        else:
            self._hits = [0.0] * len(CLASS_STARTS)
            self._trials = [0.0] * len(CLASS_STARTS)
        # Undecayed counts of this request, for the pool.
        self._new_hits = [0.0] * len(CLASS_STARTS)
        self._new_trials = [0.0] * len(CLASS_STARTS)
        # This request's own counts, decayed like the rest: the copy factor's evidence.
        self._own_hits = [0.0] * len(CLASS_STARTS)
        self._own_trials = [0.0] * len(CLASS_STARTS)
        self._factor: float | None = None
        #: The last fit, where the next one starts (the counts change a little per step).
        self._last_factor = 1.0
        self.updates = 0

    @property
    def factor(self) -> float:
        """The copy factor of this request's own counts as they are now (fitted when
        first read after they changed: a step that drafts nothing judges several shadow
        positions and reads the estimates once, if at all).

        Only this request's evidence: whether a text is being copied is a property of
        the request (a reformatted document before, a story now), while the pooled
        counts say how each match length fares on this daemon's traffic."""
        if self._factor is None:
            self._last_factor = copy_factor(self._own_hits, self._own_trials,
                                            self._last_factor, base=self.prior_factor)
            self._factor = self.prior_factor * self._last_factor
        return self._factor

    def p(self, length: int) -> float:
        """Estimated ``P(next token continues | match length)``."""
        c = length_class(length)
        return (self._hits[c] + PRIOR_WEIGHT * prior(length, self.factor)) / (
            self._trials[c] + PRIOR_WEIGHT)

    def acceptances(self, length: int, k: int) -> list[float]:
        """Per-position acceptance of a ``k``-token draft taken at match ``length``
        (``[p(length), ..., p(length + k - 1)]``, computed in one pass: a costed step
        asks for a whole window's worth per candidate)."""
        hits, trials, factor = self._hits, self._trials, self.factor
        c = length_class(length)
        end = CLASS_STARTS[c + 1] if c + 1 < len(CLASS_STARTS) else math.inf
        out: list[float] = []
        for n in range(max(0, length), max(0, length) + k):
            if n >= end:
                c += 1
                end = CLASS_STARTS[c + 1] if c + 1 < len(CLASS_STARTS) else math.inf
            odds = factor * (n / EVEN_LENGTH) ** PRIOR_POWER
            out.append((hits[c] + PRIOR_WEIGHT * odds / (odds + 1.0)) / (trials[c] + PRIOR_WEIGHT))
        return out

    def update(self, length: int, proposed: int, accepted: int, *,
               censored: bool = False) -> None:
        """A draft taken at match ``length``: ``accepted`` of ``proposed`` were taken.

        Position ``i < accepted`` continued a match of ``length + i``; position
        ``accepted`` (unless the commit was cut short: ``censored``) did not.
        """
        if proposed <= 0:
            return
        self.decay()
        for i in range(accepted):
            self._count(length + i, 1.0)
        if accepted < proposed and not censored:
            self._count(length + accepted, 0.0)

    def decay(self) -> None:
        """Age every count by one outcome (recent outcomes matter most)."""
        self.updates += 1
        self._factor = None
        for c in range(len(CLASS_STARTS)):
            self._hits[c] *= DECAY
            self._trials[c] *= DECAY
            self._own_hits[c] *= DECAY
            self._own_trials[c] *= DECAY

    def record(self, length: int, hit: bool) -> None:
        """One position judged without a draft: did the token after a match of
        ``length`` continue it? (See the proposer's shadow drafts.)"""
        self._count(length, 1.0 if hit else 0.0)

    def _count(self, length: int, hit: float) -> None:
        self._factor = None
        c = length_class(length)
        self._hits[c] += hit
        self._trials[c] += 1.0
        self._own_hits[c] += hit
        self._own_trials[c] += 1.0
        self._new_hits[c] += hit
        self._new_trials[c] += 1.0

    def close(self) -> None:
        """Hand this request's counts to the pool (once)."""
        if self.shared is not None and any(self._new_trials):
            self.shared.merge(self._new_hits, self._new_trials)
        self._new_hits = [0.0] * len(CLASS_STARTS)
        self._new_trials = [0.0] * len(CLASS_STARTS)


#: Weight of an old outcome in :class:`Calibration` (about the last ten drafts count).
CALIBRATION_DECAY = 0.9
#: Pseudo-tokens behind a calibration of 1: the estimates are trusted until drafts show
#: otherwise.
CALIBRATION_PRIOR = 2.0


def length_band(length: int) -> int:
    """The band of match lengths a draft started at: one per doubling (2-3, 4-7, ...)."""
    return max(1, length).bit_length()


class Calibration:
    """How many of the tokens the estimates expected drafts to get accepted were
    accepted lately, by the match length the drafts started at (one band per doubling):
    one request's measure of how far to trust :class:`MatchStats`.

    Why: the estimates of a draft's later positions come from longer match lengths,
    which a text may never reach, so there they are the prior curve scaled by the copy
    factor, fitted on the lengths seen. Text whose short matches hold for a few tokens
    and then end (a table's cells, code's repeated fragments) raises the copy factor
    and so every longer estimate, and where windows of many rows cost little more than
    a few it drafts long windows that are rejected at once. The outcome
    of each draft that ran to its end (real drafts, and shadow drafts scored for free)
    against what the raw estimates expected of it corrects them: :meth:`factor` scales
    the first position's acceptance, so a draft's expected accepted tokens by exactly
    that factor. By band, because the estimates may be too bold at one length and too
    cautious at another, and a copy that starts later, at long matches, must not
    pay for failed short ones. Only downwards: estimates that are too cautious are
    raised by the counts themselves.
    """

    def __init__(self) -> None:
        #: Per band: (expected accepted tokens, accepted tokens), decayed.
        self._bands: dict[int, tuple[float, float]] = {}

    def observe(self, length: int, expected: float, accepted: int) -> None:
        """A draft at match ``length`` the estimates expected ``expected`` accepted
        tokens of got ``accepted``."""
        if expected < 0.0 or accepted < 0:
            raise ValueError(f"expected={expected}, accepted={accepted}")
        band = length_band(length)
        e, a = self._bands.get(band, (0.0, 0.0))
        self._bands[band] = (e * CALIBRATION_DECAY + expected,
                             a * CALIBRATION_DECAY + accepted)

    def factor(self, length: int) -> float:
        """Accepted over expected lately at ``length``'s band, shrunk toward 1, at most 1."""
        e, a = self._bands.get(length_band(length), (0.0, 0.0))
        return min(1.0, (a + CALIBRATION_PRIOR) / (e + CALIBRATION_PRIOR))
