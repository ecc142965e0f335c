"""Acceptance of prompt-lookup drafts measured by match length.

Why by match length: how far a draft copied from an earlier occurrence will be accepted
depends above all on how long the context is that agrees with that occurrence. A
two-token coincidence ("of the") is followed by anything; forty tokens of a copied
line are followed by the rest of the line. And position ``i`` of a draft taken at match
length ``L`` is accepted, given positions ``0..i-1`` were, exactly when the next token
continues a match of length ``L + i``. So one table, ``P(next token continues | match
length L)``, gives the per-position acceptance of any draft: ``acc[i] = p(L + i)``.

Evidence: the outcomes of real drafts (:meth:`MatchStats.update`) and positions judged
without a draft (:meth:`MatchStats.record`: the proposer's shadow drafts, scored against
the tokens committed after a step that drafted nothing).

Estimates: counts per length class (lengths grouped on a roughly logarithmic scale,
:data:`CLASS_STARTS`), with exponential decay, shrunk toward a prior curve whose odds
grow with the square of the match length::

    odds0(L) = f (L / 4) ** 2          p0(L) = odds0 / (odds0 + 1)

Why that shape: short matches occur in all text and mostly by chance (on a CPU where each
verified row costs nearly a decode, drafting on them would lose), so they start at even
odds or worse; a long match is far rarer by chance than a short one, and where it occurs
the text is usually being copied, so trusting it costs little elsewhere and pays at once
where copying begins. ``f`` is the text's *copy factor*, measured across all classes at
once (the trial-weighted mean, in log space, of each class's observed odds over the
curve's, shrunk toward ``f = 1``): once long matches are seen to hold, shorter ones are
trusted too, and where long matches fail (text that repeats phrases, not passages) every
length is trusted less. Each class's own counts then refine its estimate. Nothing about
any particular text is built in; what a workload does is measured.

Sharing: a :class:`SharedMatchStats` (one per daemon and model) pools what requests
measured; each request's :class:`MatchStats` starts from a few observations' worth of
the pool and hands its own counts back when it ends. This can change how long drafts
are, never which tokens are committed (every draft is verified), so it is safe to share
across requests.
"""

from __future__ import annotations

import bisect
import math
import threading

#: Where each match-length class starts (a class covers lengths up to the next start).
CLASS_STARTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
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


def copy_factor(hits: list[float], trials: list[float]) -> float:
    """The ``f`` that fits observed acceptance by class best (see the module docstring).

    Per class, ``f_c`` = observed odds (half a count of smoothing) over the curve's;
    the result is their trial-weighted mean in log space, with ``f = 1`` weighing
    :data:`FACTOR_WEIGHT` observations.
    """
    total = FACTOR_WEIGHT
    acc = 0.0
    for c, t in enumerate(trials):
        if t <= 0.0:
            continue
        h = hits[c]
        odds = (h + 0.5) / (t - h + 0.5)
        acc += t * math.log(odds / prior_odds(_MIDS[c]))
        total += t
    f = math.exp(acc / total)
    return min(FACTOR_LIMIT, max(1.0 / FACTOR_LIMIT, f))


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

    def __init__(self, shared: SharedMatchStats | None = None) -> None:
        self.shared = shared
        if shared is not None:
            self._hits, self._trials = shared.snapshot()
        else:
            self._hits = [0.0] * len(CLASS_STARTS)
            self._trials = [0.0] * len(CLASS_STARTS)
        # Undecayed counts of this request, for the pool.
        self._new_hits = [0.0] * len(CLASS_STARTS)
        self._new_trials = [0.0] * len(CLASS_STARTS)
        self._factor: float | None = None
        self.updates = 0

    @property
    def factor(self) -> float:
        """The copy factor of the counts as they are now (fitted when first read after
        they changed: a step that drafts nothing judges several shadow positions and
        reads the estimates once, if at all)."""
        if self._factor is None:
            self._factor = copy_factor(self._hits, self._trials)
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

    def record(self, length: int, hit: bool) -> None:
        """One position judged without a draft: did the token after a match of
        ``length`` continue it? (See the proposer's shadow drafts.)"""
        self._count(length, 1.0 if hit else 0.0)

    def _count(self, length: int, hit: float) -> None:
        self._factor = None
        c = length_class(length)
        self._hits[c] += hit
        self._trials[c] += 1.0
        self._new_hits[c] += hit
        self._new_trials[c] += 1.0

    def close(self) -> None:
        """Hand this request's counts to the pool (once)."""
        if self.shared is not None and any(self._new_trials):
            self.shared.merge(self._new_hits, self._new_trials)
        self._new_hits = [0.0] * len(CLASS_STARTS)
        self._new_trials = [0.0] * len(CLASS_STARTS)
