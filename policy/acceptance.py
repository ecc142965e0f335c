"""What drafts are worth: per-position acceptance, and when to probe a proposer again.

:class:`AcceptanceTracker` estimates ``P(draft position i accepted | positions 0..i-1
accepted)`` from verified proposals (the ``acc[i]`` of :mod:`meshd.policy.costs`).

Why probe: when plain decoding wins, no proposals are verified, so the estimates never
change and a proposer that turned good again would stay off forever. :class:`Explorer`
allows one ``k = 1`` probe after a number of idle steps, a deterministic counter (runs
are repeatable); a probe that commits nothing doubles the interval (up to a cap), one
that commits something, or any regular speculation, resets it. The interval never
drops below ``expected probe cost / PROBE_BUDGET`` (:func:`probe_interval_floor`), so
probes cost at most :data:`PROBE_BUDGET` of a decode per step on average.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: The most a probe may cost on average per step, in decodes.
PROBE_BUDGET = 0.03


def probe_interval_floor(probe_cost: float, budget: float = PROBE_BUDGET) -> int:
    """The fewest idle steps between probes that keeps their expected cost (in decodes,
    ``c(1) - 1 + drafting - P(hit)``) under ``budget`` of a decode per step."""
    return max(0, math.ceil(probe_cost / budget))


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

    def evidence(self, i: int) -> float:
        """How many verified drafts (decayed) position ``i``'s estimate rests on; 0:
        only the prior and the positions before it."""
        return self._trials[min(i, self.max_positions - 1)]

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


class PooledAcceptance:
    """One proposer's per-position acceptance pooled over the requests that used it.

    Why: a request measures its own acceptance only after drafting for a while, and on
    a model whose drafts cannot pay that costs every request the same losing start.
    Pooled across the requests of one model (what ``auto`` decides from), the first
    requests measure and the later ones choose. Each finished request's totals are
    added after the older ones decay by ``decay``, so the pool follows a change in what
    the model is asked (prompts) within a few requests.
    """

    def __init__(self, *, decay: float = 0.7, min_drafts: float = 32.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        #: Drafts the pool must hold before :meth:`estimates` offers it.
        self.min_drafts = min_drafts
        self._accepted: list[float] = []
        self._drafted: list[float] = []

    @property
    def drafted(self) -> float:
        """Drafted tokens in the pool (decayed): how much evidence it holds."""
        return sum(self._drafted)

    def add(self, accepted: Sequence[int], drafted: Sequence[int]) -> None:
        """One request's totals per position: windows that drafted position ``i`` and
        windows that accepted it (so positions ``0..i`` were all accepted)."""
        if not any(drafted):
            return
        n = max(len(self._drafted), len(drafted))
        for values in (self._accepted, self._drafted):
            values[:] = [v * self.decay for v in values] + [0.0] * (n - len(values))
        for i, (a, d) in enumerate(zip(accepted, drafted, strict=False)):
            self._accepted[i] += a
            self._drafted[i] += d

    def conditional(self) -> list[float]:
        """``P(position i accepted | 0..i-1 accepted)`` for the positions drafted so far
        (empty before any draft)."""
        out: list[float] = []
        prev = 1.0
        for a, d in zip(self._accepted, self._drafted, strict=False):
            if d <= 0.0:
                break
            u = a / d
            out.append(min(1.0, u / prev) if prev > 0.0 else 0.0)
            prev = u
        return out

    def estimates(self) -> list[list[float]]:
        """``[conditional()]`` once the pool holds ``min_drafts`` drafts, else ``[]`` (the
        shape :func:`meshd.policy.gate.mtp_head_pays` takes)."""
        return [self.conditional()] if self.drafted >= self.min_drafts else []

    def prior(self) -> float | None:
        """One acceptance to start a request's estimates from: the mean conditional
        acceptance over the measured positions, kept inside (0.05, 0.95) so a request's
        own evidence can still move it; None until :meth:`estimates` offers the pool."""
        if not self.estimates():
            return None
        cond = self.conditional()
        return min(0.95, max(0.05, sum(cond) / len(cond)))
