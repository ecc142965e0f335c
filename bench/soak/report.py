"""What a soak run measured, and the judgement on it (no I/O but ``sample_process``'s /proc reads).

Why a separate module: the soak's verdict must be readable on its own. A run passes when
no protocol rule was broken, every finished output equals the single-client reference,
no error of an unexpected kind was seen, nothing leaked (requests, slots, sessions,
connections, file descriptors) and the daemon is still serving. Memory is reported, not
judged, in short runs: RSS and descriptor counts are sampled over time and a least-squares
line is fitted over the second half of the run (after warm-up), so a long run shows
growth beyond noise as a slope in MB/hour.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence

import attrs

__all__ = ["ProcessSample", "SoakReport", "floor_series", "linear_fit", "linear_slope",
           "sample_process"]


@attrs.frozen
class ProcessSample:
    """One look at the daemon process: seconds since the start, RSS and open fds."""

    t_s: float
    rss_mb: float
    fds: int


def sample_process(pid: int, t_s: float) -> ProcessSample:
    """RSS (``VmRSS``) and the number of open file descriptors of ``pid``."""
    rss_kb = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
                break
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return ProcessSample(t_s, rss_kb / 1024, fds)


def linear_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``xs`` (None with fewer than 3 points)."""
    fit = linear_fit(xs, ys)
    return None if fit is None else fit[0]


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares slope of ``ys`` over ``xs`` and its standard error (the noise: a
    slope within about two standard errors of 0 is no evidence of growth)."""
    n = len(xs)
    if n < 3 or n != len(ys):
        return None
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    return slope, (residual / (n - 2) / sxx) ** 0.5


def floor_series(samples: Sequence[ProcessSample], windows: int = 8) -> list[ProcessSample]:
    """The smallest-RSS sample of each of ``windows`` equal slices of ``samples``.

    Why: a request that allocates a lot (a multi-megabyte tokenize) lifts RSS for a
    while; the floor between such spikes is what grows when memory leaks.
    """
    if len(samples) < windows:
        return list(samples)
    size = len(samples) / windows
    return [min(samples[int(i * size):int((i + 1) * size)], key=lambda s: s.rss_mb)
            for i in range(windows)]


@attrs.define
class SoakReport:
    """Everything a soak run counts; :attr:`ok` is the verdict."""

    seconds: float = 0.0
    clients: int = 0
    model: str = ""
    actions: collections.Counter[str] = attrs.field(factory=collections.Counter)
    """Actions run, by kind (generate, chat, cancel_op, disconnect, garbage, ...)."""
    outcomes: collections.Counter[str] = attrs.field(factory=collections.Counter)
    """How generations ended: finish reasons, and ``error:<code>``."""
    errors: collections.Counter[str] = attrs.field(factory=collections.Counter)
    """Every ``error`` frame received, by code."""
    unexpected_errors: list[str] = attrs.field(factory=list)
    violations: list[str] = attrs.field(factory=list)
    mismatches: list[str] = attrs.field(factory=list)
    compared: int = 0
    """Finished outputs compared with the single-client reference."""
    leaks: dict[str, float] = attrs.field(factory=dict)
    """Resources still held once the load stopped (a non-zero value is a leak)."""
    samples: list[ProcessSample] = attrs.field(factory=list)
    fd_baseline: int | None = None
    fd_end: int | None = None
    daemon_exit: int | None = None
    checkpoints: int = 0
    restores: int = 0
    tokens: int = 0

    # ------------------------------------------------------------------ figures

    def _second_half(self) -> list[ProcessSample]:
        if not self.samples:
            return []
        t_mid = self.samples[-1].t_s / 2
        return [s for s in self.samples if s.t_s >= t_mid]

    @property
    def rss_slope_mb_per_h(self) -> float | None:
        fit = self.rss_fit_mb_per_h
        return None if fit is None else fit[0]

    @property
    def rss_fit_mb_per_h(self) -> tuple[float, float] | None:
        """RSS slope over the second half and its standard error, in MB/hour."""
        half = self._second_half()
        fit = linear_fit([s.t_s for s in half], [s.rss_mb for s in half])
        return None if fit is None else (fit[0] * 3600, fit[1] * 3600)

    @property
    def rss_floor_fit_mb_per_h(self) -> tuple[float, float] | None:
        """The same fit over the RSS floor (:func:`floor_series`) of the second half."""
        floor = floor_series(self._second_half())
        fit = linear_fit([s.t_s for s in floor], [s.rss_mb for s in floor])
        return None if fit is None else (fit[0] * 3600, fit[1] * 3600)

    @property
    def fd_slope_per_h(self) -> float | None:
        half = self._second_half()
        slope = linear_slope([s.t_s for s in half], [float(s.fds) for s in half])
        return None if slope is None else slope * 3600

    @property
    def ok(self) -> bool:
        return (not self.violations and not self.mismatches and not self.unexpected_errors
                and not any(self.leaks.values()) and self.daemon_exit in (None, 0))

    # ------------------------------------------------------------------ output

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "seconds": round(self.seconds, 1),
            "clients": self.clients,
            "model": self.model,
            "actions": dict(self.actions),
            "outcomes": dict(self.outcomes),
            "errors": dict(self.errors),
            "unexpected_errors": self.unexpected_errors,
            "violations": self.violations,
            "mismatches": self.mismatches,
            "compared": self.compared,
            "leaks": self.leaks,
            "fd_baseline": self.fd_baseline,
            "fd_end": self.fd_end,
            "rss_mb": [round(s.rss_mb, 2) for s in self.samples],
            "fds": [s.fds for s in self.samples],
            "sample_t_s": [round(s.t_s, 1) for s in self.samples],
            "rss_slope_mb_per_h": self.rss_slope_mb_per_h,
            "rss_fit_mb_per_h": self.rss_fit_mb_per_h,
            "rss_floor_fit_mb_per_h": self.rss_floor_fit_mb_per_h,
            "fd_slope_per_h": self.fd_slope_per_h,
            "checkpoints": self.checkpoints,
            "restores": self.restores,
            "tokens": self.tokens,
            "daemon_exit": self.daemon_exit,
        }

    def format(self) -> str:
        """A human summary, one figure per line."""
        def fmt(value: float | None, unit: str) -> str:
            return "n/a" if value is None else f"{value:+.2f} {unit}"

        rss = [s.rss_mb for s in self.samples]
        lines = [
            f"soak: {'PASS' if self.ok else 'FAIL'}  {self.seconds:.0f} s, {self.clients} "
            f"clients, model {self.model}",
            f"actions:     {_counts(self.actions)}",
            f"generations: {_counts(self.outcomes)}  ({self.tokens} tokens, "
            f"{self.checkpoints} checkpoints, {self.restores} restores)",
            f"errors:      {_counts(self.errors) or 'none'}",
            f"unexpected:  {len(self.unexpected_errors)}  {self.unexpected_errors[:5]}",
            f"violations:  {len(self.violations)}  {self.violations[:5]}",
            f"outputs:     {self.compared} compared with single-client runs, "
            f"{len(self.mismatches)} differ  {self.mismatches[:3]}",
            f"leaks:       {_counts(self.leaks) or 'none'}",
            f"fds:         {self.fd_baseline} before the load, {self.fd_end} after; "
            f"slope {fmt(self.fd_slope_per_h, 'fd/h')} (second half)",
        ]
        if rss:
            lines.append(
                f"rss:         {rss[0]:.1f} -> {rss[-1]:.1f} MB (max {max(rss):.1f}) over "
                f"{len(rss)} samples; second half: slope {_fit(self.rss_fit_mb_per_h)}, "
                f"floor slope {_fit(self.rss_floor_fit_mb_per_h)}")
        return "\n".join(lines)


def _fit(fit: tuple[float, float] | None) -> str:
    return "n/a" if fit is None else f"{fit[0]:+.1f} ± {fit[1]:.1f} MB/h"


def _counts(counter: collections.Counter[str] | dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(counter.items()) if v)
