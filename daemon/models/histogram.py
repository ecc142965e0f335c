"""A cumulative-bucket histogram the scheduler fills and every reader snapshots.

Why not prometheus_client's own Histogram: the scheduler's statistics are the one source
of truth that both the ``stats`` op and ``/metrics`` read; keeping the buckets here
(plain numbers, no registry) lets both report the same observations. Readers get a
:class:`HistogramSnapshot`, never the live counts (a lock makes each snapshot
consistent from any thread).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Final

import attrs

__all__ = ["LATENCY_BUCKETS_S", "Histogram", "HistogramSnapshot"]

LATENCY_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                            0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
"""Upper bounds in seconds, from a fast verify forward to a long queue wait."""


@attrs.frozen
class HistogramSnapshot:
    """Cumulative counts per upper bound (the last bound is +Inf), their sum and count."""

    buckets: tuple[tuple[float, int], ...]
    sum: float
    count: int

    def plus(self, other: HistogramSnapshot) -> HistogramSnapshot:
        """Both histograms' observations together (the same bounds: one daemon's
        models, each counted apart)."""
        assert [b for b, _ in self.buckets] == [b for b, _ in other.buckets]
        return HistogramSnapshot(
            tuple((b, n + m) for (b, n), (_, m) in zip(self.buckets, other.buckets,
                                                        strict=True)),
            self.sum + other.sum, self.count + other.count)


class Histogram:
    """Counts of observations per bucket; thread-safe."""

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        self.bounds = tuple(sorted(bounds))
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int = 1) -> None:
        """Record ``value`` (``times`` times: tokens that arrived together)."""
        if times <= 0:
            return
        value = max(0.0, value)
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += times
            self._sum += value * times

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        cumulative: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return HistogramSnapshot(tuple(cumulative), total, running)
