"""The verify-cost model: calibrated at start, kept current from the forwards we run.

Why online: a start-up calibration is one moment on a shared, noisy machine. If the
machine was busy then (or becomes busy later), a stale curve makes speculation look
cheaper or dearer than it is, and on CPUs where k rows cost nearly k decodes a wrong
curve turns a speedup into a slowdown. So every forward's wall time is recorded by its
number of rows, and the curve is rebuilt from the recent medians per size; sizes we have
not seen lately fall back to the calibration (scaled by the same base).
"""

from __future__ import annotations

import collections
import itertools
import statistics
import threading
from collections.abc import Sequence

from meshd.plugins.adaptive import CostCurve

#: Samples kept per window size; medians over them resist outliers.
WINDOW = 48
#: Fewer samples than this for a size and its calibrated ratio is used.
MIN_SAMPLES = 6
#: The curve is rebuilt after this many new samples (rebuilding each step is wasteful).
REBUILD_EVERY = 8


def is_plausible(costs: Sequence[float], *, tolerance: float = 0.85) -> bool:
    """A measured curve looks sane: c(1) > 1, it never drops much as rows grow, and no
    size costs far more than that many single decodes.

    Measurements under heavy contention come out non-monotone (seen here: a 2-row
    forward "cheaper" than 1 row); such a curve must not be cached.
    """
    if len(costs) < 2 or costs[1] <= 1.0:
        return False
    # A batch of k+1 rows never costs much more than k+1 single decodes (seen under
    # contention: c(8) = 18.3).
    if any(c > 1.5 * (k + 1) for k, c in enumerate(costs)):
        return False
    return all(b >= a * tolerance for a, b in itertools.pairwise(costs))


class CostModel:
    """Relative cost of a forward of k+1 rows vs 1 row, for k = 0..max_k."""

    def __init__(self, calibrated: Sequence[float]) -> None:
        self._prior = CostCurve.sanitized(list(calibrated))
        self._samples: dict[int, collections.deque[float]] = {
            rows: collections.deque(maxlen=WINDOW) for rows in range(1, len(calibrated) + 1)
        }
        self._lock = threading.Lock()
        self._dirty = 0
        self._curve = self._prior

    @property
    def max_k(self) -> int:
        return self._prior.max_k

    def record(self, rows: int, seconds: float) -> None:
        """One forward of ``rows`` rows took ``seconds`` (sizes beyond max_k+1 ignored)."""
        samples = self._samples.get(rows)
        if samples is None or seconds <= 0:
            return
        with self._lock:
            samples.append(seconds)
            self._dirty += 1

    def decode_seconds(self) -> float | None:
        """Wall time of a one-row forward lately: the median of recent one-row forwards,
        or, when speculation runs every step and those are rare, the best-sampled window
        size's median divided by its relative cost. None until enough samples."""
        with self._lock:
            s = self._samples[1]
            if len(s) >= MIN_SAMPLES:
                return statistics.median(s)
            rows, best = max(self._samples.items(), key=lambda item: len(item[1]))
            if len(best) < MIN_SAMPLES:
                return None
            return statistics.median(best) / self._curve.cost(rows - 1)

    def curve(self) -> CostCurve:
        """The current curve (rebuilt from recent medians every few samples)."""
        with self._lock:
            if self._dirty < REBUILD_EVERY:
                return self._curve
            self._dirty = 0
            medians = {
                rows: statistics.median(s) for rows, s in self._samples.items()
                if len(s) >= MIN_SAMPLES
            }
        base = medians.get(1)
        if base is None:
            return self._curve
        costs = [
            medians[k + 1] / base if k + 1 in medians else self._prior.cost(k)
            for k in range(self._prior.max_k + 1)
        ]
        self._curve = CostCurve.sanitized(costs)
        return self._curve
