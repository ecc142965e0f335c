"""A realised rate: what something bought against what it cost, recent evidence first.

Why one class: the MTP head's value (tokens per decode of cost, :mod:`.gate`) and the
company check's arms (tokens per second of a group's steps, :mod:`.company`) are the same
ledger: two decayed sums and their ratio, judged against another rate.
"""

from __future__ import annotations

import attrs


@attrs.define
class RealisedRate:
    """Tokens against their cost; each addition first decays the sums by ``decay``."""

    decay: float = 0.9
    tokens: float = 0.0
    cost: float = 0.0
    steps: int = 0

    def add(self, tokens: float, cost: float) -> None:
        self.tokens = self.tokens * self.decay + tokens
        self.cost = self.cost * self.decay + cost
        self.steps += 1

    @property
    def ratio(self) -> float:
        """Tokens per unit of cost (infinite before any cost)."""
        return self.tokens / self.cost if self.cost > 0.0 else float("inf")
