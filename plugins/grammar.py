"""The grammar proposer: the tokens a request's constraint forces next, as a draft.

Why a proposer: under a JSON schema much of the text is fixed before the model runs
(keys, quotes, separators, the tail of an enum value). Drafting it lets the target verify
several such tokens in one forward instead of decoding them one at a time, through the
same verify-commit-repair path as every other draft, so the output stays exactly what
plain constrained decoding gives. The target still chooses every token (a tokenizer may
split forced text differently), which is why these drafts are verified, not committed.

The engine offers it before the request's own proposer, with its own acceptance and cost
gate: forced drafts hold almost always, another proposer's may not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .base import Capabilities, Outcome, Proposal, ProposalRequest

__all__ = ["GrammarProposer"]


class GrammarProposer:
    """Drafts what ``forced()`` returns: the tokens the constraint forces from the
    committed text on (empty when the grammar leaves a choice)."""

    name = "grammar"
    capabilities = Capabilities(max_len=64)

    def __init__(self, forced: Callable[[], Sequence[int]]) -> None:
        self._forced = forced

    def ready(self, tokens: Sequence[int]) -> bool:
        """Whether the constraint forces a token next (``tokens`` are its own state)."""
        return bool(self._forced())

    def propose(self, request: ProposalRequest) -> Proposal | None:
        tokens = tuple(self._forced()[: request.max_len])
        return Proposal(tokens) if tokens else None

    def observe(self, outcome: Outcome) -> None:
        """Nothing to learn: what the grammar forces depends on the committed text alone."""

    def close(self) -> None:
        """Holds nothing of its own."""
