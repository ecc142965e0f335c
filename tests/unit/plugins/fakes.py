"""Shared fakes for the proposer tests."""

from __future__ import annotations

from collections.abc import Sequence

from meshd.plugins.base import Capabilities, Outcome, Proposal, ProposalRequest
from meshd.policy.acceptance import AcceptanceTracker


def request(tokens: Sequence[int], max_len: int = 16) -> ProposalRequest:
    return ProposalRequest(tokens=tokens, n_prompt=0, max_len=max_len, deadline=0.0)


class FixedTracker(AcceptanceTracker):
    """A tracker whose estimates are pinned (updates are still counted)."""

    def __init__(self, acc: Sequence[float]) -> None:
        super().__init__()
        self.fixed = tuple(acc)
        self.seen: list[tuple[int, int, bool]] = []

    def update(self, proposed: int, accepted: int, *, censored: bool = False) -> None:
        self.seen.append((proposed, accepted, censored))

    def acceptances(self, n: int | None = None) -> tuple[float, ...]:
        n = len(self.fixed) if n is None else n
        return tuple(self.fixed[min(i, len(self.fixed) - 1)] for i in range(n))


class FakeProposer:
    """Always offers the same draft; records what it was asked and told."""

    def __init__(self, name: str, draft: Sequence[int], max_len: int = 16) -> None:
        self.name = name
        self.capabilities = Capabilities(max_len=max_len)
        self.draft = tuple(draft)
        self.asked: list[int] = []
        self.observed: list[Outcome] = []
        self.closed = False

    def propose(self, req: ProposalRequest) -> Proposal | None:
        self.asked.append(req.max_len)
        toks = self.draft[: req.max_len]
        return Proposal(toks) if toks else None

    def observe(self, outcome: Outcome) -> None:
        self.observed.append(outcome)

    def close(self) -> None:
        self.closed = True
